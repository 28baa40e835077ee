"""Programmatic dependent launch (PDL, sm_90+): each kernel of a forward is launched before the one
ahead of it has finished.

A small-batch forward is ~100 short kernels in one CUDA graph, and between two of them the SMs sit
idle while the next launch is processed. Launched with PDL, a kernel's launch overlaps the end of
its predecessor; its first instruction waits (griddepcontrol.wait: every earlier kernel complete
and its writes visible), so it reads and writes exactly what a serial launch would. Nothing
triggers early: the predecessor's exit lets it run.

Measured on the H200 (bench.gpu --ab, W1 graph replay, bench/results/gpu_ab_pdl_modes.json), ms:
                                        0.5B    7B
  plain launches                        0.636   3.771   (0.668 / 3.772 on a repeat)
  PDL, wait only (this)                 0.614   3.702
  + trigger right after the wait        0.671   3.906   (the next kernel's CTAs sit on SMs early)
  + L2 prefetch of the weight slab      0.729   5.340   (issued before the wait)
  + both                                0.715   5.191
  trigger once the main loop is done    0.617   3.670   (vs 0.612 / 3.683 for wait only in the
                                                         same run: gpu_ab_pdl_late.json)
so none of the variants is kept.

Every Triton kernel takes GDC (constexpr), does `if GDC: wait()` first, and is launched with
launch_kwargs(device): GDC False (CPU interpreter, pre-Hopper GPUs, kernels.PDL off) compiles
none of it in.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _hopper(device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device) -> bool:
    from . import PDL  # read at call time: bench/ switches it for the A/B row

    return (PDL and device.type == "cuda" and type(wait).__name__ != "InterpretedFunction"
            and _hopper(device))


# GDC bits (A/B variants, kernels.PDL = "late" / "bulk" / "late+bulk"): 1 on (wait), 2 trigger
# the next launch once the main loop is done, 4 bulk-prefetch the weight rows into L2 before the
# wait (one cp.async.bulk.prefetch per row, not one instruction per line).
LATE, BULK = 2, 4


def launch_kwargs(device) -> dict:
    """GDC for the kernel, launch_pdl for Triton's launcher."""
    from . import PDL

    if not enabled(device):
        return dict(GDC=0)
    mode = 1 + (LATE if "late" in str(PDL) else 0) + (BULK if "bulk" in str(PDL) else 0)
    return dict(GDC=mode, launch_pdl=True)


@triton.jit
def wait():
    """Before any global access: the kernels ahead are done and their writes visible."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def main_loop_done(GDC: tl.constexpr):
    if GDC & 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows(base, rows, row_stride, nbytes, GDC: tl.constexpr):
    """L2 bulk prefetch of `rows` rows of nbytes each (16-byte aligned, a multiple of 16) starting
    at base, row_stride elements apart: one instruction per row, one row per thread (4 warps)."""
    if GDC & 4:
        for r0 in range(0, rows, 128):
            r = r0 + tl.arange(0, 128)
            ptr = base + r.to(tl.int64) * row_stride
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.lt.s32 p, $2, $3; @p cp.async.bulk.prefetch.L2.global [$1], $4; }",
                "=r,l,r,r,r", [ptr, r, tl.full([128], rows, tl.int32), tl.full([128], nbytes, tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1)
