"""Host time of one call for two classifiers of the bundled model, with the forward pass stubbed out
(engine.run returns zeros): what the fused path (many.decide_many over a bank) adds on the host
beside one classifier's own call, whatever the device. Median and p99 over --calls after warm-up.

    python -m bench.many_host [--calls 3000]          (writes $OUT/many_host.json)
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.gpu import stats, wall_times
from prefixscore import Classifier
from prefixscore.many import decide_many

GENDER = dict(template="Who is this product for? Answer women, men, kids or unisex.\nquery: {query}",
              labels=["women", "men", "kids", "unisex"])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args(argv)
    m = Classifier.many({"category": {}, "gender": GENDER}, device="cpu")
    cat, gen = m["category"], m["gender"]

    def no_forward(plan, kv, weight, logprobs=True):
        return torch.zeros(plan.rows.shape[0], weight.shape[0]), torch.zeros(plan.rows.shape[0], dtype=torch.int64)

    cat.engine.run = no_forward  # (one engine: both classifiers and the bank)
    q = "red linen summer dress for women"
    ea, eb = cat.encode(q), gen.encode(q)
    res = {"one_us": stats([1e3 * t for t in wall_times(lambda: cat.decide_encoded([ea]), a.calls, 200)]),
           "two_in_turn_us": stats([1e3 * t for t in wall_times(
               lambda: (cat.decide_encoded([ea]), gen.decide_encoded([eb])), a.calls, 200)]),
           "two_fused_us": stats([1e3 * t for t in wall_times(
               lambda: decide_many([cat, gen], [[ea], [eb]]), a.calls, 200)])}
    print(f"{'host, forward stubbed':<24} {'p50 us':>8} {'p99 us':>8}")
    for k, v in res.items():
        print(f"{k:<24} {v['p50_ms']:8.1f} {v['p99_ms']:8.1f}")  # (stats names its keys _ms)
    out = Path(os.environ.get("OUT") or "bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "many_host.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
