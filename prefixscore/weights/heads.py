"""Trained N-way label heads at inference: read the frozen model's final-normed hidden state at
the read-out position (Classifier.features) and apply a head trained for the task, with or without
the long instruction in front of the query. Fitting them lives in prefixscore.train.fit_heads.

A linear head runs through the same fused label-head path as the label tokens: it is just another
N-row projection (weight [N, H]) with every row allowed, plus a bias. Feature standardization is
folded into the saved weights, so nothing but the projection runs at inference.

The head file is safetensors (no pickle): the weights plus metadata naming the model, template,
chat flag and labels it was trained with; load_head refuses to run it against anything else.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import ConfigError, ModelLoadError
from ..values import HEAD_KINDS

FORMAT = "prefixscore-head"
VERSION = "1"
KINDS = HEAD_KINDS  # (values.py, so the command line lists them without torch)


# ---------------------------------------------------------------- the head and its file

@dataclass
class HeadWeights:
    """The head as the engine runs it, on normed features x [B, H]:
    linear  logits = x @ weight.T + bias                                  (weight [N, H])
    mlp     logits = gelu(x @ weight.T + bias) @ out_weight.T + out_bias  (weight [M, H], out [N, M])"""
    kind: str
    labels: list[str]
    weight: torch.Tensor
    bias: torch.Tensor
    out_weight: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)  # model / template / chat / training (from the file)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @functools.cached_property
    def host_bias(self) -> torch.Tensor:
        """fp32 CPU copy of the bias: Engine.run returns the kernel's logits on the host."""
        return self.bias.detach().float().cpu()

    def tensors(self) -> dict[str, torch.Tensor]:
        t = {"weight": self.weight, "bias": self.bias}
        if self.kind == "mlp":
            t |= {"out_weight": self.out_weight, "out_bias": self.out_bias}
        return t

    def to(self, device=None, dtype=None) -> "HeadWeights":
        moved = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in self.tensors().items()}
        return HeadWeights(self.kind, self.labels, meta=self.meta, **moved)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, N] from normed features in torch (the MLP path; the linear one's reference)."""
        x = x.to(self.weight.dtype)
        z = F.linear(x, self.weight, self.bias)
        if self.kind == "mlp":
            z = F.linear(F.gelu(z), self.out_weight, self.out_bias)
        return z.float()


def model_identity(loaded) -> dict:
    """What the head's input depends on: the model's shape and a sample of its weights.

    The signature is fp32 values from fixed places (embedding, output head, first/middle/last layer,
    norms), compared with a tolerance that lets the same weights load in fp32, bf16 or fp16 but
    not a different model or a fine-tune. The path is recorded for messages only, so a moved or
    copied model still matches."""
    m, c = loaded.model, loaded.model.config
    V, L = c.vocab_size, c.num_layers
    rows = torch.tensor([V // 3, V // 2, (2 * V) // 3])
    parts = [
        m.embed_tokens.weight[rows.to(m.embed_tokens.weight.device), :32],
        loaded.lm_head[rows.to(loaded.lm_head.device), :32],
        m.layers[0].self_attn.o_proj.weight[:2, :32],  # (q/k/v and gate/up get fused at load)
        m.layers[L // 2].self_attn.o_proj.weight[:2, :32],
        m.layers[L - 1].mlp.down_proj.weight[:2, :32],
        m.layers[0].input_layernorm.weight[:32],
        m.norm.weight[:64],
    ]
    sig = torch.cat([p.detach().float().cpu().reshape(-1) for p in parts])
    return {"model": loaded.name, "hidden_size": c.hidden_size, "num_layers": L, "vocab_size": V,
            "signature": sig}


def _same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    # 2^-7 relative: above bf16 rounding (2^-9) of the same fp32 values, below any real training.
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=2 ** -7, atol=1e-6))


def save_head(path, head: HeadWeights, clf, training: dict | None = None) -> None:
    """Write the head with the identity of `clf` (model, template, chat flag, labels) it was trained on."""
    from safetensors.torch import save

    from ..errors import cannot_write

    if list(head.labels) != list(clf.labels):
        raise ConfigError("the head's labels differ from the classifier's")
    ident = model_identity(clf.loaded)
    meta = {
        "format": FORMAT, "version": VERSION, "kind": head.kind,
        "labels": json.dumps(list(head.labels), ensure_ascii=False),
        "template": clf.prompt.template, "chat": json.dumps(clf.prompt.chat),
        "model": ident["model"], "hidden_size": str(ident["hidden_size"]),
        "num_layers": str(ident["num_layers"]), "vocab_size": str(ident["vocab_size"]),
        "training": json.dumps(training or {}, ensure_ascii=False),
    }
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in head.tensors().items()}
    tensors["model_signature"] = ident["signature"]
    data = save(tensors, metadata=meta)  # in memory: save_file's I/O errors are SafetensorErrors
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise cannot_write(path, e) from None


def read_head(path) -> HeadWeights:
    """The head file as written (CPU, fp32), metadata parsed into head.meta; no compatibility check."""
    from .tagged import read_tagged

    meta, tensors = read_tagged(path, "head", FORMAT, VERSION, "fit the head again")
    try:
        kind, labels = meta["kind"], json.loads(meta["labels"])
        parsed = {"template": meta["template"], "chat": json.loads(meta["chat"]), "model": meta["model"],
                  "hidden_size": int(meta["hidden_size"]), "num_layers": int(meta["num_layers"]),
                  "vocab_size": int(meta["vocab_size"]), "training": json.loads(meta.get("training", "{}")),
                  "signature": tensors.pop("model_signature")}
        head = HeadWeights(kind, labels, **tensors, meta=parsed)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: damaged head file ({type(e).__name__}: {e})") from None
    N, H = len(labels), parsed["hidden_size"]
    if kind == "mlp" and (head.out_weight is None or head.out_bias is None):
        raise ModelLoadError(f"{path}: damaged head file (an mlp head without out_weight and out_bias)")
    out_rows = head.out_weight.shape[0] if kind == "mlp" else head.weight.shape[0]
    if kind not in KINDS or head.weight.ndim != 2 or head.weight.shape[1] != H or out_rows != N:
        raise ModelLoadError(f"{path}: damaged head file (kind {kind!r}, weight "
                             f"{tuple(head.weight.shape)} for {N} labels, hidden size {H})")
    return head


def check_head(head: HeadWeights, clf, path="head") -> None:
    """Refuse a head trained for another model, template, chat flag or label list (ConfigError)."""
    m = head.meta
    ident = model_identity(clf.loaded)
    if (m["hidden_size"], m["num_layers"], m["vocab_size"]) != (
            ident["hidden_size"], ident["num_layers"], ident["vocab_size"]) \
            or not _same_weights(m["signature"], ident["signature"]):
        raise ConfigError(f"{path} was trained on another model ({m['model']}, hidden size "
                          f"{m['hidden_size']}); this classifier runs {ident['model']} (hidden size "
                          f"{ident['hidden_size']}): load that model or fit a head for this one")
    if m["template"] != clf.prompt.template or m["chat"] != clf.prompt.chat:
        raise ConfigError(f"{path} was trained with template {m['template']!r} (chat={m['chat']}); "
                          f"this classifier uses {clf.prompt.template!r} (chat={clf.prompt.chat}): "
                          f"pass the same template and chat flag, or fit a head for this one")
    if list(head.labels) != list(clf.labels):
        raise ConfigError(f"{path} was trained for the labels {head.labels}; this classifier has "
                          f"{clf.labels} (same labels in the same order are needed)")


def load_head(path, clf) -> HeadWeights:
    """read_head + check_head against `clf`, weights moved to the model's device and dtype."""
    head = read_head(path)
    check_head(head, clf, path)
    return head.to(clf.engine.device, clf.engine.dtype)


@torch.inference_mode()
def head_scores(clf, head: HeadWeights, batch, logprobs: bool = True):
    """Run pre-tokenized requests (Classifier.encode) through the model and the head ->
    (scores [B, N] fp32 on the CPU: log-softmax over the N labels, or raw logits; best [B]).

    Linear: Engine.run, i.e. the fused label-head kernel (and, on the GPU, a CUDA graph captured for
    (prefix, head.weight, logprobs=False)) with the head's rows as the projection and every row
    allowed; the bias is added to the N logits on the host. MLP: normed read-out rows, MLP in torch."""
    from ..batch import plan_classify
    from ..kernels.label_head import rms_norm

    eng = clf.engine
    plan = plan_classify([e.ids[e.start:] for e in batch], [e.start for e in batch], clf.trie,
                         branches=False)
    prefix = clf.prefix_kv if batch[0].start > 0 else eng.no_prefix
    if head.kind == "linear":
        plan.allowed = torch.ones(plan.batch, head.num_labels, dtype=torch.bool)
        logits, _ = eng.run(plan, prefix, head.weight, logprobs=False)
        logits = logits.float().cpu() + head.host_bias
    else:
        h, _ = eng.hidden(plan, prefix, read=True)
        logits = head.logits(rms_norm(h, eng.model.norm.weight, eng.model.norm.eps)).cpu()
    best = logits.argmax(-1)
    return (torch.log_softmax(logits, -1) if logprobs else logits), best


def classify_with_head(clf, head: HeadWeights, queries: list[str], logprobs: bool = True):
    """Results for queries through `head` (what Classifier(..., head=...) returns), in batches that
    follow the classifier's token budget."""
    from ..values import Result

    encoded = clf.encode_many(queries)
    out = [None] * len(encoded)
    for chunk in clf._chunks(encoded):
        scores, best = head_scores(clf, head, [encoded[i] for i in chunk], logprobs)
        for i, s, b in zip(chunk, scores.cpu().tolist(), best.cpu().tolist()):
            out[i] = Result(encoded[i].values["query"], head.labels[b], dict(zip(head.labels, s)))
    return out
