"""L2 prefetch of the MLP weights while attention runs (experiment; kernels.PREFETCH, 0 = off).

bench.gemm's tr/L2 column (seventh session): with its weights in L2, gate/up takes 5.8 us instead
of 8.0 and down 5.4 instead of 6.5 (0.5B, T = 8), while QKV and attention + O, which move under
2 MB each, leave HBM mostly idle. So here a layer's attention kernels pull W_gate/up and W_down
(26 MB, ~6 us of HBM time) into L2 ahead of the MLP. The sixth session's version prefetched only
the next kernel's weights, from the kernel ahead, and was slower (BENCHMARKS.md); this one starts
a kernel earlier and issues its prefetches after the kernel's own weight loads (EARLY_WEIGHTS),
so they do not queue ahead of them. Values are unchanged: a prefetch only warms the cache.

PREFETCH (who issues them, how, and where; bulk = one cp.async.bulk.prefetch.L2 per lane, line =
one prefetch.global.L2 per 128-byte line):
  1 attention + O, bulk, before its PDL wait     3 attention + O, bulk, after its wait
  2 attention + O, line, before its wait         4 attention + O, line, after its wait
  5 QKV, bulk, after its wait
(Before or after the wait: weight loads issued before the wait were slower without TRIGGER, as if
the wait also drained them; BENCHMARKS.md, seventh session.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PREFETCH_MAX_BYTES = 32 << 20  # a 0.5B-class MLP (26 MB); a 7B one (272 MB) would not fit in L2
LANES = 128  # prefetching lanes per program
AHEAD: dict[int, tuple] = {}  # data_ptr of (mode's source weight) -> (W_gate/up, W_down)


def register(layers) -> None:
    """The model's layers: whose MLP weights each attention kernel prefetches."""
    for layer in layers:
        wgu, wqkv = getattr(layer.mlp, "wgu", None), getattr(layer.self_attn, "wqkv", None)
        if wgu is None or wqkv is None or not wgu.is_cuda:  # unfused (reference path) or CPU
            continue
        mlp = (wgu, layer.mlp.down_proj.weight)
        AHEAD[("attn_o", layer.self_attn.o_proj.weight.data_ptr())] = mlp
        AHEAD[("qkv", wqkv.data_ptr())] = mlp


def args(kind: str, w: torch.Tensor, programs: int) -> dict:
    """Kernel arguments for the kernel of `kind` ("attn_o" / "qkv") that reads weight w."""
    from . import PREFETCH

    mode = int(PREFETCH)
    mine = "qkv" if mode == 5 else "attn_o" if mode else None
    regions = AHEAD.get((kind, w.data_ptr())) if mine == kind and w.is_cuda else None
    off = dict(PF1=w, PF1_BYTES=0, PF2=w, PF2_BYTES=0, PF_PIECE=16, PF_MODE=0, PF_LATE=False)
    if regions is None:
        return off
    sizes = [r.numel() * r.element_size() for r in regions]
    if sum(sizes) > PREFETCH_MAX_BYTES or any(r.data_ptr() % 128 for r in regions):
        return off
    per_line = mode in (2, 4)
    line = 128 if per_line else 16
    piece = triton.cdiv(triton.cdiv(max(sizes), programs * LANES), line) * line
    return dict(PF1=regions[0], PF1_BYTES=sizes[0], PF2=regions[1], PF2_BYTES=sizes[1], PF_PIECE=piece,
                PF_MODE=2 if per_line else 1, PF_LATE=mode >= 3)


@triton.jit
def _region(PF, PF_BYTES, PF_PIECE, prog, MODE: tl.constexpr):
    lane = tl.arange(0, 128)
    off = (prog * 128 + lane).to(tl.int64) * PF_PIECE
    base = PF.to(tl.pointer_type(tl.int8))
    if MODE == 1:  # one bulk prefetch of PF_PIECE bytes per lane
        size = tl.minimum(PF_BYTES - off, PF_PIECE).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }",
            "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)
    else:  # one prefetch per 128-byte line of the lane's piece
        for i in range(0, PF_PIECE, 128):
            o = off + i
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; }",
                "=r,l,r", [base + o, (o < PF_BYTES).to(tl.int32)], dtype=tl.int32, is_pure=False,
                pack=1)


@triton.jit
def prefetch(PF1, PF1_BYTES, PF2, PF2_BYTES, PF_PIECE, prog, MODE: tl.constexpr):
    """Program `prog`'s share of both regions into L2."""
    _region(PF1, PF1_BYTES, PF_PIECE, prog, MODE)
    _region(PF2, PF2_BYTES, PF_PIECE, prog, MODE)
