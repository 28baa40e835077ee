"""Shared-prefix attention fused with the O projection and the residual add, for few tokens.

At T <= 64 a layer's attention is a few microseconds of latency-bound work and its O GEMM a few
more; this kernel does both in one launch. Program (column tile, head group): for each of its HPP
query heads, attention over the pinned prefix and the in-batch ranges (attention_triton's math for
one head, rows = tokens), rounded to the dtype as the separate kernel stores it, then multiplied by
that head's D columns of Wo for the program's output columns. Heads are the K-splits of the O
GEMM: partials go to an fp32 workspace, and the last program of a column tile to arrive sums them
in head order (deterministic) and runs the RESID epilogue of gemm_triton (residual add, each row's
sum of squares for the next RMSNorm). Every column tile recomputes its heads' attention; at these
sizes that costs less than a launch. The program holds the whole batch (T <= BLOCK_T), so with
IN_TILE its in-batch keys are one masked tile loaded together with q, not range loops whose loads
wait on the ranges (H200, W1 through bench.gpu --ab: attention + O 6.91 -> 6.56 us, the replay's
span 580 -> 569 us).

Same math as attention_ref, then linear_residual; CUDA-graph safe like the kernels it fuses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_triton import _attend, _prefix_ranges, _prefix_tile, _ranges, invariant_attn_config
from .fp8 import is_fp8
from .gemm_config import SSQ_COLS, ssq_rows, tuned
from .options import DEFAULTS, KernelOptions
from .pdl import early, launch_kwargs, trigger, wait
from .triton_util import _counters, _dot, _num_sms, _store_ssq_chunks


@triton.jit
def _attn_o_kernel(
    Q, K, V, PK, PV, BS, BE, OS, PS, PE, WO, R, OUT, SSQ, WS, CNT, WSC,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, spk_t, spk_h, spv_t, spv_h,
    T, P, qk_scale,
    N: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, HPP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_NI: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, EARLY: tl.constexpr, IN_TILE: tl.constexpr,
    TRIG: tl.constexpr, GDC: tl.constexpr, RANGES: tl.constexpr, FP8: tl.constexpr,
    CANON: tl.constexpr, SSQ_C: tl.constexpr,
):
    pid_n = tl.program_id(0)
    grp = tl.program_id(1)
    SPLIT: tl.constexpr = HQ // HPP
    d = tl.arange(0, D)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    wo_rows = WO + tl.minimum(cols, N - 1)[:, None] * (HQ * D) + d[None, :]
    # EARLY: Wo's tile and the pinned prefix's first K/V tile of a one-head program do not depend
    # on the kernel ahead, so they load before the PDL wait (their latency overlaps its tail).
    PRE: tl.constexpr = EARLY and HPP == 1
    if PRE:
        wo0 = tl.load(wo_rows + grp * D)
    kt0, v0 = _prefix_tile(PK + (grp // G) * spk_h, PV + (grp // G) * spv_h, spk_t, spv_t, P * PRE, 0,
                           D, BLOCK_P)
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    if TRIG == 2:  # the next kernel may launch now (pdl.trigger)
        tl.extra.cuda.gdc_launch_dependents()
    dt = Q.dtype.element_ty
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    tok = tl.minimum(t, T - 1)  # padding rows repeat token T-1 (valid loads, never stored)

    bs, be, os_, b_lo, b_hi, o_lo, o_hi = _ranges(BS, BE, OS, tok, T)
    ps, pe, p_lo, p_hi = _prefix_ranges(PS, PE, tok, P, RANGES)
    tc = t[:, None]
    m_out = t_ok[:, None] & c_ok[None, :]
    r = tl.load(R + tc * N + cols[None, :], mask=m_out, other=0.0)  # the residual, for the epilogue
    if FP8:  # e4m3 Wo: per-output-row scales, applied once to the sum over heads (kernels/fp8.py)
        sc = tl.load(WSC + cols, mask=c_ok, other=0.0)[None, :]

    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for hh in tl.static_range(HPP):
        head = grp * HPP + hh
        kvh = head // G
        if PRE:
            wo = wo0
        else:
            wo = tl.load(wo_rows + head * D)  # [BLOCK_N, D]: issued first, its latency hides below
        if FP8:
            wo = wo.to(dt)
        tok64 = tok.to(tl.int64)
        q = tl.load(Q + tok64[:, None] * sq_t + head * sq_h + d[None, :])
        if IN_TILE:  # every in-batch key (the program holds the whole batch), with q
            kin_t = tl.load(K + kvh * sk_h + tok64[None, :] * sk_t + d[:, None])
            vin = tl.load(V + kvh * sv_h + tok64[:, None] * sv_t + d[None, :])
        else:
            kin_t, vin = q, q
        o, l_i = _attend(q, tok, bs, be, os_, b_lo, b_hi, o_lo, o_hi, PK + kvh * spk_h,
                         PV + kvh * spv_h, spk_t, spv_t, K + kvh * sk_h, V + kvh * sv_h, sk_t, sv_t,
                         P, qk_scale, kt0, v0, kin_t, vin, T, ps, pe, p_lo, p_hi, BLOCK_T, D,
                         BLOCK_P, BLOCK_NI, DOT_PREC, UPCAST, PRE, IN_TILE, RANGES, CANON)
        o = (o / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(dt)  # the attention output, as stored
        acc = _dot(o, tl.trans(wo), acc, DOT_PREC, UPCAST)
    if TRIG == 1:  # Wo is read: let the next kernel's programs start their preloads
        tl.extra.cuda.gdc_launch_dependents()

    if SPLIT > 1:  # as gemm_triton's split-K: partials, an arrival count, the last one sums
        tl.store(WS + grp * (BLOCK_T * N) + tc * N + cols[None, :], acc, mask=m_out)
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel")
        last = arrived == SPLIT - 1
        if last:
            acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for s in range(SPLIT):
                acc += tl.load(WS + s * (BLOCK_T * N) + tc * N + cols[None, :], mask=m_out, other=0.0,
                               cache_modifier=".cg")
            tl.store(CNT + pid_n, 0)
    else:
        last = True
    if last:  # HF: residual + o_proj(attn), both in the dtype, the sum rounded once
        if FP8:
            acc *= sc
        y = (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt)
        yf = tl.where(m_out, y.to(tl.float32), 0.0)
        if SSQ_C:  # (batch-invariant mode) as gemm_triton's RESID: fixed chunks in column order
            _store_ssq_chunks(SSQ, yf, pid_n, T, tc, t_ok, N, BLOCK_N, SSQ_C)
        else:
            tl.store(SSQ + pid_n * T + t, tl.sum(yf * yf, 1), mask=t_ok)
        tl.store(OUT + tc * N + cols[None, :], y, mask=m_out)


_INTERPRETED = type(_attn_o_kernel).__name__ == "InterpretedFunction"


def attn_o_config(T: int, Hq: int, N: int, D: int, dtype, device, w_elem=None,
                  options: KernelOptions = DEFAULTS) -> dict:
    """Column tiles x heads. H200 sweep (bench.kernels --only attn_o --sweep, Qwen2.5-0.5B, T = 8
    and 16): 64 columns and one head per program (196 programs) 6.2 / 7.7 us, 32 columns 6.6 / 8.0,
    two heads per program 7.4 / 9.5. Past ~3 programs per SM, wider tiles."""
    block_n = 64
    while block_n < 128 and triton.cdiv(N, block_n) * Hq > 3 * _num_sms(device):
        block_n *= 2
    pre = early(N * Hq * D * (w_elem or (4 if dtype == torch.float32 else 2)), options)
    if options.batch_invariant:  # attention as the unfused kernel does it (invariant_attn_config):
        # its row tile, key tiles, canonical in-batch order and warps, so the same layouts
        inv = invariant_attn_config(D)
        return dict(BLOCK_T=inv["BLOCK_M"], BLOCK_N=block_n, HPP=1, BLOCK_P=inv["BLOCK_N"],
                    BLOCK_NI=inv["BLOCK_NI"], num_warps=inv["num_warps"], num_stages=2, EARLY=pre,
                    IN_TILE=False, CANON=True)
    # 8 warps where Wo loads early (H200, W1 in place: attention + O 7.65 -> 6.78 us, span 524.2 ->
    # 520.4 us, bench.gpu --ab; 2 warps: +50 us)
    return dict(BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_N=block_n, HPP=1,
                BLOCK_P=64 if D <= 64 else 32, BLOCK_NI=16, num_warps=8 if pre else 4, num_stages=2,
                EARLY=pre, IN_TILE=bool(options.in_tile), CANON=False)


def attention_o_residual_small(q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, scale,
                               wo, residual, config=None, prefix_range=None,
                               options: KernelOptions = DEFAULTS):
    """residual + attention(q, k, v | prefix, ranges) @ wo^T -> (out [T, N], ssq [tiles, T] fp32),
    as attention_ref + linear_residual. q [T, Hq, D]; k, v [T, Hkv, D]; wo [N, Hq * D]."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    N = wo.shape[0]
    P = prefix_k.shape[0]
    assert Hq % Hkv == 0 and wo.shape[1] == Hq * D and residual.shape == (T, N)
    assert D >= 16 and D & (D - 1) == 0
    wo, wsc = (wo.q, wo.scale) if is_fp8(wo) else (wo, None)
    cfg = attn_o_config(T, Hq, N, D, q.dtype, q.device, wo.element_size(), options)
    cfg.update(config or {})
    tuned(cfg, "attn_o", options)
    assert cfg["BLOCK_T"] >= T and Hq % cfg["HPP"] == 0
    q, k, v, prefix_k, prefix_v = (x if x.stride(-1) == 1 else x.contiguous()
                                   for x in (q, k, v, prefix_k, prefix_v))
    if P == 0:  # never read; avoids handing the launcher an empty (null) pointer
        prefix_k, prefix_v = k, v
    wo, residual = wo.contiguous(), residual.contiguous()
    base_start, base_end, own_start = (x.contiguous() for x in (base_start, base_end, own_start))
    ps, pe = (x.contiguous() for x in prefix_range) if prefix_range is not None else (base_start,) * 2
    tiles, split = triton.cdiv(N, cfg["BLOCK_N"]), Hq // cfg["HPP"]
    out = torch.empty((T, N), dtype=q.dtype, device=q.device)
    ssq = torch.empty((ssq_rows(N, cfg, options), T), dtype=torch.float32, device=q.device)
    if split > 1:
        ws = torch.empty((split, cfg["BLOCK_T"], N), dtype=torch.float32, device=q.device)
        cnt = _counters(q.device)
        assert tiles <= cnt.numel()
    else:
        ws = cnt = out  # never touched
    _attn_o_kernel[(tiles, split)](
        q, k, v, prefix_k, prefix_v, base_start, base_end, own_start, ps, pe, wo, residual, out, ssq,
        ws, cnt, wsc if wsc is not None else out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        prefix_k.stride(0), prefix_k.stride(1), prefix_v.stride(0), prefix_v.stride(1),
        T, P, scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        N=N, HQ=Hq, G=Hq // Hkv, D=D, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED, TRIG=trigger(q.device, wo, "attn_o", options),
        RANGES=prefix_range is not None, FP8=wsc is not None,
        SSQ_C=SSQ_COLS if options.batch_invariant else 0,
        **cfg, **launch_kwargs(q.device, options),
    )
    return out, ssq
