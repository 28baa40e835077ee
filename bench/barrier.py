"""What a kernel boundary costs against a grid-wide barrier inside one kernel (H200, CUDA graph).

    python -m bench.barrier

A W1 layer is four dependent kernels (~6 µs each, whatever their bytes: BENCHMARKS.md). Merging two
of them needs a grid-wide barrier between their phases. This times the bare step both ways, each
step a trivial load/add/store per program:
  - chain:   L launches of a one-step kernel (PDL, wait only, as the forward launches), one graph;
  - barrier: one launch doing L steps with a grid barrier after each (all programs resident).
Writes $OUT/barrier.json. Checks the barrier's result (every program saw every step).
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from prefixscore.kernels.pdl import launch_kwargs, wait

from .gpu import gpu_times

OUT = Path(os.environ.get("OUT") or "bench/results")


@triton.jit
def grid_barrier(BAR, NPROG: tl.constexpr):
    """All NPROG programs (all resident at once) arrive before any leaves, and every program's
    global writes from before it are visible after it. BAR: an int64 counter that only grows, so
    nothing is re-armed between replays; arrival value a leaves at (a // NPROG + 1) * NPROG."""
    tl.debug_barrier()  # this program's threads have issued their writes before it arrives
    arrived = tl.atomic_add(BAR, 1, sem="acq_rel")  # release: those writes; one thread per program
    target = (arrived // NPROG + 1) * NPROG
    seen = arrived + 1
    while seen < target:
        seen = tl.load(BAR, volatile=True)
    tl.atomic_add(BAR, 0, sem="acquire")  # the others' writes are visible from here on
    tl.debug_barrier()


@triton.jit
def _step(X, GDC: tl.constexpr):
    if GDC:
        wait()
    pid = tl.program_id(0)
    tl.store(X + pid, tl.load(X + pid) + 1)


@triton.jit
def _steps(X, BAR, L: tl.constexpr, NPROG: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        wait()
    pid = tl.program_id(0)
    for i in range(L):
        # each step reads a neighbour's value of the step before: wrong without the barrier
        v = tl.load(X + (pid + 1) % NPROG, cache_modifier=".cg")
        grid_barrier(BAR, NPROG)
        tl.store(X + pid, v + 1)
        grid_barrier(BAR, NPROG)


def replay_us(graph):
    return statistics.median(gpu_times(graph.replay, 200)) * 1e3


def main():
    dev = torch.device("cuda")
    L = 96
    res = {"device": torch.cuda.get_device_name(), "steps": L, "rows": []}
    for P in (132, 152, 264):
        x = torch.zeros(P, dtype=torch.int32, device=dev)
        bar = torch.zeros(1, dtype=torch.int64, device=dev)
        kw = launch_kwargs(dev)
        _step[(P,)](x, **kw)
        _steps[(P,)](x, bar, L=L, NPROG=P, **kw)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            g_chain = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_chain, stream=s):
                for _ in range(L):
                    _step[(P,)](x, **kw)
            g_bar = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_bar, stream=s):
                _steps[(P,)](x, bar, L=L, NPROG=P, **kw)
        chain = replay_us(g_chain) / L
        barrier = replay_us(g_bar) / (2 * L)
        x.zero_()
        g_bar.replay()
        torch.cuda.synchronize()
        ok = bool((x == L).all())
        row = dict(programs=P, kernel_boundary_us=chain, grid_barrier_us=barrier, barrier_correct=ok)
        res["rows"].append(row)
        print(row, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "barrier.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
