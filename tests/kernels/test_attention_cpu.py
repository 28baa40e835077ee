"""The CPU attention path (SDPA over groups of rows, kernels/attention_cpu.py) equals the plain
reference on random plans: requests with label branches and multi-item spans, and any ranges;
prefix or none, a bank's prefix ranges, GQA 1/2/7, chunks of one group and of many; fp32 1e-5 and
bf16 2e-2."""
import pytest
import torch

from prefixscore.kernels.attention import attention_ref
from prefixscore.kernels.attention_cpu import attention_groups, group_layout


def random_plan(g, n_req):
    bs, be, os_, offs = [], [], [], [0]
    for _ in range(n_req):
        s0 = offs[-1]
        n = int(torch.randint(1, 12, (1,), generator=g))
        bs += [s0] * n
        be += [s0] * n
        os_ += [s0] * n
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):  # branches / items
            m, b0 = int(torch.randint(1, 6, (1,), generator=g)), len(bs)
            bs += [s0] * m
            be += [s0 + n] * m
            os_ += [b0] * m
        offs.append(len(bs))
    t = lambda x: torch.tensor(x, dtype=torch.int32)
    return t(bs), t(be), t(os_), torch.tensor(offs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed,P,Hkv,G", [(0, 0, 2, 1), (1, 17, 2, 2), (2, 40, 1, 7), (3, 5, 4, 2)])
def test_groups_path_equals_reference(seed, P, Hkv, G, dtype, tol):
    g = torch.Generator().manual_seed(seed)
    bs, be, os_, offs = random_plan(g, n_req=1 + seed * 2)
    T, D = bs.shape[0], 64
    q = torch.randn(T, Hkv * G, D, generator=g).to(dtype)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, D, generator=g).to(dtype) for _ in range(2))
    ref = attention_ref(q, k, v, pk, pv, bs, be, os_, D ** -0.5, offs)
    # score budgets that fit one block a chunk, and all; groups never merged, merged as in
    # production, and merged without a bound on the rows
    for chunk, merge in ((1, 0), (10 ** 9, 0), (1, 64), (10 ** 9, 64), (10 ** 9, 10 ** 9)):
        layout = group_layout(bs, be, os_, P, chunk_scores=chunk, merge_rows=merge)
        got = attention_groups(q, k, v, pk, pv, layout, D ** -0.5, T)
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def general_plan(g, n_spans):
    """Any ranges a plan may hold: per row an own start anywhere in its span up to itself, and a
    base range that is empty (at a random spot) a third of the time, else any sub-range of the span,
    overlapping the own range or reaching past the row."""
    bs, be, os_, offs = [], [], [], [0]
    for _ in range(n_spans):
        s0, L = offs[-1], int(torch.randint(1, 30, (1,), generator=g))
        for t in range(s0, s0 + L):
            os_.append(int(torch.randint(s0, t + 1, (1,), generator=g)))
            if int(torch.randint(0, 3, (1,), generator=g)) == 0:
                bs.append(int(torch.randint(0, s0 + L, (1,), generator=g)))
                be.append(bs[-1])
            else:
                a = int(torch.randint(s0, s0 + L, (1,), generator=g))
                bs.append(a)
                be.append(int(torch.randint(a + 1, s0 + L + 1, (1,), generator=g)))
        offs.append(s0 + L)
    t = lambda x: torch.tensor(x, dtype=torch.int32)
    return t(bs), t(be), t(os_), torch.tensor(offs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed,P,Hkv,G,ranges", [(0, 0, 2, 1, False), (1, 17, 2, 2, True),
                                                 (2, 40, 1, 7, False), (3, 5, 4, 2, True),
                                                 (4, 9, 2, 7, False), (5, 3, 1, 2, True)])
def test_groups_on_any_ranges_and_read_rows(seed, P, Hkv, G, ranges, dtype, tol):
    """The groups path over every row, and over the last layer's read-out rows only (in any order,
    repeats allowed), equals the reference, on plans like the batcher's (seeds 0-3) and on any
    ranges (4, 5); a score budget small enough that rows go in several chunks."""
    g = torch.Generator().manual_seed(100 + seed)
    if seed < 4:
        bs, be, os_, offs = random_plan(g, n_req=2 + seed * 2)
    else:
        bs, be, os_, offs = general_plan(g, n_spans=6)
    T, D = bs.shape[0], 64
    q = torch.randn(T, Hkv * G, D, generator=g).to(dtype)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, D, generator=g).to(dtype) for _ in range(2))
    pr = None
    if ranges:  # each token sees a random slice of the pinned keys (a bank of prefixes)
        a = torch.randint(0, P, (T,), generator=g)
        pr = (a.int(), (a + torch.randint(1, P + 1, (T,), generator=g)).clamp(max=P).int())
    ref = attention_ref(q, k, v, pk, pv, bs, be, os_, D ** -0.5, offs, pr)
    rows = torch.cat([torch.randperm(T, generator=g)[:max(1, T // 3)], torch.tensor([T - 1, 0, T - 1])])
    budget = 3 * (P + 12)
    got = attention_groups(q, k, v, pk, pv, group_layout(bs, be, os_, P, pr, rows, budget), D ** -0.5,
                           rows.shape[0])
    torch.testing.assert_close(got.float(), ref[rows].float(), atol=tol, rtol=tol)
    for merge in (0, 64, 10 ** 9):
        layout = group_layout(bs, be, os_, P, pr, None, budget, merge)
        got = attention_groups(q, k, v, pk, pv, layout, D ** -0.5, T)
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
