"""Flat batch plan: all requests' new tokens in one 1-D array (no padding), with what each may see.

Per flat token: its position (for RoPE) and visibility = pinned prefix + base range + own causal range
(see kernels/attention.py). Per request the layout is

    [suffix tokens ........][branch 1 path][branch 2 path]...
     own range = suffix      base = suffix, own range = the branch

and the read-out rows (root = last suffix token, then each branch's last token) in the trie's node
order, so every request contributes the same K rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import functools
import itertools

import numpy as np
import torch

from .labels import LabelTrie


@dataclass
class Plan:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    base_start: torch.Tensor  # [T] int32
    base_end: torch.Tensor  # [T] int32
    own_start: torch.Tensor  # [T] int32
    seg_offsets: torch.Tensor  # [B+1] int64, CPU: request spans (a hint for the torch reference)
    rows: torch.Tensor  # [R] int64 read-out flat positions, K per request
    allowed: torch.Tensor  # [R, N] bool: label tokens each row may choose among
    batch: int
    # One-request plans: what fixes every field but the tokens (suffix length, branch paths, first
    # position), so a graph runner can keep its filled input buffer per layout (engine.py).
    layout: tuple | None = None
    # Several classifiers' requests over a bank of their prefixes (batch.concat_plans, many.py):
    # the pinned keys each token sees, [prefix_start, prefix_end) int32 [T]; None: all of them.
    prefix_start: torch.Tensor | None = None
    prefix_end: torch.Tensor | None = None
    # Per-token embedding overrides (the Scorer's embedding items): the flat rows [E] int64 whose
    # input is soft [E, hidden] (any float dtype) instead of their token's embedding; None: none.
    soft_rows: torch.Tensor | None = None
    soft: torch.Tensor | None = None
    # A chunk of a long request's prompt over an engine.KVBank (engine.extend_plan): the bank rows
    # [T] int32 each token's K/V is written to; None: a pass that writes no K/V.
    kv_dst: torch.Tensor | None = None

    @property
    def prefix_range(self):
        return None if self.prefix_start is None else (self.prefix_start, self.prefix_end)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def pinned(self) -> "Plan":
        """Host tensors in page-locked memory, so copies to the GPU are asynchronous."""
        return Plan(**{k: (v.pin_memory() if k != "seg_offsets" and torch.is_tensor(v) else v)
                       for k, v in self.__dict__.items()})

    def to(self, device) -> "Plan":
        moved = {k: (v if k == "seg_offsets" or not torch.is_tensor(v) else v.to(device, non_blocking=True))
                 for k, v in self.__dict__.items()}
        return Plan(**moved)


def plan_classify(suffixes: list[list[int]], starts: list[int], trie: LabelTrie,
                  branches: bool = True) -> Plan:
    """suffixes[i]: request i's new token ids; starts[i]: its first position (the prefix length, or 0
    when it is computed without the cache). branches=False scores the root only (logits mode)."""
    if len(suffixes) > 1:
        return _plan_many(suffixes, starts, trie, branches)
    # One request (the latency path): its layout depends only on its suffix length, so the relative
    # arrays come from a cache and the plan costs a few numpy calls (~40 us less on the host).
    (suffix,), (start,) = suffixes, starts
    paths = tuple(map(tuple, trie.branch_paths())) if branches else ()
    pos, zero, end, own, rows, offsets = _block(len(suffix), paths)
    T = pos.shape[0]
    # torch.from_numpy, not torch.tensor(list): ~10 us less per call. The cached arrays (and the
    # trie's allowed rows) are shared and read-only; a Plan's tensors are only read.
    return Plan(
        tokens=torch.from_numpy(np.fromiter(itertools.chain(suffix, *paths), np.int64, T)),
        positions=torch.from_numpy(pos + start), base_start=zero, base_end=end, own_start=own,
        seg_offsets=offsets, rows=rows, allowed=trie.allowed, batch=1, layout=(len(suffix), paths, start),
    )


def _plan_many(suffixes: list[list[int]], starts: list[int], trie: LabelTrie,
                  branches: bool = True) -> Plan:
    """Many requests with numpy over whole arrays (no per-token Python work): at 4096 requests per
    batch the plan is on the critical path of the host."""
    paths = trie.branch_paths() if branches else []
    B, K = len(suffixes), 1 + len(paths)
    n = np.fromiter((len(s) for s in suffixes), np.int64, B)
    blen = np.array([len(p) for p in paths], np.int64)
    span = n + blen.sum()
    s0 = np.zeros(B + 1, np.int64)
    np.cumsum(span, out=s0[1:])
    T = int(s0[-1])
    # Segments: per request, the suffix then each branch path; seg_req/seg_len/seg_kind per segment.
    seg_len = np.empty((B, K), np.int64)
    seg_len[:, 0] = n
    seg_len[:, 1:] = blen
    seg_len = seg_len.ravel()
    seg_start = np.zeros(B * K, np.int64)
    np.cumsum(seg_len[:-1], out=seg_start[1:])
    req = np.repeat(np.arange(B), K)
    tok_seg = np.repeat(np.arange(B * K), seg_len)
    local = np.arange(T) - seg_start[tok_seg]  # index inside its segment
    is_branch = (np.arange(B * K) % K != 0)[tok_seg]
    tok_req = req[tok_seg]
    p0 = np.asarray(starts, np.int64)[tok_req]
    rs = s0[:-1][tok_req]
    flat = suffixes if not paths else [x for s in suffixes for x in (s, *paths)]
    tokens = np.fromiter(itertools.chain.from_iterable(flat), np.int64, T)
    positions = p0 + local + np.where(is_branch, n[tok_req], 0)
    base_start = rs
    base_end = np.where(is_branch, rs + n[tok_req], rs)  # branches see the suffix; suffix: empty
    own_start = seg_start[tok_seg]
    rows = seg_start + seg_len - 1  # last token of every segment, in node order per request
    i32 = lambda a: torch.from_numpy(a.astype(np.int32))
    return Plan(
        tokens=torch.from_numpy(tokens), positions=torch.from_numpy(positions),
        base_start=i32(base_start), base_end=i32(base_end), own_start=i32(own_start),
        seg_offsets=torch.from_numpy(s0), rows=torch.from_numpy(rows),
        allowed=torch.from_numpy(np.tile(trie.allowed.numpy(), (B, 1))), batch=B,
    )


@functools.lru_cache(maxsize=4096)
def _block(n: int, paths: tuple) -> tuple:
    """One request of n suffix tokens followed by the branch paths, relative to its first flat
    token and its first position: position (numpy, int64) and, as shared read-only tensors, base
    range start and end, own range start (int32), read-out rows, span offsets (int64). Base ranges
    start at the request's first token; the suffix's base range is empty."""
    pos, end, own, rows = list(range(n)), [0] * n, [0] * n, [n - 1]
    at = n
    for p in paths:
        pos += range(n, n + len(p))  # a branch continues right after the suffix
        end += [n] * len(p)  # and sees the whole suffix
        own += [at] * len(p)
        at += len(p)
        rows.append(at - 1)
    pos = np.array(pos, np.int64)
    pos.flags.writeable = False  # shared by every plan of this length
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    return (pos, i32([0] * at), i32(end), i32(own), torch.tensor(rows), torch.tensor([0, at]))


def concat_plans(plans: list[Plan], columns: list[int], n_columns: int, prefix_range=None) -> Plan:
    """Several classifiers' plans as one flat batch over their concatenated label rows: plan c's
    tokens, rows and ranges shifted past the plans before it, its `allowed` [R_c, N_c] placed at
    label column columns[c] of n_columns (False elsewhere, so each row chooses only among its own
    classifier's labels). prefix_range: (start, end) int32 [T], the pinned keys each token sees."""
    tok_off = np.cumsum([0] + [p.num_tokens for p in plans])
    shift = lambda name: torch.cat([getattr(p, name) + int(o) for p, o in zip(plans, tok_off)])  # noqa: E731
    cat = lambda name: torch.cat([getattr(p, name) for p in plans])  # noqa: E731
    allowed = torch.zeros(sum(p.rows.shape[0] for p in plans), n_columns, dtype=torch.bool)
    r = 0
    for p, c in zip(plans, columns):
        allowed[r:r + p.rows.shape[0], c:c + p.allowed.shape[1]] = p.allowed
        r += p.rows.shape[0]
    seg = torch.cat([plans[0].seg_offsets[:1]] + [p.seg_offsets[1:] + int(o) for p, o in zip(plans, tok_off)])
    return Plan(tokens=cat("tokens"), positions=cat("positions"), base_start=shift("base_start"),
                base_end=shift("base_end"), own_start=shift("own_start"), seg_offsets=seg,
                rows=shift("rows"), allowed=allowed, batch=sum(p.batch for p in plans),
                prefix_start=prefix_range[0] if prefix_range else None,
                prefix_end=prefix_range[1] if prefix_range else None)
