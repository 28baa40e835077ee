"""GPU time of one request by token-count bucket (H200; why engine.BUCKETS starts at 1).

    python -m bench.buckets [--shape 0.5B] [--rounds 2]

Synthetic form of bench.gpu (random weights of the shape, 48-token prefix, 9 single-token labels).
For b = 1, 2, 4, 8, 16: one request of b tokens, so it fills the bucket of exactly b tokens, and
the median GPU time of that bucket's graph replay (CUDA events). A bucket's graph does its padding
tokens' work too, so this is what a b-token request costs against being padded to a larger bucket.
Writes $OUT/buckets.json.
"""
from __future__ import annotations

import argparse
import json

import torch

from prefixscore.batch import plan_classify

from .gpu import OUT, PREFIX, SHAPES, Synthetic, gpu_times, hf_model, stats

SIZES = (1, 2, 4, 8, 16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="0.5B")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ours = Synthetic(hf_model(a.shape), max_tokens=max(SIZES))
    assert set(SIZES) <= set(ours.runner.buckets), ours.runner.buckets
    g = torch.Generator().manual_seed(3)
    res = {"device": torch.cuda.get_device_name(), "shape": a.shape, "capture": ours.capture, "rows": []}
    for r in range(a.rounds):
        for b in SIZES:
            suffix = [torch.randint(100, 30000, (b,), generator=g).tolist()]
            ours.engine.run(plan_classify(suffix, [PREFIX], ours.trie), ours.prefix, ours.weight, True)
            row = dict(round=r, tokens=b, **stats(gpu_times(ours.runner.graphs[b].replay)))
            res["rows"].append(row)
            print(f"round {r}  bucket {b:2d}  p50 {row['p50_ms']:.4f} ms  p99 {row['p99_ms']:.4f}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "buckets.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
