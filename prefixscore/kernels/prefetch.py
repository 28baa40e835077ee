"""L2 prefetch of the next kernel's weights (experiment; kernels.PREFETCH_NEXT, off by default).

At batch 1 each of a layer's four kernels streams its weights at a fraction of the HBM rate: the
rest of its time is a chain of dependent round trips (BENCHMARKS.md). The idea here: while a
kernel runs, its programs also pull the *next* kernel's weights into L2 with bulk prefetches
(QKV -> Wo, attention + O -> W_gate/up, gate/up -> W_down, down -> the next layer's Wqkv), so the
next kernel reads them from L2. Values are unchanged: a prefetch only warms the cache.

PREFETCH_NEXT: 0 off, 1 at the kernel's start (before its wait), 2 after its main loop. Only
weights up to PREFETCH_MAX_BYTES (a 0.5B-class layer; a 7B layer's would not fit in L2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PREFETCH_MAX_BYTES = 24 << 20
LANES = 128  # prefetching lanes per program (one instruction each)
NEXT: dict[int, torch.Tensor] = {}  # a weight's data_ptr -> the weight the next kernel reads


def chain(weights: list[torch.Tensor]) -> None:
    """Record the order in which a forward's kernels read these weights."""
    for a, b in zip(weights, weights[1:]):
        NEXT[a.data_ptr()] = b


def args(w: torch.Tensor, programs: int) -> dict:
    """Kernel arguments: what to prefetch after weight w, split over the grid's programs."""
    from . import PREFETCH_NEXT

    nxt = NEXT.get(w.data_ptr()) if PREFETCH_NEXT and w.is_cuda else None
    nbytes = 0 if nxt is None else nxt.numel() * nxt.element_size()
    if nxt is None or nbytes > PREFETCH_MAX_BYTES or nbytes % 16 or nxt.data_ptr() % 16:
        return dict(PF=w, PF_BYTES=0, PF_PIECE=16, PF_MODE=0)
    piece = triton.cdiv(triton.cdiv(nbytes, programs * LANES), 16) * 16  # 16-byte multiples
    return dict(PF=nxt, PF_BYTES=nbytes, PF_PIECE=piece, PF_MODE=int(PREFETCH_NEXT))


@triton.jit
def prefetch(PF, PF_BYTES, PF_PIECE, prog):
    """Program `prog`'s share of the PF_BYTES at PF into L2: one bulk prefetch per lane."""
    lane = tl.arange(0, 128)
    off = (prog * 128 + lane).to(tl.int64) * PF_PIECE
    size = tl.minimum(PF_BYTES - off, PF_PIECE).to(tl.int32)
    ptr = PF.to(tl.pointer_type(tl.int8)) + off
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }",
        "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
