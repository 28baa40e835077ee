"""LoRA fine-tuning on the GPU (issue 20 item 4): seconds per epoch and peak memory for 0.5B and 7B
shapes, and the latency of an adapter-merged classifier beside the base model's (same kernels, so
equal within noise). Random weights in the Qwen2.5 shapes with SmolLM2's tokenizer (bench.gpu's
real form), intent_dev's 450 rows; accuracy means nothing here (bench.finetune_cv measures it).

    python -m bench.finetune_gpu --shapes 0.5B,7B --epochs 2   (on the GPU machine: peft and its
                                                               needs as wheels, bench/gpu_wheels.txt)

Writes $OUT/finetune_gpu.json (default bench/results).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

CUE = "Query: {query}\nCategory:"


def model_folder(shape: str, carry: Path) -> Path:
    from bench.gpu import hf_model

    if Path(shape).is_dir():  # a model folder as it is (the CPU smoke run: a tiny model)
        return Path(shape)
    folder = Path(f"/tmp/ft_{shape}")
    if not (folder / "config.json").exists():
        hf = hf_model(shape, vocab=49152)
        hf.save_pretrained(folder)
        del hf
        torch.cuda.empty_cache()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (carry / f).exists():
                shutil.copy(carry / f, folder / f)
    return folder


def p50_ms(clf, queries, n=300, warm=30) -> dict:
    it = iter(queries * (1 + (n + warm) // len(queries)))
    for _ in range(warm):
        clf.classify(next(it))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        clf.classify(next(it))
        ts.append(1e3 * (time.perf_counter() - t))
    ts.sort()
    return {"p50_ms": statistics.median(ts), "p99_ms": ts[int(0.99 * (len(ts) - 1))]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5B,7B")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--carry", default=".carry")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tiny shapes)")
    a = ap.parse_args()
    from prefixscore import Classifier
    from prefixscore.prompt import SEED_TEMPLATE
    from prefixscore.train import finetune, save_adapter

    carry = Path(a.carry)
    with open(carry / "intent_dev.csv", newline="", encoding="utf-8") as f:
        rows = [(r["query"], r["label"]) for r in csv.DictReader(f)]
    out = Path(os.environ.get("OUT") or "bench/results")
    out.mkdir(parents=True, exist_ok=True)
    cuda = a.device.startswith("cuda")
    rec = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu", "rows": len(rows),
           "epochs": a.epochs, "runs": []}
    print(f"{'shape':>5} {'template':>9} {'s/epoch':>8} {'peak GiB':>8} {'base p50':>9} {'adapter p50':>11}")
    for shape in a.shapes.split(","):
        folder = model_folder(shape, carry)
        for name, template, chat in (("cue", CUE, False), ("seed+chat", SEED_TEMPLATE, True)):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            adapter = finetune(rows, model=str(folder), template=template, chat=chat, epochs=a.epochs,
                               patience=a.epochs, device=a.device, progress=False, log=lambda m: None)
            total = time.perf_counter() - t
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            hist = adapter.meta["training"]["history"]
            per_epoch = statistics.median(h["train_seconds"] for h in hist)
            run = {"shape": shape, "template": name, "seconds_total": total,
                   "train_seconds_per_epoch": per_epoch, "peak_gib": peak, "history": hist}
            if name == "cue":  # latency: the merged adapter runs the base model's kernels
                with tempfile.TemporaryDirectory() as d:
                    path = Path(d) / "a.safetensors"
                    save_adapter(path, adapter)
                    qs = [q for q, _ in rows]
                    base = Classifier(str(folder), template, chat=chat, device=a.device)
                    run["base"] = p50_ms(base, qs)
                    del base
                    tuned = Classifier(str(folder), adapter=path, device=a.device)
                    run["adapter"] = p50_ms(tuned, qs)
                    del tuned
            rec["runs"].append(run)
            (out / "finetune_gpu.json").write_text(json.dumps(rec, indent=1))
            lat = (f"{run['base']['p50_ms']:9.3f} {run['adapter']['p50_ms']:11.3f}"
                   if "base" in run else f"{'':9} {'':11}")
            print(f"{shape:>5} {name:>9} {per_epoch:8.1f} {peak:8.1f} {lat}", flush=True)
        if cuda:
            shutil.rmtree(folder, ignore_errors=True)  # disk: the 7B folder is 15 GB
    return 0


if __name__ == "__main__":
    sys.exit(main())
