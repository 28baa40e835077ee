"""Programmatic dependent launch (PDL, sm_90+): each kernel of a forward is launched before the one
ahead of it has finished.

A small-batch forward is ~100 short kernels in one CUDA graph, and between two of them the SMs sit
idle while the next launch is processed. Launched with PDL, a kernel's launch overlaps the end of
its predecessor; its first instruction waits (griddepcontrol.wait: every earlier kernel complete
and its writes visible), so it reads and writes exactly what a serial launch would. Where the
kernel ahead triggers (gdc_launch_dependents: trigger() below, 0.5B-class layers), its successor
launches then; otherwise the predecessor's exit lets it run.

What was measured (H200, `python -m bench.gpu --ab ...`: W1 graph replay, each variant captured and
timed in one run; --ab reads ~0.06 ms above the full bench's W1 row for the same graph, so compare
its rows only with each other; the raw JSON of each A/B is in git history under bench/results), ms:
                                              0.5B          7B
  plain launches                              0.636-0.672   3.758-3.772
  PDL, wait only                              0.612-0.614   3.683-3.702
  + trigger right after the wait              0.671         3.906   (next kernel's CTAs sit idle)
  + trigger once the main loop is done        0.617-0.619   3.670-3.681
  + weight rows L2-prefetched before the wait 0.729-0.730   4.96-5.34
  + the next kernel's weights prefetched by the kernel ahead: 0.677-0.686 (0.617 without)
Then early loads (early() below): the skinny GEMMs load their first weight tiles (all of them
where a split holds <= 32 KB), and attention + O its Wo tile and the pinned prefix's first K/V
tile, *into registers* before the wait, and each such kernel triggers its successor so that the
successor's early loads overlap this kernel's tail:
  wait only                                   0.582         3.679-3.732
  trigger only                                0.586-0.588   3.702-3.703
  early loads only                            0.658-0.660   3.900-3.921   (the wait drains them)
  early loads + trigger after the main loop   0.572-0.573   3.825-3.839
  early loads + trigger right after the wait  0.480         -             (trigger() has the rows)
Trigger-at-wait lost in the first table because nothing was loaded early: the next kernel's
programs only sat on the SMs. At 7B early loads lose, so they apply only to kernels whose weight
is at most EARLY_MAX_BYTES (every 0.5B layer; no 7B layer), and 7B runs with the wait only.

Every Triton kernel takes GDC (constexpr), does `if GDC: wait()` first, and is launched with
launch_kwargs(device, options): GDC False (CPU interpreter, pre-Hopper GPUs, KernelOptions.pdl
off) compiles none of it in. The switches here are fields of the engine's KernelOptions
(kernels/options.py), passed in by each launch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .options import KernelOptions


@functools.lru_cache(maxsize=None)
def _hopper(device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device, options: KernelOptions) -> bool:
    return (options.pdl and device.type == "cuda" and type(wait).__name__ != "InterpretedFunction"
            and _hopper(device))


EARLY_MAX_BYTES = 18 << 20  # 0.5B gate/up is 17.4 MB; the smallest 7B weight (Wo) 25.7 MB


def early(weight_bytes: int, options: KernelOptions) -> bool:
    """Whether a kernel reading this many weight bytes loads some before its wait (early_weights)."""
    return bool(options.early_weights) and weight_bytes <= EARLY_MAX_BYTES


def trigger(device, w, role: str, options: KernelOptions) -> int:
    """TRIG of the kernel reading weight w: 0 it lets the next kernel launch only by ending, 1 once
    its main loop is done, 2 right after its wait. Only where early() holds (options.trigger): the
    next kernel has early loads to overlap. 2 for the roles options.trigger_at_wait names (1
    gate_up, 2 + attn_o, 3 + the rest: qkv and the plain linears, down among them).

    At its wait, every kernel ahead is done, so the next kernel's programs launch into the SM room
    this one's leave and start their early loads while it runs. Gate/up has no split-K tail, and
    with 152 programs on 132 SMs its last loop to end is about its last program to end: triggered
    after the loop, down launched as gate/up ended (W1 timeline gap -0.03 us, the other kernels
    -1.4 to -2.6). H200, W1 graph replay in place (bench.gpu --ab), scores bitwise the same:
        none 0.539 ms (span 548 us); gate/up 0.518 (524); + attention + O 0.492 (494);
        + QKV and down 0.480 (483; with down split 10 ways, gemm_config: 0.493 / 0.496 at 19)"""
    if not (options.trigger and enabled(device, options) and early(w.numel() * w.element_size(), options)):
        return 0
    return 2 if options.trigger_at_wait >= {"gate_up": 1, "attn_o": 2}.get(role, 3) else 1


def launch_kwargs(device, options: KernelOptions) -> dict:
    """GDC for the kernel, launch_pdl for Triton's launcher."""
    return dict(GDC=True, launch_pdl=True) if enabled(device, options) else dict(GDC=False)


@triton.jit
def wait():
    """Before any global access: the kernels ahead are done and their writes visible."""
    tl.extra.cuda.gdc_wait()
