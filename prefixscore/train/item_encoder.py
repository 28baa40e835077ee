"""Item encoders: an item's text -> one soft token (a vector of the model's hidden size) that a Scorer
scores in the item's slot (DESIGN.md §9). Fitted by item_fit.py, applied by `prefixscore embed-items`.

The encoder reads the item with the frozen base model, through the engine (flat passes over many
items, no padding): per item the mean of its token embeddings, and a final-normed hidden state
(item_features: by default the read-out row of the scorer's prompt with the item in its slot and
an empty query). A trained map takes both to the soft token:

    soft = mean_embedding * scale + W z + b,    z = ([mean_embedding, hidden] - mu) / sd

(mu, sd: the features' mean and spread over the items it was fitted on). W and b start at zero and
`scale` at the value that gives the mean embedding a single token's norm, so the untrained map's
soft token is the item's rescaled bag of token embeddings; W may be low-rank, and a `mlp` map adds
a small GELU MLP on z, its output layer zero at start.

The encoder file is safetensors: the map's tensors, and metadata "prefixscore_item_encoder" (JSON:
format version, the base model's hash and name, hidden size, pooling, map kind and width, the most
item tokens read, the template, chat and labels it was fitted for, and the training report). A file
fitted for another base model is refused.
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import ConfigError
from .options import MAP_KINDS as KINDS, POOLINGS

FORMAT = "prefixscore.item_encoder"
META_KEY = "prefixscore_item_encoder"
MAX_ITEM_TOKENS = 128  # an item's text is read up to this many tokens (titles, short descriptions)
BATCH_TOKENS = 4096  # tokens a feature pass holds


class ItemMap(torch.nn.Module):
    """Features [N, 2H] (mean token embedding, pooled hidden state) -> soft tokens [N, H]."""

    def __init__(self, hidden: int, kind: str = "linear", width: int = 512, scale: float = 1.0,
                 mu: torch.Tensor | None = None, sd: torch.Tensor | None = None, rank: int = 0):
        super().__init__()
        if kind not in KINDS:
            raise ConfigError(f"unknown item map {kind!r}: use {' or '.join(KINDS)}")
        self.hidden, self.kind, self.width, self.rank = hidden, kind, width, rank
        self.scale = torch.nn.Parameter(torch.tensor(float(scale)))
        self.register_buffer("scale_init", torch.tensor(float(scale)))  # the untrained map's
        self.register_buffer("mu", torch.zeros(2 * hidden) if mu is None else mu.float().clone())
        self.register_buffer("sd", torch.ones(2 * hidden) if sd is None else sd.float().clone())
        if rank:  # low rank: W = up @ down, up zero at start
            self.linear = torch.nn.Sequential(torch.nn.Linear(2 * hidden, rank, bias=False),
                                              torch.nn.Linear(rank, hidden))
            torch.nn.init.normal_(self.linear[0].weight, std=(2 * hidden) ** -0.5)
            torch.nn.init.zeros_(self.linear[1].weight)
            torch.nn.init.zeros_(self.linear[1].bias)
        else:
            self.linear = torch.nn.Linear(2 * hidden, hidden)
            torch.nn.init.zeros_(self.linear.weight)
            torch.nn.init.zeros_(self.linear.bias)
        self.mlp = None
        if kind == "mlp":
            self.mlp = torch.nn.Sequential(torch.nn.Linear(2 * hidden, width), torch.nn.GELU(),
                                           torch.nn.Linear(width, hidden))
            torch.nn.init.zeros_(self.mlp[2].weight)
            torch.nn.init.zeros_(self.mlp[2].bias)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        z = (feats - self.mu) / self.sd
        out = feats[:, :self.hidden] * self.scale + self.linear(z)
        return out + self.mlp(z) if self.mlp is not None else out


class ItemEncoder:
    """A map, how its input is read (pooling, max_tokens) and what it was fitted for (meta)."""

    def __init__(self, map: ItemMap, pooling: str = "mean", max_tokens: int = MAX_ITEM_TOKENS,
                 meta: dict | None = None):
        if pooling not in POOLINGS:
            raise ConfigError(f"unknown pooling {pooling!r}: use {' or '.join(POOLINGS)}")
        self.map, self.pooling, self.max_tokens = map, pooling, max_tokens
        self.meta = dict(meta or {})

    @property
    def hidden(self) -> int:
        return self.map.hidden

    def check_model(self, loaded, where: str = "item encoder") -> "ItemEncoder":
        """This encoder, if fitted for this base model: a ConfigError naming both otherwise."""
        from ..weights.loading import base_hash

        h = loaded.model.config.hidden_size
        if h != self.hidden:
            raise ConfigError(f"{where}: fitted for a model of hidden size {self.hidden}, and this "
                              f"model's is {h}; give the model it was fitted for with --model "
                              f"({self.meta.get('base_name', '?')})")
        made_for, this = self.meta.get("base_model"), base_hash(loaded)
        if made_for and made_for != this:
            raise ConfigError(f"{where}: fitted for base model {self.meta.get('base_name', '?')} "
                              f"({made_for[:12]}), not this one ({loaded.name}, {this[:12]}); give the "
                              f"model it was fitted for with --model")
        return self

    @torch.no_grad()
    def embed(self, loaded, texts: list[str], progress=None) -> torch.Tensor:
        """Soft tokens [N, H] (fp32, CPU) of these item texts; progress(n) after each n read."""
        return self.map(item_features(loaded, texts, self.pooling, self.max_tokens,
                                      self.prompt(loaded), progress)).float()

    def prompt(self, loaded):
        """The prompt pooling "prompt" reads items in: the template it was fitted for."""
        if self.pooling != "prompt":
            return None
        from ..prompt import Prompt
        from ..score_input import SLOTS

        if not self.meta.get("template"):
            raise ConfigError("this item encoder reads items in its prompt, and records no template")
        return Prompt(loaded.tokenizer, self.meta["template"], chat=self.meta.get("chat"), slots=SLOTS)

    def save(self, path) -> None:
        from safetensors.torch import save_file

        meta = {"format": FORMAT, "version": 1, "hidden_size": self.hidden, "pooling": self.pooling,
                "kind": self.map.kind, "width": self.map.width, "rank": self.map.rank,
                "max_tokens": self.max_tokens} | self.meta
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.map.state_dict().items()}
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            save_file(tensors, tmp, metadata={META_KEY: json.dumps(meta, ensure_ascii=False)})
            os.replace(tmp, path)  # never a half-written encoder
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path) -> "ItemEncoder":
        from safetensors import SafetensorError, safe_open

        path = str(path)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such item encoder file")
        try:
            with safe_open(path, framework="pt") as f:
                raw = (f.metadata() or {}).get(META_KEY)
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None
        try:
            meta = json.loads(raw)
            if meta.get("format") != FORMAT:
                raise ValueError
            m = ItemMap(int(meta["hidden_size"]), meta["kind"], int(meta.get("width", 512)),
                        rank=int(meta.get("rank", 0)))
            m.load_state_dict(tensors)
            enc = cls(m.eval(), meta["pooling"], int(meta.get("max_tokens", MAX_ITEM_TOKENS)))
        except (TypeError, ValueError, KeyError, RuntimeError):
            raise ConfigError(f"{path}: not a prefixscore item encoder (made by `prefixscore "
                              f"fit-item-encoder`)") from None
        enc.meta = {k: v for k, v in meta.items() if k not in
                    ("format", "version", "hidden_size", "pooling", "kind", "width", "rank", "max_tokens")}
        return enc


def token_ids(tokenizer, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Each text's tokens alone (no special tokens added), cut at max_tokens; never empty."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [(list(x) or [tokenizer.eos_token_id or 0])[:max_tokens] for x in ids]


def embedding_norm(loaded) -> float:
    """The median norm of the model's token embeddings (the scale a soft token should have)."""
    w = loaded.model.embed_tokens.weight
    return float(w.float().norm(dim=-1).median())


@torch.no_grad()
def item_features(loaded, texts: list[str], pooling: str = "mean", max_tokens: int = MAX_ITEM_TOKENS,
                  prompt=None, progress=None) -> torch.Tensor:
    """[N, 2H] fp32 on the CPU: each text's mean token embedding, then a hidden state, final-normed,
    from the engine's flat passes (no padding): pooling "mean" / "last", the text read alone, its
    tokens' mean or its last token's; "prompt", the read-out row of the scorer's own prompt with
    the text in the item slot and an empty query (`prompt`: that Prompt), which is the state the
    text scorer's label scores come from. progress(n): called after each pass with the texts read."""
    from ..batch import plan_classify
    from ..engine import Engine
    from ..kernels.label_head import rms_norm
    from ..labels import LabelTrie

    if pooling not in POOLINGS:
        raise ConfigError(f"unknown pooling {pooling!r}: use {', '.join(POOLINGS)}")
    tok = loaded.tokenizer
    ids = token_ids(tok, texts, max_tokens)
    engine = Engine.shared(loaded)
    H = loaded.model.config.hidden_size
    emb, norm = loaded.model.embed_tokens.weight, loaded.model.norm
    trie = LabelTrie(["_"], [[0]], None)  # the plan's read-out rows: each sequence's last token
    out = torch.empty(len(ids), 2 * H)
    for k, seq in enumerate(ids):
        out[k, :H] = emb[torch.tensor(seq, device=emb.device)].float().mean(0).cpu()
    if pooling == "prompt":
        seqs, starts, kv = _in_prompt(engine, tok, prompt, texts, ids, max_tokens)
    else:
        seqs, starts, kv = ids, [0] * len(ids), {0: engine.no_prefix}
    for start in sorted(set(starts)):
        group = [k for k, s in enumerate(starts) if s == start]
        i = 0
        while i < len(group):
            j, tokens = i, 0
            while j < len(group) and (j == i or tokens + len(seqs[group[j]]) <= BATCH_TOKENS):
                tokens += len(seqs[group[j]])
                j += 1
            chunk = [seqs[k] for k in group[i:j]]
            plan = plan_classify(chunk, [start] * len(chunk), trie, branches=False)
            h, plan = engine.hidden(plan, kv[start])
            h = rms_norm(h, norm.weight, norm.eps).float().cpu()
            if pooling == "mean":
                ends = torch.tensor([len(x) for x in chunk]).cumsum(0).tolist()
                pooled = [h[e - len(x):e].mean(0) for e, x in zip(ends, chunk)]
            else:  # the last token's row (the plan's read-out row)
                pooled = h[plan.rows.cpu()]
            for k, v in zip(group[i:j], pooled):
                out[k, H:] = v
            if progress is not None:
                progress(j - i)
            i = j
    return out


def _in_prompt(engine, tok, prompt, texts: list[str], ids: list[list[int]], max_tokens: int):
    """item_features' sequences for pooling "prompt": each text (cut as `ids` cut it) in the item
    slot of the scorer's prompt with an empty query, past the pinned prefix where it agrees with
    it -> (sequences, their starts, {start: K/V})."""
    if prompt is None:
        raise ConfigError("pooling 'prompt' reads the item in the scorer's prompt: give the prompt")
    cut = [t if len(tok(t, add_special_tokens=False)["input_ids"]) <= max_tokens else
           tok.decode(x) for t, x in zip(texts, ids)]
    P = list(prompt.prefix_ids)
    seqs, starts = [], []
    for full in prompt.encode_ids([{"query": "", "item": t} for t in cut]):
        cached = full[:len(P)] == P and len(full) > len(P)  # else computed whole, no cache
        seqs.append(full[len(P):] if cached else full)
        starts.append(len(P) if cached else 0)
    return seqs, starts, {len(P): engine.prefill(P), 0: engine.no_prefix}
