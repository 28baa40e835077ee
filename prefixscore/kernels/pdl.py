"""Programmatic dependent launch (PDL, compute capability >= 9): each Triton kernel of the forward is
launched while the one before it still runs, and waits in-kernel (griddepcontrol.wait) before it
touches anything an earlier kernel writes. What it may do before the wait -- read weights, which no
kernel writes -- overlaps the previous kernel's tail; at T = 8 a layer is seven ~2-7 us kernels,
so ramp-up and tail are a large part of each.

Kernels take a `PDL: tl.constexpr` and, when it is set, call gdc_launch_dependents() and
gdc_wait() before their first read of activations (and before any write), inline (a nested jit
call is slow under the interpreter); the launch passes `**pdl_launch(x)`. Inside a CUDA graph the launch
attribute becomes a programmatic edge. Off under the interpreter and on older GPUs.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(x: torch.Tensor) -> bool:
    from . import USE_PDL  # read at call time: bench/ compares with and without

    if not (USE_PDL and x.is_cuda) or _INTERPRETED:
        return False
    return _supported(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_launch(x: torch.Tensor) -> dict:
    """Kernel-call keywords: the PDL constexpr, and the launch flag when it is on."""
    on = use_pdl(x)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def prefetch_l2(ptrs):
    """Hint: pull the 128-byte lines at `ptrs` into L2 (fire and forget; no result)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


_INTERPRETED = type(prefetch_l2).__name__ == "InterpretedFunction"
