"""Small fused kernels of the transformer block: each replaces 2-5 elementwise launches.

  rms_norm(x, w)                -> norm(x) * w
  rope_qk(qkv, cos, sin, ...)   -> q, k with optional per-head RMSNorm (Qwen3), then RoPE
  silu_mul(gate_up)             -> silu(gate) * up
  embed_rope(tokens, positions, embed, cos_table, sin_table) -> x, ssq, cos, sin (a forward's start)

Torch references define the math (and run on CPU); the Triton versions run on CUDA. The
dispatchers take the engine's KernelOptions (kernels/options.py).
"""
from __future__ import annotations

import torch

import torch.nn.functional as F

from .label_head import rms_norm as _rms_norm_ref
from .options import KernelOptions, use_triton


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


# ---------------------------------------------------------------- torch references (CPU path)
def rope_qk_ref(qkv, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6):
    """qkv [T, (Hq+2Hkv)*D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
    T = qkv.shape[0]
    q, k, v = qkv.view(T, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], dim=1)
    if q_norm is not None:
        q, k = _rms_norm_ref(q, q_norm, eps), _rms_norm_ref(k, k_norm, eps)
    c, s = cos[:, None], sin[:, None]
    q = (q * c + _rotate_half(q) * s).to(qkv.dtype)
    k = (k * c + _rotate_half(k) * s).to(qkv.dtype)
    return q, k, v


def embed_rope_ref(tokens, positions, embed, cos_table, sin_table):
    """-> (embed[tokens], None, cos_table[positions], sin_table[positions])."""
    return (F.embedding(tokens, embed), None, cos_table.index_select(0, positions),
            sin_table.index_select(0, positions))


def silu_mul_ref(gate_up, out=None):
    g, u = gate_up.chunk(2, dim=-1)
    return torch.mul(F.silu(g), u, out=out)


# ---------------------------------------------------------------- dispatch
def rms_norm(x, weight, eps, *, options: KernelOptions):
    """norm(x) * weight, the block's RMSNorm (torch reference: label_head.rms_norm); weight None:
    unit weight (the block's norm weights are folded into the next linear, model.py)."""
    if use_triton(x, options):
        from .fused_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, options=options)
    return _rms_norm_ref(x, weight, eps)


def rope_qk(qkv, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6, *, options: KernelOptions):
    if use_triton(qkv, options):
        from .fused_triton import rope_qk_triton

        return rope_qk_triton(qkv, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps, options=options)
    return rope_qk_ref(qkv, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps)


def silu_mul(gate_up, *, options: KernelOptions, out=None):
    """silu(gate) * up; out: rows to write it into ([T, I], row-contiguous), else a new tensor."""
    if use_triton(gate_up, options):
        from .fused_triton import silu_mul_triton

        return silu_mul_triton(gate_up, options=options, out=out)
    return silu_mul_ref(gate_up, out)


def embed_rope(tokens, positions, embed, cos_table, sin_table, *, options: KernelOptions):
    """The start of a forward: the token embeddings x [T, H], RoPE's cos and sin rows [T, D] of the
    positions, and on CUDA (one Triton kernel instead of three) x's row sums of squares [1, T] fp32,
    so layer 0's RMSNorm rides in its QKV GEMM like every other layer's (kernels/gemm.Normed)."""
    if use_triton(tokens, options):
        from .fused_triton import embed_rope_triton

        return embed_rope_triton(tokens, positions, embed, cos_table, sin_table, options=options)
    return embed_rope_ref(tokens, positions, embed, cos_table, sin_table)
