"""Gate/up GEMM with SiLU * up in its epilogue, for many tokens (same math as gemm.gate_up_silu_ref).

Past the skinny kernels (T > 64) gate/up is a compute-bound GEMM that cuBLAS runs at the matmul
rate, but its [T, 2I] output then goes to HBM and back for SiLU * up: on the H200, W3 (15k tokens
a request, Qwen2.5-0.5B) spent 2.6 ms of 21 in silu_mul, at the copy rate. Here one program holds
the gate and the up accumulators of the same BLOCK_N output columns (two dots per K step over one
x tile), so only [T, I] is written, once. Whether Triton's GEMM keeps cuBLAS's rate at K = 896 is
what KernelOptions.mlp_fused's A/B measures (bench.multi_item --ab mlp_fused=1); off until then.

Rounding as HF's: gate and up rounded to the dtype (their linears' outputs), SiLU of the rounded
gate rounded, times up rounded once (fused_triton._silu_mul_kernel's steps).

Programs: one per [BLOCK_M, BLOCK_N] output tile, grouped GROUP_M row tiles at a time down each
column band, so a band's weight tiles are read from L2 by the programs that run together.
CUDA-graph safe: the grid and config come from shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_config import tuned
from .options import DEFAULTS, KernelOptions
from .pdl import launch_kwargs, wait
from .triton_util import _dot


@triton.jit
def _gate_up_silu_kernel(
    X, W, B, OUT, M, I, K, stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    GDC: tl.constexpr,
):
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(I, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tm = first_m + (pid % group) % size_m
    tn = (pid % group) // size_m

    rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < I
    # Out-of-range rows and columns load as row M-1 / column I-1 (valid memory, never stored),
    # so the loop's loads need a mask on K only, and none when BLOCK_K divides K (EVEN_K).
    xm = tl.minimum(rm, M - 1).to(tl.int64)
    wn = tl.minimum(rn, I - 1).to(tl.int64)
    x_ptr = X + xm[:, None] * stride_x + rk[None, :]
    g_ptr = W + wn[None, :] * stride_w + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    u_ptr = g_ptr + I * stride_w
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr)
            wg = tl.load(g_ptr)
            wu = tl.load(u_ptr)
        else:
            k_ok = rk < K - k0
            x = tl.load(x_ptr, mask=k_ok[None, :], other=0.0)
            wg = tl.load(g_ptr, mask=k_ok[:, None], other=0.0)
            wu = tl.load(u_ptr, mask=k_ok[:, None], other=0.0)
        acc_g = _dot(x, wg, acc_g, DOT_PREC, UPCAST)
        acc_u = _dot(x, wu, acc_u, DOT_PREC, UPCAST)
        x_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K

    dt = OUT.dtype.element_ty
    if HAS_BIAS:
        acc_g += tl.load(B + wn).to(tl.float32)[None, :]
        acc_u += tl.load(B + I + wn).to(tl.float32)[None, :]
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    o_ptr = OUT + rm.to(tl.int64)[:, None] * stride_o + rn[None, :]
    tl.store(o_ptr, (s * u).to(dt), mask=m_ok[:, None] & n_ok[None, :])


# Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
_INTERPRETED = type(_gate_up_silu_kernel).__name__ == "InterpretedFunction"


def large_gu_config(dtype) -> dict:
    """128 x 128 output tiles (two fp32 accumulators: 128 registers a thread at 8 warps), K steps
    of 64; three stages of x [128, 64] and two weight tiles [64, 128] are 144 KB of shared memory
    in bf16. fp32 (tests only): smaller tiles."""
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def gate_up_silu_large(x, w_gu, bias=None, out=None, config=None, options: KernelOptions = DEFAULTS):
    """x [T, K]; w_gu [2I, K] (gate rows, then up rows); bias [2I] or None -> [T, I] =
    silu(x @ Wg^T + bg) * (x @ Wu^T + bu). `config` overrides large_gu_config (tests, bench)."""
    T, K = x.shape
    I = w_gu.shape[0] // 2
    assert w_gu.shape == (2 * I, K) and x.dtype == w_gu.dtype
    if out is None:
        out = torch.empty(T, I, dtype=x.dtype, device=x.device)
    assert out.shape == (T, I) and out.stride(-1) == 1
    if T == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gu = w_gu if w_gu.stride(-1) == 1 else w_gu.contiguous()
    cfg = tuned(large_gu_config(x.dtype), "gu_large", options)
    cfg.update(config or {})
    grid = (triton.cdiv(T, cfg["BLOCK_M"]) * triton.cdiv(I, cfg["BLOCK_N"]),)
    _gate_up_silu_kernel[grid](
        x, w_gu, bias if bias is not None else w_gu, out, T, I, K,
        x.stride(0), w_gu.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % cfg["BLOCK_K"] == 0, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED, **cfg, **launch_kwargs(x.device, options),
    )
    return out
