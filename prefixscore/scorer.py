"""Multi-item scoring: one query, many candidate items, the query computed once (DESIGN.md §2.3, §3).

Every item is scored as if alone with the whole prompt `template(query, item)`: the answer is the
label scores at the item's last token. The pinned instruction prefix is shared by every request; on
top of it, the tokens common to all of a request's items (the "query part": template text + query
up to where the item starts) are computed once per span, and each item only adds its own tokens:

    span = [query part ........][item 1 + text after the slot][item 2 + text after ...]...
            own causal range     base = query part, own range = the item; positions restart after
                                 the query part for every item, exactly as if scored alone

That is one flat pass over plain `Plan` fields, so Engine.run (and a graph runner padding any Plan to
a bucket) runs it unchanged. Two layouts, picked per request by estimated cost, or forced:

    packed  the query part once per span, many items per span
    alone   every item its own span with its own copy of the query part (no base range)

Why not a second pass with per-request prefix KV ("in-batch prefix caching")? In this flat design a
span's base range already *is* a per-request prefix computed in the same pass, so a second pass
would only add a launch and a KV copy. Its one real advantage, that items would not scan past each
other's keys, belongs in the attention kernel (scan the base range, then the own range; see
`_scan`), where it helps packed spans and label-trie branches alike.

Exactness: each item's whole prompt is tokenized as one text, and the query part is only the tokens
that are a prefix of that item's tokens; an item that disagrees (a merge across the slot boundary)
is computed alone from the cached prefix, and one that disagrees with the cached prefix itself is
computed with no cache at all. What the model sees is always the whole prompt's tokens.

`score_request` takes SGLang's `/v1/score` request shape (query, items, label_token_ids or labels,
apply_softmax, item_first) and returns its response shape.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field

import torch

from .batch import Plan
from .classifier import resolve_device, resolve_dtype
from .engine import Engine
from .errors import ConfigError, InputError
from .kernels.label_head import rms_norm
from .labels import LabelTrie, check_labels
from .loading import LoadedModel, load
from .prompt import Prompt, check_template, sentinel

SLOTS = ("query", "item")
DEFAULT_TEMPLATE = ("Decide whether the item is relevant to the query. Answer yes or no.\n"
                    "Query: {query}\nItem: {item}")
DEFAULT_LABELS = ["yes", "no"]
# logprobs:    log-probability of each label under label-constrained decoding (as Classifier)
# softmax:     exp(logprobs): probabilities over the labels (= SGLang apply_softmax=true)
# logits:      raw first-token logits (labels must start with distinct tokens)
# vocab_probs: each label token's probability under the full next-token distribution
#              (= SGLang apply_softmax=false); single-token labels; reads the vocab head, but
#              only at the read-out rows
MODES = ("logprobs", "softmax", "logits", "vocab_probs")
LAYOUTS = ("auto", "packed", "alone")
# Cost of one (query row, in-batch key) pair scanned by attention relative to its FLOPs in a GEMM:
# masked tiles, online softmax and small dots run well below the matmul rate.
ATTN_PENALTY = {"cuda": 4.0, "cpu": 2.0}
CPU_MAX_SPAN = 2048  # the torch reference attention holds a dense [span, span] score block per head


@dataclass
class ItemResult:
    item: str | list[int]  # the item as given (text, or token ids)
    label: str  # the decision: label-constrained greedy choice (argmax in logits / vocab_probs)
    scores: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Group:
    """One span of the flat batch: the shared tokens, then each item's own tokens."""
    start: int  # position of the first new token: the cached prefix length, or 0 (no cache)
    shared: list[int]
    tails: list[list[int]]
    slots: list[int]  # where each item's result goes


@dataclass
class _Head:
    """A label set: its trie and the output-head rows of its tokens."""
    labels: list[str]
    trie: LabelTrie
    weight: torch.Tensor

    @property
    def single_tokens(self) -> bool:
        return all(len(p) == 1 for p in self.trie.paths)


@dataclass
class _Template:
    """The template in one slot order: prompt split, pinned prefix and its KV, labels in context."""
    prompt: Prompt
    item_first: bool
    prefix_kv: list
    heads: dict = field(default_factory=dict)

    def before_item(self, query: str) -> str:
        """The whole prompt's text up to the item slot: the candidate shared part."""
        out = []
        for i, piece in enumerate(self.prompt.pieces):
            if i % 2 == 0:
                out.append(piece)
            elif piece == sentinel("item"):
                break
            else:
                out.append(query)
        return "".join(out)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _swap_slots(template: str) -> str:
    mark = "\x1eQ\x1e"
    return template.replace("{query}", mark).replace("{item}", "{query}").replace(mark, "{item}")


class Scorer:
    """Scorer(model=None, template=None, labels=None): score many items against one query.

    `template` has a `{query}` and an `{item}` slot (either order) after a fixed instruction; default:
    a yes/no relevance prompt with labels yes/no, on the bundled SmolLM2-135M-Instruct. Give
    `label_token_ids` instead of `labels` to score raw vocabulary tokens. A model without a tokenizer
    (a `LoadedModel` built from weights only) scores token ids only (`score_ids`); then `prefix_ids`
    are the pinned prefix.
    """

    def __init__(self, model=None, template: str | None = None, labels=None, *, label_token_ids=None,
                 device=None, dtype=None, chat: bool | None = None, mode: str = "logprobs",
                 layout: str = "auto", max_items: int = 1024, max_batch_tokens: int = 16384,
                 prefix_ids: list[int] | None = None):
        if labels is not None and label_token_ids is not None:
            raise ConfigError("give labels or label_token_ids, not both")
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
        if max_items < 1 or max_batch_tokens < 1:
            raise ConfigError("max_items and max_batch_tokens must be positive")
        if label_token_ids is None:
            labels = check_labels(DEFAULT_LABELS if labels is None else labels)
        if template is not None:
            check_template(template, SLOTS)  # fail fast, before loading a model
        if isinstance(model, LoadedModel):
            self.loaded = model
        else:
            dev = resolve_device(device)
            self.loaded = load(model, dev, resolve_dtype(dtype, dev))
        self.engine = Engine(self.loaded)
        self.config = self.engine.config
        self.tokenizer = tok = self.loaded.tokenizer
        self.mode, self.layout = mode, layout
        self.max_items, self.max_batch_tokens = max_items, max_batch_tokens
        self.chat = chat
        self._templates: dict[bool, _Template] = {}
        if tok is None:  # token ids only
            if template is not None or label_token_ids is None:
                raise ConfigError("this model has no tokenizer: give label_token_ids and no template, "
                                  "and score token ids (score_ids)")
            self.template = None
            self.prefix_ids = list(prefix_ids or [])
            self._ids_prefix_kv = self.engine.prefill(self.prefix_ids)
            self.item_first = False
        else:
            if prefix_ids is not None:
                raise ConfigError("prefix_ids is for models without a tokenizer: the template's "
                                  "instruction is the pinned prefix")
            self.template = DEFAULT_TEMPLATE if template is None else template
            t = self._template_for(None)
            self.item_first = t.item_first
            self.prompt = t.prompt
            self.prefix_ids = t.prompt.prefix_ids
            self._ids_prefix_kv = t.prefix_kv
        self.head = self._head(self.item_first, labels, label_token_ids, in_request=False)
        self.labels, self.trie = self.head.labels, self.head.trie
        self._check_mode(mode, self.head, ConfigError)
        if layout == "packed" and len(self.trie.branch_paths()) > 1 and mode in ("logprobs", "softmax"):
            raise ConfigError("layout 'packed' scores labels that branch at most once after the first "
                              "token; these labels need several branches, so use layout 'alone' or "
                              "'auto'")

    # ------------------------------------------------------------ set-up

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    def _template_for(self, item_first: bool | None) -> _Template:
        """The scorer's template (item_first=None), or the same template with its slots swapped so
        the item comes first / second as a request asks (SGLang's item_first)."""
        if not self._templates:
            prompt = Prompt(self.tokenizer, self.template, chat=self.chat, slots=SLOTS)
            first = prompt.pieces.index(sentinel("item")) < prompt.pieces.index(sentinel("query"))
            self._templates[first] = _Template(prompt, first, self.engine.prefill(prompt.prefix_ids))
            return self._templates[first]
        if item_first is None:
            return self._templates[self.item_first]
        if item_first not in self._templates:
            prompt = Prompt(self.tokenizer, _swap_slots(self.template), chat=self.chat, slots=SLOTS)
            own = self._templates[not item_first]
            kv = own.prefix_kv if prompt.prefix_ids == own.prompt.prefix_ids else \
                self.engine.prefill(prompt.prefix_ids)
            self._templates[item_first] = _Template(prompt, item_first, kv)
        return self._templates[item_first]

    def _head(self, item_first: bool, labels, label_token_ids, in_request: bool) -> _Head:
        """Label trie and head rows, cached per (slot order, label set)."""
        err = InputError if in_request else ConfigError
        if label_token_ids is not None:
            ids = self._check_token_ids(label_token_ids, "label_token_ids", err)
            if not ids:
                raise err("label_token_ids is empty: give at least one token id")
            if len(set(ids)) != len(ids):
                raise err(f"label_token_ids has duplicates: {ids}")
            key = ("ids", tuple(ids))
        else:
            key = ("text", tuple(check_labels(labels)))
        t = self._templates.get(item_first)
        cache = t.heads if t is not None else self.__dict__.setdefault("_id_heads", {})
        if key in cache:
            return cache[key]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if key[0] == "ids":
            names = (self.tokenizer.convert_ids_to_tokens(list(key[1])) if self.tokenizer is not None
                     else [str(i) for i in key[1]])
            trie = LabelTrie(names, [[i] for i in key[1]], eos)
        else:
            context = t.prompt.render(query="x", item="x")
            trie = LabelTrie.build(self.tokenizer, list(key[1]), context, t.prompt.encode_text)
            if in_request and not all(len(p) == 1 for p in trie.paths):
                multi = [l for l, p in zip(trie.labels, trie.paths) if len(p) > 1]
                raise InputError(f"labels must be single tokens in a score request (scores are per "
                                 f"label token, like label_token_ids); {multi[0]!r} is "
                                 f"{len(trie.paths[trie.labels.index(multi[0])])} tokens")
        head = _Head(trie.labels, trie, self.engine.label_weight(trie.columns))
        cache[key] = head
        return head

    def _check_mode(self, mode: str, head: _Head, err=ConfigError) -> None:
        if mode == "logits" and not head.trie.first_distinct:
            raise err("mode 'logits' needs labels whose first tokens differ; these share a first "
                      "token, so use mode 'logprobs' or 'softmax'")
        if mode == "vocab_probs" and not head.single_tokens:
            raise err("mode 'vocab_probs' (SGLang apply_softmax=false) gives each label token's "
                      "probability under the full vocabulary, so every label must be one token; "
                      "use mode 'softmax' or 'logprobs' for multi-token labels")

    def _check_token_ids(self, ids, what: str, err=InputError) -> list[int]:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise err(f"{what} must be a list of token ids")
        ids = list(ids)
        V = self.config.vocab_size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < V:
                raise err(f"{what}: {i!r} is not a token id of this model (0 <= id < {V})")
        return ids

    # ------------------------------------------------------------ public API

    def score(self, query: str, items) -> list[ItemResult]:
        """Label scores for every item, as if each were scored alone with the whole prompt."""
        return self.score_batch([(query, items)])[0]

    def score_batch(self, requests, progress=None) -> list[list[ItemResult]]:
        """Many (query, items) requests (tuples or {"query", "items"} dicts) in shared flat passes."""
        if isinstance(requests, (str, dict)) or not hasattr(requests, "__iter__"):
            raise InputError("score_batch takes a list of (query, items) requests")
        prepared = []
        requests = list(requests)
        for k, r in enumerate(requests):
            q, items = (r.get("query"), r.get("items")) if isinstance(r, dict) else r
            try:
                prepared.append(self.prepare(q, items))
            except InputError as e:
                raise (InputError(f"request {k}: {e}") if len(requests) > 1 else e) from None
        return self.run_prepared(prepared, self.mode, self.head, progress)

    def score_ids(self, query_ids, items_ids, item_first: bool = False, mode: str | None = None,
                  ) -> list[ItemResult]:
        """Score token sequences as given: query_ids + item_ids per item (item_ids + query_ids with
        item_first), no template, like SGLang's token-id requests. The pinned prefix is reused
        when a sequence starts with it."""
        mode = mode or self.mode
        return self.run_prepared([self.prepare_ids(query_ids, items_ids, item_first)], mode,
                                 self.head)[0]

    def score_request(self, req: dict) -> dict:
        """SGLang `/v1/score`: {"query", "items", "label_token_ids" | "labels", "apply_softmax",
        "item_first"} -> {"scores": [[score per label] per item], "labels", "model", "usage", ...}.

        apply_softmax=true: softmax over the label tokens; false (SGLang's default): each label
        token's probability under the full next-token distribution. Text query/items fill the
        template (item_first swaps its two slots); token-id query/items are scored as given.
        Labels default to the scorer's own.
        """
        if not isinstance(req, dict):
            raise InputError("a score request is a JSON object with query and items")
        query, items = req.get("query"), req.get("items")
        if isinstance(items, str):  # SGLang accepts one item as a bare string
            items = [items]
        flags = {}
        for k in ("apply_softmax", "item_first"):
            v = req.get(k, False)
            if not isinstance(v, bool):
                raise InputError(f"{k} must be true or false, got {v!r}")
            flags[k] = v
        if req.get("labels") is not None and req.get("label_token_ids") is not None:
            raise InputError("give labels or label_token_ids, not both")
        by_ids = isinstance(query, (list, tuple))
        if by_ids or self.tokenizer is None:
            item_first = self.item_first
        else:
            item_first = flags["item_first"]
            self._template_for(item_first)
        if req.get("labels") is None and req.get("label_token_ids") is None:
            head = self._head(item_first, self.labels if self.head.trie.paths and
                              not self._labels_are_ids() else None,
                              self.trie.columns if self._labels_are_ids() else None, True)
        else:
            head = self._head(item_first, req.get("labels"), req.get("label_token_ids"), True)
        mode = "softmax" if flags["apply_softmax"] else "vocab_probs"
        self._check_mode(mode, head, InputError)
        if by_ids:
            prep = self.prepare_ids(query, items, flags["item_first"])
        else:
            prep = self.prepare(query, items, item_first)
        results = self.run_prepared([prep], mode, head)[0]
        n_tokens = sum(len(f) for f in prep["full"])
        return {"scores": [[r.scores[l] for l in head.labels] for r in results],
                "labels": head.labels, "model": self.loaded.name, "object": "scoring",
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0}}

    def _labels_are_ids(self) -> bool:
        return any(k[0] == "ids" for t in self._templates.values() for k, h in t.heads.items()
                   if h is self.head) or self.tokenizer is None

    # ------------------------------------------------------------ requests -> token spans

    def _check_items(self, items, text: bool) -> list:
        if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
            raise InputError(f"items must be a list of {'strings' if text else 'token id lists'}")
        if not items:
            raise InputError("no items: give at least one item to score")
        if len(items) > self.max_items:
            raise InputError(f"{len(items)} items in one request, over the limit of {self.max_items}; "
                             f"split the request (or raise max_items)")
        for i, it in enumerate(items):
            if text:
                if not isinstance(it, str):
                    raise InputError(f"items[{i}] must be a string, got {type(it).__name__}")
                if not it.strip():
                    raise InputError(f"items[{i}] is empty")
            else:
                if not self._check_token_ids(it, f"items[{i}]"):
                    raise InputError(f"items[{i}] is empty")
        return list(items)

    def prepare(self, query: str, items, item_first: bool | None = None) -> dict:
        """Tokenize a text request: each item's whole prompt, plus the text before the item slot."""
        if self.tokenizer is None:
            raise ConfigError("this scorer has no tokenizer: use score_ids with token ids")
        if not isinstance(query, str):
            raise InputError(f"query must be a string, got {type(query).__name__}")
        if not query.strip():
            raise InputError("empty query")
        items = self._check_items(items, text=True)
        t = self._template_for(item_first)
        texts = [t.prompt.render(query=query, item=it) for it in items]
        full = self.tokenizer(texts, add_special_tokens=not t.prompt.chat)["input_ids"]
        shared = t.prompt.encode_text(t.before_item(query))
        return self._checked(dict(items=items, full=full, shared=shared, template=t))

    def prepare_ids(self, query_ids, items_ids, item_first: bool = False) -> dict:
        q = self._check_token_ids(query_ids, "query")
        if not q:
            raise InputError("empty query")
        items = self._check_items(items_ids, text=False)
        full = [list(it) + q if item_first else q + list(it) for it in items]
        return self._checked(dict(items=items, full=full, shared=[] if item_first else q,
                                  template=None))

    def _checked(self, prep: dict) -> dict:
        limit = self.config.context_limit - self.trie.max_len
        for i, ids in enumerate(prep["full"]):
            if len(ids) > limit:
                it = prep["items"][i]
                size = f"{len(it)} characters" if isinstance(it, str) else f"{len(it)} tokens"
                raise InputError(f"items[{i}]: the prompt is {len(ids)} tokens, over the model's "
                                 f"context limit of {limit} tokens (the item is {size}); shorten it")
        return prep

    def _groups(self, prep: dict, branch: int, one_per_span: bool) -> list[_Group]:
        """Split one request into spans. `branch`: label-branch tokens per item; one_per_span when
        the labels branch more than once (branches then need the item's whole span as base)."""
        t = prep["template"]
        prefix = t.prompt.prefix_ids if t is not None else self.prefix_ids
        P = len(prefix)
        full, shared = prep["full"], prep["shared"]
        by_start: dict[int, list[int]] = {}
        for i, ids in enumerate(full):
            start = P if P and len(ids) > P and ids[:P] == prefix else 0
            by_start.setdefault(start, []).append(i)
        groups = []
        for start, idx in by_start.items():
            ref = shared[start:]
            # Query-part tokens per item: what its own tokens share with the text before the slot
            # (at least one token of its own is left for the read-out).
            q = [min(_common(full[i][start:], ref), len(full[i]) - start - 1) for i in idx]
            L = max(set(q), key=lambda n: (n * sum(x >= n for x in q), n))
            aligned = [i for i, n in zip(idx, q) if n >= L]
            for i, n in zip(idx, q):  # disagrees at the boundary: alone, exactly its own tokens
                if n < L:
                    groups.append(_Group(start, [], [full[i][start:]], [i]))
            if not aligned:
                continue
            sizes = [len(full[i]) - start - L + branch for i in aligned]
            m = 1 if one_per_span else self.items_per_span(L, sizes)
            q_ids = full[aligned[0]][start:start + L]
            for chunk in self._fill(L, sizes, m):
                groups.append(_Group(start, q_ids, [full[aligned[j]][start + L:] for j in chunk],
                                     [aligned[j] for j in chunk]))
        return groups

    # ------------------------------------------------------------ layout by estimated cost

    def _max_span(self) -> int:
        cap = self.max_batch_tokens
        return cap if self.engine.device.type == "cuda" else min(cap, CPU_MAX_SPAN)

    def _fill(self, L: int, sizes: list[int], m: int) -> list[list[int]]:
        """Consecutive items into spans of at most m items and the span token cap."""
        out, cur, n = [], [], L
        cap = self._max_span()
        for j, s in enumerate(sizes):
            if cur and (len(cur) == m or n + s > cap):
                out.append(cur)
                cur, n = [], L
            cur.append(j)
            n += s
        out.append(cur)
        return out

    def _scan(self, S: int) -> float:
        """In-batch (query row, key) pairs the attention visits for a span of S tokens. The Triton
        kernel scans each row block's keys from the lowest start of its rows (the span's start:
        every item's base range) to its last token, S^2/2 in all; the torch reference pads each
        span to a dense S x S block. (A kernel that scanned base and own ranges separately would
        make this ~ S x (query part + item length) and packed spans nearly free.)"""
        return S * S / 2 if self.engine.device.type == "cuda" else float(S * S)

    def _cost_weights(self) -> tuple[float, float]:
        c = self.config
        H, D, Hq, Hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        per_layer = 2 * (H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * c.intermediate_size)
        per_layer += 4 * len(self.prefix_ids) * Hq * D  # every token scans the pinned prefix
        pair = 4 * Hq * D * ATTN_PENALTY.get(self.engine.device.type, 2.0)
        return per_layer * c.num_layers, pair * c.num_layers

    def items_per_span(self, shared: int, sizes: list[int]) -> int:
        """How many items share one copy of the query part: all of them (packed), one (alone), or
        (auto) the count with the least estimated cost = token FLOPs + attention pairs scanned."""
        n = len(sizes)
        if self.layout == "alone":
            return 1
        if self.layout == "packed":
            return n
        w_tok, w_pair = self._cost_weights()

        def cost(m):
            total = 0.0
            for chunk in self._fill(shared, sizes, m):
                S = shared + sum(sizes[j] for j in chunk)
                total += w_tok * S + w_pair * self._scan(S)
            return total

        candidates = sorted({n} | {2 ** k for k in range(n.bit_length()) if 2 ** k < n})
        return min(candidates, key=lambda m: (cost(m), -m))

    # ------------------------------------------------------------ spans -> passes -> scores

    def run_prepared(self, prepared: list[dict], mode: str, head: _Head, progress=None,
                     ) -> list[list[ItemResult]]:
        branches = head.trie.branch_paths() if mode in ("logprobs", "softmax") else []
        branch = sum(len(p) for p in branches)
        groups, offsets = [], []
        for k, prep in enumerate(prepared):
            base = sum(len(p["full"]) for p in prepared[:k]) if not offsets else offsets[-1]
            for g in self._groups(prep, branch, len(branches) > 1):
                g.slots = [base + s for s in g.slots]
                groups.append(g)
            offsets.append(base + len(prep["full"]))
        n = offsets[-1]
        scores: list = [None] * n
        decisions: list = [None] * n
        for batch in self._passes(groups, branch):
            s, d = self._run_pass(batch, mode, head, branches)
            slots = [i for g in batch for i in g.slots]
            for i, si, di in zip(slots, s, d):
                scores[i], decisions[i] = si, di
            if progress is not None:
                progress(len(slots))
        out, i = [], 0
        for prep in prepared:
            res = []
            for it in prep["items"]:
                res.append(ItemResult(it, head.labels[decisions[i]], dict(zip(head.labels, scores[i]))))
                i += 1
            out.append(res)
        return out

    def _passes(self, groups: list[_Group], branch: int):
        """Groups into flat batches under the token budget; cached and uncached spans apart (each
        pass attends to one prefix). On CPU also bound the reference attention's padded area."""
        cpu = self.engine.device.type != "cuda"
        for start in sorted({g.start for g in groups}, reverse=True):
            batch, tokens, widest = [], 0, 0
            for g in (g for g in groups if g.start == start):
                S = len(g.shared) + sum(len(t) + branch for t in g.tails)
                w = max(widest, S)
                over = tokens + S > self.max_batch_tokens
                if cpu:
                    over |= (len(batch) + 1) * w * w > CPU_MAX_SPAN ** 2 * 4
                if batch and over:
                    yield batch
                    batch, tokens, w = [], 0, S
                batch.append(g)
                tokens += S
                widest = w
            if batch:
                yield batch

    @torch.inference_mode()
    def _run_pass(self, groups: list[_Group], mode: str, head: _Head, branches):
        plan = plan_items(groups, head.trie, branches)
        start = groups[0].start
        prefix = self.engine.no_prefix
        if start > 0:
            t = next((t for t in self._templates.values() if len(t.prompt.prefix_ids) == start), None)
            prefix = t.prefix_kv if t is not None else self._ids_prefix_kv
        trie, n = head.trie, plan.batch
        if mode == "vocab_probs":
            probs = self._vocab_probs(plan, prefix, trie.columns)
            return probs.tolist(), probs.argmax(-1).tolist()
        s, best = self.engine.run(plan, prefix, head.weight, mode != "logits")
        if mode == "logits":
            label_scores, decision = trie.assemble_logits(s, best)
        else:
            label_scores, decision = trie.assemble(s, best, n)
            if mode == "softmax":
                label_scores = label_scores.exp()
        return label_scores.cpu().tolist(), decision.cpu().tolist()

    def _vocab_probs(self, plan: Plan, prefix, columns: list[int]) -> torch.Tensor:
        """Label tokens' probabilities under the whole vocabulary: the full head, read-out rows only."""
        h, plan = self.engine.hidden(plan, prefix)
        norm = self.engine.model.norm
        x = rms_norm(h[plan.rows], norm.weight, norm.eps)
        cols = torch.tensor(columns, device=x.device)
        out = []
        for c in range(0, x.shape[0], 1024):  # bounds the [rows, vocab] fp32 block
            logits = (x[c:c + 1024] @ self.loaded.lm_head.t()).float()
            out.append((logits[:, cols] - logits.logsumexp(-1, keepdim=True)).exp())
        return torch.cat(out).cpu()


def plan_items(groups: list[_Group], trie: LabelTrie, branches: list[tuple]) -> Plan:
    """Flat plan over spans of [shared tokens][item 1 tail][branches][item 2 tail][branches]...

    shared: own causal range from the span start. Item tail: base = the shared tokens, own = the
    tail; positions continue after the shared part, as if the item followed it alone. A label
    branch continues its item causally (own range from the item's start), which is exact when the
    labels branch once; with several branches the span holds one item and each branch takes the
    whole span as its base. Read-out rows: per item its last token, then each branch's last token
    (the trie's node order), so every item contributes the same K rows.
    """
    tokens, pos, bs, be, own, rows, offs = [], [], [], [], [], [], [0]
    for g in groups:
        s0, L = len(tokens), len(g.shared)
        assert len(branches) <= 1 or len(g.tails) == 1
        tokens += g.shared
        pos += range(g.start, g.start + L)
        bs += [s0] * L
        be += [s0] * L
        own += [s0] * L
        for tail in g.tails:
            i0, n = len(tokens), len(tail)
            p = g.start + L
            tokens += tail
            pos += range(p, p + n)
            bs += [s0] * n
            be += [s0 + L] * n
            own += [i0] * n
            rows.append(i0 + n - 1)
            for path in branches:
                b0, m = len(tokens), len(path)
                tokens += path
                pos += range(p + n, p + n + m)
                if len(branches) == 1:
                    bs += [s0] * m
                    be += [s0 + L] * m
                    own += [i0] * m
                else:
                    bs += [s0] * m
                    be += [i0 + n] * m
                    own += [b0] * m
                rows.append(b0 + m - 1)
        offs.append(len(tokens))
    n_items = sum(len(g.tails) for g in groups)
    K = 1 + len(branches)
    i32 = dict(dtype=torch.int32)
    return Plan(
        tokens=torch.tensor(tokens, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        base_start=torch.tensor(bs, **i32), base_end=torch.tensor(be, **i32),
        own_start=torch.tensor(own, **i32),
        seg_offsets=torch.tensor(offs, dtype=torch.long),
        rows=torch.tensor(rows, dtype=torch.long),
        allowed=trie.allowed[torch.arange(K).repeat(n_items)],
        batch=n_items,
    )


# ---------------------------------------------------------------- command line

def _read_requests(path: str) -> list[tuple[int, dict]]:
    """JSONL, one {"query": ..., "items": [...]} per line (other keys are passed through)."""
    import json

    from .io import _open

    out = []
    with _open(path) as f:
        try:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{n}: invalid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or "query" not in obj or "items" not in obj:
                    raise InputError(f"{path}:{n}: expected an object with \"query\" and \"items\"")
                out.append((n, obj))
        except UnicodeDecodeError:
            raise InputError(f"{path}: not valid UTF-8") from None
    if not out:
        raise InputError(f"{path}: no requests")
    return out


def cmd_score(a) -> int:
    import json
    import time

    from tqdm import tqdm

    from .cli import _err, _labels, _template

    if a.truncate:
        raise ConfigError("score does not truncate: an item over the context limit is an error")
    src = a.input or "-"
    if src == "-" and sys.stdin.isatty():
        raise InputError("no requests: pass --input FILE (JSONL) or pipe JSONL on stdin")
    rows = _read_requests(src)
    t0 = time.perf_counter()
    sc = Scorer(a.model, _template(a), _labels(a), device=a.device, dtype=a.dtype, chat=a.chat,
                mode=a.mode, layout=a.layout, max_items=a.max_items, max_batch_tokens=a.batch_tokens)
    _err(f"model ready in {time.perf_counter() - t0:.1f} s: {sc.loaded.name} on {sc.engine.device} "
         f"({str(sc.engine.dtype).removeprefix('torch.')}), prefix {sc.prefix_len} tokens cached, "
         f"labels {', '.join(sc.labels)}, mode {sc.mode}")
    prepared = []
    for n, obj in rows:
        try:
            prepared.append(sc.prepare(obj["query"], obj["items"]))
        except InputError as e:
            raise InputError(f"{src}:{n}: {e}") from None
    out = sys.stdout if a.output in (None, "-") else open(a.output, "w", encoding="utf-8")
    n_items = sum(len(p["items"]) for p in prepared)
    t0 = time.perf_counter()
    try:
        with tqdm(total=n_items, unit="item", disable=None if n_items > 1024 else True,
                  file=sys.stderr, desc="score") as bar:
            for c in range(0, len(prepared), a.chunk):
                chunk = prepared[c:c + a.chunk]
                for (_, obj), res in zip(rows[c:c + a.chunk],
                                         sc.run_prepared(chunk, sc.mode, sc.head, bar.update)):
                    rec = {k: v for k, v in obj.items() if k != "items"}
                    rec.update(labels=sc.labels, best=[r.label for r in res],
                               scores=[[r.scores[l] for l in sc.labels] for r in res])
                    out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    secs = time.perf_counter() - t0
    _err(f"scored {n_items} items of {len(rows)} requests in {secs:.2f} s "
         f"({n_items / max(secs, 1e-9):.0f} items/s)")
    return 0


def add_command(sub, model_args) -> None:
    p = sub.add_parser("score", conflict_handler="resolve",
                       help="score many items per query (JSONL {\"query\", \"items\"} per line)",
                       description="Score candidate items against a query: label scores per item, "
                                   "as if each item were scored alone with the whole prompt.")
    p.add_argument("-i", "--input", help="JSONL file, one {\"query\": ..., \"items\": [...]} per line "
                                         "(default: stdin)")
    p.add_argument("-o", "--output", default=None, help="JSONL output (default: stdout): per request "
                   "its other keys, labels, best label per item and scores per item and label")
    model_args(p)
    g = p.add_argument_group("multi-item scoring")
    g.add_argument("--template", default=None, help="template with {query} and {item} slots "
                   "(default: a yes/no relevance prompt)")
    g.add_argument("--labels", default=None, help="comma-separated labels (default: yes,no)")
    g.add_argument("--mode", default="logprobs", choices=MODES,
                   help="logprobs (default), softmax (probabilities over the labels), logits, "
                        "vocab_probs (probability under the full vocabulary; single-token labels)")
    g.add_argument("--layout", default="auto", choices=LAYOUTS,
                   help="packed: query part once per span; alone: each item with its own copy; "
                        "auto (default): the cheaper by estimated cost")
    g.add_argument("--max-items", type=int, default=1024, help="most items per request")
    g.add_argument("--chunk", type=int, default=64, help="requests per call to the engine")
    p.set_defaults(func=cmd_score)
