"""Shared-prefix attention over a flat token batch.

Every flat token t attends to
  * all P keys of the pinned prefix (shared by the whole batch, computed once), and
  * the in-batch keys j with  base_start[t] <= j < base_end[t]  or  own_start[t] <= j <= t.

Plain classification: base range empty, own range = the request's suffix. Label-trie branches and
multi-item scoring: base = the shared part (suffix / query), own range = the branch / item.

Shapes: q [T, Hq, D]; k, v [T, Hkv, D]; prefix_k, prefix_v [P, Hkv, D] (P may be 0);
base_start, base_end, own_start int32 [T]. Hq is a multiple of Hkv (GQA). Returns [T, Hq, D].

prefix_range (optional): (prefix_start, prefix_end) int32 [T]: token t sees only the pinned keys
prefix_start[t] <= p < prefix_end[t] instead of all P. Several classifiers then run in one flat
batch over one bank of their prefixes, concatenated (Classifier.many's fused pass); None: all P.

The dispatchers (attention, attention_o) take the engine's KernelOptions (kernels/options.py).
"""
from __future__ import annotations

import torch

from .attention_cpu import attention_groups, group_layout
from .fp8 import is_fp8
from .gemm import SMALL_T_MAX, linear_residual
from .options import INVARIANT_ATTN_ROWS, KernelOptions, use_triton


def attention_ref(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale,
                  seg_offsets=None, prefix_range=None):
    """Plain torch: scores over (prefix keys) ++ (visible in-batch keys), softmax in fp32.

    seg_offsets (optional, [S+1], on the CPU) splits the flat batch into spans that no visibility
    range crosses (one span per request); it only bounds the work to O(sum of span^2) instead of T^2.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qf = q.float().view(T, Hkv, G, D)
    if seg_offsets is None:  # one span: device-only ops, so a CUDA graph can capture it
        S, L = 1, T
        idx = torch.arange(T, device=q.device)[None, :]
        valid = torch.ones(1, T, dtype=torch.bool, device=q.device)
    else:
        offs = seg_offsets.tolist()
        starts, lens = offs[:-1], [b - a for a, b in zip(offs[:-1], offs[1:])]
        S, L = len(lens), max(lens)
        # Pad spans to [S, L]: index of each padded slot into the flat arrays (clamped), validity.
        ar = torch.arange(L, device=q.device)
        idx = torch.tensor(starts, device=q.device)[:, None] + ar[None, :]  # [S, L]
        valid = ar[None, :] < torch.tensor(lens, device=q.device)[:, None]
        idx = idx.clamp(max=T - 1)
    # In-batch visibility, per query slot i and key slot j of the same span.
    j = idx[:, None, :]  # key flat index [S, 1, L]
    bs, be, os_ = (x.long()[idx][:, :, None] for x in (base_start, base_end, own_start))
    t = idx[:, :, None]
    vis = ((j >= bs) & (j < be)) | ((j >= os_) & (j <= t))
    vis &= valid[:, None, :]  # [S, Lq, Lk]

    qs = qf[idx]  # [S, L, Hkv, G, D]
    ks, vs = k.float()[idx], v.float()[idx]  # [S, L, Hkv, D]
    s_in = torch.einsum("sihgd,sjhd->shgij", qs, ks) * scale
    s_in = s_in.masked_fill(~vis[:, None, None], float("-inf"))
    if prefix_k.shape[0] > 0:
        s_pre = torch.einsum("sihgd,phd->shgip", qs, prefix_k.float()) * scale
        if prefix_range is not None:
            s_pre = s_pre.masked_fill(~prefix_visible(prefix_range, idx, prefix_k.shape[0])[:, None, None],
                                      float("-inf"))
        s = torch.cat([s_pre, s_in], dim=-1)
    else:
        s = s_in
    p = torch.softmax(s, dim=-1)
    P = prefix_k.shape[0]
    out = torch.einsum("shgij,sjhd->sihgd", p[..., P:], vs)
    if P > 0:
        out = out + torch.einsum("shgip,phd->sihgd", p[..., :P], prefix_v.float())
    out = out.reshape(S, L, Hq, D)
    out = out[0] if S == 1 else out[valid]  # back to flat order: spans are contiguous, in order
    return out.to(q.dtype)


def prefix_visible(prefix_range, idx, P):
    """[S, L, P] bool: which pinned keys each (span, slot) token sees (prefix_range: see above)."""
    ps, pe = (x.long()[idx][:, :, None] for x in prefix_range)
    p = torch.arange(P, device=ps.device)
    return (p >= ps) & (p < pe)


def attention_o(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale, wo, residual,
                seg_offsets=None, layout=None, bias=None, prefix_range=None, *, options: KernelOptions,
                inplace: bool = False):
    """residual + attention(...) @ wo^T (+ bias) -> (out, ssq) as gemm.linear_residual returns them
    (inplace: as linear_residual's, the sum may be written over residual):
    one Triton kernel for few tokens on CUDA (kernels/attention_o_triton.py), else attention, then
    linear_residual. The fused kernel has no bias input: an O bias (Llama, Qwen3 with
    attention_bias) takes the two-kernel path."""
    T, Hq, D = q.shape
    fusable = _fusable(q, wo, bias, residual, options)
    # Batch-invariant mode: fused up to INVARIANT_ATTN_ROWS rows (attention in the canonical order, the
    # unfused kernel's row tile and warps), past them attention, then O split by heads as the fused kernel
    # splits it (head_split), so a row's bits are the same either way.
    if fusable and 0 < T <= (INVARIANT_ATTN_ROWS if options.batch_invariant else SMALL_T_MAX):
        from .attention_o_triton import attention_o_residual_small

        return attention_o_residual_small(q, k, v, prefix_k, prefix_v, base_start, base_end,
                                          own_start, scale, wo, residual, prefix_range=prefix_range,
                                          options=options)
    o = attention(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale, seg_offsets,
                  layout, prefix_range, options=options)
    config = head_split(Hq, D) if fusable and options.batch_invariant else None
    return linear_residual(o.reshape(T, -1), wo, bias, residual, options=options, inplace=inplace,
                           config=config)


def _fusable(q, wo, bias, residual, options: KernelOptions) -> bool:
    """Whether attention_o may take the fused kernel (attention_o_triton.py), but for T. Only for
    small O weights: on the H200 the fused kernel took 6-8 us against 7-8 for the two kernels with
    Qwen2.5-0.5B's 1.6 MB Wo, but 25-31 against 12-13 us with 7B's 26 MB (bench.kernels): there
    the O GEMM is a weight stream that the per-program attention only delays. No bias input."""
    return (use_triton(q, options) and options.fuse_attn_o and bias is None
            and q.dtype == residual.dtype and (wo.dtype == q.dtype or is_fp8(wo) and q.dtype != torch.float32)
            and wo.numel() * wo.element_size() <= 8 << 20)


def head_split(Hq: int, D: int) -> dict:
    """The O GEMM's K split by heads, one D-wide step each: the fused kernel's partial sums."""
    return {"BLOCK_K": D, "SPLIT": Hq}


def attention(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale, seg_offsets=None,
              layout=None, prefix_range=None, *, options: KernelOptions, rows=None):
    """Dispatch: the Triton kernel on CUDA, SDPA over groups of rows on CPU (attention_cpu.py, with
    the forward's layout), else the reference.
    rows (int [R], on q's device): only those query rows, -> [R, Hq, D] = attention(...)[rows]
    (the last layer of a pass, whose other rows nobody reads: model.Transformer.forward)."""
    if use_triton(q, options):
        from .attention_triton import attention_triton

        return attention_triton(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale,
                                prefix_range=prefix_range, options=options, rows=rows)
    if rows is not None:
        layout = group_layout(base_start, base_end, own_start, prefix_k.shape[0], prefix_range, rows)
        return attention_groups(q, k, v, prefix_k, prefix_v, layout, scale, rows.shape[0])
    if layout is not None:  # (built with the same prefix_range: attention_cpu.group_layout)
        return attention_groups(q, k, v, prefix_k, prefix_v, layout, scale, q.shape[0])
    return attention_ref(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale,
                         seg_offsets, prefix_range)
