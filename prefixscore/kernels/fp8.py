"""FP8 (e4m3) linear weights: one fp32 scale per output row, W ~= q * scale[:, None].

At batch 1 a forward is bound by reading the weights (0.5B: ~0.5 ms of a 0.6 ms request on the
H200), so storing the linear layers' weights in one byte instead of two halves what each GEMM
streams. Per output channel, because a row's scale then factors out of its dot product: the GEMM
multiplies the e4m3 values (converted in registers to the activations' dtype, or to fp16 where the
input's range is bounded: KernelOptions.fp8_fp16, gemm_triton.py F16) and scales each output
column once in the epilogue, exactly (scale * sum(x * q) == sum(x * (q * scale)) in real
arithmetic), and split-K partials stay unscaled until they are summed.

Which weights: the four linears of each block (QKV, O, gate/up, down), quantized after the RMSNorm
weights are folded into QKV and gate/up (model.py fuse), so the fold is not rounded twice. The
embeddings, the norms, the label head's rows and every bias stay in the activations' dtype.

Large token counts (past the skinny kernels) run FP8 x FP8 on the tensor cores
(torch._scaled_mm, row-wise scales) over activations quantized per token (one scale per row,
amax / 448) by the kernel that produces them (fp8_triton.py: the RMSNorm before QKV and gate/up,
SiLU * up before down); O's input, the attention output, is quantized by a pass of its own.
"""
from __future__ import annotations

import math

import torch

from .options import KernelOptions, use_triton

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class Fp8Weight:
    """A linear weight [N, K] as e4m3 values `q` and fp32 per-row scales `scale` [N].

    Duck-types the few tensor attributes the GEMM dispatch reads (shape, dtype, device, numel,
    element_size): dtype is e4m3, so code that requires a bf16 weight (the fused attention + O
    kernel) takes its other path.

    x_scale: a power of two under which every input row this weight can meet fits fp16
    (|x| * x_scale <= FP16_ROOM, a bound from the weights that produce x: fp16_input_scale), or
    None where no bound is known; the few-token GEMM then may multiply in fp16 (KernelOptions.
    fp8_fp16) without a norm in front."""

    __slots__ = ("q", "scale", "x_scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, x_scale: float | None = None):
        assert q.dtype == E4M3 and q.dim() == 2 and scale.shape == (q.shape[0],)
        self.q, self.scale = q.contiguous(), scale.float().contiguous()
        self.x_scale = x_scale

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Fp8Weight":
        """Per output row: scale = amax(|row|) / 448, q = round_to_e4m3(row / scale) (an all-zero
        row gets scale 1). Computed in fp32 from w's values."""
        w32 = w.float()
        amax = w32.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q = (w32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        return cls(q, scale)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def device(self):
        return self.q.device

    def numel(self) -> int:
        return self.q.numel()

    def dim(self) -> int:
        return 2

    def element_size(self) -> int:
        return 1

    def nbytes(self) -> int:
        """Bytes held: the e4m3 values and the scales."""
        return self.q.numel() + 4 * self.scale.numel()

    def contiguous(self) -> "Fp8Weight":
        return self


def is_fp8(w) -> bool:
    return isinstance(w, Fp8Weight)


FP16_ROOM = 16384.0  # 2^14: a quarter of fp16's largest value, room for the roundings on the way


def fp16_input_scale(w_gu: Fp8Weight, b_gu: torch.Tensor | None) -> float:
    """x_scale of the down projection: a power of two s with |silu(g) * u| * s <= FP16_ROOM for
    every row. g and u are rows of the gate/up GEMM's output over a normed row h, whose L2 norm is
    at most sqrt(K) (rms_norm: mean(h^2) <= 1; its weight is folded into w_gu), so |g| <= sqrt(K) *
    max ||gate row|| + max |bias| (Cauchy-Schwarz), the same for u, and |silu(g)| <= max(|g|, 0.28).
    A bound, not a measurement: loose by ~sqrt(K) a factor, which costs nothing while it fits."""
    w = w_gu.dequantize()
    inter, k = w.shape[0] // 2, w.shape[1]
    norms = w.norm(dim=1)
    b = b_gu.float().abs() if b_gu is not None else torch.zeros(2 * inter, device=w.device)
    g = k ** 0.5 * norms[:inter].max().item() + b[:inter].max().item()
    u = k ** 0.5 * norms[inter:].max().item() + b[inter:].max().item()
    bound = max(g, 0.2785) * u
    return 2.0 ** min(0, math.floor(math.log2(FP16_ROOM / bound))) if bound > 0 else 1.0


def supported(device: torch.device) -> str | None:
    """None when this device runs FP8 weights, else why not (a sentence for the user)."""
    if device.type != "cuda":
        return ("dtype fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"this is {device.type}: use bfloat16 or float32 here")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"dtype fp8 needs compute capability 8.9 or newer (Ada, Hopper); {name} is "
                f"{major}.{minor}: use bfloat16")
    return None


# ---------------------------------------------------------------- torch references and the large-T path

def linear_ref(x, w: Fp8Weight, bias=None):
    """x @ dequantize(w)^T (+ bias), in fp32 then rounded to x's dtype: the reference the kernels
    are checked against (the same math, summed in another order)."""
    y = x.float() @ w.dequantize().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token activation quantization: x [T, K] -> (e4m3 [T, K], fp32 scales [T, 1])."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class Fp8Act:
    """An activation [T, K] as e4m3 values and one fp32 scale per token (row): what a producing
    kernel hands the next FP8 x FP8 GEMM instead of bf16 (rows_q8)."""

    __slots__ = ("q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale).to(dtype)


def rows_q8(x: torch.Tensor, mode: str = "plain", eps: float = 0.0, *, options: KernelOptions) -> Fp8Act:
    """x quantized per row by the kernel that produces it, on CUDA (kernels/fp8_triton.py):
    mode "plain" x itself; "rms" rms_norm(x) with unit weight (the block's norm, its weight folded
    into the next GEMM); "silu" silu(gate) * up of gate_up [T, 2I]. Elsewhere the references."""
    if use_triton(x, options):
        from .fp8_triton import rows_q8_triton

        return Fp8Act(*rows_q8_triton(x, mode, eps, options=options))
    return Fp8Act(*quantize_rows(rows_value_ref(x, mode, eps)))


def rows_value_ref(x: torch.Tensor, mode: str, eps: float = 0.0) -> torch.Tensor:
    """What rows_q8 quantizes, as the bf16 path computes it (in x's dtype)."""
    from .fused import _rms_norm_ref, silu_mul_ref

    if mode == "rms":
        return _rms_norm_ref(x, None, eps)
    if mode == "silu":
        return silu_mul_ref(x)
    return x


def linear(x, w: Fp8Weight, bias=None, dtype=None, *, options: KernelOptions):
    """x [T, K] (or an Fp8Act) @ w^T (+ bias) -> [T, N] in x's dtype (an Fp8Act: `dtype`), for
    token counts past the skinny kernels: FP8 x FP8 tensor-core GEMM with per-token and per-channel
    scales on CUDA (x quantized here when it is not already); the reference elsewhere (CPU tests:
    an Fp8Act's dequantized values, else x's own)."""
    if isinstance(x, Fp8Act):
        if not x.q.is_cuda:
            return linear_ref(x.dequantize(), w, bias).to(dtype or torch.float32)
        xq, xs, out_dtype = x.q, x.scale, dtype
    elif not x.is_cuda:
        return linear_ref(x, w, bias)
    else:
        act = rows_q8(x, options=options)
        xq, xs, out_dtype = act.q, act.scale, x.dtype
    # _scaled_mm wants the second operand column-major: w.q^T is, as a view of the row-major q.
    y = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale[None, :], out_dtype=out_dtype)
    return y if bias is None else y + bias
