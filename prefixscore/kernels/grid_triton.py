"""Grid-wide steps inside one kernel: a barrier, and the reduction of per-program partials after it.

Used by the gate/up + down kernel (gemm_triton, EPI 3): every program leaves an fp32 partial of
the down GEMM over its own columns of the intermediate activation; after the barrier every program
sums a few output columns across all partials, in a fixed order (deterministic), adds the residual
and leaves the per-row sums of squares for the next RMSNorm.

The barrier spins, so it needs every program resident at once (gemm_triton checks the occupancy of
the compiled kernel) and cannot run under the sequential CPU interpreter: there the reduction is a
second launch of _reduce_kernel, the same code after a kernel boundary instead of the barrier.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait


@triton.jit
def grid_barrier(BAR, NPROG: tl.constexpr):
    """All NPROG programs (all resident at once) arrive before any leaves, and every program's
    global writes from before it are visible after it. BAR: an int64 counter that only grows, so
    nothing is re-armed between replays (one counter per NPROG: arrivals stay multiples of it);
    arrival value a leaves at (a // NPROG + 1) * NPROG."""
    tl.debug_barrier()  # this program's threads have issued their writes before it arrives
    arrived = tl.atomic_add(BAR, 1, sem="acq_rel")  # release: those writes; one thread per program
    target = (arrived // NPROG + 1) * NPROG
    seen = arrived + 1
    while seen < target:
        seen = tl.load(BAR, volatile=True)
    tl.atomic_add(BAR, 0, sem="acquire")  # the others' writes are visible from here on
    tl.debug_barrier()


@triton.jit
def reduce_partials(WS, R, OUT, SSQ_OUT, T, stride_ot, pid, NPROG,
                    N: tl.constexpr, NPART: tl.constexpr,
                    BLOCK_T: tl.constexpr, RED_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """OUT = R + sum_p WS[p] (WS [NPART, BLOCK_T, N] fp32), the sum rounded to OUT's dtype once and
    the add once (as HF's residual + linear); SSQ_OUT [cdiv(N, RED_N), T]: each row's sum of
    squares of OUT over one chunk of RED_N columns. Program pid takes chunks pid, pid + NPROG, ..."""
    dt = OUT.dtype.element_ty
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    n = tl.arange(0, RED_N)
    p = tl.arange(0, BLOCK_P)
    NCH: tl.constexpr = (N + RED_N - 1) // RED_N
    for c in range(pid, NCH, NPROG):
        cols = c * RED_N + n
        m = t_ok[:, None] & (cols < N)[None, :]
        r = tl.load(R + t[:, None] * stride_ot + cols[None, :], mask=m, other=0.0)
        acc = tl.zeros([BLOCK_T, RED_N], tl.float32)
        for p0 in range(0, NPART, BLOCK_P):  # fixed order: the sum does not depend on timing
            pp = (p0 + p)[:, None, None]
            v = tl.load(WS + pp * (BLOCK_T * N) + t[None, :, None] * N + cols[None, None, :],
                        mask=(pp < NPART) & m[None, :, :], other=0.0, cache_modifier=".cg")
            acc += tl.sum(v, 0)
        y = (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt)
        yf = tl.where(m, y.to(tl.float32), 0.0)
        tl.store(SSQ_OUT + c * T + t, tl.sum(yf * yf, 1), mask=t_ok)
        tl.store(OUT + t[:, None] * stride_ot + cols[None, :], y, mask=m)


@triton.jit
def _reduce_kernel(WS, R, OUT, SSQ_OUT, T, stride_ot,
                   N: tl.constexpr, NPART: tl.constexpr, BLOCK_T: tl.constexpr,
                   RED_N: tl.constexpr, BLOCK_P: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        wait()
    reduce_partials(WS, R, OUT, SSQ_OUT, T, stride_ot, tl.program_id(0), tl.num_programs(0), N,
                    NPART, BLOCK_T, RED_N, BLOCK_P)


def reduce_launch(ws, r, out, ssq_out, T, cfg, launch_kw):
    """The reduction as its own launch (interpreter; GPUs where the programs cannot all be resident)."""
    npart, bt, n = ws.shape
    nch = triton.cdiv(n, cfg["RED_N"])
    _reduce_kernel[(nch,)](ws, r, out, ssq_out, T, out.stride(0), N=n, NPART=npart, BLOCK_T=bt,
                           RED_N=cfg["RED_N"], BLOCK_P=cfg["BLOCK_P"], **launch_kw)
