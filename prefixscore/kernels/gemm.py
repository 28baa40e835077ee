"""Linear layers for few tokens: torch references and the dispatch to kernels/gemm_triton.py.

  linear_residual(x, w, b, r)        -> (r + x @ w^T (+ b), ssq)               (addmm)
  gate_up_silu(x, w_gu, b)           -> silu(x @ Wg^T) * (x @ Wu^T)            (linear + silu_mul)
  qkv_rope(x, w_qkv, b, cos, sin, ...) -> q, k, v after per-head norm + RoPE (linear + rope_qk)

gate_up_silu and qkv_rope also take x as Normed: the residual stream's RMSNorm with unit weight, not
yet computed (the norm weight is folded into their weight columns, model.py).

On CUDA with T <= SMALL_T_MAX tokens these are one skinny Triton kernel each (weight read spread
over every SM, epilogue fused), and the block's RMSNorms and residual adds ride along: the GEMM
that writes the residual stream (O, down) adds the residual in its epilogue and leaves per-row
sums of squares (ssq), and the GEMM that reads the stream (QKV, gate/up) scales its output rows
by 1/rms (rms_norm(x) @ W^T = rstd * (x @ W^T)). Larger T stays on cuBLAS (F.linear, addmm) + the
fused elementwise kernels. Every dispatcher takes the engine's KernelOptions (kernels/options.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import fp8
from .fused import rms_norm, rope_qk, rope_qk_ref, silu_mul, silu_mul_ref
from .options import KernelOptions, use_triton

SMALL_T_MAX = 64  # crossover to cuBLAS (tune from bench/gemm.py)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------- torch references
def linear_ref(x, w, bias=None):
    return F.linear(x, w, bias)


def gate_up_silu_ref(x, w_gu, bias=None):
    return silu_mul_ref(F.linear(x, w_gu, bias))


def qkv_rope_ref(x, w_qkv, bias, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6):
    return rope_qk_ref(F.linear(x, w_qkv, bias), cos, sin, Hq, Hkv, D, q_norm, k_norm, eps)


@dataclass
class Normed:
    """rms_norm(x) (unit weight) as a GEMM input, left for the GEMM's epilogue when the skinny GEMM
    that wrote x also left its per-row sums of squares (ssq); otherwise computed first (tensor())."""
    x: torch.Tensor
    ssq: torch.Tensor | None
    eps: float

    def tensor(self, options: KernelOptions):
        return rms_norm(self.x, None, self.eps, options=options)


def _data(x):
    """The tensor a GEMM input is made from (a Normed's residual stream)."""
    return x.x if isinstance(x, Normed) else x


def _prologue(x, skinny: bool, options: KernelOptions):
    """-> (the GEMM input, norm arguments for the skinny kernel's NORM epilogue or None): a Normed
    is left to the skinny kernel when its producer left the sums of squares, else computed here."""
    if not isinstance(x, Normed):
        return x, None
    if skinny and x.ssq is not None and options.fuse_norms:
        return x.x, (x.eps, x.ssq)
    return x.tensor(options), None


# ---------------------------------------------------------------- dispatch
def _small(x, w, options: KernelOptions) -> bool:
    """The skinny kernel takes this GEMM: few tokens, or any T in batch-invariant mode (its one
    config over row tiles, gemm_config.config_rows)."""
    return (isinstance(x, torch.Tensor) and use_triton(x, options) and x.dim() == 2
            and 0 < x.shape[0] and (x.shape[0] <= SMALL_T_MAX or options.batch_invariant)
            and x.dtype in _DTYPES and (w.dtype == x.dtype or fp8.is_fp8(w) and x.dtype != torch.float32))


def _linear(x, w, bias, dtype, options: KernelOptions):
    """F.linear, or the FP8 GEMM for an e4m3 weight (kernels/fp8.py; x may be an Fp8Act, whose
    product is returned in `dtype`)."""
    return fp8.linear(x, w, bias, dtype, options=options) if fp8.is_fp8(w) else F.linear(x, w, bias)


def _fp8_input(x, w, options: KernelOptions):
    """On CUDA past the skinny kernels, an e4m3 weight's input quantized per token by the kernel
    that makes it (kernels/fp8_triton.py): a Normed's RMSNorm writes e4m3 itself. None: the
    ordinary path (bf16 input; fp8.linear quantizes a plain tensor itself)."""
    if fp8.is_fp8(w) and isinstance(x, Normed) and use_triton(x.x, options):
        return fp8.rows_q8(x.x, "rms", x.eps, options=options)
    return None


def linear_residual(x, w, bias, residual, *, options: KernelOptions, inplace: bool = False,
                    config: dict | None = None):
    """-> (residual + x @ w^T (+ bias), ssq): the new residual stream and, from the skinny kernel,
    its per-row sums of squares by column tile for the next Normed (None on the other paths).
    inplace: past the skinny kernels the sum is written over `residual` (the model's own stream,
    read by nothing after): addmm into a new tensor first copies the residual there, a [T, hidden]
    device copy per call (W3 on the H200: 48 copies, 0.8 ms of a 21 ms request).
    config: the skinny kernel's launch-config entries (attention_o's head_split)."""
    if _small(x, w, options):
        from .gemm_triton import linear_residual_small

        return linear_residual_small(x, w, bias, residual, config=config, options=options)
    if bias is None and not fp8.is_fp8(w):  # cuBLAS adds the residual in its epilogue (one
        # rounding instead of HF's two)
        return torch.addmm(residual, x, w.t(), out=residual if inplace else None), None
    y = _linear(x, w, bias, residual.dtype, options)
    return (residual.add_(y) if inplace else residual + y), None


def gate_up_silu(x, w_gu, bias=None, *, options: KernelOptions):
    """-> silu(x @ Wg^T) * (x @ Wu^T): a tensor, or past the skinny kernels with e4m3 weights on
    CUDA an fp8.Fp8Act (SiLU * up writes the down GEMM's e4m3 input itself)."""
    skinny = _small(_data(x), w_gu, options)
    q8 = None if skinny else _fp8_input(x, w_gu, options)
    if q8 is not None:
        return fp8.rows_q8(_linear(q8, w_gu, bias, x.x.dtype, options), "silu", options=options)
    x, norm = _prologue(x, skinny, options)
    if skinny:
        from .gemm_triton import gate_up_silu_small

        return gate_up_silu_small(x, w_gu, bias, norm=norm, options=options)
    return silu_mul(_linear(x, w_gu, bias, None, options), options=options)


def _rope_fits(D):
    return (D // 2) >= 16 and (D // 2) & (D // 2 - 1) == 0


def qkv_rope(x, w_qkv, bias, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6, *,
             options: KernelOptions):
    """-> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (v may be a view on the cuBLAS path)."""
    skinny = _small(_data(x), w_qkv, options) and _rope_fits(D)
    q8 = None if skinny else _fp8_input(x, w_qkv, options)
    if q8 is not None:
        return rope_qk(_linear(q8, w_qkv, bias, x.x.dtype, options), cos, sin, Hq, Hkv, D, q_norm,
                       k_norm, eps, options=options)
    x, norm = _prologue(x, skinny, options)
    if skinny:
        from .gemm_triton import qkv_rope_small

        return qkv_rope_small(x, w_qkv, bias, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps, norm=norm,
                              options=options)
    return rope_qk(_linear(x, w_qkv, bias, None, options), cos, sin, Hq, Hkv, D, q_norm, k_norm, eps,
                   options=options)
