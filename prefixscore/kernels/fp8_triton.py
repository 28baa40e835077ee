"""Per-token e4m3 activations for the FP8 x FP8 GEMMs (large token counts), made by the kernel that
produces them (kernels/fp8.py has the references): the block's RMSNorm and SiLU * up write e4m3
values and a scale per row instead of bf16, so quantizing costs no pass of its own; the attention
output (O's input, written by programs of one head each) goes through the plain mode.

One program per row, two passes over it in BLOCK chunks: the first finds the row's amax (after,
for the norm, its sum of squares), the second writes round_to_e4m3(v / scale), scale = amax / 448.
The row is read twice from L2 (a few KB) instead of being written in bf16 and read back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .options import DEFAULTS, KernelOptions
from .pdl import launch_kwargs, wait

MODES = {"plain": 0, "rms": 1, "silu": 2}
E4M3_MAX = 448.0


@triton.jit
def _value(X, row, offs, m, H, rstd, MODE: tl.constexpr):
    """The bf16 value the bf16 path would hand to the GEMM, in fp32 (rounded where it rounds)."""
    if MODE == 2:  # silu(gate) rounded, times up, rounded once (fused.silu_mul_ref)
        g = tl.load(X + row * 2 * H + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(X + row * 2 * H + H + offs, mask=m, other=0.0).to(tl.float32)
        dt = X.dtype.element_ty
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (s * u).to(dt).to(tl.float32)
    x = tl.load(X + row * H + offs, mask=m, other=0.0).to(tl.float32)
    if MODE == 1:  # rms_norm with unit weight (its weight is folded into the next GEMM)
        return (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _rows_q8_kernel(X, Q, S, H, eps, MODE: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Q: e4m3, or (interpreter) fp32 values already divided and clamped, cast on the host."""
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    row = tl.program_id(0)
    ar = tl.arange(0, BLOCK)
    rstd = 1.0
    if MODE == 1:
        ssq = tl.zeros([BLOCK], tl.float32)
        for k in range(0, H, BLOCK):
            m = k + ar < H
            x = tl.load(X + row * H + k + ar, mask=m, other=0.0).to(tl.float32)
            ssq += x * x
        rstd = tl.rsqrt(tl.sum(ssq, 0) / H + eps)
    amax = tl.zeros([BLOCK], tl.float32)
    for k in range(0, H, BLOCK):
        m = k + ar < H
        amax = tl.maximum(amax, tl.where(m, tl.abs(_value(X, row, k + ar, m, H, rstd, MODE)), 0.0))
    a = tl.max(amax, 0)
    scale = tl.where(a > 0, a / 448.0, 1.0)
    tl.store(S + row, scale)
    for k in range(0, H, BLOCK):
        m = k + ar < H
        v = _value(X, row, k + ar, m, H, rstd, MODE) / scale
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(Q + row * H + k + ar, v.to(Q.dtype.element_ty), mask=m)


# Triton's CPU interpreter rounds fp32 -> e4m3 wrongly near a power of two (124.3 -> 64, a tie
# 84 -> 88): there the kernel writes the fp32 values and torch casts them (as the GPU's cvt does).
_INTERPRETED = type(_rows_q8_kernel).__name__ == "InterpretedFunction"


def rows_q8_triton(x: torch.Tensor, mode: str, eps: float = 0.0, options: KernelOptions = DEFAULTS):
    """x [T, H] (mode silu: [T, 2H], gate then up) -> (e4m3 [T, H], fp32 scales [T, 1])."""
    x = x.contiguous()
    T = x.shape[0]
    H = x.shape[1] // (2 if mode == "silu" else 1)
    q = torch.empty((T, H), dtype=torch.float32 if _INTERPRETED else torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    if T:
        _rows_q8_kernel[(T,)](x, q, s, H, float(eps), MODE=MODES[mode],
                              BLOCK=min(2048, triton.next_power_of_2(H)), num_warps=4,
                              **launch_kwargs(x.device, options))
    return (q.to(torch.float8_e4m3fn) if _INTERPRETED else q), s
