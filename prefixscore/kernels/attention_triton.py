"""Shared-prefix attention as one Triton kernel (same math as attention.attention_ref).

Cascade layout: one program = BLOCK_M rows x one kv head, where a row is a (token, query head of
that kv head) pair, token-major. Stacking the G query heads of a kv head into the M dimension of
the dot means each prefix K/V tile is read once per block of tokens instead of once per query
head, and GQA ratios like 7 waste no padding (a block simply covers BLOCK_M / G tokens).

Per program: online softmax over the P prefix keys (dense, no mask but the tail), then over two
in-batch key ranges, each masked per row: the base range [min bs, max be) over the rows that have
a non-empty base, then the own range [min own_start, max t + 1) with own-causal visibility minus
the row's base range (so a key both ranges cover is counted once). Scanning one range
[min start, max end] instead would, for multi-item scoring (one span = query part + many items,
each item's base = the query part), sweep every earlier item for a block deep in the span:
O(S^2) key pairs per span of S tokens instead of S x (query + item). fp32 state; dots in the
input dtype (bf16 tensor cores) with fp32 accumulation; fp32 inputs use IEEE dots so they match
the reference to ~1e-6.

CUDA-graph safe: the grid and every launch parameter depend only on shapes; the in-batch key ranges
are computed inside the kernel from the plan tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_config import tuned
from .options import DEFAULTS, INVARIANT_ATTN_ROWS, KernelOptions
from .pdl import launch_kwargs, wait
from .triton_util import _dot, _num_sms


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax update with a [BLOCK_M, BLOCK_N] tile of log2-scaled scores."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # masked scores are -inf -> 0
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _ranges(BS, BE, OS, tok, T):
    """Per-row visibility and the block's two in-batch key ranges. Base range [bs, be), ignored
    when empty, and own causal range [os, t]. The block scans base [b_lo, b_hi) over the rows with
    a non-empty base (empty, zero trips, when none has one) and own [o_lo, o_hi) = [min os, max t
    + 1). Padding rows repeat token T-1's ranges. An empty base becomes [0, 0) in the per-row
    bounds, so it excludes nothing from the own range."""
    bs = tl.load(BS + tok)
    be = tl.load(BE + tok)
    os_ = tl.load(OS + tok)
    has_base = bs < be
    b_lo = tl.maximum(tl.min(tl.where(has_base, bs, T), 0), 0)
    b_hi = tl.minimum(tl.max(tl.where(has_base, be, 0), 0), T)
    o_lo = tl.maximum(tl.min(os_, 0), 0)
    o_hi = tl.minimum(tl.max(tok, 0) + 1, T)
    return tl.where(has_base, bs, 0), tl.where(has_base, be, 0), os_, b_lo, b_hi, o_lo, o_hi


@triton.jit
def _prefix_tile(pk_base, pv_base, spk_t, spv_t, P, start, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys (transposed, [D, BLOCK_N]) and values of the prefix from key `start`, zero past P."""
    d = tl.arange(0, D)
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols < P
    kt = tl.load(pk_base + cols[None, :] * spk_t + d[:, None], mask=col_ok[None, :], other=0.0)
    v = tl.load(pv_base + cols[:, None] * spv_t + d[None, :], mask=col_ok[:, None], other=0.0)
    return kt, v


@triton.jit
def _prefix_ranges(PS, PE, tok, P, RANGES: tl.constexpr):
    """Per-row pinned-key range [ps, pe) and the block's [p_lo, p_hi) (RANGES: from the plan's
    prefix_start / prefix_end; else every row sees [0, P))."""
    if RANGES:
        ps = tl.load(PS + tok)
        pe = tl.load(PE + tok)
        p_lo = tl.min(ps, 0)
        p_hi = tl.max(pe, 0)
    else:  # whole prefix: _attend scans [0, P) and reads none of these (tensors, not constants,
        # so both branches return the same kinds of values)
        ps = tok
        pe = tok
        p_lo = tl.min(tok, 0) * 0
        p_hi = p_lo + P
    return ps, pe, p_lo, p_hi


@triton.jit
def _attend(q, tok, bs, be, os_, b_lo, b_hi, o_lo, o_hi, pk_base, pv_base, spk_t, spv_t,
            k_base, v_base, sk_t, sv_t, P, qk_scale, kt0, v0, kin_t, vin, T, ps, pe, p_lo, p_hi,
            M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NI: tl.constexpr,
            DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, PRE_KV: tl.constexpr,
            IN_TILE: tl.constexpr, RANGES: tl.constexpr, CANON: tl.constexpr = False):
    """Online softmax of q [M, D] (row i: token tok[i]) over one kv head's keys: the prefix, then
    the in-batch base and own ranges (see _ranges) -> (unnormalised output [M, D], row sums).
    PRE_KV: kt0, v0 are the prefix's first tile (_prefix_tile at 0), loaded by the caller.
    IN_TILE: the rows are the whole batch (tok = 0..T-1, T <= M) and kin_t [D, M], vin [M, D] all
    of its in-batch keys, loaded by the caller: one masked tile instead of the two range loops,
    whose loads wait on the ranges (one dependent round trip to memory fewer).
    RANGES: row i sees only the pinned keys [ps[i], pe[i]) (a bank of several prefixes); the block
    scans [p_lo, p_hi), the union of its rows' ranges.
    CANON (batch-invariant mode): each row gathers its own in-batch keys in tiles that start at its
    own range's first key (_attend_rows), so how they are grouped and which lane each key takes
    depend on the request alone, not on where it sits in the batch or what shares the block."""
    d = tl.arange(0, D)
    # Finite start for the running max: a row whose keys in a tile are all masked then gets
    # exp2(-inf - m) = 0 and alpha = 1 instead of NaN from (-inf) - (-inf).
    m_i = tl.full([M], -1.0e30, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    # 1) the cached prefix: every row sees every key; only the last tile has a tail.
    first = 0
    if PRE_KV:
        if P > 0:
            # (own names: with P == 1 specialised this `if` is static, and a name reused by the
            # loops below with another shape would be loop-carried)
            s0 = _dot(q, kt0, tl.zeros([M, BLOCK_N], tl.float32), DOT_PREC, UPCAST) * qk_scale
            c0 = tl.arange(0, BLOCK_N)
            if RANGES:
                vis0 = (c0 < P)[None, :] & (c0[None, :] >= ps[:, None]) & (c0[None, :] < pe[:, None])
            else:
                vis0 = (c0 < P)[None, :]
            s0 = tl.where(vis0, s0, float("-inf"))
            m_i, l_i, acc = _softmax_step(s0, v0, m_i, l_i, acc, DOT_PREC, UPCAST)
        first = BLOCK_N
    if RANGES:  # the block's union of its rows' ranges
        lo = tl.maximum(p_lo, first)
        hi = p_hi
    else:
        lo = first
        hi = P
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        kt = tl.load(pk_base + cols[None, :] * spk_t + d[:, None], mask=col_ok[None, :], other=0.0)
        v = tl.load(pv_base + cols[:, None] * spv_t + d[None, :], mask=col_ok[:, None], other=0.0)
        s = _dot(q, kt, tl.zeros([M, BLOCK_N], tl.float32), DOT_PREC, UPCAST) * qk_scale
        if RANGES:
            vis = col_ok[None, :] & (cols[None, :] >= ps[:, None]) & (cols[None, :] < pe[:, None])
        else:
            vis = col_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC, UPCAST)
    if CANON:
        m_i, l_i, acc = _attend_rows(q, tok, bs, be, os_, k_base, v_base, sk_t, sv_t, qk_scale, m_i,
                                     l_i, acc, D, BLOCK_NI)
    elif IN_TILE:  # 2) in-batch key c is visible to a row iff bs <= c < be or os <= c <= t
        s = _dot(q, kin_t, tl.zeros([M, M], tl.float32), DOT_PREC, UPCAST) * qk_scale
        c = tl.arange(0, M)[None, :]
        vis = ((c >= bs[:, None]) & (c < be[:, None])) | ((c >= os_[:, None]) & (c <= tok[:, None]))
        s = tl.where(vis & (c < T), s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, vin, m_i, l_i, acc, DOT_PREC, UPCAST)
    else:
        # 2) in-batch keys, masked per row. A block spans only a few tokens plus their requests'
        # look-back, so narrower tiles (BLOCK_NI) waste fewer exp/dot lanes on masked keys.
        # 2a) base range: key c is visible to a row iff bs <= c < be.
        for start in range(b_lo, b_hi, BLOCK_NI):
            cols = start + tl.arange(0, BLOCK_NI)
            col_ok = cols < b_hi
            cols64 = cols.to(tl.int64)
            kt = tl.load(k_base + cols64[None, :] * sk_t + d[:, None], mask=col_ok[None, :], other=0.0)
            v = tl.load(v_base + cols64[:, None] * sv_t + d[None, :], mask=col_ok[:, None], other=0.0)
            s = _dot(q, kt, tl.zeros([M, BLOCK_NI], tl.float32), DOT_PREC, UPCAST) * qk_scale
            c = cols[None, :]
            vis = (c >= bs[:, None]) & (c < be[:, None]) & col_ok[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC, UPCAST)
        # 2b) own range: os <= c <= t, minus the keys 2a already counted for this row (bs <= c < be).
        for start in range(o_lo, o_hi, BLOCK_NI):
            cols = start + tl.arange(0, BLOCK_NI)
            col_ok = cols < o_hi
            cols64 = cols.to(tl.int64)
            kt = tl.load(k_base + cols64[None, :] * sk_t + d[:, None], mask=col_ok[None, :], other=0.0)
            v = tl.load(v_base + cols64[:, None] * sv_t + d[None, :], mask=col_ok[:, None], other=0.0)
            s = _dot(q, kt, tl.zeros([M, BLOCK_NI], tl.float32), DOT_PREC, UPCAST) * qk_scale
            c = cols[None, :]
            in_base = (c >= bs[:, None]) & (c < be[:, None])
            vis = (c >= os_[:, None]) & (c <= tok[:, None]) & ~in_base & col_ok[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, DOT_PREC, UPCAST)
    return acc, l_i


@triton.jit
def _rows_step(q, cols, vis, k_base, v_base, sk_t, sv_t, qk_scale, m_i, l_i, acc, D: tl.constexpr):
    """One online-softmax update over a [M, NI] tile of per-row key indices (vis: which count),
    in fp32 FMAs: gathered keys [M, NI, D] and values, no dot (rows do not share keys here)."""
    d = tl.arange(0, D)[None, None, :]
    at = tl.where(vis, cols, 0).to(tl.int64)[:, :, None]
    kg = tl.load(k_base + at * sk_t + d, mask=vis[:, :, None], other=0.0).to(tl.float32)
    s = tl.sum(q.to(tl.float32)[:, None, :] * kg, 2) * qk_scale
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # masked keys -> 0; a tile with none leaves the state as it was
    l_i = l_i * alpha + tl.sum(p, 1)
    vg = tl.load(v_base + at * sv_t + d, mask=vis[:, :, None], other=0.0).to(tl.float32)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vg, 1)
    return m_new, l_i, acc


@triton.jit
def _attend_rows(q, tok, bs, be, os_, k_base, v_base, sk_t, sv_t, qk_scale, m_i, l_i, acc,
                 D: tl.constexpr, NI: tl.constexpr):
    """The in-batch part of _attend in canonical order: row i's base keys bs[i] + j and then its
    own keys os[i] + j (j = 0, 1, ... in tiles of NI), minus base keys, each row from its own
    start. The trip counts are the block's longest ranges; a row's trips past its own are exact
    no-ops (no visible key: alpha 1, nothing added)."""
    j = tl.arange(0, NI)[None, :]
    nb = tl.max(be - bs, 0)
    for j0 in range(0, nb, NI):
        cols = bs[:, None] + j0 + j
        vis = cols < be[:, None]
        m_i, l_i, acc = _rows_step(q, cols, vis, k_base, v_base, sk_t, sv_t, qk_scale, m_i, l_i,
                                   acc, D)
    no = tl.max(tok - os_ + 1, 0)
    for j0 in range(0, no, NI):
        cols = os_[:, None] + j0 + j
        in_base = (cols >= bs[:, None]) & (cols < be[:, None])
        vis = (cols <= tok[:, None]) & ~in_base
        m_i, l_i, acc = _rows_step(q, cols, vis, k_base, v_base, sk_t, sv_t, qk_scale, m_i, l_i,
                                   acc, D)
    return m_i, l_i, acc


@triton.jit
def _prefix_attn_kernel(
    Q, K, V, PK, PV, BS, BE, OS, PS, PE, O, ROWS,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, spk_t, spk_h, spv_t, spv_h, so_t, so_h,
    T, R, P, qk_scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_NI: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, GDC: tl.constexpr,
    RANGES: tl.constexpr, CANON: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    kvh = tl.program_id(1)
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r = rows // G  # output row; its token is r, or ROWS[r] (HAS_ROWS: R query rows of T)
    head = kvh * G + rows % G
    row_ok = r < R
    # Padding rows (only in the last block) reuse row R-1, which that block already holds, so
    # they load valid memory and do not widen the key range; they are never stored.
    r = tl.minimum(r, R - 1)
    if HAS_ROWS:
        tok = tl.load(ROWS + r).to(tl.int32)
    else:
        tok = r
    d = tl.arange(0, D)

    q = tl.load(Q + tok.to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + d[None, :])
    bs, be, os_, b_lo, b_hi, o_lo, o_hi = _ranges(BS, BE, OS, tok, T)  # latency hides behind the prefix
    ps, pe, p_lo, p_hi = _prefix_ranges(PS, PE, tok, P, RANGES)
    acc, l_i = _attend(q, tok, bs, be, os_, b_lo, b_hi, o_lo, o_hi, PK + kvh * spk_h, PV + kvh * spv_h,
                       spk_t, spv_t, K + kvh * sk_h, V + kvh * sv_h, sk_t, sv_t, P, qk_scale,
                       q, q, q, q, T, ps, pe, p_lo, p_hi, BLOCK_M, D, BLOCK_N, BLOCK_NI, DOT_PREC,
                       UPCAST, False, False, RANGES, CANON)

    # A valid plan always lets a token see itself (l_i > 0); the guard only keeps padding finite.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = O + r.to(tl.int64)[:, None] * so_t + head[:, None] * so_h + d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])


# Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
_INTERPRETED = type(_prefix_attn_kernel).__name__ == "InterpretedFunction"


def attn_config(T: int, G: int, Hkv: int, D: int, dtype, device) -> dict:
    """Launch config from shapes only (no autotuning: it would time kernels during graph capture).

    Biggest row block that still gives ~2 programs per SM, so large batches reuse each K/V tile
    across many rows, while tiny batches (T=8: 56 rows) get 16-row blocks and a few programs that
    each finish quickly; the whole small-batch case is one short launch either way.
    q, acc and the score tile live in registers: BLOCK_M * D is capped so nothing spills on sm_90
    (fp32 IEEE dots run on FMA units and hold much more, so fp32 -- tests only -- uses 16 rows).
    """
    budget = 8192 if dtype != torch.float32 else 1024
    rows = T * G
    target = 2 * _num_sms(device)
    block_m = 16
    for bm in (128, 64, 32):
        if bm * D <= budget and triton.cdiv(rows, bm) * Hkv >= target:
            block_m = bm
            break
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=64 if D <= 128 else 32,  # prefix key tile
        BLOCK_NI=32,  # in-batch key tile
        num_warps=8 if block_m * D >= budget else 4,
        num_stages=2,
    )


def invariant_attn_config(D: int) -> dict:
    """Batch-invariant mode (KernelOptions.batch_invariant): one config whatever T (the prefix's dots
    then run the same instructions for every row) and the canonical in-batch order (CANON); the
    gathered [16, NI, D] key and value tiles kept to 8K elements."""
    return dict(BLOCK_M=INVARIANT_ATTN_ROWS, BLOCK_N=64 if D <= 128 else 32,
                BLOCK_NI=max(2, 8192 // (INVARIANT_ATTN_ROWS * D)), CANON=True, num_warps=4, num_stages=2)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_triton(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale, out=None,
                     config=None, prefix_range=None, options: KernelOptions = DEFAULTS, rows=None):
    """q [T, Hq, D]; k, v [T, Hkv, D]; prefix_k, prefix_v [P, Hkv, D]; int [T] ranges -> [T, Hq, D].
    rows (int [R]): only those query rows -> [R, Hq, D], each row gathering its own keys (the
    CANON order of batch-invariant mode: scattered rows share no key range worth a dot tile).

    Any stride on dims 0 and 1 is fine (e.g. views into a fused QKV buffer). `config` overrides
    entries of attn_config() (tests and benchmarks).
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    P = prefix_k.shape[0]
    R = T if rows is None else rows.shape[0]
    assert Hq % Hkv == 0, "query heads must be a multiple of kv heads"
    assert D >= 16 and D & (D - 1) == 0, "head dim must be a power of two >= 16"
    assert k.shape == v.shape == (T, Hkv, D) and prefix_v.shape == prefix_k.shape
    if out is None:
        out = torch.empty((R, Hq, D), dtype=q.dtype, device=q.device)
    assert out.shape == (R, Hq, D) and out.stride(-1) == 1
    if R == 0:
        return out
    q, k, v, prefix_k, prefix_v = map(_last_dim_contiguous, (q, k, v, prefix_k, prefix_v))
    base_start, base_end, own_start = (x.contiguous() for x in (base_start, base_end, own_start))
    if P == 0:  # never read; avoids handing the launcher an empty (null) pointer
        prefix_k, prefix_v = k, v
    ps, pe = (x.contiguous() for x in prefix_range) if prefix_range is not None else (base_start,) * 2
    G = Hq // Hkv
    cfg = (invariant_attn_config(D) if options.batch_invariant or rows is not None else
           tuned(attn_config(T, G, Hkv, D, q.dtype, q.device), "attn", options))
    cfg.update(config or {})
    canon = cfg.pop("CANON", False)
    has_rows = rows is not None
    rows = rows.contiguous() if has_rows else base_start  # (not read without HAS_ROWS)
    grid = (triton.cdiv(R * G, cfg["BLOCK_M"]), Hkv)
    _prefix_attn_kernel[grid](
        q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, ps, pe, out, rows,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        prefix_k.stride(0), prefix_k.stride(1), prefix_v.stride(0), prefix_v.stride(1),
        out.stride(0), out.stride(1),
        T, R, P, scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        G=G, D=D, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=_INTERPRETED,
        RANGES=prefix_range is not None, CANON=canon, HAS_ROWS=has_rows,
        **cfg, **launch_kwargs(q.device, options),
    )
    return out
