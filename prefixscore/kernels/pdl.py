"""Programmatic dependent launch (PDL, sm_90+): each kernel of a forward starts before the one
ahead of it ends.

A small-batch forward is ~100 short kernels in one CUDA graph; between two of them the SMs sit
idle for the launch and for the next kernel's first loads. A kernel launched with PDL may start
while its predecessor runs. Ours then
  1. L2-prefetch what no kernel of the forward writes: their weight slice, the pinned prefix K/V;
  2. wait (griddepcontrol.wait: every earlier kernel complete, its writes visible);
  3. let their own successor launch (after the wait, so at most one kernel runs ahead);
and only then read activations or write anything. The values are those of serial launches: only
the prefetches, which are hints and carry no values, overlap the kernel ahead.

Every Triton kernel takes GDC (constexpr), does `if GDC: <prefetches>; enter()` first, and is
launched with launch_kwargs(device): GDC False (CPU interpreter, pre-Hopper GPUs, kernels.PDL
off) compiles none of it in.
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

    return (PDL and device.type == "cuda" and type(enter).__name__ != "InterpretedFunction"
            and _hopper(device))


def launch_kwargs(device) -> dict:
    """GDC for the kernel, launch_pdl for Triton's launcher."""
    return dict(GDC=True, launch_pdl=True) if enabled(device) else dict(GDC=False)


@triton.jit
def enter():
    """Steps 2 and 3: call once every prefetch is issued, before any other global access."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(base, rows, row_stride, cols, BLOCK_R: tl.constexpr = 64, BLOCK_C: tl.constexpr = 16):
    """Step 1 for a [rows, cols] region (elements; row_stride apart) at base: one prefetch per
    128-byte line, BLOCK_R x BLOCK_C lines at a time (a few per thread)."""
    STEP: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth  # elements per line
    for r0 in range(0, rows, BLOCK_R):
        r = tl.minimum(r0 + tl.arange(0, BLOCK_R), rows - 1).to(tl.int64)
        for c0 in range(0, cols, STEP * BLOCK_C):
            c = tl.minimum(c0 + tl.arange(0, BLOCK_C) * STEP, cols - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l",
                                      [base + r[:, None] * row_stride + c[None, :]],
                                      dtype=tl.int32, is_pure=False, pack=1)
