"""Helpers shared by the Triton kernels of several modules: the SM count the launch configs are
sized by, the dot that works around the interpreter, and the split-K arrival counters. A leaf
module (triton and torch only), so the kernel modules import it, not each other."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # interpreter only (the kernels' _INTERPRETED); bf16 products are exact in fp32
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _store_ssq_chunks(SSQ, yf, pid_n, T, tc, t_ok, N: tl.constexpr, BLOCK_N: tl.constexpr,
                      SSQ_C: tl.constexpr):
    """Batch-invariant mode's per-row sums of squares of column tile pid_n (yf: [rows, BLOCK_N]
    fp32, masked) in SSQ_C-column chunks, each summed in column order by an fp32 dot (FMA, k in
    order) against a chunk indicator: tl.sum's order follows the tile's layout, which follows its
    rows and warps. Chunk c of the tile goes to SSQ[pid_n * BLOCK_N / SSQ_C + c, row]."""
    CH: tl.constexpr = BLOCK_N // SSQ_C
    cc = tl.arange(0, 16)[None, :]
    ind = tl.where(tl.arange(0, BLOCK_N)[:, None] // SSQ_C == cc, 1.0, 0.0)
    part = tl.dot(yf * yf, ind, input_precision="ieee")
    ch = pid_n * CH + cc
    tl.store(SSQ + ch * T + tc, part,
             mask=t_ok[:, None] & (cc < CH) & (ch < (N + SSQ_C - 1) // SSQ_C))


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: pick the same configs as on an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict = {}
_RETIRED: list = []  # counter buffers replaced by larger ones (CUDA graphs may point at them)
_MAX_TILES = 1 << 16


def _counters(device, n: int = 0):
    """At least n zeroed int32 arrival counters, one buffer per (device, stream); kernels leave
    them zeroed.

    Created on first use (warm up before capturing a graph; if the first use is inside a capture
    the zero-fill is captured too, which is harmless); grown for a batch-invariant launch over
    more row tiles than it holds, the old buffer kept alive for the graphs that point at it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:  # graphs captured with the smaller one still use it: keep it alive
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(_MAX_TILES, n), dtype=torch.int32, device=device)
    return buf
