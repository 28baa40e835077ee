"""The CPU path of the shared-prefix attention (same function as attention.attention_ref), through
torch's fused SDPA over blocks of query rows.

A block is a run of consecutive rows, and its keys are the pinned prefix, a base window and an own
window: the union of its rows' base ranges, then from the first own start to its last row (minus
the base window), masked per row. The runs start as groups of rows with the same ranges (a plain
request, a query part, one item, one label branch), and a group joins the block before it when it
reads it and the block stays small (_merge): a classify request and its label branches are one
block, while a multi-item request of 100 items of 150 tokens behind a 50-token query part stays
101 blocks of ~150 x 200 scores per head, where one dense block over its 15,050 tokens (the old
CPU path) was 15,050 x 15,050.

Blocks are padded to the largest of their chunk: blocks are sorted by size and chunked, so a few
long ones do not pad many short ones (a chunk's padded scores are at most twice its blocks'), and
a chunk's scores are bounded (chunk_scores).
The layout is built once per forward (model.Attention: ctx.layout) and read by every layer.
`rows`: the last layer's read-out rows only (Transformer.forward), each row a block of its own.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

CHUNK_SCORES = 1 << 22  # query rows x keys of one SDPA call (x heads: its score block)
MERGE_ROWS = 64  # rows up to which a block takes the groups that read it (_merge)


def group_layout(base_start, base_end, own_start, P: int, prefix_range=None, rows=None,
                 chunk_scores: int = CHUNK_SCORES, merge_rows: int = MERGE_ROWS) -> list[tuple]:
    """-> chunks of (dst [c, Lq] output rows, valid [c, Lq], q_idx [c, Lq], k_idx [c, Lk],
    mask [c, 1, Lq, P + Lk]) over the batch's rows (or the given `rows`, output in their order)."""
    bs, be, os_ = (np.asarray(x, dtype=np.int64) for x in (base_start, base_end, own_start))
    T = bs.shape[0]
    empty = bs >= be  # an empty base (bs == be, anywhere) adds no key
    bs, be = np.where(empty, 0, bs), np.where(empty, 0, be)
    ps, pe = ((np.asarray(x, dtype=np.int64) for x in prefix_range) if prefix_range is not None
              else (np.zeros(T, np.int64), np.full(T, P, np.int64)))
    if rows is None:
        keys = np.stack([bs, be, os_, ps, pe])
        start = np.flatnonzero(np.r_[True, (keys[:, 1:] != keys[:, :-1]).any(0)])
        r0, r1 = _merge(start, np.r_[start[1:], T], bs, be, os_, merge_rows)
        d0 = r0  # output row of a block's first query
        kb0, kb1, ko0 = _windows(r0, r1, bs, be, os_)
    else:
        r0 = np.asarray(rows, dtype=np.int64)
        r1, d0 = r0 + 1, np.arange(r0.shape[0])
        kb0, kb1, ko0 = bs[r0], be[r0], os_[r0]
    nq, nb, no = r1 - r0, kb1 - kb0, r1 - ko0
    order = np.lexsort((nb + no, nq))
    chunks, i, G = [], 0, order.shape[0]
    while i < G:  # chunks of similar blocks, padded to their largest: scores bounded, and at
        # most twice the blocks' own
        j, Lq, Lk, own = i, 0, 0, 0
        while j < G:
            b = order[j]
            q2, k2, own2 = max(Lq, nq[b]), max(Lk, nb[b] + no[b]), own + nq[b] * (P + nb[b] + no[b])
            padded = (j - i + 1) * q2 * (P + k2)
            if j > i and (padded > chunk_scores or padded > 2 * own2):
                break
            Lq, Lk, own, j = q2, k2, own2, j + 1
        sel = order[i:j]
        chunks.append(_chunk(r0[sel], r1[sel], d0[sel], kb0[sel], kb1[sel], ko0[sel], bs, be, os_,
                             ps, pe, P, T))
        i = j
    return chunks


def _windows(r0, r1, bs, be, os_):
    """Per block [r0, r1): its base window (the union of its rows' non-empty base ranges; [0, 0)
    for none) and its own window's start (the least own start)."""
    has = be > bs
    lo = np.minimum.reduceat(np.where(has, bs, np.iinfo(np.int64).max), r0)
    hi = np.maximum.reduceat(np.where(has, be, 0), r0)
    none = hi == 0
    return np.where(none, 0, lo), hi, np.minimum.reduceat(os_, r0)


def _merge(g0, g1, bs, be, os_, max_rows: int):
    """Consecutive groups [g0, g1) into blocks: a group joins the block before it when it reads
    that block's rows (its base range or its own start reaches back into them: a label branch, an
    item behind its query part) and the block stays within max_rows rows. So a classify request
    and its label branches are one block; a group that reads nothing before it (a new request)
    starts one, and so does a long item (one dense block over a packed request is what this path
    avoids)."""
    r0, r1 = [], []
    b0 = None
    for a, z, x0, x1, o in zip(g0.tolist(), g1.tolist(), bs[g0].tolist(), be[g0].tolist(),
                               os_[g0].tolist()):
        if b0 is not None and z - b0 <= max_rows and (o < a or (x1 > x0 and x0 < a and x1 > b0)):
            b1 = z
            continue
        if b0 is not None:
            r0.append(b0)
            r1.append(b1)
        b0, b1 = a, z
    if b0 is not None:
        r0.append(b0)
        r1.append(b1)
    return np.asarray(r0, dtype=np.int64), np.asarray(r1, dtype=np.int64)


def _chunk(r0, r1, d0, kb0, kb1, ko0, bs, be, os_, ps, pe, P, T):
    nq, nb, no = r1 - r0, kb1 - kb0, r1 - ko0
    Lq, Lb, Lo = int(nq.max()), int(nb.max()), int(no.max())
    aq, ab, ao = np.arange(Lq), np.arange(Lb), np.arange(Lo)
    valid = aq[None, :] < nq[:, None]
    t = np.minimum(r0[:, None] + aq, T - 1)  # [c, Lq] query rows (padding: repeats, dropped)
    dst = d0[:, None] + aq
    tb, te, to = bs[t][:, :, None], be[t][:, :, None], os_[t][:, :, None]  # [c, Lq, 1] per row
    tt_ = t[:, :, None]
    jb = (kb0[:, None] + ab)[:, None, :]  # [c, 1, Lb] base window keys
    jo = (ko0[:, None] + ao)[:, None, :]  # [c, 1, Lo] own window keys, minus the base window's
    mine_b = ((jb >= to) & (jb <= tt_)) | ((jb >= tb) & (jb < te))
    base_ok = (ab < nb[:, None])[:, None, :] & mine_b
    in_bw = (jo >= kb0[:, None, None]) & (jo < kb1[:, None, None])
    own_ok = (ao < no[:, None])[:, None, :] & ~in_bw & (jo >= to) & (jo <= tt_)
    p = np.arange(P)
    pre = (p >= ps[t][:, :, None]) & (p < pe[t][:, :, None])  # [c, Lq, P]
    k_idx = np.clip(np.concatenate([jb[:, 0], jo[:, 0]], 1), 0, T - 1)
    mask = np.concatenate([pre, base_ok, own_ok], axis=2)[:, None]
    tt = torch.from_numpy
    return tt(dst), tt(valid), tt(t), tt(k_idx), tt(np.ascontiguousarray(mask))


def attention_groups(q, k, v, prefix_k, prefix_v, layout, scale, n_out: int):
    """attention_ref's function over group_layout's chunks -> [n_out, Hq, D] (n_out: T, or the
    number of read-out rows)."""
    out = torch.empty(n_out, q.shape[1], q.shape[2], dtype=q.dtype)
    for dst, valid, q_idx, k_idx, mask in layout:
        c = q_idx.shape[0]
        kk = torch.cat([prefix_k.expand(c, *prefix_k.shape), k[k_idx]], dim=1).transpose(1, 2)
        vv = torch.cat([prefix_v.expand(c, *prefix_v.shape), v[k_idx]], dim=1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[q_idx].transpose(1, 2), kk, vv, attn_mask=mask,
                                           scale=scale, enable_gqa=True).transpose(1, 2)
        out[dst[valid]] = o[valid]
    return out
