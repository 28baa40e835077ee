"""Batch-invariant mode (KernelOptions.batch_invariant, issue 23): a row's outputs are bitwise the same
whether it runs alone or inside a larger batch, at any offset, for every kernel of the forward:
the skinny GEMMs over row tiles (each epilogue, split-K), attention (canonical in-batch order)
and the label head. Each is also checked against its torch reference (tolerances: fp32 1e-4,
bf16 2e-2, as the kernels' own tests). Compiled on CUDA, else under the Triton CPU interpreter,
where tl.dot is numpy's matmul, which rounds a row differently by its position in the block
(OpenBLAS: row 10 of a [16, 64] @ [64, 32] product differs from the same row at 0); there a row
keeps its place in its 16-row tile (other rows before it, a different batch size and tile count),
and equality checks that the kernels give every row the same operations in the same order. On
CUDA a row runs truly alone (the tensor cores compute each row of an MMA the same way; the GPU
test, test_gpu_classify_alone_equals_batched, checks the whole forward). The mode is a field of
an engine's KernelOptions, passed to each kernel here (INV), not a process-wide switch.
"""
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from tests.helpers import fix_interpreter  # noqa: E402

fix_interpreter()

from prefixscore.kernels.attention import attention_ref  # noqa: E402
from prefixscore.kernels.attention_triton import attention_triton  # noqa: E402
from prefixscore.kernels.gemm import gate_up_silu_ref, linear_ref, qkv_rope_ref  # noqa: E402
from prefixscore.kernels.gemm_triton import (  # noqa: E402
    gate_up_silu_small, linear_residual_small, linear_small, qkv_rope_small)
from prefixscore.kernels.label_head import label_head_ref  # noqa: E402
from prefixscore.kernels.label_head_triton import label_head_triton  # noqa: E402
from prefixscore.kernels.options import KernelOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEVICE == "cuda"
BF, F32 = torch.bfloat16, torch.float32
TOL = {F32: 1e-4, BF: 2e-2}
# Interpreter: few programs (wide tiles), still split-K so the per-row-tile workspace and arrival
# counters run; CUDA: the pinned config itself.
SMALL = None if CUDA else {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT": 2}
INV = KernelOptions(batch_invariant=True)


def inv(rows: int = 16) -> KernelOptions:
    """Batch-invariant options for the GEMMs. Past `rows` rows they run wide tiles that add their
    K splits in turn (gemm_config.wide_config); under the interpreter those tiles are pinned to the
    narrow ones' shape (rows x 32: numpy rounds a row by its place in the block, module doc), so
    there the check is the splits' order, the row tiling and the sums of squares' chunks."""
    if CUDA:
        return KernelOptions(batch_invariant=True, invariant_rows=rows)
    tune = {f"{role}.{key}": v for role in ("linear", "down", "gu", "qkv")
            for key, v in (("BLOCK_T", rows), ("BLOCK_N", 32))}
    return KernelOptions(batch_invariant=True, invariant_rows=rows, tune=tune)


def seed():
    """A fresh seed per test, printed (a failure shows it); PREFIXSCORE_TEST_SEED replays one."""
    s = int(os.environ.get("PREFIXSCORE_TEST_SEED") or random.randrange(1 << 30))
    print("seed", s)
    return torch.Generator().manual_seed(s)


def _rand(gen, *shape, dtype=BF, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def launch_start(a: int, tile: int = 16) -> int:
    """Where a launch for rows starting at a starts: a itself on CUDA; under the interpreter the
    start of a's row tile (module doc)."""
    return a if CUDA else a - a % tile


def _pieces(T, gen):
    """A few (start, length) row ranges of a batch of T rows, the first tile's and later ones."""
    out = [(0, 1), (0, 16), (T - 3, 3)]
    for _ in range(3):
        n = int(torch.randint(1, 20, (1,), generator=gen))
        out.append((int(torch.randint(0, T - n + 1, (1,), generator=gen)), n))
    return out


@pytest.mark.parametrize("rows", [16, 64])
@pytest.mark.parametrize("dtype", [F32, BF], ids=["fp32", "bf16"])
@pytest.mark.parametrize("epi", ["plain", "residual", "gated+norm", "qkv+rope+norm", "qk-norm"])
@pytest.mark.parametrize("block_k", [64, 32], ids=["1step", "2steps"])
def test_gemm_rows_do_not_depend_on_the_batch(epi, dtype, rows, block_k):
    """Rows t0..t0+n of a launch of 45 (16-row tiles) or 150 rows (64-row tiles, the other
    invariant_rows bench/invariance_gpu measures: three row tiles either way) against the same rows
    launched alone (qk-norm: Qwen3's per-head norms in the RoPE epilogue; test_kernels_gemm has
    its reference). Under the interpreter K = 96 in two splits of one 64-wide step each (the second
    past K), or K = 112 in two of two 32-wide steps (the last partly past K: where numpy's dot
    chains like the tensor cores, only splits of two steps tell their sums added in split order
    from one running sum); on CUDA the configs themselves, at Qwen2.5-0.5B's down shape (K 4,864
    in ten splits of four steps, 896 columns)."""
    if CUDA and block_k != 64:
        pytest.skip("the interpreter's split shapes")
    opts = inv(rows)
    # (PRE 0: the narrow config's preloaded steps are one dot, which numpy rounds unlike the same
    # steps' dots in turn; the tensor cores and the fp32 FMA dot chain them in k order alike)
    small = None if CUDA else dict(SMALL, BLOCK_K=block_k, PRE=0)
    gen = seed()
    T, K, N = (3 * rows - 3, 4864, 896) if CUDA else (3 * rows - 3, 96 if block_k == 64 else 112, 112)
    x = _rand(gen, T, K, dtype=dtype)
    w = _rand(gen, N, K, dtype=dtype, scale=K ** -0.5)
    b = _rand(gen, N, dtype=dtype)
    r = _rand(gen, T, N, dtype=dtype, scale=2.0)
    ssq = (torch.rand(3, T, generator=gen) * K).to(DEVICE)  # a producer's per-tile sums of squares
    D, Hq, Hkv = 32, 1, 1
    ang = torch.rand(T, D // 2, generator=gen) * 6.28
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    wq, bq = w[:(Hq + 2 * Hkv) * D], b[:(Hq + 2 * Hkv) * D]
    qn, kn = (_rand(gen, D, dtype=dtype) for _ in range(2))

    def run(a, n):
        s = slice(a, a + n)
        if epi == "plain":
            return [linear_small(x[s], w, b, config=small, options=opts)]
        if epi == "residual":
            return list(linear_residual_small(x[s], w, b, r[s], config=small, options=opts))
        norm = (1e-6, ssq[:, s].contiguous())
        if epi == "gated+norm":
            return [gate_up_silu_small(x[s], w, b, config=small, norm=norm, options=opts)]
        qk = (qn, kn) if epi == "qk-norm" else (None, None)
        return list(qkv_rope_small(x[s], wq, bq, cos[s], sin[s], Hq, Hkv, D, *qk, config=small, norm=norm,
                                   options=opts))

    whole = run(0, T)
    for a, n in _pieces(T, gen):
        a0 = launch_start(a, rows)
        for got, ref in zip(run(a0, a + n - a0), whole):
            if ref.shape[0] != T:  # (ssq: [tiles, T])
                got, ref = got[:, a - a0:], ref[:, a:a + n]
            else:
                got, ref = got[a - a0:], ref[a:a + n]
            assert torch.equal(got, ref), (epi, a, n, (got.float() - ref.float()).abs().max())
    # and the whole launch against the torch reference
    if epi == "qk-norm":
        return
    if epi == "plain":
        torch.testing.assert_close(whole[0].float(), linear_ref(x, w, b).float(),
                                   atol=TOL[dtype], rtol=TOL[dtype])
    elif epi == "residual":
        y = linear_ref(x, w, b).float()
        err = (whole[0].float() - (r.float() + y)).abs()
        assert (err <= TOL[dtype] * (1 + r.float().abs() + y.abs())).all(), err.max()
    else:
        rstd = torch.rsqrt(ssq.sum(0) / K + 1e-6)[:, None]
        h = (x.float() * rstd).to(dtype)  # the norm (unit weight) the epilogue applies
        refs = ([gate_up_silu_ref(h, w, b)] if epi == "gated+norm"
                else qkv_rope_ref(h, wq, bq, cos, sin, Hq, Hkv, D))
        tol = TOL[dtype] * (1 if CUDA or dtype == F32 else 2)  # (see test_kernels_gemm's norm test)
        # The reference rounds h and the linear's output to the dtype where the kernel keeps fp32,
        # so each output may be off by a few roundings of its terms' magnitudes, not of its own
        # (which cancellation can make small): S = |h| @ |w|^T + |b| carried through the epilogue.
        # silu(g) * u: |d| <= 1.1 |dg| |u| + |g| |du| (+ the output's rounding) <= 3.1 Sg Su.
        # RoPE mixes each element with its other half: S * |cos| + swap(S) * |sin|.
        S = h.float().abs() @ w.float().abs().T + b.float().abs()
        if epi == "gated+norm":
            Sg, Su = S.chunk(2, dim=-1)
            scales = [3.1 * Sg * Su]
        else:
            S = S[:, :(Hq + 2 * Hkv) * D].view(T, Hq + 2 * Hkv, D)
            swap = torch.cat([S[..., D // 2:], S[..., :D // 2]], -1)
            roped = S * cos.float().abs()[:, None] + swap * sin.float().abs()[:, None]
            scales = [roped[:, :Hq], roped[:, Hq:Hq + Hkv], S[:, Hq + Hkv:]]
        for got, ref, scale in zip(whole, refs, scales):
            err = (got.float() - ref.float()).abs()
            assert (err <= tol * (1 + scale)).all(), (err / (1 + scale)).max()


def test_fp8_gemm_rows_do_not_depend_on_the_batch():
    """e4m3 weights (kernels/fp8.py) in the row-tiled skinny GEMM: the residual epilogue's rows
    alone and inside a 45-row launch, bitwise; against the dequantized weight's reference."""
    from prefixscore.kernels.fp8 import Fp8Weight

    gen = seed()
    T, K, N = 45, 96, 80
    x = _rand(gen, T, K)
    w = Fp8Weight.quantize((torch.randn(N, K, generator=gen) * K ** -0.5).to(DEVICE, BF))
    r = _rand(gen, T, N, scale=2.0)
    whole, ssq = linear_residual_small(x, w, None, r, config=SMALL, options=inv())
    for a, n in _pieces(T, gen):
        a0 = launch_start(a)
        got, gs = linear_residual_small(x[a0:a + n], w, None, r[a0:a + n], config=SMALL, options=inv())
        assert torch.equal(got[a - a0:], whole[a:a + n]) and torch.equal(gs[:, a - a0:], ssq[:, a:a + n])
    y = x.float() @ w.dequantize().float().t()
    err = (whole.float() - (r.float() + y)).abs()
    assert (err <= 2e-2 * (1 + r.float().abs() + y.abs())).all(), err.max()


def _requests(lengths, gen):
    """Visibility ranges of requests laid out back to back, each with the most general ranges
    (test_kernels_triton.make_random_plan's, inside the request): a random own start in [request
    start, t] and a base range inside the request (empty a third of the time)."""
    T = sum(lengths)
    bs, be, own = (torch.zeros(T, dtype=torch.int32) for _ in range(3))
    t = 0
    for L in lengths:
        for r in range(t, t + L):
            own[r] = int(torch.randint(t, r + 1, (1,), generator=gen))
            if int(torch.randint(0, 3, (1,), generator=gen)) > 0:
                a = int(torch.randint(t, t + L, (1,), generator=gen))
                bs[r], be[r] = a, int(torch.randint(a + 1, t + L + 1, (1,), generator=gen))
        t += L
    return bs, be, own


@pytest.mark.parametrize("dtype", [F32, BF], ids=["fp32", "bf16"])
def test_attention_rows_do_not_depend_on_the_batch(dtype):
    """Every request's rows of a batch against the request alone (its ranges moved to 0) and at
    another offset behind other requests; the batch against attention_ref."""
    gen = seed()
    P, G, Hkv, D = 70, 3, 2, 32
    lengths = [int(torch.randint(1, 25, (1,), generator=gen)) for _ in range(5)]
    T = sum(lengths)
    bs, be, own = _requests(lengths, gen)
    q, k, v = (_rand(gen, T, h, D, dtype=dtype) for h in (G * Hkv, Hkv, Hkv))
    pk, pv = (_rand(gen, P, Hkv, D, dtype=dtype) for _ in range(2))
    dev = [x.to(DEVICE) for x in (bs, be, own)]
    whole = attention_triton(q, k, v, pk, pv, *dev, D ** -0.5, options=INV)
    ref = attention_ref(q, k, v, pk, pv, *dev, D ** -0.5)
    torch.testing.assert_close(whole.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    t0 = 0
    for L in lengths:
        s = slice(t0, t0 + L)
        # alone (CUDA), and behind another request's rows; under the interpreter the rows keep
        # their place in their 16-row tiles (module doc): shift = t0 mod 16 (+ 16)
        for shift in ((0, 37) if CUDA else (t0 % 16, t0 % 16 + 16)):
            fill = [_rand(gen, shift, h, D, dtype=dtype) for h in (G * Hkv, Hkv, Hkv)]
            zero = torch.zeros(shift, dtype=torch.int32)
            ranges = [torch.cat([zero, x[s] - t0 + shift]).to(DEVICE) for x in (bs, be, own)]
            qkv = [torch.cat([f, x[s]]) for f, x in zip(fill, (q, k, v))]
            got = attention_triton(*qkv, pk, pv, *ranges, D ** -0.5, options=INV)[shift:]
            assert torch.equal(got, whole[s]), (L, shift, (got.float() - whole[s].float()).abs().max())
        t0 += L


@pytest.mark.parametrize("case", ["fp32", "bf16", "fp8"])
def test_attention_o_fused_alone_equals_unfused_in_a_batch(case):
    """Batch-invariant attention + O: each request alone (at most 16 rows: the fused kernel, its
    attention in the unfused kernel's tiles and order) against its rows of a 45-row batch
    (attention_triton, then the O GEMM split by heads in wide tiles, attention.head_split):
    bitwise, the output and its sums of squares; the batch against attention_ref and the O
    product. Under the interpreter one query head per kv head (the unfused kernel's rows are then
    tokens, in the fused kernel's places) and only requests that start a 16-row tile. (fp32: the
    attention's own rounding shows, where bf16's rounding of its output hides most of it.)"""
    from prefixscore.kernels.attention import head_split
    from prefixscore.kernels.attention_o_triton import attention_o_residual_small
    from prefixscore.kernels.fp8 import Fp8Weight

    gen = seed()
    P, Hkv, D, N = 70, 2 if CUDA else 4, 32, 96
    Hq = Hkv * (3 if CUDA else 1)
    fp8, dtype = case == "fp8", F32 if case == "fp32" else BF
    lengths = [16, 7, 9, 8, 5]
    T = sum(lengths)
    bs, be, own = _requests(lengths, gen)
    q, k, v = (_rand(gen, T, h, D, dtype=dtype) for h in (Hq, Hkv, Hkv))
    pk, pv = (_rand(gen, P, Hkv, D, dtype=dtype) for _ in range(2))
    wo = _rand(gen, N, Hq * D, dtype=dtype, scale=(Hq * D) ** -0.5)
    wo = Fp8Weight.quantize(wo) if fp8 else wo
    r = _rand(gen, T, N, dtype=dtype, scale=2.0)
    opts = KernelOptions(batch_invariant=True,
                         tune=() if CUDA else {"down.BLOCK_T": 16, "down.BLOCK_N": 64})
    scale = D ** -0.5
    o = attention_triton(q, k, v, pk, pv, *(x.to(DEVICE) for x in (bs, be, own)), scale, options=opts)
    whole, ssq = linear_residual_small(o.reshape(T, -1), wo, None, r, config=head_split(Hq, D),
                                       options=opts)
    t0 = 0
    for L in lengths:
        s = slice(t0, t0 + L)
        if CUDA or t0 % 16 == 0:
            ranges = [(x[s] - t0).to(DEVICE) for x in (bs, be, own)]
            got, gs = attention_o_residual_small(q[s], k[s], v[s], pk, pv, *ranges, scale, wo, r[s],
                                                 options=opts)
            assert torch.equal(got, whole[s]), (t0, L, (got.float() - whole[s].float()).abs().max())
            assert torch.equal(gs, ssq[:, s]), (t0, L)
        t0 += L
    w = wo.dequantize() if fp8 else wo
    ref_o = attention_ref(q, k, v, pk, pv, *(x.to(DEVICE) for x in (bs, be, own)), scale).reshape(T, -1)
    y = ref_o.float() @ w.float().t()
    err = (whole.float() - (r.float() + y)).abs()
    # o rounded to the dtype either way (bf16: <= 2^-8 relative per element, differing by one
    # rounding where the kernel's fp32 attention differs from the reference's), carried through
    # |o| @ |w|
    S = ref_o.float().abs() @ w.float().abs().t()
    tol = TOL[dtype]
    assert (err <= tol * (1 + r.float().abs() + S)).all(), (err / (1 + r.float().abs() + S)).max()


@pytest.mark.parametrize("dtype", [F32, BF], ids=["fp32", "bf16"])
def test_label_head_rows_do_not_depend_on_the_batch(dtype):
    gen = seed()
    # (R: past 2,080 rows the default config takes 32-row blocks; H: one tile for 16 bf16 rows)
    T, H, N, R = 60, 600, 11, 2100
    hidden = _rand(gen, T, H, dtype=dtype)
    rows = torch.randint(0, T, (R,), generator=gen).to(DEVICE)
    nw = (torch.rand(H, generator=gen) + 0.5).to(DEVICE, dtype)
    w = _rand(gen, N, H, dtype=dtype, scale=H ** -0.5)
    allowed = (torch.rand(R, N, generator=gen) < 0.7).to(DEVICE)
    allowed[:, 0] = True
    s, b = label_head_triton(hidden, rows, nw, 1e-6, w, allowed, options=INV)
    rs, rb = label_head_ref(hidden, rows, nw, 1e-6, w, allowed)
    torch.testing.assert_close(s, rs, atol=TOL[dtype] * 5, rtol=TOL[dtype])
    for a, n in _pieces(R, gen):
        a0 = launch_start(a)
        s1, b1 = label_head_triton(hidden, rows[a0:a + n], nw, 1e-6, w, allowed[a0:a + n], options=INV)
        assert torch.equal(s1[a - a0:], s[a:a + n]) and torch.equal(b1[a - a0:], b[a:a + n]), (a, n)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_classify_alone_equals_batched():
    """The whole forward in batch-invariant mode: 60 requests (1-24 suffix tokens; a 9-label trie
    whose labels share first tokens, so each request also reads three branch rows) each alone
    (its graph bucket) and inside flat batches of 60, 512 and 2,048 requests (eager, past the
    graphs): bitwise the same scores and decisions. Qwen2.5-0.5B widths, 6 layers of random
    weights (test_batch's bucket test)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from prefixscore.batch import plan_classify
    from prefixscore.weights.model_config import ModelConfig
    from prefixscore.engine import Engine
    from prefixscore.labels import LabelTrie
    from prefixscore.weights.loading import from_tensors

    cfg = AutoConfig.for_model("qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                               num_key_value_heads=2, num_hidden_layers=6, vocab_size=4096,
                               max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=BF)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in n else p.normal_(0, 0.02)
    loaded = from_tensors(ModelConfig.from_hf(cfg), hf.state_dict(), None, "random",
                          torch.device("cuda"), BF)
    engine = Engine(loaded, INV)
    labels = [str(t) for t in range(9)]
    # three first tokens, three labels each: three branch rows per request (base + own ranges)
    trie = LabelTrie(labels, [[100 + t // 3, 300 + t % 3] for t in range(9)], None)
    prefix = engine.prefill(list(range(200, 248)))
    weight = engine.label_weight(trie.columns)
    engine.capture(prefix, weight, True, 64)
    rng = random.Random(4)
    reqs = [[rng.randrange(4096) for _ in range(rng.randint(1, 24))] for _ in range(60)]
    alone = [engine.run(plan_classify([r], [48], trie), prefix, weight, True) for r in reqs]
    for n in (60, 512, 2048):
        batch = [reqs[i % 60] for i in range(n)]
        plan = plan_classify(batch, [48] * n, trie)
        scores, best = engine.run(plan, prefix, weight, True)
        at = 0  # (read-out rows: the same number per request, in request order)
        for i in range(n):
            s1, b1 = alone[i % 60]
            k = s1.shape[0]
            assert torch.equal(scores[at:at + k], s1) and torch.equal(best[at:at + k], b1), (n, i)
            at += k
        assert at == scores.shape[0]


def test_mode_is_the_engines(monkeypatch, tiny_model):
    """Classifier(batch_invariant=) and --batch-invariant fix the mode of the classifier's engine
    (its KernelOptions), not of the process: another classifier keeps its own; None takes the
    environment's default (PREFIXSCORE_BATCH_INVARIANT) or, over a shared loaded model, the shared
    engine's; a classifier, scorer or Classifier.many member asking a shared engine for the other
    setting is refused. On CPU the answers are torch's either way."""
    from prefixscore import Classifier
    from prefixscore.cli.common import classifier_kwargs
    from prefixscore.cli.commands import build_parser
    from prefixscore.errors import ConfigError
    from prefixscore.scorer import Scorer
    from prefixscore.weights.loading import load

    path = str(tiny_model("qwen2"))
    spec = dict(template="Which category? {query}", labels=["Dress", "Jeans"], chat=False)
    queries = ["red dress", "jeans"]
    monkeypatch.delenv("PREFIXSCORE_BATCH_INVARIANT", raising=False)
    plain = Classifier(path, device="cpu", **spec)
    inv = Classifier(path, device="cpu", batch_invariant=True, **spec)
    assert plain.engine.options.batch_invariant is False and inv.engine.options.batch_invariant is True
    assert plain.engine is not inv.engine
    assert inv.classify_batch(queries) == plain.classify_batch(queries)
    assert Classifier(path, device="cpu", **spec).engine.options.batch_invariant is False
    monkeypatch.setenv("PREFIXSCORE_BATCH_INVARIANT", "1")  # the environment gives the default only
    assert Classifier(path, device="cpu", **spec).engine.options.batch_invariant is True
    off = Classifier(path, device="cpu", batch_invariant=False, **spec)
    assert off.engine.options.batch_invariant is False
    assert inv.engine.options.batch_invariant is True and plain.engine.options.batch_invariant is False
    monkeypatch.delenv("PREFIXSCORE_BATCH_INVARIANT")

    # one loaded model: one engine, one setting (its graphs hold its kernels)
    loaded = load(path, "cpu", torch.float32)
    first = Classifier(loaded, batch_invariant=True, **spec)
    assert Classifier(loaded, **spec).engine is first.engine  # None: the shared engine's
    assert Classifier(loaded, batch_invariant=True, **spec).engine is first.engine
    with pytest.raises(ConfigError, match="batch_invariant=False: this model's engine runs its kernels "
                                          "with batch_invariant=True"):
        Classifier(loaded, batch_invariant=False, **spec)
    with pytest.raises(ConfigError, match="batch_invariant=False"):
        Scorer(loaded, chat=False, batch_invariant=False)
    assert Scorer(loaded, chat=False, batch_invariant=True).engine is first.engine
    with pytest.raises(ConfigError, match="batch_invariant=True"):
        Classifier.many({"a": dict(spec), "b": dict(spec, batch_invariant=True)}, path, device="cpu")
    many = Classifier.many({"a": dict(spec), "b": dict(spec)}, path, device="cpu", batch_invariant=True)
    assert {c.engine.options.batch_invariant for c in many.values()} == {True}

    a = build_parser().parse_args(["classify", "--batch-invariant", "x"])
    assert classifier_kwargs(a)["batch_invariant"] is True
    a = build_parser().parse_args(["classify", "x"])
    assert classifier_kwargs(a)["batch_invariant"] is None


def test_options_reach_every_kernel(monkeypatch, tiny_model):
    """An engine's KernelOptions (not the defaults) reach every kernel entry point of its forwards,
    through the model's Context, and its label head: the prefill, eager runs, and the hidden states
    a Scorer reads."""
    import prefixscore.engine as engine_mod
    import prefixscore.model as model_mod
    from prefixscore import Classifier
    from prefixscore.engine import Engine
    from prefixscore.scorer import Scorer
    from prefixscore.weights.loading import load

    seen = []
    entry_points = [(model_mod, name) for name in ("embed_rope", "qkv_rope", "attention_o", "gate_up_silu",
                                                   "linear_residual")] + [(engine_mod, "label_head")]
    for mod, name in entry_points:
        def spy(*a, _real=getattr(mod, name), _name=name, **kw):
            seen.append((_name, kw["options"]))
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, spy)
    loaded = load(str(tiny_model("qwen2")), "cpu", torch.float32)
    engine = Engine.shared(loaded, batch_invariant=True, fuse_norms=False, tune={"gu.num_stages": 3})
    assert engine.options == KernelOptions.from_env(batch_invariant=True, fuse_norms=False,
                                                    tune=(("gu.num_stages", 3),))
    clf = Classifier(loaded, template="Which category? {query}", labels=["Dress", "Jeans"], chat=False)
    clf.classify_batch(["red dress", "jeans"])
    Scorer(loaded, chat=False).score("shoes", ["a red shoe", "a hat"])
    assert {n for n, _ in seen} == {"embed_rope", "qkv_rope", "attention_o", "gate_up_silu",
                                    "linear_residual", "label_head"}
    assert all(o is engine.options for _, o in seen), {n for n, o in seen if o is not engine.options}


def test_counters_grow_without_freeing():
    """A row-tiled launch past the arrival-counter buffer's size gets a larger zeroed one; the old
    one stays alive (CUDA graphs captured with it keep pointing at it)."""
    from prefixscore.kernels import triton_util as U

    dev = torch.device(DEVICE)
    old = U._counters(dev)
    new = U._counters(dev, old.numel() + 5)
    assert new.numel() >= old.numel() + 5 and not new.any()
    assert any(b is old for b in U._RETIRED) and U._counters(dev) is new
