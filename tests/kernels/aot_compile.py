"""Compile every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

    python tests/kernels/aot_compile.py         (TRITON_INTERPRET unset; run by test_kernels_compile.py)

The interpreter runs the kernels' math on CPU but never compiles them, so a kernel it accepts can
still fail to compile on the GPU. This builds each kernel with the launch configs the production
heuristics pick for the Qwen2.5-0.5B and -7B shapes and runs the whole pipeline to a cubin with
the ptxas that ships in the triton wheel. Prints one line per kernel; exits 1 on the first failure.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"

from prefixscore.kernels import attention_o_triton as AO  # noqa: E402
from prefixscore.kernels import attention_triton as AT  # noqa: E402
from prefixscore.kernels import fused_triton as F  # noqa: E402
from prefixscore.kernels import fp8_triton as Q8  # noqa: E402
from prefixscore.kernels import gemm_config as C  # noqa: E402
from prefixscore.kernels import gemm_triton as G  # noqa: E402
from prefixscore.kernels import label_head_triton as LH  # noqa: E402
from prefixscore.kernels.options import KernelOptions  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SMEM_PER_BLOCK = 227 << 10  # sm_90's most shared memory per block
CPU = torch.device("cpu")  # config heuristics: the interpreter's stand-in for an H200 (132 SMs)
BF16 = torch.bfloat16
# Batch-invariant wide tiles (gemm_config.wide_config): a few registers' worth of stack at most;
# accumulators that do not fit spill by the hundred bytes inside the K loop
WIDE_STACK = 16


def compile_kernel(name, fn, types, consts, num_warps=4, num_stages=2, max_stack=None):
    """types: parameter -> Triton type ("*bf16", "fp32", ...), the rest i32; consts: constexprs.
    max_stack: most bytes of stack frame (registers spilled to local memory) allowed."""
    params = list(inspect.signature(fn.fn).parameters)
    unknown = (set(consts) | set(types)) - set(params)
    assert not unknown, f"{name}: no parameters {unknown}"
    consts = dict(consts, GDC=True)  # the H200 build: programmatic dependent launch (kernels/pdl.py)
    if "TRIG" in params:
        consts.setdefault("TRIG", False)
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    # As a launch specializes them: pointers (torch allocations) and strides 16-aligned. Without
    # this, loads are not vectorized and no loop is pipelined, so registers and shared memory
    # would not be the GPU build's.
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if sig[p].startswith("*") or re.fullmatch(r"stride_\w+|s(q|k|v|pk|pv)_[th]", p)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages,
                                                    "launch_pdl": True})
    assert k.asm.get("cubin"), f"{name}: no cubin"
    # (a build over an SM's shared memory compiles, and fails only at launch)
    assert k.metadata.shared <= SMEM_PER_BLOCK, f"{name}: {k.metadata.shared} B of shared memory"
    assert "griddepcontrol.wait" in k.asm["ptx"], f"{name}: no PDL wait"
    regs, stack = resources(k.asm["cubin"])
    assert max_stack is None or stack <= max_stack, f"{name}: spills ({stack} B of stack, {regs} registers)"
    print(f"ok {name} [{regs} registers, {stack} B stack]", flush=True)
    return k


def resources(cubin: bytes) -> tuple[int, int]:
    """Registers a thread and bytes of stack frame (spills) of a build, as cuobjdump reads them
    (the build's ptxas log is gone once Triton caches it)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(m[1]), int(m[2])


def split_launch(cfg):
    cfg = dict(cfg)
    return cfg, cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)


def skinny(name, T, ncols, K, epi, N, block_n=None, norm=False, resid=False, hq=14, hkv=2, d=64,
           nt=28, trig=False, cfg=None, fp8=False, wide=0, f16=False, inv=False, qk_norm=False):
    """nt: the producer's column tiles, whose sums of squares a NORM prologue adds (unrolled).
    fp8: e4m3 weights with per-row fp32 scales (kernels/fp8.py). inv: batch-invariant mode (sums of
    squares in SSQ_COLS chunks); wide: its config for that many rows (gemm_config.wide_config),
    over row tiles. f16: the dot in fp16 (KernelOptions.fp8_fp16; fp8 only)."""
    cfg = cfg or C.gemm_config(T, ncols, K, epi, BF16, CPU, block_n=block_n, fp8=fp8)
    if wide:
        cfg = C.wide_config(cfg, wide, epi, 2, 1 if fp8 else 2)
        if block_n is None:
            assert cfg["num_stages"] >= 2, cfg
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    cfg = C._finish_config(cfg, K, BF16, epi, N * K * (1 if fp8 else 2), 1 if fp8 else None)
    serial = cfg.pop("SERIAL", False)
    cfg, nw, ns = split_launch(cfg)
    types = {p: "*bf16" for p in ("X", "W", "B", "OUT", "COS", "SIN", "QN", "KN", "QO", "KO", "VO", "R")}
    types.update({"WS": "*fp32", "SSQ_IN": "*fp32", "SSQ_OUT": "*fp32", "CNT": "*i32",
                  "eps": "fp32", "norm_eps": "fp32", "xs": "fp32", "zero": "fp32"})
    if fp8:
        types.update(W="*fp8e4nv", WSC="*fp32")
    consts = dict(N=N, K=K, EPI=epi, HAS_BIAS=epi == 2, NORM=norm, NT=nt, RESID=resid,
                  DOT_PREC="tf32", UPCAST=False, HQ=hq, HKV=hkv, D=d, QK_NORM=qk_norm, TRIG=trig, FP8=fp8,
                  TGRID=bool(wide), F16=f16, SERIAL=serial, SSQ_C=C.SSQ_COLS if inv or wide else 0, **cfg)
    k = compile_kernel(f"skinny {name} fp8={fp8} wide={wide} f16={f16} {cfg}", G._skinny_kernel, types,
                       consts, nw, ns, max_stack=WIDE_STACK if wide else None)
    if f16:  # e4m3 -> fp16 only, one conversion per two weights (gemm_triton.py, F16)
        ptx = k.asm["ptx"]
        assert "cvt.bf16.f16" not in ptx and ".f32.f16.f16.f32" in ptx, f"{name}: e4m3 not multiplied in fp16"


def main():
    # Qwen2.5-0.5B (hidden 896, I 4864, 14/2 heads of 64) and 7B (3584, 18944, 28/4 of 128), T = 16.
    skinny("0.5B qkv+rope+norm", 16, 18 * 32, 896, 2, 1152, block_n=32, norm=True)
    skinny("0.5B gate/up+norm", 16, 4864, 896, 1, 9728, norm=True, nt=14)  # after attention + O
    pre16 = KernelOptions(gu_pre_kb=16)  # the A/B's other value: one step preloaded
    cfg = C._finish_config(C.gemm_config(16, 4864, 896, 1, BF16, CPU), 896, BF16, 1, 9728 * 896 * 2,
                           options=pre16)
    skinny("0.5B gate/up+norm, 16 KB before the wait", 16, 4864, 896, 1, 9728, norm=True, nt=14,
           trig=True, cfg=cfg)
    skinny("0.5B gate/up+norm (T=64)", 64, 4864, 896, 1, 9728, norm=True, nt=14, trig=True)
    skinny("0.5B gate/up+norm, trigger after the wait", 16, 4864, 896, 1, 9728, norm=True, nt=14, trig=2)
    skinny("0.5B down+residual", 16, 896, 4864, 0, 896, resid=True)
    skinny("0.5B down+residual, trigger", 16, 896, 4864, 0, 896, resid=True, trig=True)
    skinny("0.5B o+residual (T=64)", 64, 896, 896, 0, 896, resid=True)
    skinny("7B qkv+rope+norm", 16, 36 * 64, 3584, 2, 4608, block_n=64, norm=True, hq=28, hkv=4, d=128,
           nt=56)  # after down's 64-column tiles
    skinny("7B gate/up+norm", 16, 18944, 3584, 1, 37888, norm=True, nt=112)  # after O's 32
    skinny("7B o+residual", 16, 3584, 3584, 0, 3584, resid=True)
    skinny("7B down+residual", 16, 3584, 18944, 0, 3584, resid=True)
    # FP8 weights (kernels/fp8.py): each epilogue, the preloaded (PRE) and the looped steps
    skinny("0.5B qkv+rope+norm", 16, 18 * 32, 896, 2, 1152, block_n=32, norm=True, fp8=True)
    skinny("0.5B gate/up+norm", 16, 4864, 896, 1, 9728, norm=True, nt=14, trig=True, fp8=True)
    skinny("0.5B down+residual", 16, 896, 4864, 0, 896, resid=True, fp8=True)
    skinny("0.5B o+residual (T=64)", 64, 896, 896, 0, 896, resid=True, fp8=True)
    skinny("7B gate/up+norm", 16, 18944, 3584, 1, 37888, norm=True, nt=112, fp8=True)
    skinny("7B down+residual", 16, 3584, 18944, 0, 3584, resid=True, fp8=True)
    # ... with the dot in fp16 (KernelOptions.fp8_fp16): behind the norm (the 0.5B one preloads), down
    skinny("7B qkv+rope+norm", 16, 36 * 64, 3584, 2, 4608, block_n=64, norm=True, hq=28, hkv=4, d=128,
           nt=56, fp8=True, f16=True)
    skinny("7B gate/up+norm", 16, 18944, 3584, 1, 37888, norm=True, nt=112, fp8=True, f16=True)
    skinny("0.5B gate/up+norm", 16, 4864, 896, 1, 9728, norm=True, nt=14, trig=True, fp8=True, f16=True)
    skinny("7B down+residual", 16, 3584, 18944, 0, 3584, resid=True, fp8=True, f16=True)  # (x * x_scale)
    # batch-invariant mode: the T = 16 configs, and their K splits in wide tiles past 16 rows
    skinny("0.5B down+residual", 16, 896, 4864, 0, 896, resid=True, trig=True, inv=True)
    for fp8 in (False, True):  # each role of both shapes, none spilling (WIDE_STACK)
        skinny("0.5B qkv+rope+norm", 16, 18 * 32, 896, 2, 1152, block_n=32, norm=True, fp8=fp8, wide=4096)
        skinny("0.5B qkv+rope+norm, Qwen3's head norms", 16, 18 * 32, 896, 2, 1152, block_n=32, norm=True,
               fp8=fp8, wide=4096, qk_norm=True)
        skinny("0.5B gate/up+norm", 16, 4864, 896, 1, 9728, norm=True, nt=28, trig=True, fp8=fp8, wide=4096)
        skinny("0.5B down+residual", 16, 896, 4864, 0, 896, resid=True, trig=True, fp8=fp8, wide=4096)
        for T in (40, 4096):
            skinny("0.5B o+residual, split by heads", 16, 896, 896, 0, 896, resid=True, fp8=fp8, wide=T,
                   cfg=dict(C.gemm_config(16, 896, 896, 0, BF16, CPU, fp8=fp8), BLOCK_K=64, SPLIT=14))
        skinny("7B qkv+rope+norm", 16, 36 * 64, 3584, 2, 4608, block_n=64, norm=True, hq=28, hkv=4, d=128,
               nt=56, fp8=fp8, wide=4096)
        skinny("7B gate/up+norm", 16, 18944, 3584, 1, 37888, norm=True, nt=56, fp8=fp8, wide=4096)
        skinny("7B down+residual", 16, 3584, 18944, 0, 3584, resid=True, fp8=fp8, wide=4096)
        skinny("7B o+residual, split by heads", 16, 3584, 3584, 0, 3584, resid=True, fp8=fp8, wide=4096,
               cfg=dict(C.gemm_config(16, 3584, 3584, 0, BF16, CPU, fp8=fp8), BLOCK_K=128, SPLIT=28))

    at_types = {p: "*bf16" for p in ("Q", "K", "V", "PK", "PV", "O")}
    at_types.update({p: "*i32" for p in ("BS", "BE", "OS", "PS", "PE")}, ROWS="*i64", qk_scale="fp32")
    for T, Gq, Hkv, D, ranges in ((16, 7, 4, 128, False), (8, 7, 2, 64, False), (4096, 7, 2, 64, False),
                                  (8, 7, 2, 64, True), (4096, 7, 2, 64, True)):
        cfg, nw, ns = split_launch(AT.attn_config(T, Gq, Hkv, D, BF16, CPU))
        compile_kernel(f"attention T={T} G={Gq} D={D} ranges={ranges} {cfg}", AT._prefix_attn_kernel,
                       at_types, dict(G=Gq, D=D, DOT_PREC="tf32", UPCAST=False, RANGES=ranges,
                                      CANON=False, HAS_ROWS=False, **cfg), nw, ns)
    # batch-invariant mode (rows gather their keys), and the last layer's read-out rows (same order)
    for Gq, Hkv, D, rows in ((7, 2, 64, False), (7, 4, 128, False), (7, 2, 64, True), (7, 4, 128, True)):
        cfg = AT.invariant_attn_config(D)
        cfg, nw, ns = split_launch(cfg)
        compile_kernel(f"attention ({'read-out rows' if rows else 'batch-invariant'}) G={Gq} D={D} {cfg}",
                       AT._prefix_attn_kernel, at_types,
                       dict(G=Gq, D=D, DOT_PREC="tf32", UPCAST=False, RANGES=False, HAS_ROWS=rows, **cfg),
                       nw, ns)

    # Triton compiles an int argument equal to 1 as a constant: a one-key prefix, one token.
    cfg, nw, ns = split_launch(AT.attn_config(1, 7, 2, 64, BF16, CPU))
    compile_kernel(f"attention P=1 T=1 {cfg}", AT._prefix_attn_kernel, at_types,
                   dict(G=7, D=64, DOT_PREC="tf32", UPCAST=False, P=1, T=1, R=1, RANGES=False, CANON=False,
                        HAS_ROWS=False, **cfg), nw, ns)

    ao_types = {p: "*bf16" for p in ("Q", "K", "V", "PK", "PV", "WO", "R", "OUT")}
    ao_types.update({p: "*i32" for p in ("BS", "BE", "OS", "PS", "PE", "CNT")}, SSQ="*fp32", WS="*fp32",
                    qk_scale="fp32")
    for T, trig, in_tile, ranges, fp8 in ((16, False, True, False, False), (64, False, True, False, False),
                                          (16, True, True, False, False), (16, True, False, False, False),
                                          (16, 2, True, False, False), (16, True, True, True, False),
                                          (64, True, False, True, False), (16, 2, True, False, True),
                                          (64, True, False, True, True)):
        cfg, nw, ns = split_launch(AO.attn_o_config(T, 14, 896, 64, BF16, CPU, 1 if fp8 else None))
        cfg["IN_TILE"] = in_tile
        types = {**ao_types, "WO": "*fp8e4nv", "WSC": "*fp32"} if fp8 else ao_types
        compile_kernel(f"attention+O T={T} trigger={trig} ranges={ranges} fp8={fp8} {cfg}",
                       AO._attn_o_kernel, types, dict(N=896, HQ=14, G=7, D=64, DOT_PREC="tf32",
                                                      UPCAST=False, TRIG=trig, RANGES=ranges, FP8=fp8,
                                                      SSQ_C=0, **cfg), nw, ns)
    for fp8 in (False, True):  # batch-invariant mode: the unfused attention's tiles and order
        cfg, nw, ns = split_launch(AO.attn_o_config(16, 14, 896, 64, BF16, CPU, 1 if fp8 else None,
                                                    KernelOptions(batch_invariant=True)))
        types = {**ao_types, "WO": "*fp8e4nv", "WSC": "*fp32"} if fp8 else ao_types
        compile_kernel(f"attention+O batch-invariant fp8={fp8} {cfg}", AO._attn_o_kernel, types,
                       dict(N=896, HQ=14, G=7, D=64, DOT_PREC="tf32", UPCAST=False, TRIG=True,
                            RANGES=False, FP8=fp8, SSQ_C=C.SSQ_COLS, **cfg), nw, ns)

    cfg, nw, ns = split_launch(AO.attn_o_config(1, 14, 896, 64, BF16, CPU))
    compile_kernel(f"attention+O P=1 T=1 {cfg}", AO._attn_o_kernel, ao_types,
                   dict(N=896, HQ=14, G=7, D=64, DOT_PREC="tf32", UPCAST=False, P=1, T=1, RANGES=False,
                        FP8=False, SSQ_C=0, **cfg), nw, ns)

    for R, N in ((1, 19), (512, 19), (1, 9)):  # (1, 9): W1's one tile (ONE)
        cfg, nw, ns = split_launch(LH.head_config(R, N, 896, CPU))
        compile_kernel(f"label head R={R} {cfg}", LH._label_head_kernel,
                       {"X": "*bf16", "ROWS": "*i64", "NW": "*bf16", "W": "*bf16", "ALLOWED": "*u8",
                        "SCORES": "*fp32", "BEST": "*i64", "eps": "fp32"},
                       dict(LOGPROBS=True, DOT_PREC="tf32", UPCAST=False, **cfg), nw, ns)

    for has_w in (False, True):
        compile_kernel(f"rms_norm weight={has_w}", F._rms_norm_kernel,
                       {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
                       dict(HAS_W=has_w, BLOCK=1024))
    compile_kernel("rope_qk", F._rope_qk_kernel,
                   {p: "*bf16" for p in ("qkv_ptr", "cos_ptr", "sin_ptr", "qn_ptr", "kn_ptr", "q_ptr", "k_ptr")}
                   | {"eps": "fp32"}, dict(HQ=14, HKV=2, D=64, NH=16, QK_NORM=False))
    compile_kernel("silu_mul", F._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16"},
                   dict(BLOCK=1024))
    for mode, m in Q8.MODES.items():  # e4m3 activations for the FP8 x FP8 GEMMs
        compile_kernel(f"rows_q8 {mode}", Q8._rows_q8_kernel,
                       {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "eps": "fp32"},
                       dict(MODE=m, BLOCK=2048))
    compile_kernel("embed_rope", F._embed_rope_kernel,
                   {p: "*bf16" for p in ("E", "CT", "ST", "X", "COS", "SIN")}
                   | {"TOK": "*i32", "POS": "*i32", "SSQ": "*fp32"}, dict(BLOCK=1024, BLOCK_D=64))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one line the test can show
        print(f"FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
        sys.exit(1)
