"""Fused label head as one Triton kernel (same math as label_head.label_head_ref).

One program = BLOCK_R read-out rows x all N label tokens: gather the rows of hidden, RMSNorm them
(pass 1 over H: sum of squares; pass 2: normalise in fp32, round to the input dtype like the
reference, scale by the norm weight), project onto the N label-token rows of the output embedding
while looping over H, then mask, argmax (first index on ties) and the restricted log-softmax, all
in registers. N (<= 512) lives in one tile so the per-row softmax needs no second kernel.

ONE (one program, H and the label rows in one tile each: the latency path, e.g. one request of
Qwen2.5-0.5B, 9 labels): the label weights, the norm weight, the read-out rows and the allowed
mask are loaded before the PDL wait, and the rows of hidden in one load after it, so the kernel's
chain after the wait is that load, the math and the stores (the two passes' loops issue their
loads one chunk at a time).

CUDA-graph safe: grid and launch parameters depend only on shapes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .options import DEFAULTS, KernelOptions
from .pdl import launch_kwargs, wait
from .triton_util import _dot, _num_sms


@triton.jit
def _normed(x, rstd, g, XDT: tl.constexpr, WDT: tl.constexpr):
    """rms_norm of an fp32 chunk of rows with the reference's roundings: (x * rstd) to the input
    dtype, then * norm weight g to the weight dtype."""
    return ((x * rstd[:, None]).to(XDT).to(tl.float32) * g[None, :]).to(WDT)


@triton.jit
def _label_head_kernel(
    X, ROWS, NW, W, ALLOWED, SCORES, BEST,
    sx_t, sw_n, sa_r, ss_r,
    R, N, H, eps,
    LOGPROBS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, GDC: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    kk = tl.arange(0, BLOCK_K)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    ok = r_ok[:, None] & n_ok[None, :]
    if ONE:  # the weights (BLOCK_K covers H), before the wait: they never depend on a kernel
        kk_ok = kk < H
        wt1 = tl.load(W + n[None, :] * sw_n + kk[:, None], mask=n_ok[None, :] & kk_ok[:, None], other=0.0)
        g1 = tl.load(NW + kk, mask=kk_ok, other=0.0).to(tl.float32)
    # The read-out rows and the allowed mask are the call's inputs, written before the forward's
    # first kernel; the kernel ahead has passed its own wait once this one runs (it launches this
    # one from after it, or ends first), so everything before that kernel is complete.
    src = tl.load(ROWS + r, mask=r_ok, other=0).to(tl.int64)
    allowed = tl.load(ALLOWED + r[:, None] * sa_r + n[None, :], mask=ok, other=0) != 0
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    x_rows = X + src[:, None] * sx_t

    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    if ONE:  # one load of the rows, then the same math as the two passes below
        x = tl.load(x_rows + kk[None, :], mask=r_ok[:, None] & kk_ok[None, :], other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / H + eps)
        h = _normed(x, rstd, g1, X.dtype.element_ty, W.dtype.element_ty)
        acc = _dot(h, wt1, acc, DOT_PREC, UPCAST)
    else:
        # Pass 1: mean of squares in fp32.
        ss = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + kk
            x = tl.load(x_rows + k[None, :], mask=r_ok[:, None] & (k < H)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(x * x, 1)
        rstd = tl.rsqrt(ss / H + eps)

        # Pass 2 (the rows are now in L1/L2): normalise, project onto the label rows.
        for k0 in range(0, H, BLOCK_K):
            k = k0 + kk
            k_ok = k < H
            x = tl.load(x_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            g = tl.load(NW + k, mask=k_ok, other=0.0).to(tl.float32)
            h = _normed(x, rstd, g, X.dtype.element_ty, W.dtype.element_ty)
            wt = tl.load(W + n[None, :] * sw_n + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = _dot(h, wt, acc, DOT_PREC, UPCAST)

    # The reference's matmul returns the weight dtype: round like it so argmax ties agree.
    logits = acc.to(W.dtype.element_ty).to(tl.float32)
    allowed |= (r >= R)[:, None] & n_ok[None, :]  # padding rows stay finite (never stored)
    logits = tl.where(allowed, logits, float("-inf"))
    m = tl.max(logits, 1)
    # First index attaining the max (torch.argmax); a row with nothing allowed gives 0, as in torch.
    best = tl.min(tl.where(logits == m[:, None], n[None, :], BLOCK_N), 1)
    if LOGPROBS:
        lse = m + tl.log(tl.sum(tl.exp(logits - m[:, None]), 1))
        logits = logits - lse[:, None]
    tl.store(SCORES + r[:, None] * ss_r + n[None, :], logits, mask=ok)
    tl.store(BEST + r, best.to(tl.int64), mask=r_ok)


# Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
_INTERPRETED = type(_label_head_kernel).__name__ == "InterpretedFunction"


def head_config(R: int, N: int, H: int, device, elem_bytes: int = 2,
                options: KernelOptions = DEFAULTS) -> dict:
    """Launch config from shapes only (no autotuning: it would time kernels during graph capture).

    Every program streams all N x H label weights (from L2 after the first), so with many rows use
    bigger row blocks for reuse as long as about half the SMs still get a program; few rows get 16
    (the smallest dot). One program whose label weights fit in 32 KB and rows in 16K elements
    runs ONE: everything in one tile (H200, W1: see BENCHMARKS.md).
    """
    if options.batch_invariant:  # one config whatever R, over row blocks (options.py)
        R = options.invariant_rows
    block_n = max(16, triton.next_power_of_2(N))
    assert block_n <= 512, "label head supports at most 512 label tokens"
    block_h = triton.next_power_of_2(H)
    if (options.head_one_tile and R <= 16 and block_n * block_h * elem_bytes <= 32768
            and 16 * block_h <= 16384):
        return dict(BLOCK_R=16, BLOCK_N=block_n, BLOCK_K=block_h, ONE=True, num_warps=8,
                    num_stages=1)
    block_r = 16
    for br in (64, 32):
        if br * block_n <= 16384 and triton.cdiv(R, br) >= _num_sms(device) // 2:
            block_r = br
            break
    # H chunk: x tile [BLOCK_R, BLOCK_K] and weight tile [BLOCK_K, BLOCK_N] small enough not to spill
    block_k = max(16, min(256, 16384 // block_n, 8192 // block_r, triton.next_power_of_2(H)))
    return dict(
        BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k, ONE=False,
        num_warps=8 if block_k * (block_n + block_r) >= 16384 else 4,
        num_stages=2,
    )


def label_head_triton(hidden, rows, norm_weight, eps, weight, allowed, logprobs=True,
                      out_scores=None, out_best=None, config=None, options: KernelOptions = DEFAULTS):
    """hidden [T, H]; rows int [R]; norm_weight [H]; weight [N, H]; allowed bool [R, N]
    -> (scores [R, N] fp32, -inf where not allowed; best [R] int64).

    hidden may have any row stride. `config` overrides entries of head_config() (tests, benchmarks).
    """
    T, H = hidden.shape
    N = weight.shape[0]
    R = rows.shape[0]
    assert weight.shape == (N, H) and norm_weight.shape == (H,) and allowed.shape == (R, N)
    if out_scores is None:
        out_scores = torch.empty((R, N), dtype=torch.float32, device=hidden.device)
    if out_best is None:
        out_best = torch.empty((R,), dtype=torch.int64, device=hidden.device)
    assert out_scores.shape == (R, N) and out_scores.dtype == torch.float32 and out_scores.stride(-1) == 1
    assert out_best.shape == (R,) and out_best.dtype == torch.int64 and out_best.is_contiguous()
    if R == 0:
        return out_scores, out_best
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    allowed = allowed if allowed.stride(-1) == 1 else allowed.contiguous()
    if allowed.dtype == torch.bool:
        allowed = allowed.view(torch.uint8)  # same bytes; plain integer loads
    rows, norm_weight = rows.contiguous(), norm_weight.contiguous()
    cfg = head_config(R, N, H, hidden.device, weight.element_size(), options)
    cfg.update(config or {})
    assert not cfg["ONE"] or H <= cfg["BLOCK_K"]  # (several ONE programs: batch-invariant mode)
    _label_head_kernel[(triton.cdiv(R, cfg["BLOCK_R"]),)](
        hidden, rows, norm_weight, weight, allowed, out_scores, out_best,
        hidden.stride(0), weight.stride(0), allowed.stride(0), out_scores.stride(0),
        R, N, H, eps,
        LOGPROBS=bool(logprobs),
        DOT_PREC="ieee" if weight.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED,
        **cfg, **launch_kwargs(hidden.device, options),
    )
    return out_scores, out_best
