"""FP8 (e4m3) weights (kernels/fp8.py): the per-row quantization's error bounds, the skinny GEMM
kernels with e4m3 weights (kernels/gemm_triton.py, FP8) against dequantize-then-matmul references,
and a quantized model against the same model holding the dequantized weights.

The kernels run compiled on CUDA, else under the Triton CPU interpreter (which converts e4m3 as
the GPU does). Fresh random inputs per run. Tolerances: the kernels multiply the same values
(e4m3 values are exact in bf16 and fp16; behind a norm the fp16 operand x * rstd is rounded once
more, 2^-11 relative) and scale the fp32 sum once, so they differ from the reference by summation
order and the output's bf16 rounding: bf16's 2e-2 (abs and rel), as the bf16 kernel tests.
"""
import math
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from tests.helpers import fix_interpreter  # noqa: E402

fix_interpreter()

from prefixscore.kernels import fp8  # noqa: E402
from prefixscore.kernels.fp8 import E4M3_MAX, Fp8Weight  # noqa: E402
from prefixscore.kernels.gemm import gate_up_silu_ref, qkv_rope_ref  # noqa: E402
from prefixscore.kernels.options import DEFAULTS, KernelOptions  # noqa: E402
from prefixscore.kernels.gemm_triton import (  # noqa: E402
    gate_up_silu_small, linear_residual_small, linear_small, qkv_rope_small)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BF = torch.bfloat16
TOL = 2e-2
SMALL = None if CUDA else {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT": 2}  # few programs, split-K


def seed():
    s = random.randrange(1 << 30)
    print("seed", s)
    return torch.Generator().manual_seed(s)


def weight(N, K, gen, spread=True):
    """A weight whose rows have very different magnitudes (per-row scales must matter)."""
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    if spread:
        w = w * torch.exp(torch.randn(N, 1, generator=gen))
    return w


def test_quantize_round_trip_bounds():
    """Per row: the largest |w| maps to +-448 exactly (its value survives), every other value is
    within half an e4m3 step (1/16 relative for normals, 2^-10 * scale below 2^-6 * scale), and an
    all-zero row stays zero."""
    gen = seed()
    w = weight(64, 200, gen)
    w[5] = 0.0
    q = Fp8Weight.quantize(w)
    assert q.q.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    d = q.dequantize()
    assert (d[5] == 0).all() and q.scale[5] == 1
    rows = [i for i in range(64) if i != 5]
    amax = w[rows].abs().amax(1)
    torch.testing.assert_close(q.scale[rows], amax / E4M3_MAX)
    top = w[rows].abs().argmax(1)
    assert (q.q[rows].float().abs().gather(1, top[:, None]) == E4M3_MAX).all()
    err = (d - w).abs()
    bound = w.abs() / 16 + q.scale[:, None] * 2 ** -10
    assert (err <= bound * (1 + 1e-6)).all(), (err / bound).max()
    # and not much better than that: the values really are rounded to 3 mantissa bits
    assert (err[rows] / w[rows].abs().clamp(min=1e-30)).max() > 1 / 64


def test_quantize_rows_bounds():
    gen = seed()
    x = torch.randn(7, 96, generator=gen) * torch.exp(torch.randn(7, 1, generator=gen))
    xq, s = fp8.quantize_rows(x)
    assert s.shape == (7, 1)
    err = (xq.float() * s - x).abs()
    assert (err <= x.abs() / 16 + s * 2 ** -10 + 1e-12).all()


@pytest.mark.parametrize("N,K,bias", [(160, 192, True), (100, 200, False)])
def test_linear_small_fp8(N, K, bias):
    gen = seed()
    w = Fp8Weight.quantize(weight(N, K, gen).to(DEVICE))
    b = torch.randn(N, generator=gen).to(DEVICE, BF) if bias else None
    for T in ([1, 5, 16] if not CUDA else [1, 3, 8, 16, 33, 64]):
        x = torch.randn(T, K, generator=gen).to(DEVICE, BF)
        buf = torch.full((T, N + 3), float("nan"), dtype=BF, device=DEVICE)
        out = linear_small(x, w, b, out=buf[:, :N], config=SMALL)
        assert not out.isnan().any() and buf[:, N:].isnan().all()
        ref = fp8.linear_ref(x.float(), w, None if b is None else b.float())
        torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)
        # the scales are applied: the kernel is far from the raw e4m3 values' product
        raw = x.float() @ w.q.float().t()
        assert (out.float() - raw).abs().max() > 10 * TOL


def test_residual_fp8():
    gen = seed()
    N, K, T = 128, 160, 6
    w = Fp8Weight.quantize(weight(N, K, gen).to(DEVICE))
    x = torch.randn(T, K, generator=gen).to(DEVICE, BF)
    r = (torch.randn(T, N, generator=gen) * 2).to(DEVICE, BF)
    out, ssq = linear_residual_small(x, w, None, r, config=SMALL)
    y = fp8.linear_ref(x.float(), w)
    err = (out.float() - (r.float() + y)).abs()
    assert (err <= TOL * (1 + r.float().abs() + y.abs())).all(), err.max()
    torch.testing.assert_close(ssq.sum(0), out.float().pow(2).sum(1), rtol=1e-4, atol=1e-3)


def residual_rows(T, H, gen):
    """Rows of a residual stream: magnitudes spread over two orders (rstd far from 1, so a norm
    applied twice or not at all shows), one row past fp16's range (massive activations: the
    kernel's fp16 operands must be the normed rows, |x * rstd| <= sqrt(H), not x)."""
    x = torch.randn(T, H, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen)) * 4
    x[T // 2] *= 1e5
    return x.to(DEVICE, BF), x.to(BF).float().pow(2).sum(1)[None, :].contiguous().to(DEVICE)  # ssq: one producer tile


def normed(x):
    return x.float() * torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("fp16", [False, True])
def test_gate_up_fp8_with_norm(fp16):
    """The gated epilogue (two accumulators, two scale rows) after a fused RMSNorm (NORM); with
    fp8_fp16 the norm scales x before an fp16 dot instead of the sum after a bf16 one."""
    gen = seed()
    T, H, I = 5, 160, 64
    x, ssq = residual_rows(T, H, gen)
    w = Fp8Weight.quantize(weight(2 * I, H, gen) * 0.5)
    w = Fp8Weight(w.q.to(DEVICE), w.scale.to(DEVICE))
    out = gate_up_silu_small(x, w, config=SMALL, norm=(1e-6, ssq), options=KernelOptions(fp8_fp16=fp16))
    ref = gate_up_silu_ref(normed(x), w.dequantize())
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * TOL, rtol=2 * TOL)


@pytest.mark.parametrize("fp16", [False, True])
def test_residual_fp8_fp16_input_scale(fp16):
    """Down's GEMM (+ residual) with x_scale = 2^-4 and rows up to 2^14 / x_scale (past fp16's
    largest value): the fp16 arm scales x into range before the dot and back after it, exactly."""
    gen = seed()
    N, K, T = 96, 192, 5
    w = Fp8Weight.quantize(weight(N, K, gen).to(DEVICE))
    w.x_scale = 2.0 ** -4
    x = torch.randn(T, K, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen))
    x = (x / x.abs().amax(1, keepdim=True) * torch.tensor([1.0, 30.0, 2e3, 1e5, 2 ** 18])[:, None]).to(DEVICE, BF)
    r = torch.randn(T, N, generator=gen).to(DEVICE, BF)
    out, _ = linear_residual_small(x, w, None, r, config=SMALL, options=KernelOptions(fp8_fp16=fp16))
    y = fp8.linear_ref(x.float(), w)
    assert out.isfinite().all()
    err = (out.float() - (r.float() + y)).abs()
    assert (err <= TOL * (1 + r.float().abs() + y.abs())).all(), err.max()


def test_fp16_input_scale_bounds_down_inputs():
    """fp8.fp16_input_scale: a power of two <= 1 under which silu(g) * u of any residual row (rms-
    normed, any magnitude) stays within FP16_ROOM, and within a factor 2 of the bound it proves."""
    gen = seed()
    H, I = 64, 96
    wgu = weight(2 * I, H, gen) * 40  # large rows: the bound needs a scale below 1
    bgu = torch.randn(2 * I, generator=gen)
    q = Fp8Weight.quantize(wgu)
    s = fp8.fp16_input_scale(q, bgu)
    assert s <= 1 and math.log2(s) == round(math.log2(s))
    x = torch.randn(256, H, generator=gen) * torch.exp(3 * torch.randn(256, 1, generator=gen))
    x[:, 0] += 1e4 * torch.randn(256, generator=gen)  # massive activations in one channel
    gu = normed(x) @ q.dequantize().t() + bgu
    h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    assert h.abs().max() * s <= fp8.FP16_ROOM
    w = q.dequantize()
    bound = ((H ** 0.5 * w[:I].norm(dim=1).max() + bgu[:I].abs().max())
             * (H ** 0.5 * w[I:].norm(dim=1).max() + bgu[I:].abs().max()))
    assert bound * s > fp8.FP16_ROOM / 2


def test_fp8_fp16_switch_reaches_the_kernel():
    """KernelOptions.fp8_fp16 changes the arithmetic (x * rstd rounded to fp16 before the dot, not
    the fp32 sum scaled after it): of 5 x 64 bf16 outputs, each off by ~2^-11 before its own 2^-8
    rounding, some round apart (all 320 alike: ~0.9^320). Without this, both arms could run one path."""
    gen = seed()
    x, ssq = residual_rows(5, 160, gen)
    w = Fp8Weight.quantize(weight(128, 160, gen) * 0.5)
    w = Fp8Weight(w.q.to(DEVICE), w.scale.to(DEVICE))
    a, b = (gate_up_silu_small(x, w, config=SMALL, norm=(1e-6, ssq), options=KernelOptions(fp8_fp16=f))
            for f in (False, True))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("fp16", [False, True])
def test_qkv_rope_fp8_with_norm(fp16):
    """QKV + RoPE after a fused RMSNorm, e4m3 weights, the dot in bf16 or fp16 (as gate/up's)."""
    gen = seed()
    Hq, Hkv, D, K, T = 4, 2, 32, 96, 5
    w = Fp8Weight.quantize(weight((Hq + 2 * Hkv) * D, K, gen).to(DEVICE))
    b = torch.randn((Hq + 2 * Hkv) * D, generator=gen).to(DEVICE, BF)
    x, ssq = residual_rows(T, K, gen)
    ang = torch.rand(T, D // 2, generator=gen) * 6.28
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(DEVICE, BF), ang.sin().to(DEVICE, BF)
    ref = qkv_rope_ref(normed(x), w.dequantize(), b.float(), cos.float(), sin.float(), Hq, Hkv, D)
    res = qkv_rope_small(x, w, b, cos, sin, Hq, Hkv, D, config=None if CUDA else {"BLOCK_K": 32, "SPLIT": 3},
                         norm=(1e-6, ssq), options=KernelOptions(fp8_fp16=fp16))
    for o, r in zip(res, ref):
        assert o.shape == r.shape and o.isfinite().all()
        torch.testing.assert_close(o.float(), r.float(), atol=TOL, rtol=TOL)


def test_qkv_rope_fp8():
    gen = seed()
    Hq, Hkv, D, K, T = 4, 2, 32, 96, 3
    w = Fp8Weight.quantize(weight((Hq + 2 * Hkv) * D, K, gen).to(DEVICE))
    b = torch.randn((Hq + 2 * Hkv) * D, generator=gen).to(DEVICE, BF)
    x = torch.randn(T, K, generator=gen).to(DEVICE, BF)
    ang = torch.rand(T, D // 2, generator=gen) * 6.28
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(DEVICE, BF), ang.sin().to(DEVICE, BF)
    qn = (torch.rand(D, generator=gen) * 0.5 + 0.5).to(DEVICE, BF)
    kn = (torch.rand(D, generator=gen) * 0.5 + 0.5).to(DEVICE, BF)
    ref = qkv_rope_ref(x.float(), w.dequantize(), b.float(), cos.float(), sin.float(), Hq, Hkv, D,
                       qn.float(), kn.float(), 1e-6)
    res = qkv_rope_small(x, w, b, cos, sin, Hq, Hkv, D, qn, kn, 1e-6,
                         config=None if CUDA else {"BLOCK_K": 32, "SPLIT": 3})
    for o, r in zip(res, ref):
        assert o.shape == r.shape and not o.isnan().any()
        torch.testing.assert_close(o.float(), r.float(), atol=TOL, rtol=TOL)


def test_linear_ref_on_cpu_is_the_dequantized_matmul():
    """fp8.linear off CUDA (CPU tests of the model) is the reference: x @ dequantize(w)^T."""
    gen = seed()
    w = Fp8Weight.quantize(weight(40, 24, gen))
    x = torch.randn(3, 24, generator=gen)
    b = torch.randn(40, generator=gen)
    torch.testing.assert_close(fp8.linear(x, w, b, options=DEFAULTS), x @ w.dequantize().t() + b)


@pytest.mark.skipif(not CUDA, reason="torch._scaled_mm needs a CUDA GPU of compute capability 8.9+")
def test_scaled_mm_path():
    """Past the skinny kernels: FP8 x FP8 with per-token activation scales. The activations are
    rounded to e4m3 too, so the tolerance is e4m3's (relative error of the result's norm)."""
    gen = seed()
    w = Fp8Weight.quantize(weight(512, 896, gen).cuda())
    x = torch.randn(300, 896, generator=gen).cuda().to(BF)
    b = torch.randn(512, generator=gen).cuda().to(BF)
    out = fp8.linear(x, w, b, options=DEFAULTS).float()
    ref = fp8.linear_ref(x.float(), w, b.float())
    assert (out - ref).norm() / ref.norm() < 0.05


def test_quantized_model_equals_dequantized_weights(tiny_model):
    """Model.quantize_fp8 quantizes the four linears of every block after the norm fold, and the
    forward reads them as their dequantized values (CPU: fp32 reference path): the same model with
    those values as plain fp32 weights scores the same (1e-5); bf16 weights of the embeddings,
    norms and biases are untouched."""
    from prefixscore import Classifier
    from prefixscore.kernels.fp8 import is_fp8

    path = str(tiny_model("qwen2"))
    spec = dict(template="Which category? {query}", labels=["Dress", "Jeans", "Hoodie"], chat=False)
    q = Classifier(path, device="cpu", dtype="float32", **spec)
    plain = Classifier(path, device="cpu", dtype="float32", **spec)
    before = q.engine.weight_bytes()
    q.engine.model.quantize_fp8()
    for lq, lp in zip(q.engine.model.layers, plain.engine.model.layers):
        a, m = lq.self_attn, lq.mlp
        assert all(map(is_fp8, (a.wqkv, a.o_proj.weight, m.wgu, m.down_proj.weight)))
        assert 0 < m.down_proj.weight.x_scale <= 1 and a.o_proj.weight.x_scale is None  # (fp8_fp16)
        lp.self_attn.wqkv = a.wqkv.dequantize()
        lp.self_attn.o_proj.weight.data = a.o_proj.weight.dequantize()
        lp.mlp.wgu = m.wgu.dequantize()
        lp.mlp.down_proj.weight.data = m.down_proj.weight.dequantize()
        assert torch.equal(a.bqkv, lp.self_attn.bqkv)
    assert q.engine.weight_bytes() < before
    # the pinned prefix was computed with the old weights: compute both again
    for c in (q, plain):
        c.prefix_kv[:] = c.engine.prefill(c.prompt.prefix_ids)
    queries = ["red dress", "levis 501 jeans", "kids hoodie", "连衣裙"]
    for a, b in zip(q.classify_batch(queries), plain.classify_batch(queries)):
        assert a.label == b.label
        assert max(abs(a.scores[k] - b.scores[k]) for k in a.scores) <= 1e-5


@pytest.mark.parametrize("cfg", [None, {"BLOCK_N": 64, "HPP": 7}, {"EARLY": False}])
def test_attention_o_fp8(cfg):
    """Attention fused with an e4m3 O projection and the residual add: the scale of each output
    column applied once, after the sum over heads (with and without the head split-K)."""
    from tests.kernels.test_kernels_triton import make_random_plan

    from prefixscore.kernels.attention import attention_ref
    from prefixscore.kernels.attention_o_triton import attention_o_residual_small

    gen = seed()
    P, G, Hkv, D, N = 30, 7, 1, 64, 96
    bs, be, own = (x.to(DEVICE) for x in make_random_plan(12, gen))
    T, Hq = bs.shape[0], G * Hkv
    q, k, v = (torch.randn(T, h, D, generator=gen).to(DEVICE, BF) for h in (Hq, Hkv, Hkv))
    pk, pv = (torch.randn(P, Hkv, D, generator=gen).to(DEVICE, BF) for _ in range(2))
    wo = Fp8Weight.quantize(weight(N, Hq * D, gen).to(DEVICE))
    r = torch.randn(T, N, generator=gen).to(DEVICE, BF)
    out, ssq = attention_o_residual_small(q, k, v, pk, pv, bs, be, own, D ** -0.5, wo, r, config=cfg)
    o = attention_ref(q, k, v, pk, pv, bs, be, own, D ** -0.5).reshape(T, -1)
    w = wo.dequantize()
    y = o.float() @ w.t()
    # The kernel's o and attention_ref's may differ by a bf16 ulp per element, and a column's sum
    # over 448 products can cancel: bound by the sum of |products| (the error each ulp can reach),
    # not by |y| (seed 942938799: y 0.044 from products up to 7.5). Measured over 41 seeds: at most
    # 1.5x of 1e-3 + 2^-8 (|r + y| + sum|o w|); a missing scale or a wrong head is off by ~|y|.
    mag = o.float().abs() @ w.abs().t()
    err = (out.float() - (r.float() + y)).abs()
    assert (err <= 4e-3 + 2 ** -6 * ((r.float() + y).abs() + mag)).all(), err.max()
    torch.testing.assert_close(ssq.sum(0), out.float().pow(2).sum(1), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("mode", ["plain", "rms", "silu"])
def test_rows_q8_kernel(mode):
    """The producers' e4m3 output (kernels/fp8_triton.py) against quantize_rows of the bf16
    path's values: the same per-row scales (amax / 448) and the values within half an e4m3 step;
    rows longer than one BLOCK (two passes over several chunks) and a zero row."""
    from prefixscore.kernels.fp8_triton import rows_q8_triton

    gen = seed()
    T, H = 5, 2500 if CUDA else 300  # (past one 2,048 chunk on CUDA; the interpreter: BLOCK 512)
    x = torch.randn(T, 2 * H if mode == "silu" else H, generator=gen) * 3
    x[2] = 0.0
    x = x.to(DEVICE, BF)
    q, s = rows_q8_triton(x, mode, 1e-6)
    want = fp8.rows_value_ref(x, mode, 1e-6).float()
    rq, rs = fp8.quantize_rows(want)
    # rms, silu: the kernel's own sum order and exp may move a value (the amax) by one bf16 step;
    # under the interpreter two (its fp32 -> bf16 casts truncate: see test_kernels_gemm)
    ulps = 0 if mode == "plain" else 1 if CUDA else 2
    torch.testing.assert_close(s, rs, rtol=2e-6 + ulps * 2 ** -7, atol=0)
    assert s[2] == 1 and (q[2].float() == 0).all()
    got = q.float() * s
    # half an e4m3 step; a whole one where the value itself may be a bf16 step off (rms, silu)
    step = 1 if mode == "plain" else 2 * (1 + ulps * 2 ** -7)
    assert (got - want).abs().le(step * (want.abs() / 16 + s * 2 ** -10) + 1e-6).all()
    if mode == "plain":  # the same values, the same rounding
        assert torch.equal(q.float(), rq.float())


def test_fp8_linear_takes_quantized_activations():
    """fp8.linear of an Fp8Act (what the producers hand over) is the product of its dequantized
    values (CPU reference; on CUDA FP8 x FP8 within e4m3's error)."""
    gen = seed()
    w = Fp8Weight.quantize(weight(64, 96, gen).to(DEVICE))
    x = torch.randn(100, 96, generator=gen).to(DEVICE, BF)
    act = fp8.rows_q8(x, options=DEFAULTS)
    out = fp8.linear(act, w, None, BF, options=DEFAULTS).float()
    ref = act.dequantize() @ w.dequantize().t()
    assert (out - ref).norm() / ref.norm() < (1e-2 if CUDA else 4e-3)  # (CPU: out's bf16 rounding)


def test_fp8_wide_layers_take_their_own_split(monkeypatch):
    """7B-class e4m3 weights at T <= 16 split K by FP8_WIDE (measured on the H200: the bf16 split
    left the halved weight stream stalling); bf16, the 0.5B shapes and larger T keep theirs. The
    entry points say whether their weight is e4m3."""
    from prefixscore.kernels import gemm_triton
    from prefixscore.kernels.gemm_config import FP8_WIDE, gemm_config

    cpu = torch.device("cpu")
    for T, cols, K, epi in ((1, 18944, 3584, 1), (16, 3584, 18944, 0), (8, 36 * 64, 3584, 2)):
        assert gemm_config(T, cols, K, epi, BF, cpu, fp8=True)["SPLIT"] == FP8_WIDE["SPLIT"]
        assert gemm_config(T, cols, K, epi, BF, cpu)["SPLIT"] != FP8_WIDE["SPLIT"]
    for T, cols, K, epi in ((1, 4864, 896, 1), (32, 18944, 3584, 1)):
        assert gemm_config(T, cols, K, epi, BF, cpu, fp8=True) == gemm_config(T, cols, K, epi, BF, cpu)
    seen = []
    real = gemm_triton.gemm_config
    monkeypatch.setattr(gemm_triton, "gemm_config", lambda *a, **kw: seen.append(kw.get("fp8")) or real(*a, **kw))
    gen = seed()
    w16 = weight(64, 96, gen).to(DEVICE, BF)
    x = torch.randn(2, 96, generator=gen).to(DEVICE, BF)
    linear_small(x, w16, config=SMALL)
    linear_small(x, Fp8Weight.quantize(w16), config=SMALL)
    assert seen == [False, True]
