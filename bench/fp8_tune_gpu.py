"""FP8 weights at batch 1 on the 7B shape, launch configs A/B'd in place (issue 23's W4: <= 2.2 ms;
fifteenth session: e4m3 4.13 ms against bf16 3.69 at bf16's configs).

Each variant: kernels.TUNE overrides for every skinny-GEMM role (qkv, gu, down), a fresh engine
over the same HF weights with graphs up to 16 tokens, W4's GPU time (one 8-token request, graph
replay, CUDA events; p50 of 100 after warm-up), and the largest score difference from the fp8
default over 16 requests (a config changes the summation, not the math). Isolated kernels timed
from Python are host-bound at ~90 us, so only in-place numbers count here.

    device run:  python -m bench.fp8_tune_gpu     (writes $OUT/fp8_tune_gpu.json)
"""
from __future__ import annotations

import json

import numpy as np
import torch

from bench.gpu import OUT, Synthetic, gpu_times, hf_model, random_suffixes, stats
from prefixscore import kernels

ROLES = ("qkv", "gu", "down")


def every(**kw):
    return {f"{r}.{k}": v for r in ROLES for k, v in kw.items() if not (r == "qkv" and k == "BLOCK_N")}


# (first run, fifteenth session, bench/results/fp8_tune_gpu_s15a.json: bf16 3.686, fp8 4.129, swap
# 5.239, K256 3.421, K512 / K256+stages6 out of shared memory, stages6 3.520, N64 4.696, split4
# 3.317, K256+warps8 4.564 ms; swap, N64 and 8 warps lose everywhere)
# (second round, after FP8_WIDE = {"SPLIT": 4} became the default: what still adds to it)
VARIANTS = [
    ("fp8", True, {}),
    ("fp8 +K256", True, every(BLOCK_K=256)),
    ("fp8 +stages6", True, every(num_stages=6)),
    ("fp8 split8", True, every(SPLIT=8)),
    ("bf16", False, {}),
]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    hf = hf_model("7B")
    one, sixteen = random_suffixes(1, seed=9), random_suffixes(16, seed=10)
    res, ref = {"device": torch.cuda.get_device_name(), "variants": {}}, None
    for name, fp8, tune in VARIANTS:
        kernels.TUNE = tune
        try:
            ours = Synthetic(hf, max_tokens=16 * 8, fp8=fp8)
            r = {"tune": tune, "w4_gpu": stats(gpu_times(ours.replay_fn(one), 100, 10))}
            got = ours.classify_ids(sixteen)[0]
            if name == "fp8":
                ref = got
            r["max_abs_vs_fp8_default"] = None if ref is None or not fp8 else float(np.abs(got - ref).max())
        except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: recorded)
            r = {"tune": tune, "error": repr(e)[:300]}
        finally:
            kernels.TUNE = {}
        res["variants"][name] = r
        print(name, json.dumps(r), flush=True)
        ours = None
        torch.cuda.empty_cache()
        (OUT / "fp8_tune_gpu.json").write_text(json.dumps(res, indent=1))
    print(f"\n{'variant':<22} {'W4 gpu p50 ms':>13} {'max|d| vs fp8':>13}")
    for name, r in res["variants"].items():
        if "w4_gpu" in r:
            d = r["max_abs_vs_fp8_default"]
            print(f"{name:<22} {r['w4_gpu']['p50_ms']:13.3f} {'' if d is None else f'{d:13.4f}'}")
        else:
            print(f"{name:<22} {r['error'][:60]}")


if __name__ == "__main__":
    main()
