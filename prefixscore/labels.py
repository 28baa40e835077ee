"""Labels: tokenized in context, arranged in a trie, and the score semantics of DESIGN.md §3.

decision  = label-constrained greedy decoding: at each trie node take the child with the highest logit.
scores[l] = sum over the branching nodes on l's path of the log-softmax restricted to that node's
            children (log-probability of l under label-constrained decoding).
logits    = raw first-token logits (only when all labels start with distinct tokens).
Single-child nodes need no forward work: their restricted log-softmax is 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import ConfigError

END = -1  # child marker for "label ends here" (decoded as the EOS token)


def check_labels(labels) -> list[str]:
    if isinstance(labels, str) or not hasattr(labels, "__iter__"):
        raise ConfigError("labels must be a list of strings")
    labels = list(labels)
    if not labels:
        raise ConfigError("the label list is empty: give at least two labels")
    for l in labels:
        if not isinstance(l, str) or not l.strip():
            raise ConfigError(f"every label must be a non-empty string, got {l!r}")
    seen = set()
    dups = [l for l in labels if l in seen or seen.add(l)]
    if dups:
        raise ConfigError(f"duplicate labels: {sorted(set(dups))}")
    return labels


class LabelTrie:
    def __init__(self, labels: list[str], paths: list[list[int]], eos_id: int | None):
        self.labels = labels
        if len({tuple(p) for p in paths}) != len(paths):
            raise ConfigError("two labels tokenize to the same tokens; make them distinct")
        need_end = any(tuple(q[: len(p)]) == tuple(p) for p in paths for q in paths if len(q) > len(p))
        if need_end:
            if eos_id is None:
                raise ConfigError("a label is a prefix of another and the tokenizer has no EOS token")
            paths = [p + [eos_id] for p in paths]  # the shorter label is chosen by generating EOS
        self.paths = paths
        # Children per node (node = tuple of tokens from the root).
        children: dict[tuple, list[int]] = {}
        for p in paths:
            for d in range(len(p)):
                kids = children.setdefault(tuple(p[:d]), [])
                if p[d] not in kids:
                    kids.append(p[d])
        # Scored nodes: the root always (it gives the first-token logits), then every branching node.
        self.nodes = [()] + sorted(n for n, k in children.items() if n and len(k) > 1)
        self.columns = sorted({t for p in paths for t in p})  # vocab order: argmax ties like HF
        col = {t: i for i, t in enumerate(self.columns)}
        self.allowed = torch.zeros(len(self.nodes), len(self.columns), dtype=torch.bool)
        for i, n in enumerate(self.nodes):
            for t in children[n]:
                self.allowed[i, col[t]] = True
        # Per label, its (node index, column) terms; padded with a (0, -1) "no term" marker.
        index = {n: i for i, n in enumerate(self.nodes)}
        terms = [[(index[tuple(p[:d])], col[p[d]]) for d in range(len(p)) if tuple(p[:d]) in index]
                 for p in paths]
        depth = max(len(t) for t in terms)
        # numpy: assemble() runs on every call's host path, where torch -> numpy costs ~1 us each
        self.term_node = np.zeros((len(paths), depth), dtype=np.int64)
        self.term_col = np.zeros((len(paths), depth), dtype=np.int64)
        self.term_valid = np.zeros((len(paths), depth), dtype=bool)
        for l, ts in enumerate(terms):
            for d, (n, c) in enumerate(ts):
                self.term_node[l, d], self.term_col[l, d], self.term_valid[l, d] = n, c, True
        self.term_flat = self.term_node * len(self.columns) + self.term_col  # into a [K * N] row
        self.term_none = ~self.term_valid
        self.terms = [tuple((n * len(self.columns) + c, n, c) for n, c in ts) for ts in terms]
        self.first_distinct = len({p[0] for p in paths}) == len(paths)
        self.max_len = max(len(p) for p in paths)

    @classmethod
    def build(cls, tokenizer, labels, context_text: str, encode) -> "LabelTrie":
        """Tokenize each label as it follows `context_text` (the rendered prompt), so merges with the
        prompt's last characters are those the model would see."""
        labels = check_labels(labels)
        ctx = encode(context_text)
        paths = []
        for l in labels:
            full = encode(context_text + l)
            ids = full[len(ctx):] if full[: len(ctx)] == ctx else None
            if not ids:  # the label merges into the prompt's last token: fall back to it alone
                ids = tokenizer(l, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ConfigError(f"label {l!r} tokenizes to nothing")
            paths.append(ids)
        return cls(labels, paths, getattr(tokenizer, "eos_token_id", None))

    def branch_paths(self) -> list[tuple]:
        """Token paths to feed after the suffix, one per scored non-root node."""
        return self.nodes[1:]

    def assemble(self, scores: torch.Tensor, best: torch.Tensor, batch: int):
        """scores [B*K, N], best [B*K] on the CPU (K = len(nodes) rows per request, in node order)
        -> label scores [B, L] and decision index [B], as numpy (host work: a few array ops)."""
        K, N = len(self.nodes), len(self.columns)
        s = scores.numpy().reshape(batch, K * N)
        v = np.where(self.term_valid, s[:, self.term_flat], np.float32(0.0))  # [B, L, depth]
        label_scores = v[..., 0]
        for d in range(1, v.shape[-1]):  # each label's terms added in node order (as assemble_one)
            label_scores = label_scores + v[..., d]
        # greedy: the label whose every node's choice was its next token (exactly one is)
        chosen = best.numpy().reshape(batch, K)[:, self.term_node] == self.term_col
        return label_scores, (chosen | self.term_none).all(-1).argmax(-1)

    def assemble_one(self, scores: torch.Tensor, best: torch.Tensor) -> tuple[list[float], int]:
        """assemble() for one request, in plain Python over its K * N numbers: ~8 vs ~19 us on
        the latency path (numpy's per-call cost dominates at this size). The same floats: a label's
        terms are added in fp32, in node order, as assemble adds them."""
        if isinstance(scores, torch.Tensor):  # (numpy arrays too: many.py's slices)
            scores, best = scores.numpy(), best.numpy()
        s, b = scores.ravel().tolist(), best.tolist()
        out = []
        for ts in self.terms:
            if len(ts) == 1:  # (s holds fp32 values already)
                out.append(s[ts[0][0]])
                continue
            acc = np.float32(s[ts[0][0]])
            for i, _, _ in ts[1:]:
                acc = acc + np.float32(s[i])
            out.append(float(acc))
        for l, ts in enumerate(self.terms):  # the label whose every node chose its next token
            for _, n, c in ts:
                if b[n] != c:
                    break
            else:
                return out, l
        return out, 0  # (none: as argmax over all-False)

    def assemble_logits(self, logits: torch.Tensor, best: torch.Tensor):
        """Raw first-token logits [B, N] and their argmax column [B] -> per label [B, L], decision."""
        first = np.array([self.columns.index(p[0]) for p in self.paths])
        return logits.numpy()[:, first], (first[None, :] == best.numpy()[:, None]).argmax(-1)


@dataclass
class LabelHead:
    """A label set as a scorer uses it: its trie and the output-head rows of its tokens."""
    labels: list[str]
    trie: LabelTrie
    weight: torch.Tensor

    @property
    def single_tokens(self) -> bool:
        return all(len(p) == 1 for p in self.trie.paths)
