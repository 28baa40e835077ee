"""A transformer block for few tokens as one persistent Triton kernel (issue 35).

The four skinny kernels of a block (kernels/gemm_triton.py, kernels/attention_o_triton.py) each
pay a launch and then, at their PDL wait, the whole previous grid's end. Here one grid of
resident programs runs the four as phases:

  0  QKV GEMM, 1/rms row scale, (per-head norm,) RoPE     -> q, k, v        (_skinny_unit, EPI 2)
  1  attention over the pinned prefix and the in-batch ranges, O GEMM, + x  -> x1, its ssq
                                                                           (_attn_o_unit)
  2  gate/up GEMM, 1/rms row scale, SiLU * up                              -> h   (EPI 1)
  3  down GEMM + x1                                                         -> x2, its ssq (EPI 0)

A phase's work units are the programs of the kernel it replaces (column tile x K split, or
column tile x head), dealt to the programs in turn; the phases are separated by a grid barrier
(triton_util._grid_sync) instead of kernel boundaries. Each program's first unit of a phase loads
its leading weight tiles (PRE, as before a PDL wait) before the barrier, so the next phase's
weight stream starts while the last programs of this one finish. The math is the four kernels';
two things can round a sum differently: the attention + O unit runs at this kernel's warps where
its own kernel runs 8, and a phase with more units than the grid has programs runs fewer K splits
(0.5B's down: 8 instead of 10). H200: x2 bitwise the four kernels' at T = 1 and 16, one bf16 step
off at T = 8; H100: bitwise at 1, 8 and 16. Every bucket of up to 16 tokens runs the one
configuration, as the four kernels do.

Measured (bench.layer, Qwen2.5-0.5B's block, T = 8, one graph of 24 blocks): 25.5 us a block
against the four kernels' 18.3 on the H200, 25.8 against 19.2 on the H100. Each barrier costs
~0.45 us (one launch of all four phases 25.5, four launches of one phase 24.1); the rest is where
weights load. PDL runs two kernels' programs side by side, so a kernel's weights stream during the
whole kernel ahead; here a program loads a phase's weights once its unit of the phase before is
done, and the sm_90 build preloads 2 of down's 5 K-steps (its own kernel: 4 of 4, at 10 splits).
Per-phase critical path on the H100 (TIMED): QKV 3.8, attention + O 6.9, gate/up 8.3, down 5.4 us.
Off by default (KernelOptions.persistent_layer) until it wins.

ROTATE (layer.rotate): phase p's units are dealt starting where phase p - 1's ended, so the
programs idle in p - 1 take p's first units and load their weights during p - 1, which pays where
adjacent phases' units fit the grid together (bench.layer --sweep has such configs). LAUNCH_NEXT
(layer.trigger): every program lets the next kernel launch as it enters the down phase, so the next
block's programs take the slots ours leave, load their weights and wait at their PDL wait, where
otherwise the next launch follows our end.

FIRST / LAST (constexpr) pick the phases one launch runs: the engine runs 0..3; the tests run one
phase per launch under the interpreter, which executes programs one after another and would spin
for ever at a barrier (a launch of one phase has none).

Every program must be resident at once or the barrier never opens: the grid is the SM count times
the programs per SM that the compiled kernel's registers and shared memory allow (at most 2), and
the units of each phase are capped to the grid. (layer.coop makes it a cooperative launch, which
the driver keeps resident even beside another stream's kernels.) A barrier that still never opens
gives up after triton_util.SPIN_LIMIT polls and raises a flag (barrier_stalled): a wrong result
the tests catch, not a hung GPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention_o_triton import _attn_o_unit, attn_o_config
from .gemm_config import _finish_config, config_rows, gemm_config, tuned
from .gemm_triton import _skinny_unit
from .options import DEFAULTS, KernelOptions
from .pdl import launch_kwargs, wait
from .triton_util import _counters, _grid_sync, _num_sms

# A phase's launch config as one constexpr tuple, in the order _layer_kernel indexes it (C0[0] ...)
SKINNY_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT", "ITERS", "PRE", "NT", "TILES")
ATTN_KEYS = ("BLOCK_N", "BLOCK_P", "BLOCK_NI", "EARLY", "TILES", "SPLIT")


@triton.jit
def _phase_sync(v, n_units, BAR, target, SYNC: tl.constexpr):
    """A program with no unit in this phase (its place v past the units) still takes part in its
    barrier (SYNC 2) or waits for the kernel ahead (SYNC 1) before it goes on to the next phase's
    loads."""
    if v >= n_units:
        if SYNC == 1:
            wait()
        elif SYNC == 2:
            _grid_sync(BAR, target)


@triton.jit
def _layer_kernel(
    X, SSQ0, WQKV, BQKV, COS, SIN, QN, KN, Q, K, V,
    PK, PV, BS, BE, OS, PS, PE, WO, X1, SSQ1,
    WGU, BGU, H, WD, BD, X2, SSQ2,
    WS, CNT, BAR, TIMES,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, spk_t, spk_h, spv_t, spv_h,
    T, P, qk_scale, eps, norm_eps,
    HID: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, QK_NORM: tl.constexpr, QKV_BIAS: tl.constexpr,
    MLP_BIAS: tl.constexpr, RANGES: tl.constexpr,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
    BLOCK_T: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, GDC: tl.constexpr, TIMED: tl.constexpr,
    ROTATE: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # Units per phase; with ROTATE, phase p's units go first to the programs that had none in phase
    # p - 1 (its dealing starts where p - 1's ended), so those load p's weights during p - 1, as a
    # PDL-launched kernel's programs do beside the kernel ahead. v: this program's place in a phase.
    N0: tl.constexpr = C0[6] * C0[2]
    N1: tl.constexpr = C1[4] * C1[5]
    N2: tl.constexpr = C2[6] * C2[2]
    N3: tl.constexpr = C3[6] * C3[2]
    if TIMED:  # TIMES [G, 5] int64: each program's start, then the end of its share of each phase
        tl.store(TIMES + pid * 5, tl.extra.cuda.globaltimer())
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    # phase p's sync: the kernel ahead (PDL) for the first phase, else the barrier number p - FIRST
    # (targets count arrivals since the launch; BAR is zeroed again at the end)
    if FIRST <= 0 and 0 <= LAST:
        S0: tl.constexpr = (1 if GDC else 0) if FIRST == 0 else 2
        v = pid
        _phase_sync(v, N0, BAR, (0 - FIRST) * G, S0)
        for u in range(v, N0, G):
            _skinny_unit(u // C0[2], u % C0[2], 0, C0[6], BAR, (0 - FIRST) * G, u == v,
                         X, WQKV, BQKV, X, WS, CNT, COS, SIN, QN, KN, Q, K, V, SSQ0, X, X, X,
                         T, BLOCK_T, HID, 0, eps, norm_eps, NQKV, HID, 2, QKV_BIAS, True, C0[5],
                         False, BLOCK_T, C0[0], C0[1], C0[2], C0[3], True, DOT_PREC, UPCAST, HQ,
                         HKV, D, QK_NORM, C0[4], 0, False, False, SYNC=S0, XMOD=".cg")
    if TIMED and FIRST <= 0 and 0 <= LAST:
        tl.store(TIMES + pid * 5 + 1, tl.extra.cuda.globaltimer())
    if FIRST <= 1 and 1 <= LAST:
        S1: tl.constexpr = (1 if GDC else 0) if FIRST == 1 else 2
        v = (pid + G - (N0 % G if ROTATE else 0)) % G
        _phase_sync(v, N1, BAR, (1 - FIRST) * G, S1)
        for u in range(v, N1, G):
            _attn_o_unit(u // C1[5], u % C1[5], BAR, (1 - FIRST) * G, u == v,
                         Q, K, V, PK, PV, BS, BE, OS, PS, PE, WO, X, X1, SSQ1, WS, CNT, X,
                         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, spk_t, spk_h, spv_t, spv_h, T, P,
                         qk_scale, HID, HQ, HQ // HKV, D, HQ // C1[5], BLOCK_T, C1[0], C1[1],
                         C1[2], DOT_PREC, UPCAST, C1[3], True, 0, RANGES, False, SYNC=S1,
                         XMOD=".cg")
    if TIMED and FIRST <= 1 and 1 <= LAST:
        tl.store(TIMES + pid * 5 + 2, tl.extra.cuda.globaltimer())
    if FIRST <= 2 and 2 <= LAST:
        S2: tl.constexpr = (1 if GDC else 0) if FIRST == 2 else 2
        v = (pid + G - ((N0 + N1) % G if ROTATE else 0)) % G
        _phase_sync(v, N2, BAR, (2 - FIRST) * G, S2)
        for u in range(v, N2, G):
            _skinny_unit(u // C2[2], u % C2[2], 0, C2[6], BAR, (2 - FIRST) * G, u == v,
                         X1, WGU, BGU, H, WS, CNT, X, X, X, X, X, X, X, SSQ1, X, X, X,
                         T, BLOCK_T, HID, INTER, 0.0, norm_eps, 2 * INTER, HID, 1, MLP_BIAS, True,
                         C2[5], False, BLOCK_T, C2[0], C2[1], C2[2], C2[3], True, DOT_PREC, UPCAST,
                         1, 1, 1, False, C2[4], 0, False, False, SYNC=S2, XMOD=".cg")
    if TIMED and FIRST <= 2 and 2 <= LAST:
        tl.store(TIMES + pid * 5 + 3, tl.extra.cuda.globaltimer())
    if GDC and LAUNCH_NEXT and LAST == 3:  # (layer.trigger) the next kernel may launch now: its
        # programs take the slots ours leave, load their weights and wait for our end (PDL), which
        # the four kernels' down does too; without it the next block's launch follows our end
        tl.extra.cuda.gdc_launch_dependents()
    if FIRST <= 3 and 3 <= LAST:
        S3: tl.constexpr = (1 if GDC else 0) if FIRST == 3 else 2
        v = (pid + G - ((N0 + N1 + N2) % G if ROTATE else 0)) % G
        _phase_sync(v, N3, BAR, (3 - FIRST) * G, S3)
        for u in range(v, N3, G):
            _skinny_unit(u // C3[2], u % C3[2], 0, C3[6], BAR, (3 - FIRST) * G, u == v,
                         H, WD, BD, X2, WS, CNT, X, X, X, X, X, X, X, X, X1, SSQ2, X,
                         T, BLOCK_T, INTER, HID, 0.0, 0.0, HID, INTER, 0, MLP_BIAS, False, 1, True,
                         BLOCK_T, C3[0], C3[1], C3[2], C3[3], True, DOT_PREC, UPCAST, 1, 1, 1,
                         False, C3[4], 0, False, False, SYNC=S3, XMOD=".cg")
    if TIMED and LAST == 3:
        tl.store(TIMES + pid * 5 + 4, tl.extra.cuda.globaltimer())
    if LAST > FIRST:  # every program is past every barrier once all have arrived here: the last
        # to arrive zeroes both counters for the next launch (and the next graph replay)
        if tl.atomic_add(BAR + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
            tl.store(BAR, 0)
            tl.store(BAR + 1, 0)


_INTERPRETED = type(_layer_kernel).__name__ == "InterpretedFunction"
MAX_T = 16  # the latency buckets; past them the four kernels (and cuBLAS) take the block
# The launch: programs per SM (the grid is this times the SM count, each phase's units capped to
# it) and warps per program; KernelOptions.tune's layer.per_sm / layer.num_warps override them.
# H200 (bench.layer, T = 8): 2 programs of 4 warps 25.5 us a layer, 1 of 4 30.3, 1 of 8 30.7; 2 of
# 8 do not fit (255 registers).
# bench.layer A/B knobs: uncap 1, each phase keeps its own kernel's config (units past the grid run
# in turn); coop 1, a cooperative launch (the driver then guarantees every program resident at once,
# even beside another stream's kernels, where the occupancy check below cannot).
# rotate 1, each phase's units dealt first to the programs idle in the phase before (_layer_kernel);
# trigger 1, the next kernel launches as the down phase starts (PDL).
LAUNCH = dict(per_sm=2, num_warps=4, uncap=0, coop=0, rotate=0, trigger=0)


def _skinny_phase(T, ncols, K, epi, dtype, device, role, grid, options, block_n=None, nt=1):
    """A skinny GEMM phase's config (gemm_config's, as its kernel would run) with at most `grid`
    units: past that, fewer K splits, then wider column tiles (each program would otherwise run two
    units in turn)."""
    cfg = gemm_config(config_rows(T, options), ncols, K, epi, dtype, device, block_n=block_n)
    tuned(cfg, role, options)
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    w_bytes = (2 if epi == 1 else 1) * ncols * K * dtype.itemsize
    if epi == 2:
        w_bytes *= 2  # ncols counts half heads
    while block_n is None and triton.cdiv(ncols, cfg["BLOCK_N"]) > grid:  # more columns a unit
        cfg["BLOCK_N"] *= 2
    tiles = triton.cdiv(ncols, cfg["BLOCK_N"])
    assert tiles <= grid, (ncols, cfg["BLOCK_N"], grid)
    kit = triton.cdiv(K, cfg["BLOCK_K"])
    split = min(cfg.get("SPLIT", 1), kit, max(1, grid // tiles))
    cfg["SPLIT"] = split
    cfg = _finish_config(cfg, K, dtype, epi, w_bytes, options=options)
    cfg["TILES"], cfg["NT"] = tiles, nt
    return cfg


@functools.lru_cache(maxsize=None)  # (per launch otherwise: read-only, options are frozen)
def layer_config(T, hidden, inter, Hq, Hkv, D, nt0, dtype, device, grid, options) -> dict:
    """Each phase's config (constexpr tuples in SKINNY_KEYS / ATTN_KEYS order) for a grid of
    `grid` programs, and the workspace each phase needs."""
    c0 = _skinny_phase(T, (Hq + 2 * Hkv) * (D // 2), hidden, 2, dtype, device, "qkv", grid,
                       options, block_n=D // 2, nt=nt0)
    c1 = tuned(attn_o_config(T, Hq, hidden, D, dtype, device, options=options), "attn_o", options)
    while triton.cdiv(hidden, c1["BLOCK_N"]) * Hq > grid and c1["BLOCK_N"] < 256:
        c1["BLOCK_N"] *= 2
    tiles = triton.cdiv(hidden, c1["BLOCK_N"])
    # then more heads per unit (HPP, a divisor of Hq; 7B: 4)
    c1["HPP"] = next(h for h in range(c1["HPP"], Hq + 1) if Hq % h == 0 and tiles * (Hq // h) <= grid)
    c1["TILES"], c1["SPLIT"] = tiles, Hq // c1["HPP"]
    c2 = _skinny_phase(T, inter, hidden, 1, dtype, device, "gu", grid, options, nt=c1["TILES"])
    c3 = _skinny_phase(T, hidden, inter, 0, dtype, device, "down", grid, options)
    bt = max(16, triton.next_power_of_2(T))
    ws = bt * max(c0["SPLIT"] * (Hq + 2 * Hkv) * D, c1["SPLIT"] * hidden, c2["SPLIT"] * 2 * inter,
                  c3["SPLIT"] * hidden)
    units = max(c0["TILES"] * c0["SPLIT"], c1["TILES"] * c1["SPLIT"], c2["TILES"] * c2["SPLIT"],
                c3["TILES"] * c3["SPLIT"])
    return dict(C0=tuple(c0[k] for k in SKINNY_KEYS), C1=tuple(int(c1[k]) for k in ATTN_KEYS),
                C2=tuple(c2[k] for k in SKINNY_KEYS), C3=tuple(c3[k] for k in SKINNY_KEYS),
                BLOCK_T=bt, ws=ws, units=units, tiles_out=c3["TILES"])


_FITS: dict = {}  # (device, grid, launch constexprs) -> programs per SM the compiled kernel allows


@functools.lru_cache(maxsize=None)
def _sm_limits(device):
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["multiprocessor_count"], props["max_shared_mem"], props.get("max_num_regs", 65536)


def _resident(compiled, num_warps, device) -> int:
    """Programs of the compiled kernel one SM holds at once (registers, shared memory)."""
    sms, smem, regs = _sm_limits(device)
    compiled._init_handles()  # (loads the module: n_regs is known from then on)
    per_warp = -(-compiled.n_regs * 32 // 256) * 256  # registers are allocated per warp in 256s
    by_regs = regs // (per_warp * num_warps)
    by_smem = smem // max(compiled.metadata.shared + 1024, 1)  # (1 KB reserved per block)
    return min(by_regs, by_smem)


def layer_small(x, ssq, wqkv, bqkv, cos, sin, q_norm, k_norm, qk_eps, prefix_k, prefix_v, base_start,
                base_end, own_start, scale, wo, w_gu, b_gu, w_down, b_down, norm_eps, Hq, Hkv, D,
                prefix_range=None, phases=(0, 3), options: KernelOptions = DEFAULTS,
                out=None, times=None):
    """One block (model.Block's math on the skinny path) for T <= MAX_T tokens -> (x2 [T, hidden],
    ssq [tiles, T] fp32), as qkv_rope_small, attention_o_residual_small, gate_up_silu_small and
    linear_residual_small in turn. x: the residual stream; ssq: its row sums of squares by column
    tile (the producer's). phases: (first, last) to run in this launch; `out`: the intermediates
    (q, k, v, x1, ssq1, h, x2, ssq2) of a launch that ran the earlier phases (tests). times (CUDA,
    bench.layer): int64 [programs, 5] for each program's %globaltimer at its start and at the end
    of its share of each phase (ns), to see which phase the grid waits on."""
    T, hidden = x.shape
    inter = w_gu.shape[0] // 2
    P = prefix_k.shape[0]
    assert 0 < T <= MAX_T and x.is_contiguous() and ssq.is_contiguous() and ssq.shape[1:] == (T,)
    assert D // 2 >= 16 and (D // 2) & (D // 2 - 1) == 0 and Hq % Hkv == 0
    dev, dt = x.device, x.dtype
    sms = _num_sms(dev)
    launch = tuned(dict(LAUNCH), "layer", options)
    grid = sms * launch["per_sm"]
    cfg = layer_config(T, hidden, inter, Hq, Hkv, D, ssq.shape[0], dt, dev,
                       1 << 30 if launch["uncap"] else grid, options)
    if out is None:
        kw = dict(dtype=dt, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        out = (torch.empty((T, Hq, D), **kw), torch.empty((T, Hkv, D), **kw),
               torch.empty((T, Hkv, D), **kw), torch.empty((T, hidden), **kw),
               torch.empty((cfg["C1"][4], T), **f32), torch.empty((T, inter), **kw),
               torch.empty((T, hidden), **kw), torch.empty((cfg["tiles_out"], T), **f32))
    q, k, v, x1, ssq1, h, x2, ssq2 = out
    ws = torch.empty(cfg["ws"], dtype=torch.float32, device=dev)
    cnt = _counters(dev)
    # the barrier's two counters and its flag (_grid_sync; split-K counters come from the front)
    bar = cnt[cnt.numel() - 3:]
    if P == 0:  # never read; avoids handing the launcher an empty (null) pointer
        prefix_k, prefix_v = k, v
    ps, pe = prefix_range if prefix_range is not None else (base_start, base_start)
    pk = prefix_k if prefix_k.stride(-1) == 1 else prefix_k.contiguous()
    pv = prefix_v if prefix_v.stride(-1) == 1 else prefix_v.contiguous()
    none = x  # a pointer for the inputs a configuration never reads
    args = (x, ssq, wqkv, none if bqkv is None else bqkv, cos.contiguous(), sin.contiguous(),
            none if q_norm is None else q_norm, none if k_norm is None else k_norm, q, k, v,
            pk, pv, base_start, base_end, own_start, ps, pe, wo, x1, ssq1,
            w_gu, none if b_gu is None else b_gu, h, w_down, none if b_down is None else b_down, x2,
            ssq2, ws, cnt, bar, none if times is None else times,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            pk.stride(0), pk.stride(1), pv.stride(0), pv.stride(1),
            T, P, scale * 1.4426950408889634, float(qk_eps), float(norm_eps))
    kw = dict(HID=hidden, INTER=inter, HQ=Hq, HKV=Hkv, D=D, QK_NORM=q_norm is not None,
              QKV_BIAS=bqkv is not None, MLP_BIAS=b_gu is not None,
              RANGES=prefix_range is not None, C0=cfg["C0"], C1=cfg["C1"], C2=cfg["C2"],
              C3=cfg["C3"], BLOCK_T=cfg["BLOCK_T"],
              DOT_PREC="ieee" if dt == torch.float32 else "tf32", UPCAST=_INTERPRETED,
              FIRST=phases[0], LAST=phases[1], TIMED=times is not None, ROTATE=bool(launch["rotate"]),
              LAUNCH_NEXT=bool(launch["trigger"]),
              num_warps=launch["num_warps"],
              num_stages=3,
              **launch_kwargs(dev, options))
    # (rotated dealing wants the whole grid: programs idle in one phase are the next one's loaders)
    g = grid if launch["rotate"] else min(grid, cfg["units"])
    assert times is None or (times.dtype == torch.int64 and times.shape[0] >= g and not _INTERPRETED)
    if not _INTERPRETED and phases[1] > phases[0]:
        # every program resident, or the first barrier never opens (checked once per compiled
        # configuration: the launch path stays a plain launch)
        key = (str(dev), g, tuple(sorted(kw.items())))
        if key not in _FITS:
            _FITS[key] = _resident(_layer_kernel.warmup(*args, grid=(g,), **kw), launch["num_warps"], dev)
        assert _FITS[key] * sms >= g, f"persistent layer: {g} programs, {_FITS[key]} per SM fit"
    if launch["coop"] and not _INTERPRETED:
        kw["launch_cooperative_grid"] = True
    _layer_kernel[(g,)](*args, **kw)
    return x2, ssq2, out
