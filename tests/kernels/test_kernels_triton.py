"""Triton kernels against their torch references: compiled on CUDA, else under the Triton CPU
interpreter (TRITON_INTERPRET=1, which must be set before triton is imported).

Tolerances (abs and rel): fp32 1e-4, bf16 2e-2. Outputs are NaN-poisoned before every run and
checked fully written (and, for strided outputs, nothing written outside the view).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from prefixscore.kernels.attention import attention_ref  # noqa: E402
from prefixscore.kernels.label_head import label_head_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


from tests.helpers import fix_interpreter  # noqa: E402

fix_interpreter()

from prefixscore.kernels.attention_triton import attention_triton  # noqa: E402
from prefixscore.kernels.label_head_triton import label_head_triton  # noqa: E402


def _randint(gen, lo, hi):  # inclusive
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def make_plan(T, gen):
    """Visibility ranges like real plans: requests of random lengths laid out back to back.

    Plain request: own range = the request, base empty (bs == be at a random spot, which must be
    ignored). Branched request (label trie / multi-item): a query part (own = request start), then
    branches each seeing base = an earlier span of the request plus its own causal range.
    """
    bs = torch.zeros(T, dtype=torch.int32)
    be = torch.zeros(T, dtype=torch.int32)
    own = torch.zeros(T, dtype=torch.int32)
    t = 0
    while t < T:
        L = min(T - t, _randint(gen, 1, 40))
        empty = _randint(gen, 0, T)
        bs[t:t + L] = be[t:t + L] = empty
        own[t:t + L] = t
        if L >= 3 and _randint(gen, 0, 2) > 0:
            qlen = _randint(gen, 1, L - 2)
            b = t + qlen
            while b < t + L:
                blen = min(t + L - b, _randint(gen, 1, 8))
                s0 = _randint(gen, t, t + qlen - 1)  # base: any earlier non-empty span
                bs[b:b + blen], be[b:b + blen] = s0, _randint(gen, s0 + 1, t + qlen)
                own[b:b + blen] = b
                b += blen
        t += L
    return bs, be, own


def make_multi_item_plan(spans, overlap=0):
    """Multi-item scoring plans: per span (query_len, [item lengths]), back to back. Query part:
    own causal from the span start, base empty. Item: base = the query part [s, s + q) (adjacent to
    item 1), own = the item. overlap > 0 stretches each item's base that many keys past its own
    start (clipped to the item), so base and own ranges overlap and the kernel must not count the
    shared keys twice."""
    bs, be, own = [], [], []
    t = 0
    for qlen, items in spans:
        s = t
        bs += [s] * qlen  # empty base at a non-zero spot
        be += [s] * qlen
        own += [s] * qlen
        t += qlen
        for L in items:
            bs += [s] * L
            be += [t + min(overlap, L) if overlap else s + qlen] * L
            own += [t] * L
            t += L
    i32 = dict(dtype=torch.int32)
    return torch.tensor(bs, **i32), torch.tensor(be, **i32), torch.tensor(own, **i32)


def make_random_plan(T, gen):
    """The most general plans: spans of random lengths; each row t gets a random own start in
    [span start, t] and a random base range inside its span (empty a third of the time, else any
    sub-range, possibly overlapping or adjacent to its own range or reaching past t)."""
    bs = torch.zeros(T, dtype=torch.int32)
    be = torch.zeros(T, dtype=torch.int32)
    own = torch.zeros(T, dtype=torch.int32)
    t = 0
    while t < T:
        L = min(T - t, _randint(gen, 1, 60))
        for r in range(t, t + L):
            own[r] = _randint(gen, t, r)
            if _randint(gen, 0, 2) == 0:
                bs[r] = be[r] = _randint(gen, 0, T)
            else:
                a = _randint(gen, t, t + L - 1)
                bs[r], be[r] = a, _randint(gen, a + 1, t + L)
        t += L
    return bs, be, own


def _check_close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# P, T, G (=Hq/Hkv), Hkv, D, dtype, block_m (None: the shape heuristic, as in production)
ATTN_CASES = [
    (0, 1, 1, 1, 64, torch.float32, None),
    (1, 8, 7, 2, 64, torch.bfloat16, None),  # Qwen2.5-0.5B heads, one request
    (48, 8, 7, 4, 128, torch.float32, None),  # Qwen2.5-7B heads
    (37, 57, 2, 2, 128, torch.bfloat16, None),
    (600, 64, 1, 2, 64, torch.float32, 64),
    (130, 300, 7, 1, 64, torch.bfloat16, 128),
    (5, 300, 2, 2, 128, torch.float32, 128),
    (0, 200, 7, 2, 64, torch.float32, 32),
    (600, 20, 7, 1, 128, torch.bfloat16, None),
]


def _run_attention(P, G, Hkv, D, dtype, block_m, plan, gen, idx_dtype=torch.int32):
    bs, be, own = plan
    T = bs.shape[0]
    Hq = G * Hkv
    # q, k, v as views of one fused QKV projection output, prefix K/V interleaved in one cache:
    # strides on dim 0 are not the contiguous ones.
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    cache = torch.randn(P, 2, Hkv, D, generator=gen).to(DEVICE, dtype)
    pk, pv = cache[:, 0], cache[:, 1]
    bs, be, own = (x.to(DEVICE, idx_dtype) for x in (bs, be, own))
    scale = D ** -0.5
    ref = attention_ref(q, k, v, pk, pv, bs, be, own, scale)

    # Output into a NaN-poisoned strided view; padding heads must stay untouched.
    buf = torch.full((T, Hq + 3, D), float("nan"), dtype=dtype, device=DEVICE)
    out = buf[:, :Hq]
    cfg = None if block_m is None else {"BLOCK_M": block_m}
    res = attention_triton(q, k, v, pk, pv, bs, be, own, scale, out=out, config=cfg)
    assert res.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), "output not fully written"
    assert buf[:, Hq:].isnan().all(), "wrote outside the output view"
    _check_close(out, ref, dtype)


@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_attention(case):
    P, T, G, Hkv, D, dtype, block_m = ATTN_CASES[case]
    gen = torch.Generator().manual_seed(1000 + case)
    _run_attention(P, G, Hkv, D, dtype, block_m, make_plan(T, gen), gen)


def _plain_plan(lengths):  # own = the request, base empty (bs == be == 0: must be ignored)
    own = torch.cat([torch.full((L,), s, dtype=torch.int32)
                     for s, L in zip([sum(lengths[:i]) for i in range(len(lengths))], lengths)])
    zero = torch.zeros_like(own)
    return zero, zero.clone(), own


# P, G, Hkv, D, dtype, block_m, plan builder (gen -> (bs, be, own)), plan index dtype
PLAN_CASES = [
    # multi-item: query part + items of different lengths; 7 heads/token -> blocks straddle items
    (0, 7, 2, 64, torch.bfloat16, 64, lambda g: make_multi_item_plan([(5, [9, 3, 17, 1, 12, 6])])),
    (48, 7, 1, 64, torch.float32, 32, lambda g: make_multi_item_plan([(5, [9, 3, 17, 1, 12, 6])])),
    # two spans, a long item (many key tiles in the own range), one-token query parts
    (3, 2, 2, 64, torch.float32, 16,
     lambda g: make_multi_item_plan([(12, [40, 2, 33]), (1, [1, 70]), (40, [5])])),
    (0, 7, 2, 64, torch.bfloat16, 128,
     lambda g: make_multi_item_plan([(12, [40, 2, 33]), (1, [1, 70]), (40, [5])])),
    # base range overlapping the own range (and reaching past t within the item)
    (5, 2, 1, 64, torch.float32, 16, lambda g: make_multi_item_plan([(7, [10, 4, 25]), (3, [9])], overlap=6)),
    (0, 7, 2, 64, torch.bfloat16, 64,
     lambda g: make_multi_item_plan([(7, [10, 4, 25]), (3, [9])], overlap=40)),
    # fully random ranges: overlapping / adjacent / empty bases, own starts anywhere
    (4, 1, 2, 64, torch.float32, 16, lambda g: make_random_plan(150, g)),
    (0, 7, 1, 64, torch.bfloat16, 128, lambda g: make_random_plan(120, g)),
    # old plain and label-branch plans, int64 plan tensors
    (9, 7, 1, 64, torch.float32, 32, lambda g: _plain_plan([8, 1, 30, 8, 3])),
    (9, 7, 1, 64, torch.float32, 32, lambda g: _plain_plan([8, 1, 30, 8, 3])),  # same, int64
    (20, 2, 2, 64, torch.bfloat16, 16, lambda g: make_plan(100, g)),
    (0, 7, 2, 64, torch.float32, None, lambda g: make_plan(90, g)),
]
PLAN_IDX64 = {1, 5, 9, 11}  # cases that pass the plan as int64


@pytest.mark.parametrize("case", range(len(PLAN_CASES)))
def test_attention_plans(case):
    P, G, Hkv, D, dtype, block_m, build = PLAN_CASES[case]
    gen = torch.Generator().manual_seed(3000 + case)
    idx_dtype = torch.int64 if case in PLAN_IDX64 else torch.int32
    _run_attention(P, G, Hkv, D, dtype, block_m, build(gen), gen, idx_dtype)


def test_multi_item_plan_shape():
    """The builder itself: item rows see exactly the query part plus their own item prefix."""
    bs, be, own = make_multi_item_plan([(3, [2, 4])])
    assert bs.tolist() == [0] * 9 and be.tolist() == [0, 0, 0] + [3] * 6
    assert own.tolist() == [0, 0, 0, 3, 3, 5, 5, 5, 5]
    bs, be, own = make_multi_item_plan([(3, [2, 4])], overlap=3)
    assert be.tolist() == [0, 0, 0, 5, 5, 8, 8, 8, 8]


def test_attention_allocates_output():
    gen = torch.Generator().manual_seed(7)
    T, Hkv, G, D, P = 12, 2, 2, 64, 3
    q = torch.randn(T, Hkv * G, D, generator=gen).to(DEVICE)
    k, v = (torch.randn(T, Hkv, D, generator=gen).to(DEVICE) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, D, generator=gen).to(DEVICE) for _ in range(2))
    bs, be, own = (x.to(DEVICE) for x in make_plan(T, gen))
    out = attention_triton(q, k, v, pk, pv, bs, be, own, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check_close(out, attention_ref(q, k, v, pk, pv, bs, be, own, 0.125), torch.float32)


# Read-out rows only (the last layer, Transformer.forward(rows=...)): P, G, Hkv, D, dtype, plan, rows
# (None: a random third of the rows plus the last row twice), prefix ranges (a bank of two)
ROWS_CASES = [
    (48, 7, 2, 64, torch.bfloat16, lambda g: make_multi_item_plan([(5, [9, 3, 17, 1, 12, 6])]), None, False),
    (0, 7, 1, 64, torch.float32, lambda g: make_random_plan(90, g), None, False),
    (30, 2, 2, 128, torch.float32, lambda g: make_plan(60, g), None, True),
    (5, 7, 2, 64, torch.bfloat16, lambda g: _plain_plan([8, 1, 30]), [7, 8, 38], False),  # last tokens
]


@pytest.mark.parametrize("case", range(len(ROWS_CASES)))
def test_attention_rows(case):
    """attention_triton(rows=...) == attention_ref(...)[rows], into a NaN-poisoned output."""
    P, G, Hkv, D, dtype, build, rows, ranges = ROWS_CASES[case]
    gen = torch.Generator().manual_seed(5500 + case)
    bs, be, own = (x.to(DEVICE) for x in build(gen))
    T, Hq = bs.shape[0], G * Hkv
    q = torch.randn(T, Hq, D, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(T, Hkv, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    pr = None
    if ranges:
        pr = tuple(x.to(DEVICE) for x in _bank([P // 3, P - P // 3], [T], gen))
    if rows is None:
        rows = torch.cat([torch.randperm(T, generator=gen)[:T // 3], torch.tensor([T - 1, T - 1])])
    rows = torch.as_tensor(rows).to(DEVICE)
    ref = attention_ref(q, k, v, pk, pv, bs, be, own, D ** -0.5, prefix_range=pr)[rows.long()]
    out = torch.full((rows.shape[0], Hq, D), float("nan"), dtype=dtype, device=DEVICE)
    attention_triton(q, k, v, pk, pv, bs, be, own, D ** -0.5, out=out, prefix_range=pr, rows=rows)
    assert not out.isnan().any(), "output not fully written"
    _check_close(out, ref, dtype)


# Attention fused with the O projection and the residual add (T <= 64):
# P, G, Hkv, D, N (hidden), dtype, plan builder, config override (None: the shape heuristic)
ATTN_O_CASES = [
    (48, 7, 2, 64, 96, torch.bfloat16, lambda g: _plain_plan([8]), None),  # 0.5B heads, one request
    (0, 1, 2, 64, 64, torch.float32, lambda g: _plain_plan([1]), None),  # no prefix, one token
    (600, 2, 2, 128, 80, torch.float32, lambda g: make_plan(64, g), {"HPP": 2}),  # ragged N
    (37, 7, 1, 64, 128, torch.bfloat16, lambda g: make_multi_item_plan([(5, [9, 3, 17, 1, 12])]),
     {"BLOCK_N": 64, "HPP": 7}),  # one head group: no split
    (5, 7, 4, 128, 96, torch.float32, lambda g: make_random_plan(40, g), {"BLOCK_N": 64}),  # 7B heads
    (73, 7, 2, 64, 896, torch.bfloat16, lambda g: _plain_plan([3, 9, 4]), {"BLOCK_N": 128, "HPP": 7}),
    (100, 7, 2, 64, 96, torch.float32, lambda g: _plain_plan([5]), {"EARLY": False}),  # Wo, prefix after the wait
    (20, 7, 2, 64, 96, torch.bfloat16, lambda g: make_random_plan(50, g), {"IN_TILE": False}),  # range loops
    (9, 2, 2, 64, 64, torch.float32, lambda g: make_multi_item_plan([(4, [6, 2, 5])], overlap=3), None),
]


@pytest.mark.parametrize("case", range(len(ATTN_O_CASES)))
def test_attention_o_residual(case):
    from prefixscore.kernels.attention_o_triton import attention_o_residual_small

    P, G, Hkv, D, N, dtype, build, cfg = ATTN_O_CASES[case]
    gen = torch.Generator().manual_seed(5000 + case)
    bs, be, own = (x.to(DEVICE) for x in build(gen))
    T, Hq = bs.shape[0], G * Hkv
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    pk, pv = (torch.randn(P, Hkv, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    wo = (torch.randn(N, Hq * D, generator=gen) / (Hq * D) ** 0.5).to(DEVICE, dtype)
    r = torch.randn(T, N, generator=gen).to(DEVICE, dtype)
    scale = D ** -0.5
    for _ in range(2):  # twice: the split-K arrival counters are left zeroed
        out, ssq = attention_o_residual_small(q, k, v, pk, pv, bs, be, own, scale, wo, r, config=cfg)
        o = attention_ref(q, k, v, pk, pv, bs, be, own, scale).reshape(T, -1)
        y = o.float() @ wo.float().t()
        # bf16: the sum may cancel, so the tolerance scales with the operands (as test_kernels_gemm)
        err = (out.float() - (r.float() + y)).abs()
        assert (err <= TOL[dtype] * (1 + r.float().abs() + y.abs())).all(), err.max()
        torch.testing.assert_close(ssq.sum(0), out.float().pow(2).sum(1), rtol=1e-4, atol=1e-3)


# T, H, N, R, dtype, logprobs, block_r (None: heuristic)
HEAD_CASES = [
    (3, 64, 1, 1, torch.float32, True, None),
    (20, 896, 9, 5, torch.bfloat16, True, None),  # Qwen2.5-0.5B hidden, 9 labels
    (40, 1000, 64, 33, torch.float32, False, None),  # H not a multiple of the chunk
    (64, 256, 300, 70, torch.bfloat16, False, None),  # N padded to 512
    (50, 128, 16, 100, torch.bfloat16, True, 64),
    (30, 192, 9, 40, torch.float32, True, 32),
    (12, 300, 12, 16, torch.float32, True, None),  # one tile (ONE), ragged H, fp32
    (20, 896, 9, 1, torch.bfloat16, True, None),  # one request of Qwen2.5-0.5B (ONE)
    (20, 896, 9, 1, torch.bfloat16, False, "two passes"),  # the same through the looped passes
]


def test_label_head_one_tile_config():
    """ONE (everything in one tile, loads before the wait) for one small program only."""
    from prefixscore.kernels.label_head_triton import head_config

    cpu = torch.device("cpu")
    assert head_config(1, 9, 896, cpu)["ONE"] and head_config(16, 9, 576, cpu)["ONE"]
    assert not head_config(17, 9, 896, cpu)["ONE"]  # two programs
    assert not head_config(1, 9, 3584, cpu)["ONE"]  # 7B hidden: 128 KB of label weights
    assert not head_config(1, 9, 896, cpu, elem_bytes=4)["ONE"]  # fp32: 64 KB
    assert [head_config(R, 9, 300, cpu, 4)["ONE"] for R in (1, 16)] == [True, True]


@pytest.mark.parametrize("case", range(len(HEAD_CASES)))
def test_label_head(case):
    T, H, N, R, dtype, logprobs, block_r = HEAD_CASES[case]
    gen = torch.Generator().manual_seed(2000 + case)
    hidden = torch.randn(T, H + 8, generator=gen)
    rows = torch.randint(0, T, (R,), generator=gen)
    norm_w = 1 + 0.1 * torch.randn(H, generator=gen)
    weight = torch.randn(N, H, generator=gen) * H ** -0.5
    allowed = torch.rand(R, N, generator=gen) < 0.6
    allowed[torch.arange(R), torch.randint(0, N, (R,), generator=gen)] = True  # >= 1 per row
    allowed[0] = True
    if N >= 4:  # exact ties: two identical label rows, and rows allowed only those two
        weight[3] = weight[1]
        allowed[1::3] = False
        allowed[1::3, [1, 3]] = True
    hidden, norm_w, weight = (x.to(DEVICE, dtype) for x in (hidden, norm_w, weight))
    hidden = hidden[:, :H]  # strided rows, like a view into a bigger buffer
    rows, allowed = rows.to(DEVICE), allowed.to(DEVICE)
    eps = 1e-6
    ref_s, ref_b = label_head_ref(hidden, rows, norm_w, eps, weight, allowed, logprobs)

    scores = torch.full((R, N), float("nan"), device=DEVICE)
    best = torch.full((R,), -1, dtype=torch.int64, device=DEVICE)
    s, b = label_head_triton(hidden, rows, norm_w, eps, weight, allowed, logprobs,
                             out_scores=scores, out_best=best,
                             config=None if block_r is None else {"ONE": False, "BLOCK_K": 256}
                             if block_r == "two passes" else {"BLOCK_R": block_r})
    assert s.data_ptr() == scores.data_ptr() and b.data_ptr() == best.data_ptr()
    assert not scores.isnan().any() and (best >= 0).all(), "output not fully written"
    assert torch.equal(torch.isneginf(scores), ~allowed)
    _check_close(scores[allowed], ref_s[allowed], dtype)
    assert allowed.gather(1, best[:, None]).all()
    if N >= 4:  # ties resolve to the first index, like torch.argmax
        assert (best[1::3] == 1).all()
    if dtype == torch.float32:
        assert torch.equal(best, ref_b)
    else:  # bf16 may flip near-ties; the pick must score within tolerance of the reference max
        picked = ref_s.gather(1, best[:, None])[:, 0]
        assert (picked >= ref_s.max(1).values - 2 * TOL[dtype]).all()


# Per-token prefix ranges (a bank of several classifiers' prefixes, Classifier.many's fused pass):
# P per classifier, G, Hkv, D, dtype, block_m, requests' suffix lengths, fused kernel config
BANK_CASES = [
    ([73, 30], 7, 2, 64, torch.bfloat16, None, [8, 5, 9, 3], None),  # 0.5B heads, two classifiers
    ([5, 0, 130], 2, 2, 64, torch.float32, 16, [4, 6, 1, 7, 2, 9], {"IN_TILE": False}),  # an empty prefix
    ([64, 64], 1, 2, 128, torch.float32, 32, [30, 2], {"EARLY": False}),
]


def _bank(Ps, lengths, gen):
    """(prefix_start, prefix_end) per token, requests cycling through the classifiers; plain plan."""
    offs = [sum(Ps[:i]) for i in range(len(Ps))]
    ps = torch.cat([torch.full((L,), offs[i % len(Ps)], dtype=torch.int32) for i, L in enumerate(lengths)])
    pe = torch.cat([torch.full((L,), offs[i % len(Ps)] + Ps[i % len(Ps)], dtype=torch.int32)
                    for i, L in enumerate(lengths)])
    return ps, pe


@pytest.mark.parametrize("case", range(len(BANK_CASES)))
def test_attention_prefix_ranges(case):
    """Each request attends to its own classifier's prefix only: the reference over the bank with
    ranges equals the reference over that classifier's prefix alone, request by request; the Triton
    kernels (alone and fused with O) and the CPU groups path equal the reference with ranges."""
    from prefixscore.kernels.attention_cpu import attention_groups, group_layout
    from prefixscore.kernels.attention_o_triton import attention_o_residual_small

    Ps, G, Hkv, D, dtype, block_m, lengths, ocfg = BANK_CASES[case]
    gen = torch.Generator().manual_seed(7000 + case)
    bs, be, own = _plain_plan(lengths)
    ps, pe = _bank(Ps, lengths, gen)
    T, Hq, P = bs.shape[0], G * Hkv, sum(Ps)
    q = torch.randn(T, Hq, D, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(T, Hkv, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    bs, be, own, ps, pe = (x.to(DEVICE) for x in (bs, be, own, ps, pe))
    scale = D ** -0.5
    ref = attention_ref(q, k, v, pk, pv, bs, be, own, scale, prefix_range=(ps, pe))
    at = 0
    for i, L in enumerate(lengths):  # request i alone, with its classifier's prefix only
        c = i % len(Ps)
        lo, hi = sum(Ps[:c]), sum(Ps[:c + 1])
        sl = slice(at, at + L)
        alone = attention_ref(q[sl], k[sl], v[sl], pk[lo:hi], pv[lo:hi], bs[sl] * 0, be[sl] * 0,
                              own[sl] - at, scale)
        # Both sums run in fp32 but over key sets of other sizes (the bank masks what "alone" never
        # sees), so on a GPU their rounding can differ in the last fp32 bits, and an output stored
        # in bf16 can then round to the neighbouring value: one bf16 step, at most 2^-7 of the value
        # (8 significant bits; the step is 2^-7 relative at the bottom of a binade).
        rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(ref[sl].float(), alone.float(), atol=1e-5, rtol=rtol)
        at += L
    cfg = None if block_m is None else {"BLOCK_M": block_m}
    _check_close(attention_triton(q, k, v, pk, pv, bs, be, own, scale, config=cfg,
                                  prefix_range=(ps, pe)), ref, dtype)
    layout = group_layout(bs.cpu(), be.cpu(), own.cpu(), P, (ps.cpu(), pe.cpu()))
    f32 = [x.cpu().float() for x in (q, k, v, pk, pv)]
    _check_close(attention_groups(*f32, layout, scale, T), attention_ref(
        *f32, bs.cpu(), be.cpu(), own.cpu(), scale, prefix_range=(ps.cpu(), pe.cpu())), torch.float32)
    N = 96
    wo = (torch.randn(N, Hq * D, generator=gen) / (Hq * D) ** 0.5).to(DEVICE, dtype)
    r = torch.randn(T, N, generator=gen).to(DEVICE, dtype)
    out, _ = attention_o_residual_small(q, k, v, pk, pv, bs, be, own, scale, wo, r, config=ocfg,
                                        prefix_range=(ps, pe))
    y = ref.reshape(T, -1).float() @ wo.float().t()
    err = (out.float() - (r.float() + y)).abs()
    assert (err <= TOL[dtype] * (1 + r.float().abs() + y.abs())).all(), err.max()


def test_attention_tuned_config():
    """KernelOptions.tune's attn.* overrides reach the launch (bench.multi_item --ab arms): an
    override Triton cannot launch fails, and a valid one still equals the reference."""
    from prefixscore.kernels.options import KernelOptions

    gen = torch.Generator().manual_seed(8)
    T, Hkv, G, D, P = 40, 2, 7, 64, 5
    q = torch.randn(T, Hkv * G, D, generator=gen).to(DEVICE)
    k, v = (torch.randn(T, Hkv, D, generator=gen).to(DEVICE) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, D, generator=gen).to(DEVICE) for _ in range(2))
    bs, be, own = (x.to(DEVICE) for x in make_multi_item_plan([(6, [9, 3, 17, 5])]))
    ref = attention_ref(q, k, v, pk, pv, bs, be, own, 0.125)
    ok = KernelOptions(tune={"attn.BLOCK_M": 32, "attn.BLOCK_NI": 16})
    _check_close(attention_triton(q, k, v, pk, pv, bs, be, own, 0.125, options=ok), ref, torch.float32)
    with pytest.raises(Exception):
        attention_triton(q, k, v, pk, pv, bs, be, own, 0.125, options=KernelOptions(tune={"attn.BLOCK_M": 24}))
