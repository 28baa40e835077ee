"""Programmatic dependent launch (PDL, sm_90+): each kernel of a forward is launched before the one
ahead of it has finished.

A small-batch forward is ~100 short kernels in one CUDA graph, and between two of them the SMs sit
idle while the next launch is processed. Launched with PDL, a kernel's launch overlaps the end of
its predecessor; its first instruction waits (griddepcontrol.wait: every earlier kernel complete
and its writes visible), so it reads and writes exactly what a serial launch would. Where the
kernel ahead triggers (gdc_launch_dependents: trigger() below, 0.5B-class layers), its successor
launches then; otherwise the predecessor's exit lets it run.

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
so only the wait was kept then. --ab reads ~0.06 ms above the full bench's W1 row for the same graph
in the same device call (0.613 vs 0.556: gpu_ab_pdl_bulk.json, gpu_quick_pdl_final.json), so
compare its rows only with each other. (Not the GPU clock after a capture: a 0.3 s warm-up before
timing changed nothing, and on the next session's machine both harnesses read ~0.595 ms.)

Seventh session (bench.gpu --ab EARLY_WEIGHTS,TRIGGER, two device calls; bench/results/
gpu_ab_early_trigger_*session7*.json): the skinny GEMMs load their first weight tiles (all of them
where a split holds <= 32 KB), and attention + O its Wo tile and the pinned prefix's first K/V tile,
*into registers* before the wait (early()); and each of those kernels triggers its successor once
its main loop has read its weights (trigger()), so the successor's early loads overlap this
kernel's split-K reduction and stores:
                                              0.5B          7B
  neither (the sixth session's)               0.582 (0.615) 3.679-3.732
  trigger only                                0.586-0.588   3.702-3.703
  early loads only                            0.658-0.660   3.900-3.921   (the wait seems to drain them)
  early loads + trigger (kept for 0.5B-class) 0.572-0.573   3.825-3.839
(0.615: the baseline's second capture in both calls.) At 7B both lose, so they apply only to
kernels whose weight is at most EARLY_MAX_BYTES (every 0.5B layer; no 7B layer), and 7B runs as
before.

Ninth session: with early loads, the trigger pays most right after the wait (trigger() has the
rows: W1 0.539 -> 0.480 ms). The second session's "trigger right after the wait" above lost
because nothing was loaded early then: the next kernel's programs only sat on the SMs.

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
    -1.4 to -2.6). H200, W1 graph replay in place, scores bitwise the same (bench/results/
    gpu_ab_gu_trigger_session9.json, gpu_ab_round5_session9.json, gpu_ab_round6_session9.json):
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
