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


def barrier_stalled(device) -> bool:
    """Whether a grid barrier gave up (_grid_sync's flag, the last counter of a buffer) since the
    last call; clears it. A host sync: tests and bench/ only."""
    hit = False
    for buf in list(_COUNTERS.values()) + _RETIRED:
        if _same_device(buf.device, torch.device(device)):
            hit |= bool(buf[-1].item())
            buf[-1] = 0
    return hit


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 alike (an index left out is the current device's)."""
    def index(d):
        return d.index if d.index is not None or d.type != "cuda" else torch.cuda.current_device()
    return a.type == b.type and index(a) == index(b)


# A grid barrier gives up after this many polls (seconds at ~1 us a poll; a real wait is
# microseconds) and raises the flag BAR + 2 instead of hanging the GPU: a program that never
# arrives (a grid that is not all resident at once) then costs a wrong result that
# barrier_stalled() reports, not a machine.
SPIN_LIMIT = tl.constexpr(1 << 22)


@triton.jit
def _grid_sync(BAR, target):
    """A barrier across the programs of a persistent grid (kernels/layer_triton.py): arrive on the
    int32 counter BAR, then wait until it reaches target (the number of programs times the barriers
    passed so far). As cooperative groups' grid.sync: the block's stores, one release by one thread,
    acquire loads until the count is in, the block released together. Every program must be
    resident at once (the launcher sizes the grid by occupancy), and the interpreter, which runs
    programs one after another, must never reach it (it would spin for ever). Bounded: SPIN_LIMIT
    polls, then the flag BAR + 2."""
    tl.debug_barrier()  # every thread's stores before the release
    tl.atomic_add(BAR, 1, sem="release", scope="gpu")
    n = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")  # (an acquire load: PTX)
    polls = 0
    while (n < target) & (polls < SPIN_LIMIT):
        n = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
        polls += 1
    if n < target:
        tl.atomic_xchg(BAR + 2, 1, scope="gpu")
    tl.debug_barrier()
