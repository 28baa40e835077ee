"""Programmatic dependent launch (PDL, sm_90+): each kernel of a forward is launched before the one
ahead of it has finished.

A small-batch forward is ~100 short kernels in one CUDA graph, and between two of them the SMs sit
idle while the next launch is processed. Launched with PDL, a kernel's launch overlaps the end of
its predecessor; its first instruction waits (griddepcontrol.wait: every earlier kernel complete
and its writes visible), so it reads and writes exactly what a serial launch would. Nothing
triggers early: the predecessor's exit lets it run.

Measured on the H200 (bench.gpu --ab: W1 graph replay, each variant captured and timed twice in
one run; bench/results/gpu_ab_pdl_*.json), ms:
                                              0.5B          7B
  plain launches                              0.636-0.672   3.758-3.772
  PDL, wait only (this)                       0.612-0.614   3.683-3.702
  + trigger right after the wait              0.671         3.906   (next kernel's CTAs sit early)
  + trigger once the main loop is done        0.617-0.619   3.670-3.681
  + weight rows L2-prefetched before the wait,
    one prefetch per 128-byte line            0.729         5.340
    one cp.async.bulk.prefetch per row        0.730         4.960-4.989
    the same with the late trigger            0.619-0.621   4.878-4.895
  the *next* kernel's weights prefetched by the kernel ahead (sixth session, its own harness:
    0.617 without): at its start 0.686, after its main loop 0.677 (gpu_prefetch_next_session6.json)
so only the wait is kept. --ab reads ~0.06 ms above the full bench's W1 row for the same graph
in the same device call (0.613 vs 0.556: gpu_ab_pdl_bulk.json, gpu_quick_pdl_final.json), so
compare its rows only with each other. (Not the GPU clock after a capture: a 0.3 s warm-up before
timing changed nothing, and on the next session's machine both harnesses read ~0.595 ms.)

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


def trigger(device) -> bool:
    """TRIG for the kernels that can let the next one start early (kernels.TRIGGER)."""
    from . import TRIGGER

    return bool(TRIGGER) and enabled(device)


def launch_kwargs(device) -> dict:
    """GDC for the kernel, launch_pdl for Triton's launcher."""
    return dict(GDC=True, launch_pdl=True) if enabled(device) else dict(GDC=False)


@triton.jit
def wait():
    """Before any global access: the kernels ahead are done and their writes visible."""
    tl.extra.cuda.gdc_wait()
