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

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "Plan":
        moved = {k: (v if k == "seg_offsets" or not torch.is_tensor(v) else v.to(device, non_blocking=True))
                 for k, v in self.__dict__.items()}
        return Plan(**moved)


def plan_classify(suffixes: list[list[int]], starts: list[int], trie: LabelTrie,
                  branches: bool = True) -> Plan:
    """suffixes[i]: request i's new token ids; starts[i]: its first position (the prefix length, or 0
    when it is computed without the cache). branches=False scores the root only (logits mode)."""
    tokens, pos, bs, be, own, rows, offs = [], [], [], [], [], [], [0]
    paths = trie.branch_paths() if branches else []
    for ids, p0 in zip(suffixes, starts):
        s0, n = len(tokens), len(ids)
        tokens += ids
        pos += range(p0, p0 + n)
        bs += [s0] * n
        be += [s0] * n  # empty base range
        own += [s0] * n
        rows.append(s0 + n - 1)
        for path in paths:
            b0 = len(tokens)
            tokens += path
            pos += range(p0 + n, p0 + n + len(path))
            bs += [s0] * len(path)
            be += [s0 + n] * len(path)
            own += [b0] * len(path)
            rows.append(b0 + len(path) - 1)
        offs.append(len(tokens))
    K = 1 + len(paths)
    node_of_row = torch.arange(K).repeat(len(suffixes))
    i32 = dict(dtype=torch.int32)
    return Plan(
        tokens=torch.tensor(tokens, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        base_start=torch.tensor(bs, **i32), base_end=torch.tensor(be, **i32),
        own_start=torch.tensor(own, **i32),
        seg_offsets=torch.tensor(offs, dtype=torch.long),
        rows=torch.tensor(rows, dtype=torch.long),
        allowed=trie.allowed[node_of_row],
        batch=len(suffixes),
    )
