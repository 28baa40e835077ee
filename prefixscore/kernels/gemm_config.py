"""Launch configuration of the skinny GEMMs (kernels/gemm_triton.py): from shapes only, no
autotuning (it would time kernels during graph capture), each choice with the H200 sweep behind
it; KernelOptions.tune overrides by role for bench/ A/Bs; batch-invariant mode keeps the K splits of
the invariant_rows config for every T (config_rows, wide_config)."""
from __future__ import annotations

import torch
import triton

from .options import DEFAULTS, KernelOptions
from .pdl import early
from .triton_util import _num_sms


def _np2(n):
    return triton.next_power_of_2(max(int(n), 1))


def config_rows(T: int, options: KernelOptions = DEFAULTS) -> int:
    """The T a launch config is chosen for: T, or in batch-invariant mode (options.batch_invariant)
    always options.invariant_rows, whose K splits then hold for every T (wide_config past it), so
    a row's arithmetic never depends on how many rows share the launch."""
    return options.invariant_rows if options.batch_invariant else T


# Batch-invariant mode: RESID's per-row sums of squares in chunks of this many columns whatever the
# column tile (the invariant_rows configs' BLOCK_N), each chunk summed in column order
# (triton_util._store_ssq_chunks).
SSQ_COLS = 32


def ssq_rows(ncols: int, cfg: dict, options: KernelOptions) -> int:
    """Rows of a RESID epilogue's sums of squares (gemm_triton, attention_o_triton): one per column
    tile, or in batch-invariant mode one per SSQ_COLS columns whatever the tile."""
    return triton.cdiv(ncols, SSQ_COLS if options.batch_invariant else cfg["BLOCK_N"])


# Shared memory the wide tiles' pipeline may take (an H100/H200 SM has 228 KB).
WIDE_SMEM = 200 << 10


def wide_config(cfg: dict, T: int, epi: int, x_bytes: int = 2, w_bytes: int = 2) -> dict:
    """Batch-invariant mode past invariant_rows rows: the invariant_rows config's K splits (where a
    row's sum changes: split boundaries and their order), in wide row and column tiles that read
    each weight tile once per BLOCK_T rows instead of per 16; one program runs every split of its
    tile in turn (SERIAL) and adds them in split order, as the split programs' last one does. On
    the GPU the tensor cores round a row the same in every tile shape (bench.invariance_gpu:
    alone_split_and_tile_of_T), which tests/test_invariance.py holds on the GPU. x_bytes, w_bytes:
    element sizes (the pipeline's stages fit WIDE_SMEM)."""
    # e4m3 weights in two tiles (gate/up, RoPE's halves): their bf16 conversions sit in registers
    # beside the accumulators, and 128-row tiles spill (sm_90 ptxas; aot_compile checks each build)
    rows = 64 if w_bytes == 1 and epi else 128
    cfg = dict(cfg, BLOCK_T=min(rows, max(16, triton.next_power_of_2(T))), PRE=0, SERIAL=True)
    if epi != 2:  # (RoPE's tile is half a head)
        cfg["BLOCK_N"] = 64
    bk = cfg["BLOCK_K"]
    while True:
        stage = (cfg["BLOCK_T"] * x_bytes + (2 if epi else 1) * cfg["BLOCK_N"] * w_bytes) * bk
        cfg["num_stages"] = min(3, WIDE_SMEM // stage)
        if cfg["num_stages"] >= 2 or cfg["BLOCK_T"] == 16:
            break
        cfg["BLOCK_T"] //= 2
    # Two warpgroups from 64 rows: one holds 128 rows' accumulators (and running sums) only by
    # spilling them, every role of both model shapes (sm_90 ptxas)
    cfg["num_warps"] = 8 if cfg["BLOCK_T"] >= 64 else 4
    return cfg


# e4m3 weights of 7B-class layers (every role, gate/up too):
# at bf16's configs a program streams half the bytes per tile and the weight read stalls (7B W4
# 4.13 ms against bf16's 3.69); more programs in flight fix most of it. H200, W4 in place over every
# skinny role (a sweep of each setting alone): SPLIT 4 3.317 ms,
# BLOCK_K 256 3.421, 6 stages 3.520; swapped MMA operands 5.24, BLOCK_N 64 4.70, 8 warps 4.56.
FP8_WIDE = {"SPLIT": 4}


def gemm_config(T: int, ncols: int, K: int, epi: int, dtype, device, block_n=None, fp8=False) -> dict:
    """Launch config from shapes only (no autotuning: it would time kernels during graph capture).

    ncols: output column tiles are counted over this many columns (N plain, I gated; for rope
    block_n is fixed to D/2 and ncols = heads * D/2). Picks a column tile so T-tile re-reads of x
    stay below the weight bytes, then splits K until there are about 2 programs per SM.
    fp8: e4m3 weights (FP8_WIDE for 7B-class layers at T <= 16).
    """
    cfg = _shape_config(T, ncols, K, epi, dtype, device, block_n)
    # 7B-class: ncols x K of 8.3M (QKV, counted in half heads) to 68M; 0.5B-class at most 4.4M
    if fp8 and T <= 16 and ncols * K >= 6_000_000:
        cfg.update(FP8_WIDE)
    return cfg


def _shape_config(T, ncols, K, epi, dtype, device, block_n):
    sms = _num_sms(device)
    bt = max(16, _np2(T))
    if block_n is None:
        # H200 sweeps (bench/gemm.py, T=8/16): 32 columns per program beat 16 and 64 for every
        # layer of both model shapes, incl. the two-tile gate/up epilogue.
        block_n = 32 if T <= 32 else 64
    wide = (2 if epi else 1) * ncols * K * 2 >= (16 << 20)  # a 7B-class weight (0.5B: <= 9 MB)
    if wide and bt == 16 and epi != 1 and dtype != torch.float32:
        # 7B-class weights at T <= 16 (sweep: bench/results/gemm_7b_T16_*.json): deeper loads
        # per program beat more programs -- split-K 2, 4 stages; long rows (down, K = 18944) in
        # 64 x 256 tiles. Down 37.9 -> 35.4 us, o 10.3 -> 9.8, QKV+RoPE 13.7 -> 13.0 (floors 31.8,
        # 6.0, 7.7).
        if epi == 2:
            return dict(BLOCK_T=bt, BLOCK_N=block_n, BLOCK_K=256, SPLIT=2, DOT=True, num_warps=4,
                        num_stages=3)
        long_k = K >= 8192
        return dict(BLOCK_T=bt, BLOCK_N=64 if long_k else 32, BLOCK_K=256 if long_k else 128,
                    SPLIT=2, DOT=True, num_warps=4, num_stages=4)
    block_k = 128 if K >= 128 else max(16, _np2(K))
    if dtype == torch.float32:
        block_k = min(block_k, 64)
    tiles = triton.cdiv(ncols, block_n)
    kit = triton.cdiv(K, block_k)
    # Split K until about 2 programs per SM (none once the tiles alone fill the SMs: the sweep had
    # gate/up at SPLIT 1 7.6 us vs 8.4 at SPLIT 2). Split-K partials cost 2 * SPLIT * BLOCK_T * N * 4
    # bytes of (L2) traffic: keep that under twice the weight bytes (N * K * 2) at large T.
    # (0.5B down, W1 in place: 19 splits beat 10 by 10 us while down launched as gate/up ended; with
    # every kernel triggering at its wait, 10 beat 19 by 15 us: bench.gpu --ab.)
    split = 1 if tiles >= sms else max(1, min(kit, triton.cdiv(2 * sms, tiles), max(2, K // (2 * bt))))
    iters = triton.cdiv(kit, split)
    split = triton.cdiv(kit, iters)
    return dict(BLOCK_T=bt, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, DOT=True,
                num_warps=4, num_stages=3 if iters > 1 else 2)


# Weight bytes per program loaded before the PDL wait, held in registers until the wait: a whole
# split of up to 32 KB (no loop follows), else at most 16 KB ahead of the pipelined loop; the gated
# GEMM (gate/up, the most bytes per program) takes KernelOptions.gu_pre_kb in either case. H200, W1 in
# place (bench.gpu --ab): 0.5B gate/up with 16 / 32 / 64 KB before the
# wait, span 567.8 / 564.5 / 553.3 us (gate/up 9.60 / 9.54 / 8.83 us), and with the trigger at
# the wait (pdl.trigger) 32 KB read +38 us against 64; at 64 KB, 4 of its 7 steps, sm_90
# ptxas gives 222 registers and no spills (two programs per SM).
PRE_ALL_BYTES, PRE_BYTES = 32 << 10, 16 << 10


def tuned(cfg: dict, role: str, options: KernelOptions = DEFAULTS) -> dict:
    """cfg with options.tune's overrides for this role (bench/ A/B of launch configs in place)."""
    for key, v in options.tune:
        r, _, name = key.partition(".")
        if r == role and v:
            cfg[name] = v
    return cfg


def _finish_config(cfg, K, dtype, epi, weight_bytes, w_elem=None, options: KernelOptions = DEFAULTS):
    """Make SPLIT/ITERS consistent (a config override may set SPLIT or BLOCK_K alone), fit smem,
    and pick PRE: the leading K-steps whose weight tiles load before the PDL wait (a power of two:
    they are one tile), all of them for the small layers (PRE_ALL_BYTES, PRE_BYTES), none where
    pdl.early(weight_bytes, options) says no."""
    cfg = dict(cfg)
    kit = triton.cdiv(K, cfg["BLOCK_K"])
    split = max(1, min(int(cfg.get("SPLIT", 1)), kit))
    iters = triton.cdiv(kit, split)
    cfg["SPLIT"] = triton.cdiv(kit, iters)
    cfg["ITERS"] = iters
    if not cfg.get("DOT", True):
        cfg["BLOCK_T"] = cfg.get("BLOCK_T_FMA", cfg["BLOCK_T"])
    cfg.pop("BLOCK_T_FMA", None)
    if "PRE" not in cfg:
        w_elem = w_elem or (4 if dtype == torch.float32 else 2)  # weight bytes per element
        step = (2 if epi else 1) * cfg["BLOCK_N"] * cfg["BLOCK_K"] * w_elem
        pre = 0
        if early(weight_bytes, options) and cfg.get("DOT", True):
            pre = 1 << (iters.bit_length() - 1)  # the largest power of two <= iters
            def budget(p):
                if epi == 1 and cfg["BLOCK_T"] <= 16:  # (T = 32 at 32 KB already spills)
                    return options.gu_pre_kb << 10
                return PRE_ALL_BYTES if p == iters else PRE_BYTES

            while pre and pre * step > budget(pre):
                pre //= 2
        cfg["PRE"] = pre
    assert 0 <= cfg["PRE"] <= iters and cfg["PRE"] & (cfg["PRE"] - 1) == 0
    return cfg
