"""Linear layers for few tokens: torch references and the dispatch to kernels/gemm_triton.py.

  linear(x, w, b)                    -> x @ w^T (+ b)                          (F.linear)
  gate_up_silu(x, w_gu, b)           -> silu(x @ Wg^T) * (x @ Wu^T)            (linear + silu_mul)
  qkv_rope(x, w_qkv, b, cos, sin, ...) -> q, k, v after per-head norm + RoPE (linear + rope_qk)

On CUDA with T <= SMALL_T_MAX tokens these are one skinny Triton kernel each (weight read spread
over every SM, epilogue fused); larger T stays on cuBLAS (F.linear) + the fused elementwise kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import use_triton
from .fused import rope_qk, rope_qk_ref, silu_mul, silu_mul_ref

SMALL_T_MAX = 64  # crossover to cuBLAS (tune from bench/gemm.py)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------- torch references
def linear_ref(x, w, bias=None):
    return F.linear(x, w, bias)


def gate_up_silu_ref(x, w_gu, bias=None):
    return silu_mul_ref(F.linear(x, w_gu, bias))


def qkv_rope_ref(x, w_qkv, bias, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6):
    return rope_qk_ref(F.linear(x, w_qkv, bias), cos, sin, Hq, Hkv, D, q_norm, k_norm, eps)


# ---------------------------------------------------------------- dispatch
def _small(x, w) -> bool:
    return (x.is_cuda and use_triton() and x.dim() == 2 and 0 < x.shape[0] <= SMALL_T_MAX
            and x.dtype in _DTYPES and w.dtype == x.dtype)


def linear(x, w, bias=None, out=None):
    if _small(x, w):
        from .gemm_triton import linear_small

        return linear_small(x, w, bias, out=out)
    if out is not None:
        return torch.matmul(x, w.t(), out=out) if bias is None else out.copy_(F.linear(x, w, bias))
    return F.linear(x, w, bias)


def gate_up_silu(x, w_gu, bias=None):
    if _small(x, w_gu):
        from .gemm_triton import gate_up_silu_small

        return gate_up_silu_small(x, w_gu, bias)
    return silu_mul(F.linear(x, w_gu, bias))


def qkv_rope(x, w_qkv, bias, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6):
    """-> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (v may be a view on the cuBLAS path)."""
    if _small(x, w_qkv) and (D // 2) >= 16 and (D // 2) & (D // 2 - 1) == 0:
        from .gemm_triton import qkv_rope_small

        return qkv_rope_small(x, w_qkv, bias, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps)
    return rope_qk(F.linear(x, w_qkv, bias), cos, sin, Hq, Hkv, D, q_norm, k_norm, eps)
