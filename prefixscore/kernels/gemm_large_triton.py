"""GEMMs for many tokens with the block's elementwise work in their epilogues (same math as
gemm.gate_up_silu_ref and gemm.qkv_rope_ref, after the block's RMSNorm).

Past the skinny kernels (T > 64) the GEMMs are compute-bound and cuBLAS runs them at the matmul
rate, but around them sit passes over memory: RMSNorm writes the normalised rows, RoPE reads the
QKV output back, SiLU * up reads the [T, 2I] gate/up output back (W3 on the H200, 15k tokens a
request: silu_mul 2.6 ms, RMSNorm and RoPE 1.0 ms, of 21). One program here holds two
accumulators for one output tile (two dots per K step over one x tile), so each of those passes
becomes the epilogue of the GEMM before it:

  EPI 1  gated: w = [Wg; Wu] ([2I, K]); the accumulators are the gate and the up columns of the
         same BLOCK_N outputs; out[T, I] = silu(gate) * up            (replaces silu_mul)
  EPI 2  rope:  w = Wqkv; the accumulators are the first and the second halves of the same heads
         (BLOCK_N / (D/2) heads a tile), so RoPE's rotate-half pairs meet in registers; writes q,
         k rotated and v                                              (replaces rope_qk)
  NORM   x is the residual stream and w has the RMSNorm weight folded in (model.py): each program
         sums its rows' squares from the x tiles its K loop loads anyway (the whole K), and the
         epilogue scales by rstd: rms_norm(x) @ w^T = rstd * (x @ w^T)  (replaces rms_norm)

Whether Triton's GEMM keeps cuBLAS's rate at K = 896 is what KernelOptions.mlp_fused and qkv_fused
A/B (bench.multi_item --ab mlp_fused=1,qkv_fused=1); off until then.

Rounding as HF's where it is cheap: a linear's output rounded to the dtype, SiLU of the rounded
gate rounded, times up rounded once (fused_triton._silu_mul_kernel's steps); RoPE in fp32 from the
rounded q, k, rounded once (fused_triton._rope_qk_kernel's). NORM scales the fp32 sums instead of
rounding the normalised x first (HF's order): one rounding fewer, as the skinny kernels' NORM.

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
def _large_kernel(
    X, W, B, OUT, COS, SIN, QO, KO, VO, M, N, K, stride_x, stride_w, stride_o, eps,
    EPI: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, GDC: tl.constexpr,
):
    """N: columns of one accumulator family (EPI 1: I; EPI 2: head halves, (HQ + 2 HKV) * D/2)."""
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tm = first_m + (pid % group) % size_m
    tn = (pid % group) // size_m

    rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    # Out-of-range rows and columns load as row M-1 / column N-1 (valid memory, never stored),
    # so the loop's loads need a mask on K only, and none when BLOCK_K divides K (EVEN_K).
    xm = tl.minimum(rm, M - 1).to(tl.int64)
    rc = tl.minimum(rn, N - 1)
    if EPI == 1:
        wa = rc  # gate rows; up rows I further
        wb = rc + N
    else:
        HALF: tl.constexpr = D // 2
        head = rc // HALF
        c = rc % HALF
        wa = head * D + c  # first half of the head; second half HALF further
        wb = wa + HALF
    x_ptr = X + xm[:, None] * stride_x + rk[None, :]
    a_ptr = W + wa.to(tl.int64)[None, :] * stride_w + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    b_ptr = W + wb.to(tl.int64)[None, :] * stride_w + rk[:, None]
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ssq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr)
            w_a = tl.load(a_ptr)
            w_b = tl.load(b_ptr)
        else:
            k_ok = rk < K - k0
            x = tl.load(x_ptr, mask=k_ok[None, :], other=0.0)
            w_a = tl.load(a_ptr, mask=k_ok[:, None], other=0.0)
            w_b = tl.load(b_ptr, mask=k_ok[:, None], other=0.0)
        if NORM:  # the rows' sums of squares from the tile the dot reads anyway
            xf = x.to(tl.float32)
            ssq += tl.sum(xf * xf, 1)
        acc_a = _dot(x, w_a, acc_a, DOT_PREC, UPCAST)
        acc_b = _dot(x, w_b, acc_b, DOT_PREC, UPCAST)
        x_ptr += BLOCK_K
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K

    if NORM:
        rstd = tl.rsqrt(ssq / K + eps)[:, None]
        acc_a *= rstd
        acc_b *= rstd
    if HAS_BIAS:
        acc_a += tl.load(B + wa).to(tl.float32)[None, :]
        acc_b += tl.load(B + wb).to(tl.float32)[None, :]
    m_out = m_ok[:, None] & n_ok[None, :]
    if EPI == 1:
        dt = OUT.dtype.element_ty
        g = acc_a.to(dt).to(tl.float32)
        u = acc_b.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(OUT + rm.to(tl.int64)[:, None] * stride_o + rn[None, :], (s * u).to(dt), mask=m_out)
    else:
        dt = QO.dtype.element_ty
        a = acc_a.to(dt).to(tl.float32)  # the qkv linear's output, rounded like F.linear
        b = acc_b.to(dt).to(tl.float32)
        t = rm.to(tl.int64)[:, None]
        cc = c[None, :]
        c1 = tl.load(COS + t * D + cc, mask=m_out, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t * D + cc, mask=m_out, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t * D + HALF + cc, mask=m_out, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t * D + HALF + cc, mask=m_out, other=0.0).to(tl.float32)
        h = head[None, :]
        rot = h < HQ + HKV  # q and k heads; v heads keep a, b
        o1 = tl.where(rot, a * c1 - b * s1, a).to(dt)
        o2 = tl.where(rot, b * c2 + a * s2, b).to(dt)
        is_q = m_out & (h < HQ)
        is_k = m_out & (h >= HQ) & rot
        is_v = m_out & (h >= HQ + HKV)
        q_dst = QO + (t * HQ + h) * D + cc
        k_dst = KO + (t * HKV + (h - HQ)) * D + cc
        v_dst = VO + (t * HKV + (h - HQ - HKV)) * D + cc
        tl.store(q_dst, o1, mask=is_q)
        tl.store(q_dst + HALF, o2, mask=is_q)
        tl.store(k_dst, o1, mask=is_k)
        tl.store(k_dst + HALF, o2, mask=is_k)
        tl.store(v_dst, o1, mask=is_v)
        tl.store(v_dst + HALF, o2, mask=is_v)


# Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
_INTERPRETED = type(_large_kernel).__name__ == "InterpretedFunction"


def large_config(dtype) -> dict:
    """128 x 128 output tiles (two fp32 accumulators: 128 registers a thread at 8 warps), K steps
    of 64; three stages of x [128, 64] and two weight tiles [64, 128] are 144 KB of shared memory
    in bf16. fp32 (tests only): smaller tiles."""
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _launch(x, w, bias, epi, ncols, out, rope, norm_eps, config, role, options):
    """One _large_kernel launch. ncols: the kernel's N; out: EPI 1's output; rope: EPI 2's (cos,
    sin, q, k, v, Hq, Hkv, D). Pointers an epilogue does not read get w (never dereferenced)."""
    T, K = x.shape
    assert x.dtype == w.dtype and w.shape[1] == K
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    cfg = tuned(large_config(x.dtype), role, options)
    cfg.update(config or {})
    cos, sin, qo, ko, vo, Hq, Hkv, D = rope or (w, w, w, w, w, 1, 1, 2)
    grid = (triton.cdiv(T, cfg["BLOCK_M"]) * triton.cdiv(ncols, cfg["BLOCK_N"]),)
    _large_kernel[grid](
        x, w, bias if bias is not None else w, out if out is not None else w, cos, sin, qo, ko, vo,
        T, ncols, K, x.stride(0), w.stride(0), out.stride(0) if out is not None else 0,
        1e-6 if norm_eps is None else norm_eps,
        EPI=epi, HAS_BIAS=bias is not None, NORM=norm_eps is not None, HQ=Hq, HKV=Hkv, D=D,
        EVEN_K=K % cfg["BLOCK_K"] == 0, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED, **cfg, **launch_kwargs(x.device, options),
    )


def gate_up_silu_large(x, w_gu, bias=None, out=None, norm_eps=None, config=None,
                       options: KernelOptions = DEFAULTS):
    """x [T, K]; w_gu [2I, K] (gate rows, then up rows); bias [2I] or None -> [T, I] =
    silu(x' @ Wg^T + bg) * (x' @ Wu^T + bu), x' = x, or with norm_eps x / rms(x) (NORM).
    `config` overrides large_config (tests, bench)."""
    T = x.shape[0]
    I = w_gu.shape[0] // 2
    assert w_gu.shape[0] == 2 * I
    if out is None:
        out = torch.empty(T, I, dtype=x.dtype, device=x.device)
    assert out.shape == (T, I) and out.stride(-1) == 1
    if T:
        _launch(x, w_gu, bias, 1, I, out, None, norm_eps, config, "gu_large", options)
    return out


def qkv_rope_large(x, w_qkv, bias, cos, sin, Hq, Hkv, D, norm_eps=None, config=None,
                   options: KernelOptions = DEFAULTS):
    """x [T, K]; w_qkv [(Hq + 2 Hkv) D, K]; cos, sin [T, D] -> q [T, Hq, D], k [T, Hkv, D] (RoPE
    applied) and v [T, Hkv, D], of x or (norm_eps) x / rms(x). No per-head norm (Qwen3 takes the
    unfused path)."""
    T = x.shape[0]
    assert w_qkv.shape[0] == (Hq + 2 * Hkv) * D and D % 2 == 0
    q = torch.empty(T, Hq, D, dtype=x.dtype, device=x.device)
    k = torch.empty(T, Hkv, D, dtype=x.dtype, device=x.device)
    v = torch.empty(T, Hkv, D, dtype=x.dtype, device=x.device)
    if T:
        rope = (cos.contiguous(), sin.contiguous(), q, k, v, Hq, Hkv, D)
        _launch(x, w_qkv, bias, 2, (Hq + 2 * Hkv) * D // 2, None, rope, norm_eps, config, "qkv_large",
                options)
    return q, k, v
