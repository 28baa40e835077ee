"""Triton versions of kernels/fused.py (same math; see the references there). One program per token
row: these are memory-bound and tiny, so the point is one launch instead of several."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, H, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    dt = out_ptr.dtype.element_ty
    # All arithmetic in fp32, rounded to the dtype where HF rounds (bf16 math in the interpreter
    # is not reliable, and this gives the same values).
    x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = (x + tl.load(r_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
    tl.store(res_ptr + row * H + offs, x.to(dt), mask=m)  # the new residual stream
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)  # round before the weight, like HF
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (w * y).to(dt), mask=m)  # exact product, rounded once


def add_rms_norm_triton(x, residual, weight, eps, out=None, res_out=None):
    T, H = x.shape
    out = torch.empty_like(x) if out is None else out
    res_out = torch.empty_like(x) if res_out is None else res_out
    _add_rms_norm_kernel[(T,)](x, residual if residual is not None else x, weight, out, res_out, H,
                               eps, HAS_RES=residual is not None,
                               BLOCK=triton.next_power_of_2(H), num_warps=4)
    return out, res_out


@triton.jit
def _rope_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, k_ptr, eps,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr):
    """One program per token: all q and k heads of that token. q -> [T, HQ, D], k -> [T, HKV, D]."""
    t = tl.program_id(0)
    half: tl.constexpr = D // 2
    d = tl.arange(0, half)
    c1 = tl.load(cos_ptr + t * D + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * D + d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * D + half + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * D + half + d).to(tl.float32)
    row = qkv_ptr + t * (HQ + 2 * HKV) * D
    for h in tl.static_range(HQ + HKV):
        a = tl.load(row + h * D + d)
        b = tl.load(row + h * D + half + d)
        if QK_NORM:
            if h < HQ:
                nw = qn_ptr
            else:
                nw = kn_ptr
            af, bf = a.to(tl.float32), b.to(tl.float32)
            r = tl.rsqrt((tl.sum(af * af, 0) + tl.sum(bf * bf, 0)) / D + eps)
            dt = q_ptr.dtype.element_ty
            a = (tl.load(nw + d).to(tl.float32) * (af * r).to(dt).to(tl.float32)).to(dt)
            b = (tl.load(nw + half + d).to(tl.float32) * (bf * r).to(dt).to(tl.float32)).to(dt)
        # HF rounds q*cos and rotate_half(q)*sin separately in the input dtype; fp32 here differs
        # from that by at most one rounding step (within the bf16 tolerance of the tests).
        af, bf = a.to(tl.float32), b.to(tl.float32)
        o1 = af * c1 - bf * s1
        o2 = bf * c2 + af * s2
        if h < HQ:
            dst = q_ptr + (t * HQ + h) * D
        else:
            dst = k_ptr + (t * HKV + h - HQ) * D
        tl.store(dst + d, o1.to(q_ptr.dtype.element_ty))
        tl.store(dst + half + d, o2.to(q_ptr.dtype.element_ty))


def rope_qk_triton(qkv, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6):
    T = qkv.shape[0]
    q = torch.empty(T, Hq, D, device=qkv.device, dtype=qkv.dtype)
    k = torch.empty(T, Hkv, D, device=qkv.device, dtype=qkv.dtype)
    v = qkv.view(T, Hq + 2 * Hkv, D)[:, Hq + Hkv:]
    norm = q_norm is not None
    _rope_qk_kernel[(T,)](qkv, cos, sin, q_norm if norm else qkv, k_norm if norm else qkv, q, k, eps,
                          HQ=Hq, HKV=Hkv, D=D, QK_NORM=norm, num_warps=1)
    return q, k, v


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + row * 2 * I + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + offs, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # HF: silu(g) rounded to the dtype, then * up (exact in fp32, rounded once)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * I + offs, (s * u).to(dt), mask=m)


def silu_mul_triton(gate_up):
    T, I2 = gate_up.shape
    I = I2 // 2
    out = torch.empty(T, I, device=gate_up.device, dtype=gate_up.dtype)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](gate_up, out, I, BLOCK=BLOCK, num_warps=4)
    return out
