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


def launch_kwargs(device) -> dict:
    """GDC for the kernel, launch_pdl for Triton's launcher."""
    return dict(GDC=True, launch_pdl=True) if enabled(device) else dict(GDC=False)


@triton.jit
def wait():
    """Before any global access: the kernels ahead are done and their writes visible."""
    tl.extra.cuda.gdc_wait()
