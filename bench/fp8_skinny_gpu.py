"""Why FP8 weights did not beat bf16 at batch 1 (issue 23; H200 fifteenth session: 7B W4 4.16 ms
fp8 vs 3.75 bf16), kernel by kernel, and how close FP8 per-channel quantization alone lets any
kernel get to HF fp32's decisions.

  kernels   the 7B layers' skinny GEMMs at T = 1 (one 16-row tile) in isolation: bf16 and e4m3
            weights at the default launch config, then e4m3 over a grid of launch configs with the
            MMA operands as today (x @ w^T, M = 16 rows) and swapped (w @ x^T: the weight tile is
            the MMA's M = BLOCK_N side, converted in registers). GPU time p50 and the weight-read
            rate (weight bytes / time).
  quant     HF fp32 on the weights quantized per output channel to e4m3 and back (no kernel of
            ours): decisions against HF fp32 on the unquantized weights, the same 500 requests
            as bench.fp8_gpu's fidelity -- the agreement that quantization alone leaves.

    device run:  python -m bench.fp8_skinny_gpu [--budget S] [--skip-quant]   (writes $OUT/fp8_skinny_gpu.json)
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import time

import torch

from bench.gpu import OUT, gpu_times
from prefixscore.kernels import fp8 as F8
from prefixscore.kernels.gemm_triton import gate_up_silu_small, linear_small

# 7B (Qwen2.5-7B): hidden 3584, intermediate 18944, 28 / 4 heads of 128
LAYERS = {"gate_up": (2 * 18944, 3584, 1), "down": (3584, 18944, 0), "qkv": (4608, 3584, 0),
          "o": (3584, 3584, 0)}
GRID = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT=sp, num_stages=st)
        for bn, bk in ((64, 256), (128, 256), (64, 128), (128, 128), (32, 256), (32, 128))
        for sp in (1, 2, 4) for st in (4,)]


def time_us(fn) -> float:
    return 1e3 * statistics.median(gpu_times(fn, 60, 10, warm_s=0.05))


def kernels(budget_s: float) -> dict:
    """budget_s: seconds of the config grid (compiles included), shared evenly by the layers."""
    out = {}
    x = torch.randn(1, 3584, device="cuda", dtype=torch.bfloat16)
    for name, (N, K, epi) in LAYERS.items():
        xk = x if K == 3584 else torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        w8 = F8.Fp8Weight.quantize(w16)
        op = gate_up_silu_small if epi == 1 else linear_small
        r = out[name] = {"floor_bf16_us": N * K * 2 / 4.8e6, "floor_fp8_us": N * K / 4.8e6}
        r["bf16"] = time_us(lambda: op(xk, w16))
        r["fp8"] = time_us(lambda: op(xk, w8))
        r["fp8_swap"] = time_us(lambda: op(xk, w8, config={"SWAP": True}))
        print(name, json.dumps(r), flush=True)
        ref = op(xk, w8).float()
        grid = r["grid"] = []
        deadline = time.time() + budget_s / len(LAYERS)
        for cfg in GRID:
            for swap in (False, True):
                if time.time() > deadline:
                    break
                c = {**cfg, "SWAP": swap}
                try:
                    got = op(xk, w8, config=c).float()
                    err = float((got - ref).abs().max() / ref.abs().max())
                    grid.append({**c, "us": time_us(lambda: op(xk, w8, config=c)), "rel_err": err})
                except Exception as e:  # noqa: BLE001 (a config that does not fit: recorded)
                    grid.append({**c, "error": repr(e)[:200]})
        ok = [g for g in grid if "us" in g]
        for swap in (False, True):
            best = min((g for g in ok if g["SWAP"] == swap), key=lambda g: g["us"], default=None)
            r[f"best_{'swap' if swap else 'plain'}"] = best
        print(name, "best", json.dumps({k: r[k] for k in ("bf16", "fp8", "best_plain", "best_swap")}),
              flush=True)
    return out


def quant(shape: str, n: int = 500) -> dict:
    """HF fp32 with e4m3-per-channel round-tripped linear weights vs HF fp32 (bench.fp8_gpu's
    requests and clear-margin rule)."""
    from bench.gpu import PREFIX, hf_model, hf_reference, random_suffixes

    hf = hf_model(shape)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(100, 30000, (PREFIX,), generator=g).tolist()  # as bench.gpu.Synthetic
    sfx = random_suffixes(n, seed=123)
    hf32 = copy.deepcopy(hf).float()
    del hf
    ref = hf_reference(hf32, prefix, sfx)
    with torch.no_grad():
        for name, p in hf32.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.copy_(F8.Fp8Weight.quantize(p).dequantize())
    got = hf_reference(hf32, prefix, sfx)
    del hf32
    torch.cuda.empty_cache()
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    want, dec = ref.argmax(-1), got.argmax(-1)
    return {"n": n, "agree_with_hf_fp32": int((dec == want).sum()),
            "max_abs_diff_vs_hf_fp32": float((got - ref).abs().max()),
            "flips_on_clear_margin": int(((dec != want) & clear).sum())}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["kernels"] = kernels(float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv
                             else 120)
    (OUT / "fp8_skinny_gpu.json").write_text(json.dumps(res, indent=1))
    print(f"\n{'layer':<8} {'floor16':>8} {'floor8':>7} {'bf16':>7} {'fp8':>7} {'fp8 swap':>8} "
          f"{'best plain':>10} {'best swap':>10}  (us)")
    for name, r in res["kernels"].items():
        bp, bs = r.get("best_plain") or {}, r.get("best_swap") or {}
        print(f"{name:<8} {r['floor_bf16_us']:8.1f} {r['floor_fp8_us']:7.1f} {r['bf16']:7.1f} "
              f"{r['fp8']:7.1f} {r['fp8_swap']:8.1f} {bp.get('us', 0):10.1f} {bs.get('us', 0):10.1f}")
    if "--skip-quant" not in sys.argv:
        res["quant"] = {}
        for shape in ("0.5B", "7B"):
            res["quant"][shape] = quant(shape)
            print("quant", shape, json.dumps(res["quant"][shape]), flush=True)
            (OUT / "fp8_skinny_gpu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
