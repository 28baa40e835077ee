"""Multi-item layout (scorer.py): how a request's items share spans of the flat batch, and how
spans make passes.

  Span        one span: the tokens its items share (the query part), then each item's own tokens
  SpanLayout  items per span (layout auto / packed / alone), the token budget, spans grouped into
              passes
  plan_items  the flat Plan of some spans (what Engine.run takes)

A request is one flat pass over plain `Plan` fields (any Plan is padded to a token bucket). Layouts (`layout=`):

    packed  the query part once, then every item of the request that fits the token budget, in one span
    alone   every item its own span with its own copy of the query part (no base range)
    auto    (default) packed: the attention of both devices scans an item's base range (the query
            part) and its own range, not the items between them (the Triton kernel's two ranges,
            the CPU path's groups of rows), so items do not pay for each other and sharing the
            query part only saves tokens. (auto once chose fewer items per span on the CPU, whose
            attention was dense per span.)

Why not a second pass with per-request prefix KV ("in-batch prefix caching")? In this flat design a
span's base range already *is* a per-request prefix computed in the same pass, so a second pass
would only add a launch and a KV copy. Its one real advantage, that items do not scan past each
other's keys, is in the attention itself (it scans the base range, then the own range), where it
helps packed spans and label-trie branches alike.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .batch import Plan
from .labels import LabelTrie
from .score_input import SOFT
from .weights.tokenizer import common_prefix_len


@dataclass
class Span:
    """One span of the flat batch: the shared tokens, then each item's own tokens."""
    start: int  # position of the first new token: the cached prefix length, or 0 (no cache)
    kv: list  # the prefix K/V it attends to (the engine's empty one when start == 0)
    shared: list[int]
    tails: list[list[int]]
    slots: list[int]  # where each item's result goes
    soft: list | None = None  # per tail, its soft token's vector (an embedding item) or None
    # kv an engine.KVBank's: the rows [lo, hi) of it the span sees (its request's QueryKV region)
    kv_range: tuple | None = None


@dataclass
class SpanLayout:
    """The layout and token budget of a Scorer's spans."""
    layout: str  # auto, packed or alone (scorer.LAYOUTS)
    max_batch_tokens: int

    def fill(self, L: int, sizes: list[int], m: int) -> list[list[int]]:
        """Consecutive items into spans of at most m items and the batch's token cap."""
        out, cur, n = [], [], L
        for j, s in enumerate(sizes):
            if cur and (len(cur) == m or n + s > self.max_batch_tokens):
                out.append(cur)
                cur, n = [], L
            cur.append(j)
            n += s
        return out + [cur]

    def items_per_span(self, shared: int, sizes: list[int]) -> int:
        """How many items share one copy of the query part: one (alone), else all that fit (packed,
        and auto). Both devices' attention scans each item's query part and its own tokens
        whatever else shares the span (the Triton kernel's two ranges, the CPU path's groups of
        rows: kernels/attention_cpu.py), so sharing the query part only saves its tokens.
        `sizes`: each item's own tokens (label branches included)."""
        return 1 if self.layout == "alone" else len(sizes)

    def passes(self, groups, branch: int):
        """Spans into flat batches under the token budget, one pass per prefix K/V, greedily in the
        order the spans come (from a list or a stream): a batch is yielded once the next span of
        its K/V does not fit, the rest at the end."""
        filling: dict[int, tuple[list[Span], int]] = {}  # id(kv) -> (spans, tokens)
        for g in groups:
            batch, tokens = filling.get(id(g.kv), ([], 0))
            S = len(g.shared) + sum(len(t) + branch for t in g.tails)
            if batch and tokens + S > self.max_batch_tokens:
                yield batch
                batch, tokens = [], 0
            batch.append(g)
            filling[id(g.kv)] = (batch, tokens + S)
        for batch, _ in filling.values():
            yield batch


def plan_items(groups: list[Span], trie: LabelTrie, branches: list[tuple]) -> Plan:
    """Flat plan over spans of [shared tokens][item 1 tail][branches][item 2 tail][branches]...

    shared: own causal range from the span start. Item tail: base = the shared tokens, own = the
    tail; positions continue after the shared part, as if the item followed it alone. A label
    branch continues its item causally (own range from the item's start), which is exact when the
    labels branch once; with several branches the span holds one item and each branch takes the
    whole span as its base. Read-out rows: per item its last token, then each branch's last token
    (the trie's node order), so every item contributes the same K rows.

    Python walks segments (a few per item); numpy expands them to tokens.
    """
    toks, seg, rows, offs = _segments(groups, branches)
    t = offs[-1]
    seg = np.array(seg, np.int64).reshape(-1, 5)
    lens = seg[:, 0]
    first = np.zeros(len(seg), np.int64)
    np.cumsum(lens[:-1], out=first[1:])
    expand = lambda col: np.repeat(col, lens)  # noqa: E731
    positions = np.arange(t, dtype=np.int64) + expand(seg[:, 1] - first)
    n_items = sum(len(g.tails) for g in groups)
    tokens = np.fromiter(itertools.chain.from_iterable(toks), np.int64, t)
    prefix_start = prefix_end = None
    if groups[0].kv_range is not None:  # the bank rows each span's tokens see (a pass's spans
        # share one K/V: SpanLayout.passes)
        lo, hi, n = (np.array(x, np.int64) for x in zip(*(
            (*g.kv_range, e - b) for g, b, e in zip(groups, offs, offs[1:]))))
        prefix_start, prefix_end = _i32(np.repeat(lo, n)), _i32(np.repeat(hi, n))
    soft = [v for g in groups if g.soft for v in g.soft if v is not None]  # in flat order
    soft_rows = None
    if soft:  # each embedding item's tail holds one SOFT: the rows that skip the embedding lookup
        soft_rows = np.flatnonzero(tokens == SOFT)
        assert len(soft_rows) == len(soft), "one soft token per embedding item"
        tokens[soft_rows] = 0  # (any id: its embedding is replaced)
    return Plan(
        tokens=torch.from_numpy(tokens),
        positions=torch.from_numpy(positions),
        base_start=_i32(expand(seg[:, 2])), base_end=_i32(expand(seg[:, 3])),
        own_start=_i32(expand(seg[:, 4])),
        seg_offsets=torch.tensor(offs, dtype=torch.long),
        rows=torch.tensor(rows, dtype=torch.long),
        allowed=torch.from_numpy(np.tile(trie.allowed.numpy(), (n_items, 1))),
        batch=n_items,
        soft_rows=None if soft_rows is None else torch.from_numpy(soft_rows),
        soft=None if soft_rows is None else torch.stack(soft),
        prefix_start=prefix_start, prefix_end=prefix_end,
    )


def _i32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, np.int32))


def _segments(groups: list[Span], branches: list[tuple]):
    """plan_items' walk over the spans: (token lists, per segment (length, first position, base
    start, base end, own start), read-out rows, each span's first flat token and the end)."""
    toks, seg = [], []
    rows, offs, t = [], [0], 0
    for g in groups:
        s0, L = t, len(g.shared)
        assert len(branches) <= 1 or len(g.tails) == 1
        if L:
            toks.append(g.shared)
            seg.append((L, g.start, s0, s0, s0))
            t += L
        for tail in g.tails:
            i0, n, p = t, len(tail), g.start + L
            toks.append(tail)
            seg.append((n, p, s0, s0 + L, i0))
            t += n
            rows.append(t - 1)
            for path in branches:
                m = len(path)
                toks.append(path)
                seg.append((m, p + n, s0, s0 + L, i0) if len(branches) == 1 else
                           (m, p + n, s0, i0 + n, t))
                t += m
                rows.append(t - 1)
        offs.append(t)
    return toks, seg, rows, offs


def by_start(prep, prefix_ids: list[int]) -> dict[int, list[int]]:
    """A request's items by where their new tokens start: past the pinned prefix (its length), or
    0 for an item that disagrees with it (computed with no cache)."""
    P, out = len(prefix_ids), {}
    for i, ids in enumerate(prep.full):
        start = P if P and len(ids) > P and ids[:P] == prefix_ids else 0
        out.setdefault(start, []).append(i)
    return out


def query_part(prep, start: int, idx: list[int]) -> tuple[list[int], list[int], int]:
    """(ref, q, L) of items idx starting at `start`: ref the request's tokens before the item slot
    past start; q per item how many of its tokens equal ref's (at least one token of its own stays,
    for the read-out); L the length the items share, the one that saves the most tokens (an item
    whose tokens merge deeper across the slot boundary shares less: q < L)."""
    full, ref = prep.full, prep.shared[start:]
    q = [min(common_prefix_len(full[i][start:], ref), len(full[i]) - start - 1) for i in idx]
    L = max(set(q), key=lambda n: (n * sum(x >= n for x in q), n))
    return ref, q, L


def request_spans(layout: SpanLayout, prep, prefix_ids: list[int], prefix_kv, bare: tuple, branch: int,
                  one_per_span: bool) -> list[Span]:
    """Split one request (a score_input.Prepared) into spans. bare: (K/V, its kv_range) of items
    computed without the pinned prefix (engine.Engine.bare); `branch`: label-branch tokens per
    item; one_per_span when the labels branch more than once (a branch then takes its item's
    whole span as base)."""
    full, groups = prep.full, []
    soft = (lambda ids: None) if prep.soft is None else (lambda ids: [prep.soft[i] for i in ids])
    for start, idx in by_start(prep, prefix_ids).items():
        kv, rng = (prefix_kv, None) if start else bare
        ref, q, L = query_part(prep, start, idx)
        aligned = [i for i, n in zip(idx, q) if n >= L]
        groups += [Span(start, kv, [], [full[i][start:]], [i], soft([i]), rng) for i, n in zip(idx, q) if n < L]
        sizes = [len(full[i]) - start - L + branch for i in aligned]
        m = 1 if one_per_span else layout.items_per_span(L, sizes)
        for chunk in layout.fill(L, sizes, m):
            ids = [aligned[j] for j in chunk]
            groups.append(Span(start, kv, ref[:L], [full[i][start + L:] for i in ids], ids, soft(ids), rng))
    return groups


def cached_spans(layout: SpanLayout, prep, idx: list[int], start: int, q: list[int], L: int, kv,
                 branch: int, one_per_span: bool) -> list[Span]:
    """Spans of items idx (starting at `start`, q and L as query_part gives them) over a request's
    own K/V that holds its query part (engine.QueryKV, filled through start + L): an item's tail
    starts where it stops agreeing with the query part, min(q, L), and attends to that many rows
    of the K/V (causal, so they are exactly the rows its own prompt would give), no shared tokens
    in the pass. A K/V in the engine's bank is named by its rows (Span.kv_range): the spans of
    every request there share passes and the bank's graphs."""
    full, spans, by_len = prep.full, [], {}
    soft = (lambda ids: None) if prep.soft is None else (lambda ids: [prep.soft[i] for i in ids])
    for i, n in zip(idx, q):
        by_len.setdefault(min(n, L), []).append(i)
    for n, ids in by_len.items():
        sizes = [len(full[i]) - start - n + branch for i in ids]
        m = 1 if one_per_span else layout.items_per_span(0, sizes)
        for chunk in layout.fill(0, sizes, m):
            its = [ids[j] for j in chunk]
            banked = kv.bank is not None
            spans.append(Span(start + n, kv.bufs if banked else kv.view(start + n), [],
                              [full[i][start + n:] for i in its], its, soft(its),
                              kv.range(start + n) if banked else None))
    return spans
