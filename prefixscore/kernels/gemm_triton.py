"""Skinny GEMMs for few tokens (T <= 64) with fused epilogues (same math as kernels/gemm.py).

At T = 8..64 a linear layer is a weight stream: out[T, N] = x[T, K] @ w[N, K]^T reads N*K weights
once and does almost no math per byte, so what matters is how many bytes are in flight across all
SMs and how few fixed costs (launches, epilogue kernels, split-K reduce kernels) there are.

One kernel, three epilogues (EPI):
  0  plain:  out = x @ w^T (+ bias); with RESID, out = residual + x @ w^T (+ bias) and per-row sums
             of squares of out over this program's columns (ssq [column tiles, T]) for the next
             RMSNorm, which then runs inside the next GEMM (NORM)
  1  gated:  w = [Wg; Wu] ([2I, K]); out[T, I] = silu(x @ Wg^T) * (x @ Wu^T)   (replaces silu_mul)
  2  rope:   w = Wqkv; one program = one head of D columns, held as two accumulators (the first
             and second halves of the head) so RoPE's rotate-half pairs meet in registers;
             optional Qwen3 per-head RMSNorm; writes q, k (rotated) and v  (replaces rope_qk)

Layout of the work: programs over (column tile, K split). A column tile is BLOCK_N output columns
(two tiles of BLOCK_N for EPI 1/2). K is split SPLIT ways so that small-N layers still spread their
weight read over every SM; each split runs ITERS steps of BLOCK_K (static trip count, so Triton's
pipeliner keeps num_stages tiles in flight). Split-K partials go to an fp32 workspace; the last
program of a column tile to finish (an atomic counter per tile, reset by that program) sums the
partials in split order -- deterministic -- and runs the epilogue. No second kernel.

NORM: x is the residual stream and w has the RMSNorm weight folded into its columns (model.py), so
rms_norm(x) @ w^T = rstd[t] * (x @ w^T): the loop is the plain GEMM's and the epilogue scales each
row by rstd, summed from the ssq the producer left (no norm kernel, no extra pass over x).
(Normalising x inside the loop instead puts elementwise work between x's load and tl.dot, which
Triton then stops pipelining: +11 us per 7B GEMM on the H200. With e4m3 weights it does scale x
inside the loop, to multiply in fp16 (F16 below); the sm_90 build still streams x and the weights
through cp.async there.)

PRE (0.5B-class weights, pdl.early): the first PRE K-steps' weight tiles are loaded into registers
before the PDL wait, as one tile multiplied in one dot, and the loop runs the rest; TRIG lets the
next kernel launch right after the wait (2) or once the loop is done (1), so its own early loads
overlap this kernel's work (kernels/pdl.py has the measurements).

Batch-invariant mode (KernelOptions.batch_invariant): the invariant_rows config's K splits for every
T; past invariant_rows rows one program of a wide tile runs all of them in turn (SERIAL) and adds
them in split order, the sum the split programs' last one makes, without a workspace; RESID's sums
of squares go in SSQ_COLS-column chunks, each summed in column order (SSQ_C).

The inner product is tl.dot with T padded to BLOCK_T >= 16 (mma; tensor-core throughput is not
the limit here) or, with DOT=False, an FMA broadcast-reduce for tiny T (BLOCK_T >= 1).

CUDA-graph safe: grid and launch parameters come from shapes (and the engine's KernelOptions)
only; no host syncs. The per-tile counters live in a small cached int32 buffer per (device,
stream) that every kernel leaves zeroed (triton_util._counters).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .fp8 import is_fp8
from .gemm_config import (SSQ_COLS, _finish_config, config_rows, gemm_config, ssq_rows, tuned,
                          wide_config)
from .options import DEFAULTS, KernelOptions
from .pdl import launch_kwargs, trigger, wait
from .triton_util import _counters, _store_ssq_chunks


@triton.jit
def _skinny_kernel(
    X, W, B, OUT, WS, CNT,
    COS, SIN, QN, KN, QO, KO, VO,
    SSQ_IN, R, SSQ_OUT, WSC,
    T, TP, stride_xt, stride_ot, eps, norm_eps, xs, zero,
    N: tl.constexpr, K: tl.constexpr,
    EPI: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, NT: tl.constexpr, RESID: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, ITERS: tl.constexpr,
    DOT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
    PRE: tl.constexpr, TRIG: tl.constexpr, GDC: tl.constexpr, FP8: tl.constexpr,
    TGRID: tl.constexpr, F16: tl.constexpr, SERIAL: tl.constexpr, SSQ_C: tl.constexpr,
):
    if TGRID:  # T past one row tile (batch-invariant mode's wide tiles): a third grid axis
        pid_t = tl.program_id(2)
    else:
        pid_t = 0
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_tiles = tl.num_programs(0)  # column tiles
    TWO: tl.constexpr = EPI != 0
    # F16 (FP8 only; KernelOptions.fp8_fp16): e4m3 weights multiplied in fp16, not bf16, x scaled by
    # rstd (NORM) or by xs (Fp8Weight.x_scale) before the dot. e4m3 -> fp16 is one conversion per
    # two values (cvt.rn.f16x2.e4m3x2) where bf16 takes a second, scalar one per value (sm_90 build:
    # cvt.bf16.f16), and the CUDA guide rates conversions at 16 a clock per SM: three per two
    # weights would cap the weight stream near 2.8 TB/s on the H200, one per two lifts the cap past
    # HBM (an estimate: KernelOptions.fp8_fp16 is off until bench.fp8_gpu times it). Normed rows fit
    # fp16 (|x * rstd| <= sqrt(K)), so rstd scales x before the dot instead of the sum after it;
    # down's rows fit once scaled by xs, a power of two from a bound on gate/up's weights
    # (fp8.fp16_input_scale), undone exactly in the epilogue; O's input has no bound: bf16.
    tl.static_assert(not F16 or FP8)
    if TGRID:
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        cnt = CNT + pid_t * n_tiles + pid_n
    else:
        t = tl.arange(0, BLOCK_T)
        cnt = CNT + pid_n
    j = tl.arange(0, BLOCK_N)
    t_ok = t < T
    # Columns (rows of W) of the one or two accumulators.
    if EPI == 0:
        cols_a = pid_n * BLOCK_N + j
        c_ok = cols_a < N
        cols_b = cols_a
    elif EPI == 1:
        I: tl.constexpr = N // 2
        cols_a = pid_n * BLOCK_N + j  # gate
        c_ok = cols_a < I
        cols_b = cols_a + I  # up
    else:
        cols_a = pid_n * D + j  # first half of head pid_n (BLOCK_N == D // 2)
        c_ok = j < BLOCK_N
        cols_b = cols_a + BLOCK_N
    # Rows of W past N are clamped (they are never stored) so weight loads need only a K mask.
    wa_ptr = W + tl.minimum(cols_a, N - 1)[:, None] * K
    wb_ptr = W + tl.minimum(cols_b, N - 1)[:, None] * K
    x_ptr = X + t[:, None] * stride_xt

    k0 = pid_k * (ITERS * BLOCK_K)
    tc = t[:, None]
    jc = j[None, :]
    m_out = t_ok[:, None] & c_ok[None, :]
    # The weights do not depend on the kernel ahead: the first PRE K-steps' tiles are loaded before
    # the PDL wait, so their memory latency overlaps the kernel ahead's tail (kernels/pdl.py).
    EVEN_K: tl.constexpr = (K % BLOCK_K == 0) and (SPLIT * ITERS * BLOCK_K == K)
    if PRE > 0:
        kp = k0 + tl.arange(0, PRE * BLOCK_K)
        kp_ok = kp < K
        if EVEN_K:
            wpa = tl.load(wa_ptr + kp[None, :], eviction_policy="evict_first")
            if TWO:
                wpb = tl.load(wb_ptr + kp[None, :], eviction_policy="evict_first")
        else:
            wpa = tl.load(wa_ptr + kp[None, :], mask=kp_ok[None, :], other=0.0,
                          eviction_policy="evict_first")
            if TWO:
                wpb = tl.load(wb_ptr + kp[None, :], mask=kp_ok[None, :], other=0.0,
                              eviction_policy="evict_first")
    if GDC:  # PDL: wait for the kernel ahead (kernels/pdl.py)
        wait()
    if TRIG == 2:  # the next kernel may launch now (pdl.trigger)
        tl.extra.cuda.gdc_launch_dependents()

    # The epilogue's inputs, loaded before the main loop so their latency hides under it (after
    # it, the last program of a split-K tile would wait on one more round trip to memory).
    if NORM:  # rstd of each row from the producer's per-tile sums of squares, added in tile order:
        # tl.sum over a [tiles, T] load adds in an order that follows the tensor's layout, which
        # Triton picks apart for T % 16 == 0, and one request then scored up to 0.012 apart in
        # buckets 8 and 16 on the H200. NT independent loads, all in flight.
        ssq = tl.zeros([BLOCK_T], tl.float32)
        for tile in tl.static_range(NT):
            ssq += tl.load(SSQ_IN + tile * T + t, mask=t_ok, other=0.0)
        rstd = tl.rsqrt(ssq / K + norm_eps)[:, None]
    if F16:  # what scales x into fp16's range before the dot
        if NORM:
            xmul = rstd
        else:
            xmul = xs
    if FP8:  # per-output-row weight scales (kernels/fp8.py)
        sc_a = tl.load(WSC + cols_a, mask=c_ok, other=0.0)[None, :]
        if TWO:
            sc_b = tl.load(WSC + cols_b, mask=c_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias_a = tl.load(B + cols_a, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        if TWO:
            bias_b = tl.load(B + cols_b, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if RESID:
        r_in = tl.load(R + tc * stride_ot + cols_a[None, :], mask=m_out, other=0.0)
    if EPI == 2:  # RoPE's cos / sin rows (q and k heads only; masked off for v heads)
        m_rope = t_ok[:, None] & (pid_n < HQ + HKV)
        c1 = tl.load(COS + tc * D + jc, mask=m_rope, other=0.0)
        s1 = tl.load(SIN + tc * D + jc, mask=m_rope, other=0.0)
        c2 = tl.load(COS + tc * D + BLOCK_N + jc, mask=m_rope, other=0.0)
        s2 = tl.load(SIN + tc * D + BLOCK_N + jc, mask=m_rope, other=0.0)

    acc_a = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if SERIAL:  # (gemm_config.wide_config) this program runs every K split in turn: each from zero,
        # added to the running sum in split order, as the split programs' last one adds theirs.
        # `zero` is a 0.0 argument: from a constant zero Triton would fold tot + dot(x, w, 0) into
        # dot(x, w, tot), another order.
        split0 = tl.zeros([BLOCK_T, BLOCK_N], tl.float32) + zero
        acc_a, acc_b, tot_a, tot_b = split0, split0, acc_a, acc_b
    STEPS: tl.constexpr = SPLIT * ITERS if SERIAL else ITERS
    if PRE > 0:  # the preloaded K-steps as one dot (DOT only: gemm_config sets PRE = 0 otherwise)
        xp = tl.load(x_ptr + kp[None, :], mask=t_ok[:, None] & kp_ok[None, :], other=0.0)
        if F16:
            xp = (xp.to(tl.float32) * xmul).to(tl.float16)
            wpa = wpa.to(tl.float16)
            if TWO:
                wpb = wpb.to(tl.float16)
        elif FP8:  # e4m3 weights: to the activations' dtype in registers (scaled in the epilogue)
            wpa = wpa.to(X.dtype.element_ty)
            if TWO:
                wpb = wpb.to(X.dtype.element_ty)
        if UPCAST:
            xp = xp.to(tl.float32)
            wpa = wpa.to(tl.float32)
        acc_a = tl.dot(xp, tl.trans(wpa), acc_a, input_precision=DOT_PREC)
        if TWO:
            if UPCAST:
                wpb = wpb.to(tl.float32)
            acc_b = tl.dot(xp, tl.trans(wpb), acc_b, input_precision=DOT_PREC)
    for i in range(PRE, STEPS):
        k = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xv = tl.load(x_ptr + k[None, :], mask=t_ok[:, None], other=0.0)
            wa = tl.load(wa_ptr + k[None, :], eviction_policy="evict_first")
        else:
            k_ok = k < K
            xv = tl.load(x_ptr + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            wa = tl.load(wa_ptr + k[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if F16:
            xv = (xv.to(tl.float32) * xmul).to(tl.float16)
            wa = wa.to(tl.float16)
        elif FP8:
            wa = wa.to(X.dtype.element_ty)
        # acc += x @ w^T, inlined (a nested jit call costs ~10 ms per call in the interpreter)
        if DOT:
            if UPCAST:  # interpreter only: it multiplies bf16 bit patterns in tl.dot (triton#11584)
                xv = xv.to(tl.float32)
                wa = wa.to(tl.float32)
            acc_a = tl.dot(xv, tl.trans(wa), acc_a, input_precision=DOT_PREC)
        else:
            xf = xv.to(tl.float32)[:, None, :]
            acc_a += tl.sum(xf * wa.to(tl.float32)[None, :, :], axis=2)
        if TWO:
            if EVEN_K:
                wb = tl.load(wb_ptr + k[None, :], eviction_policy="evict_first")
            else:
                wb = tl.load(wb_ptr + k[None, :], mask=k_ok[None, :], other=0.0,
                             eviction_policy="evict_first")
            if F16:
                wb = wb.to(tl.float16)
            elif FP8:
                wb = wb.to(X.dtype.element_ty)
            if DOT:
                if UPCAST:
                    wb = wb.to(tl.float32)
                acc_b = tl.dot(xv, tl.trans(wb), acc_b, input_precision=DOT_PREC)
            else:
                acc_b += tl.sum(xf * wb.to(tl.float32)[None, :, :], axis=2)
        if SERIAL:  # a split's last step: its sum into the running sum. (A branch, not tl.where:
            # Triton then waits for the MMAs only there, not after every step; sm_90 PTX)
            if (i + 1) % ITERS == 0:
                tot_a = tot_a + acc_a
                acc_a = split0
                if TWO:
                    tot_b = tot_b + acc_b
                    acc_b = split0
    if SERIAL:
        acc_a, acc_b = tot_a, tot_b

    if TRIG == 1:  # the weight stream is done: let the next kernel's programs start their preloads
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT > 1 and not SERIAL:
        # Partials to the workspace [SPLIT, TP, N] (fp32; TP: the row tiles' rows), then count
        # arrivals.
        ws = WS + pid_k * (TP * N) + tc * N
        tl.store(ws + cols_a[None, :], acc_a, mask=m_out)
        if TWO:
            tl.store(ws + cols_b[None, :], acc_b, mask=m_out)
        tl.debug_barrier()  # every thread's partial stores before the (release) arrival
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
        last = arrived == SPLIT - 1
        if last:
            acc_a = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            acc_b = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for s in range(SPLIT):  # fixed order: the sum does not depend on who came last
                wss = WS + s * (TP * N) + tc * N
                acc_a += tl.load(wss + cols_a[None, :], mask=m_out, other=0.0, cache_modifier=".cg")
                if TWO:
                    acc_b += tl.load(wss + cols_b[None, :], mask=m_out, other=0.0, cache_modifier=".cg")
            tl.store(cnt, 0)  # ready for the next launch (and the next graph replay)
    else:
        last = True

    if last:
        if FP8:  # a row's scale factors out of its dot product: applied once, to the sum
            if F16 and not NORM:  # x was scaled by xs (a power of two: exact both ways)
                sc_a = sc_a * (1.0 / xs)
                if TWO:
                    sc_b = sc_b * (1.0 / xs)
            acc_a *= sc_a
            if TWO:
                acc_b *= sc_b
        if NORM and not F16:
            acc_a *= rstd
            acc_b *= rstd
        if HAS_BIAS:
            acc_a += bias_a
            if TWO:
                acc_b += bias_b
        if EPI == 0:
            dt = OUT.dtype.element_ty
            y = acc_a.to(dt)
            if RESID:  # HF: residual + linear(x), both in the dtype, the sum rounded once
                y = (y.to(tl.float32) + r_in.to(tl.float32)).to(dt)
                yf = tl.where(m_out, y.to(tl.float32), 0.0)
                if SSQ_C:  # (batch-invariant mode) in fixed chunks, each in column order
                    _store_ssq_chunks(SSQ_OUT, yf, pid_n, T, tc, t_ok, N, BLOCK_N, SSQ_C)
                else:
                    tl.store(SSQ_OUT + pid_n * T + t, tl.sum(yf * yf, 1), mask=t_ok)
            tl.store(OUT + tc * stride_ot + cols_a[None, :], y, mask=m_out)
        elif EPI == 1:
            dt = OUT.dtype.element_ty
            # HF: gate and up rounded to the dtype by their linears, silu(gate) rounded, then the
            # product (exact in fp32) rounded once.
            g = acc_a.to(dt).to(tl.float32)
            u = acc_b.to(dt).to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            tl.store(OUT + tc * stride_ot + cols_a[None, :], (sg * u).to(dt), mask=m_out)
        else:
            dt = QO.dtype.element_ty
            h = pid_n
            a = acc_a.to(dt).to(tl.float32)  # the qkv linear's output, rounded like F.linear
            b = acc_b.to(dt).to(tl.float32)
            # Same math as fused_triton._rope_qk_kernel from here on.
            if QK_NORM:
                if h < HQ + HKV:
                    if SSQ_C:  # (batch-invariant mode) in column order, as RESID's sums of squares
                        # (a row's sum in column 0, exact zeros beside it)
                        e0 = tl.where((j[:, None] >= 0) & (tl.arange(0, 16)[None, :] == 0), 1.0, 0.0)
                        sa = tl.sum(tl.dot(a * a, e0, input_precision="ieee"), 1)
                        sb = tl.sum(tl.dot(b * b, e0, input_precision="ieee"), 1)
                    else:
                        sa = tl.sum(a * a, 1)
                        sb = tl.sum(b * b, 1)
                    r = tl.rsqrt((sa + sb) / D + eps)[:, None]
                    if h < HQ:
                        wa = tl.load(QN + j).to(tl.float32)[None, :]
                        wb = tl.load(QN + BLOCK_N + j).to(tl.float32)[None, :]
                    else:
                        wa = tl.load(KN + j).to(tl.float32)[None, :]
                        wb = tl.load(KN + BLOCK_N + j).to(tl.float32)[None, :]
                    a = (wa * (a * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                    b = (wb * (b * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            if h < HQ + HKV:
                o1 = (a * c1.to(tl.float32) - b * s1.to(tl.float32)).to(dt)
                o2 = (b * c2.to(tl.float32) + a * s2.to(tl.float32)).to(dt)
                if h < HQ:
                    dst = QO + (tc * HQ + h) * D + jc
                else:
                    dst = KO + (tc * HKV + (h - HQ)) * D + jc
                tl.store(dst, o1, mask=m_out)
                tl.store(dst + BLOCK_N, o2, mask=m_out)
            else:
                dst = VO + (tc * HKV + (h - HQ - HKV)) * D + jc
                tl.store(dst, a.to(dt), mask=m_out)
                tl.store(dst + BLOCK_N, b.to(dt), mask=m_out)


# Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
_INTERPRETED = type(_skinny_kernel).__name__ == "InterpretedFunction"


def _launch(x, w, bias, epi, ncols, cfg, out=None, rope=None, norm=None, resid=None,
            options: KernelOptions = DEFAULTS):
    """norm: (eps, ssq) of NORM; resid: (residual, ssq_out) of RESID."""
    T, K = x.shape
    N = w.shape[0]
    # fp16 dot (KernelOptions.fp8_fp16): behind a norm, or where the weight knows its input's bound
    f16 = options.fp8_fp16 and is_fp8(w) and (norm is not None or w.x_scale is not None)
    xs = w.x_scale if f16 and norm is None else 1.0
    w, wsc = (w.q, w.scale) if is_fp8(w) else (w, None)
    cfg = _finish_config(cfg, K, x.dtype, epi, w.numel() * w.element_size(), w.element_size(), options)
    serial = cfg.pop("SERIAL", False)
    ntt = triton.cdiv(T, cfg["BLOCK_T"])  # row tiles: 1 unless batch-invariant (wide_config)
    tiles = triton.cdiv(ncols, cfg["BLOCK_N"])
    grid = (tiles, 1 if serial else cfg["SPLIT"], ntt)
    tp = ntt * cfg["BLOCK_T"]
    if cfg["SPLIT"] > 1 and not serial:
        ws = torch.empty((cfg["SPLIT"], tp, N), dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, tiles * ntt)
        assert tiles * ntt <= cnt.numel()
    else:
        ws = cnt = x  # never touched
    if rope is None:
        cos = sin = qn = kn = qo = ko = vo = x
        hq = hkv = d = 1
        eps, qk_norm = 0.0, False
    else:
        cos, sin, qn, kn, qo, ko, vo, hq, hkv, d, eps = rope
        qk_norm = qn is not None
        if not qk_norm:
            qn = kn = x
        out = x
    norm_eps, ssq_in = norm if norm is not None else (0.0, x)
    nt = ssq_in.shape[0] if norm is not None else 1
    r, ssq_out = resid if resid is not None else (x, x)
    if norm is not None:
        assert ssq_in.shape[1:] == (T,) and ssq_in.is_contiguous()
    if resid is not None:
        assert epi == 0 and r.shape == out.shape and r.stride() == out.stride()
        assert ssq_out.shape == (ssq_rows(ncols, cfg, options), T) and ssq_out.dtype == torch.float32
        assert not options.batch_invariant or cfg["BLOCK_N"] % SSQ_COLS == 0
    _skinny_kernel[grid](
        x, w, bias if bias is not None else x, out, ws, cnt,
        cos, sin, qn, kn, qo, ko, vo,
        ssq_in, r, ssq_out, wsc if wsc is not None else x,
        T, tp, x.stride(0), out.stride(0) if rope is None else 0, eps, norm_eps, xs, 0.0,
        N=N, K=K, EPI=epi, HAS_BIAS=bias is not None,
        NORM=norm is not None, NT=nt, RESID=resid is not None,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=_INTERPRETED,
        HQ=hq, HKV=hkv, D=d, QK_NORM=qk_norm, FP8=wsc is not None, TGRID=ntt > 1,
        F16=f16, SERIAL=serial, SSQ_C=SSQ_COLS if options.batch_invariant else 0,
        TRIG=trigger(x.device, w, ("linear", "gate_up", "qkv")[epi], options),
        **cfg, **launch_kwargs(x.device, options),
    )


def _config(x, w, ncols, epi, config, role, options, block_n=None) -> dict:
    """The launch config of x @ w^T: gemm_config's for x's rows (batch-invariant mode: for
    invariant_rows, in wide tiles past them), the caller's entries over it, then options.tune's
    for role."""
    T, K = x.shape
    cfg = gemm_config(config_rows(T, options), ncols, K, epi, x.dtype, x.device, block_n=block_n,
                      fp8=is_fp8(w))
    cfg.update(config or {})
    if options.batch_invariant and T > options.invariant_rows:
        w_bytes = w.q.element_size() if is_fp8(w) else w.element_size()
        cfg = wide_config(cfg, T, epi, x.element_size(), w_bytes)
    return tuned(cfg, role, options)


def _prep(x, w, bias):
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = w.contiguous()  # (an Fp8Weight is)
    if bias is not None:
        bias = bias.contiguous()
    return x, w, bias


# ---------------------------------------------------------------- entry points

# Every entry point takes the engine's KernelOptions (options.py; the defaults for tests and bench).
def linear_small(x, w, bias=None, out=None, config=None, options: KernelOptions = DEFAULTS):
    """x [T, K] @ w[N, K]^T (+ bias) -> [T, N], T <= 64. `out` may have any row stride."""
    return _plain_or_gated(x, w, bias, out, config, options, epi=0)


def linear_residual_small(x, w, bias, residual, config=None, options: KernelOptions = DEFAULTS):
    """residual + x @ w^T (+ bias) -> (out [T, N], ssq [column tiles, T] fp32): ssq holds each
    row's sum of squares of out over one column tile, for the next GEMM's `norm` prologue."""
    return _plain_or_gated(x, w, bias, None, config, options, epi=0, residual=residual)


def gate_up_silu_small(x, w_gu, bias=None, out=None, config=None, norm=None,
                       options: KernelOptions = DEFAULTS):
    """silu(x @ Wg^T (+bg)) * (x @ Wu^T (+bu)) -> [T, I] with w_gu = [Wg; Wu] of shape [2I, K].
    norm=(eps, ssq): x is the residual stream, multiplied as rms_norm(x) (unit weight: fold the
    norm's weight into w_gu); ssq from linear_residual_small."""
    assert w_gu.shape[0] % 2 == 0
    return _plain_or_gated(x, w_gu, bias, out, config, options, epi=1, norm=norm)


def _plain_or_gated(x, w, bias, out, config, options, epi, norm=None, residual=None):
    x, w, bias = _prep(x, w, bias)
    T = x.shape[0]
    cols = w.shape[0] // (2 if epi == 1 else 1)  # output columns: N, or I for [Wg; Wu]
    if out is None:
        out = torch.empty((T, cols), dtype=x.dtype, device=x.device)
    assert out.shape == (T, cols) and out.stride(-1) == 1
    cfg = _config(x, w, cols, epi, config, "gu" if epi == 1 else "down" if residual is not None else "linear",
                  options)
    resid = None
    if residual is not None:
        rows = ssq_rows(cols, cfg, options)
        resid = (residual.contiguous(), torch.empty((rows, T), dtype=torch.float32, device=x.device))
        assert out.is_contiguous() and resid[0].shape == out.shape
    if T > 0:
        _launch(x, w, bias, epi, cols, cfg, out=out, norm=_norm_args(norm), resid=resid, options=options)
    return out if resid is None else (out, resid[1])


def _norm_args(norm):
    if norm is None:
        return None
    eps, ssq = norm
    return float(eps), ssq.contiguous()


def qkv_rope_small(x, w_qkv, bias, cos, sin, Hq, Hkv, D, q_norm=None, k_norm=None, eps=1e-6,
                   config=None, norm=None, options: KernelOptions = DEFAULTS):
    """x @ Wqkv^T (+ bias), then (Qwen3 per-head RMSNorm and) RoPE on q and k, as
    fused.rope_qk_ref after a plain linear -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D].
    norm: as gate_up_silu_small's."""
    x, w_qkv, bias = _prep(x, w_qkv, bias)
    T = x.shape[0]
    H = Hq + 2 * Hkv
    assert w_qkv.shape[0] == H * D and D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0
    kw = dict(dtype=x.dtype, device=x.device)
    q = torch.empty((T, Hq, D), **kw)
    k = torch.empty((T, Hkv, D), **kw)
    v = torch.empty((T, Hkv, D), **kw)
    if T == 0:
        return q, k, v
    cos, sin = cos.contiguous(), sin.contiguous()
    if q_norm is not None:
        q_norm, k_norm = q_norm.contiguous(), k_norm.contiguous()
    cfg = _config(x, w_qkv, H * (D // 2), 2, config, "qkv", options, block_n=D // 2)
    cfg["BLOCK_N"] = D // 2
    _launch(x, w_qkv, bias, 2, H * (D // 2), cfg,
            rope=(cos, sin, q_norm, k_norm, q, k, v, Hq, Hkv, D, eps), norm=_norm_args(norm),
            options=options)
    return q, k, v
