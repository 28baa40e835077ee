"""CPU latency of the bundled model on the real workload, next to Hugging Face in the same run.

    python -m bench.cpu [--n 100]        (writes bench/results/cpu.json, or $OUT/cpu.json)

Rows, per query, on intent_dev.csv queries with the seed prompt in the chat template:
  prefixscore classify(query)          batch 1, whole call (tokenize + plan + forward + scores)
  prefixscore classify_batch(64)       per query
  HF generate, full prompt, batch 1    AutoModelForCausalLM.generate restricted to the label trie
                                       (what the engine's decision equals), greedy
  HF forward, full prompt, batch 1     one forward over the whole prompt (a lower bound for HF)
  HF generate, full prompt, batch 64   left-padded batch, per query
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from prefixscore import Classifier
from prefixscore.weights.loading import bundled_model_path, converted_folder

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def timed(fn, n, warmup=3):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t))
    return out


def summary(ms, per=1):
    ms = sorted(m / per for m in ms)
    return {"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
            "n": len(ms)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100, help="timed calls per row")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads for every row")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    # (tests/ itself on sys.path would make tests/kernels shadow the `kernels` package that
    # transformers imports: the repository root is, as `python -m bench.cpu` runs from it)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.hf_reference import hf_generate
    from transformers import AutoModelForCausalLM

    with open(DATA / "intent_dev.csv", newline="") as f:
        queries = [r["query"] for r in csv.DictReader(f)]
    clf = Classifier(device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(converted_folder(bundled_model_path()), dtype=torch.float32).eval()
    eos = clf.loaded.tokenizer.eos_token_id
    it = iter(queries * 100)
    rows = {}
    rows["prefixscore classify, batch 1"] = summary(timed(lambda: clf.classify(next(it)), a.n))
    nb = max(3, a.n // 10)
    rows["prefixscore classify_batch, batch 64 (per query)"] = summary(
        timed(lambda: clf.classify_batch(queries[:64]), nb, 1), per=64)
    ids = iter([clf.encode(q).ids for q in queries] * 100)
    rows["HF generate, full prompt, batch 1"] = summary(
        timed(lambda: hf_generate(hf, [next(ids)], clf.trie, eos), a.n))

    @torch.no_grad()
    def hf_forward():
        hf(input_ids=torch.tensor([next(ids)]), logits_to_keep=1)

    rows["HF forward only, full prompt, batch 1"] = summary(timed(hf_forward, a.n))
    batch_ids = [clf.encode(q).ids for q in queries[:64]]
    rows["HF generate, full prompt, batch 64 (per query)"] = summary(
        timed(lambda: hf_generate(hf, batch_ids, clf.trie, eos, batch=64), nb, 1), per=64)
    ours, peer = rows["prefixscore classify, batch 1"]["p50_ms"], rows["HF generate, full prompt, batch 1"]["p50_ms"]
    res = {"threads": torch.get_num_threads(), "prefix_tokens": clf.prefix_len, "rows": rows,
           "speedup_batch1_vs_hf_generate": peer / ours}
    out = Path(os.environ.get("OUT") or "bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(res, indent=1))
    print(f"CPU, {res['threads']} threads, bundled SmolLM2-135M fp32, prefix {clf.prefix_len} tokens cached")
    print(f"{'row':50s} {'p50 ms':>9s} {'p99 ms':>9s}")
    for k, v in rows.items():
        print(f"{k:50s} {v['p50_ms']:9.2f} {v['p99_ms']:9.2f}")
    print(f"batch-1 speed-up over HF generate: {res['speedup_batch1_vs_hf_generate']:.1f}x")


if __name__ == "__main__":
    main()
