"""Triton versions of kernels/fused.py (same math; see the references there). One program per token
row: these are memory-bound and tiny, so the point is one launch instead of several. Each entry point
takes the engine's KernelOptions (kernels/options.py; the defaults for tests and bench)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .options import DEFAULTS, KernelOptions
from .pdl import launch_kwargs, wait


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                     GDC: tl.constexpr):
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    dt = out_ptr.dtype.element_ty
    # All arithmetic in fp32, rounded to the dtype where HF rounds (bf16 math in the interpreter
    # is not reliable, and this gives the same values).
    xf = tl.load(x_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)  # round before the weight, like HF
    if HAS_W:
        y = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32) * y  # exact, rounded once
    tl.store(out_ptr + row * H + offs, y.to(dt), mask=m)


def rms_norm_triton(x, weight, eps, out=None, options: KernelOptions = DEFAULTS):
    T, H = x.shape
    x = x.contiguous()
    out = torch.empty_like(x) if out is None else out
    _rms_norm_kernel[(T,)](x, x if weight is None else weight, out, H, eps, HAS_W=weight is not None,
                           BLOCK=triton.next_power_of_2(H), num_warps=4,
                           **launch_kwargs(x.device, options))
    return out


@triton.jit
def _rope_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, k_ptr, eps,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NH: tl.constexpr,
                    QK_NORM: tl.constexpr, GDC: tl.constexpr):
    """One program per token, all q and k heads at once as a [NH, D/2] tile (NH = HQ + HKV padded to
    a power of two): one vectorised load/compute/store instead of a serial loop over heads."""
    if GDC:
        wait()
    t = tl.program_id(0)
    half: tl.constexpr = D // 2
    h = tl.arange(0, NH)[:, None]
    d = tl.arange(0, half)[None, :]
    m = (h < HQ + HKV) & (d < half)
    row = qkv_ptr + t * (HQ + 2 * HKV) * D + h * D
    a = tl.load(row + d, mask=m, other=0.0).to(tl.float32)
    b = tl.load(row + half + d, mask=m, other=0.0).to(tl.float32)
    dt = q_ptr.dtype.element_ty
    if QK_NORM:  # Qwen3: RMSNorm over each head's D values (q heads use q_norm, k heads k_norm)
        r = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]
        is_q = h < HQ
        wa = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d)).to(tl.float32)
        wb = tl.where(is_q, tl.load(qn_ptr + half + d), tl.load(kn_ptr + half + d)).to(tl.float32)
        a = (wa * (a * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        b = (wb * (b * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    c1 = tl.load(cos_ptr + t * D + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * D + d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * D + half + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * D + half + d).to(tl.float32)
    # HF rounds q*cos and rotate_half(q)*sin separately in the input dtype; fp32 here differs from
    # that by at most one rounding step (within the bf16 tolerance of the tests).
    o1 = (a * c1 - b * s1).to(dt)
    o2 = (b * c2 + a * s2).to(dt)
    qd = q_ptr + (t * HQ + h) * D
    kd = k_ptr + (t * HKV + h - HQ) * D
    mq = m & (h < HQ)
    mk = m & (h >= HQ)
    tl.store(qd + d, o1, mask=mq)
    tl.store(qd + half + d, o2, mask=mq)
    tl.store(kd + d, o1, mask=mk)
    tl.store(kd + half + d, o2, mask=mk)


def rope_qk_triton(qkv, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6,
                   options: KernelOptions = DEFAULTS):
    T = qkv.shape[0]
    q = torch.empty(T, Hq, D, device=qkv.device, dtype=qkv.dtype)
    k = torch.empty(T, Hkv, D, device=qkv.device, dtype=qkv.dtype)
    v = qkv.view(T, Hq + 2 * Hkv, D)[:, Hq + Hkv:]
    norm = q_norm is not None
    NH = triton.next_power_of_2(Hq + Hkv)
    _rope_qk_kernel[(T,)](qkv, cos, sin, q_norm if norm else qkv, k_norm if norm else qkv, q, k, eps,
                          HQ=Hq, HKV=Hkv, D=D, NH=NH, QK_NORM=norm, num_warps=4 if NH * D >= 2048 else 2,
                          **launch_kwargs(qkv.device, options))
    return q, k, v


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        wait()
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + row * 2 * I + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + offs, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # HF: silu(g) rounded to the dtype, then * up (exact in fp32, rounded once)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * I + offs, (s * u).to(dt), mask=m)


def silu_mul_triton(gate_up, options: KernelOptions = DEFAULTS, out=None):
    T, I2 = gate_up.shape
    I = I2 // 2
    if out is None:
        out = torch.empty(T, I, device=gate_up.device, dtype=gate_up.dtype)
    assert out.shape == (T, I) and out.stride() == (I, 1), "silu_mul writes contiguous rows"
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](gate_up, out, I, BLOCK=BLOCK, num_warps=4,
                                                  **launch_kwargs(gate_up.device, options))
    return out


@triton.jit
def _embed_rope_kernel(TOK, POS, E, CT, ST, X, SSQ, COS, SIN, H, V, NPOS, D,
                       BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr):
    t = tl.program_id(0)
    if GDC:
        wait()
    # Clamped ids only keep a bad plan inside the tables (valid plans are in range).
    tok = tl.minimum(tl.load(TOK + t), V - 1).to(tl.int64)
    pos = tl.minimum(tl.load(POS + t), NPOS - 1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(E + tok * H + offs, mask=m, other=0.0)
    tl.store(X + t * H + offs, x, mask=m)
    xf = x.to(tl.float32)
    tl.store(SSQ + t, tl.sum(xf * xf, 0))
    d = tl.arange(0, BLOCK_D)
    md = d < D
    tl.store(COS + t * D + d, tl.load(CT + pos * D + d, mask=md), mask=md)
    tl.store(SIN + t * D + d, tl.load(ST + pos * D + d, mask=md), mask=md)


def embed_rope_triton(tokens, positions, embed, cos_table, sin_table, options: KernelOptions = DEFAULTS):
    T = tokens.shape[0]
    (V, H), D = embed.shape, cos_table.shape[1]
    assert embed.is_contiguous() and cos_table.is_contiguous() and sin_table.is_contiguous()
    kw = dict(device=embed.device, dtype=embed.dtype)
    x, cos, sin = torch.empty(T, H, **kw), torch.empty(T, D, **kw), torch.empty(T, D, **kw)
    ssq = torch.empty(1, T, device=embed.device, dtype=torch.float32)
    if T:
        _embed_rope_kernel[(T,)](tokens.contiguous(), positions.contiguous(), embed, cos_table,
                                 sin_table, x, ssq, cos, sin, H, V, cos_table.shape[0], D,
                                 BLOCK=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
                                 num_warps=4,
                                 **launch_kwargs(embed.device, options))
    return x, ssq, cos, sin


@triton.jit
def _copy_bytes_kernel(SRC, DST, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + i, tl.load(SRC + i, mask=i < n), mask=i < n)


def copy_bytes(src, dst, n, options: KernelOptions = DEFAULTS):
    """dst[:n] = src[:n] (uint8) by a kernel: src or dst may be pinned host memory, which the GPU
    reads and writes in place (zero-copy) -- a kernel node in a CUDA graph where a memcpy node
    costs ~6 us of GPU time (bench.gpu --ab COPIES)."""
    assert src.dtype == dst.dtype == torch.uint8 and src.is_contiguous() and dst.is_contiguous()
    BLOCK = 4096
    gpu = dst.device if dst.is_cuda else src.device
    _copy_bytes_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK, **launch_kwargs(gpu, options))
