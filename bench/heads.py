"""Prompt mode vs trained label heads on tests/data/intent_dev.csv, bundled model.

    python -m bench.heads                      # 5-fold, few-shot k in {1, 2, 4}; CPU is fine
    python -m bench.heads --folds 3 --shots 1,2 --device cuda

Modes, all on the same stratified folds (seed 0), every row predicted by a mode that did not see it:
  prompt, zero-shot             the seed prompt, label-constrained decoding (the engine's default)
  prompt, k-shot                k examples per label from the other folds in the cached prefix
  head, with instruction        linear head on the read-out hidden state of the seed prompt
  head, no instruction          linear head on the template "{query}" without the chat wrapper:
                                no prefix at all
Latency: 'ms/q batched' = the whole set's forward / rows; 'ms batch-1 p50' = one query per call.
Writes bench/results/heads.json (or $OUT/heads.json).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from prefixscore.weights.loading import obtain
from prefixscore.cli.train import format_confusion_all
from prefixscore.train.fit_heads import FitOptions, compare_modes
from prefixscore.prompt import SEED_LABELS, SEED_TEMPLATE

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "intent_dev.csv"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--shots", default="1,2,4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", default="linear", choices=["linear", "mlp"])
    ap.add_argument("--latency-queries", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with open(a.data, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    loaded = obtain(None, a.device, a.dtype)
    dev, dtype = loaded.lm_head.device, loaded.lm_head.dtype
    t0 = time.perf_counter()
    rep = compare_modes(loaded, [r["query"] for r in rows], [r["label"] for r in rows], SEED_LABELS,
                        SEED_TEMPLATE, shots=[int(k) for k in a.shots.split(",") if k],
                        folds=a.folds, seed=a.seed, opts=FitOptions(kind=a.kind, seed=a.seed),
                        latency_queries=a.latency_queries,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    rep["bench_s"] = time.perf_counter() - t0
    rep["env"] = {"command": "python -m bench.heads " + " ".join(sys.argv[1:]), "model": loaded.name,
                  "device": str(dev), "dtype": str(dtype).removeprefix("torch."),
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    print(format_confusion_all(rep))
    print(f"\n{rep['bench_s']:.0f} s on {dev} ({rep['env']['dtype']}, {torch.get_num_threads()} threads)")
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "heads.json"
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
