"""A whole transformer block for few tokens as one persistent kernel (kernels/layer_triton.py):
when it applies, and the call. The four-kernel path (kernels/gemm.py, kernels/attention.py) stays
the fallback and the reference: the persistent kernel runs the same units (the same math; where a
sum may round differently: layer_triton's docstring)."""
from __future__ import annotations

import torch

from . import fp8
from .options import KernelOptions, use_triton

MAX_T = 16  # the latency buckets (layer_triton.MAX_T)
WO_MAX_BYTES = 8 << 20  # attention + O as one phase: only where attention.attention_o fuses them


def fits(x, ssq, wqkv, wo, o_bias, D, options: KernelOptions) -> bool:
    """Whether the persistent block takes this layer: options.persistent_layer, on CUDA, 16-bit
    activations and weights (no FP8 yet), T <= MAX_T, the row sums of squares of x at hand (the
    skinny path's fused norms), the fused attention + O (no O bias, a 0.5B-class Wo), and not
    batch-invariant mode (its attention reduces in the canonical order, kernels/options.py)."""
    T = x.shape[0]
    return bool(options.persistent_layer and use_triton(x, options) and 0 < T <= MAX_T
                and ssq is not None and x.dtype in (torch.bfloat16, torch.float16)
                and not fp8.is_fp8(wqkv) and not fp8.is_fp8(wo) and wqkv.dtype == x.dtype
                and o_bias is None and wo.numel() * wo.element_size() <= WO_MAX_BYTES
                and options.fuse_norms and options.fuse_attn_o and options.in_tile
                and not options.batch_invariant and D // 2 >= 16 and (D // 2) & (D // 2 - 1) == 0)


def block(x, ssq, wqkv, bqkv, cos, sin, q_norm, k_norm, qk_eps, prefix_k, prefix_v, base_start,
          base_end, own_start, scale, wo, w_gu, b_gu, w_down, b_down, norm_eps, Hq, Hkv, D,
          prefix_range=None, *, options: KernelOptions):
    """-> (x2, ssq2): the block's new residual stream and its row sums of squares by column tile."""
    from .layer_triton import layer_small

    x2, ssq2, _ = layer_small(x, ssq, wqkv, bqkv, cos, sin, q_norm, k_norm, qk_eps, prefix_k,
                              prefix_v, base_start, base_end, own_start, scale, wo, w_gu, b_gu,
                              w_down, b_down, norm_eps, Hq, Hkv, D, prefix_range, options=options)
    return x2, ssq2
