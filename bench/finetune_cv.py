"""k-fold cross-validation of `prefixscore finetune` on intent_dev (issue 20), bundled model, CPU.

    python -m bench.finetune_cv --tag query                       # "{query}", no chat, defaults
    python -m bench.finetune_cv --tag seed --template seed --chat # the seed prompt in its template
    python -m bench.finetune_cv --tag q-head --objective head --only-folds 0

Every row is predicted once, by the adapter of the fold that held it out, through the engine
(Classifier(adapter=...): merged weights, the user's path). Per fold: accuracy, macro-F1, Chinese
rows (Han characters, no kana), fine-tune seconds, best epoch; pooled over the predicted rows at
the end. Writes bench/results/finetune_cv_<tag>.json after every fold (a long run keeps its folds).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from prefixscore import Classifier
from prefixscore.train.fit_heads import stratified_folds
from prefixscore.prompt import SEED_LABELS, SEED_TEMPLATE
from prefixscore.rows.report import confusion_report
from prefixscore.train import finetune, save_adapter

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "intent_dev.csv"
HAN, KANA = re.compile(r"[\u4e00-\u9fff]"), re.compile(r"[\u3040-\u30ff]")


def chinese(q: str) -> bool:
    return bool(HAN.search(q)) and not KANA.search(q)


def metrics(rows, pred, labels) -> dict:
    gold = [l for _, l in rows]
    zh = [i for i, (q, _) in enumerate(rows) if chinese(q)]
    rep = confusion_report(gold, pred, labels)
    return {"rows": len(rows), "accuracy": rep["accuracy"], "macro_f1": rep["macro_f1"],
            "f1": rep["f1"], "confusion": rep["confusion"], "chinese_rows": len(zh),
            "chinese_accuracy": sum(gold[i] == pred[i] for i in zh) / max(1, len(zh))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--tag", required=True)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--only-folds", default=None, help="comma-separated fold ids (default: all)")
    ap.add_argument("--template", default="{query}", help="a template, or 'seed' for the seed prompt")
    ap.add_argument("--chat", action="store_true", help="wrap in the chat template (default: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--refit", action="store_true", default=None)
    ap.add_argument("--extra", action="append", default=[],
                    help="a CSV of training rows added to every fold's training part (never tested)")
    ap.add_argument("--model", default=None, help="default: the bundled model (a .gguf file of it on a GPU host)")
    ap.add_argument("--device", default="cpu", help="where it trains (it predicts on the CPU, the default path)")
    ap.add_argument("--dtype", default=None, help="the frozen base weights' in training (default: fp32 on CPU, bf16 on a GPU)")
    ap.add_argument("--final", default=None, help="then train on every row of --data and --extra and write the adapter here")
    for k, t in (("objective", str), ("rank", int), ("alpha", float), ("lr", float), ("epochs", int),
                 ("patience", int), ("batch_size", int), ("val_fraction", float), ("dropout", float),
                 ("label_smoothing", float), ("weight_decay", float)):
        ap.add_argument("--" + k.replace("_", "-"), type=t, default=None)
    a = ap.parse_args()
    template = SEED_TEMPLATE if a.template == "seed" else a.template
    with open(a.data, newline="", encoding="utf-8") as f:
        rows = [(r["query"], r["label"]) for r in csv.DictReader(f)]
    labels = list(SEED_LABELS)
    extra = []
    for path in a.extra:
        with open(path, newline="", encoding="utf-8") as f:
            extra += [(r["query"], r["label"]) for r in csv.DictReader(f)]
    seen = {" ".join(q.lower().split()) for q, _ in rows}
    overlap = [q for q, _ in extra if " ".join(q.lower().split()) in seen]
    if overlap:  # a tested row in the training part would flatter every fold
        raise SystemExit(f"--extra repeats {len(overlap)} rows of --data, e.g. {overlap[:3]}")
    fold = stratified_folds([labels.index(l) for _, l in rows], a.folds, a.seed)
    which = range(a.folds) if a.only_folds is None else [int(x) for x in a.only_folds.split(",")]
    recipe = {k: getattr(a, k) for k in ("objective", "rank", "alpha", "lr", "epochs", "patience",
                                         "batch_size", "val_fraction", "dropout", "label_smoothing",
                                         "weight_decay", "refit") if getattr(a, k) is not None}
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"finetune_cv_{a.tag}.json"
    rec = {"tag": a.tag, "template": template, "chat": a.chat, "recipe": recipe, "folds": a.folds,
           "extra": [os.path.basename(p) for p in a.extra], "extra_rows": len(extra),
           "device": a.device, "dtype": a.dtype,
           "seed": a.seed, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "host": platform.node(), "per_fold": []}
    pooled_rows, pooled_pred = [], []
    print(f"{'fold':>4} {'acc':>6} {'F1':>6} {'zh':>6} {'secs':>6} {'best':>4}")
    for k in which:
        train = [r for r, f in zip(rows, fold) if f != k] + extra
        test = [r for r, f in zip(rows, fold) if f == k]
        t = time.perf_counter()
        adapter = finetune(train, model=a.model, template=template, labels=labels, chat=a.chat,
                           seed=a.seed, progress=False, log=lambda m: None, device=a.device,
                           dtype=a.dtype, **recipe)
        secs = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "fold.adapter.safetensors"
            save_adapter(path, adapter)
            clf = Classifier(a.model, adapter=path, device="cpu", graphs=False)  # the default path
            pred = [r.label for r in clf.classify_batch([q for q, _ in test])]
        m = metrics(test, pred, labels)
        tr = adapter.meta["training"]
        m |= {"fold": k, "seconds": round(secs, 1), "best_epoch": tr["best_epoch"],
              "epochs_run": tr["epochs_run"], "val_acc": tr.get("val_acc"), "history": tr["history"]}
        rec["per_fold"].append(m)
        pooled_rows += test
        pooled_pred += pred
        rec["pooled"] = metrics(pooled_rows, pooled_pred, labels)
        out.write_text(json.dumps(rec, indent=1))
        print(f"{k:>4} {m['accuracy']:6.3f} {m['macro_f1']:6.3f} {m['chinese_accuracy']:6.3f} "
              f"{secs:6.0f} {tr['best_epoch']:>4}", flush=True)
    if a.final:
        t = time.perf_counter()
        adapter = finetune(rows + extra, model=a.model, template=template, labels=labels, chat=a.chat,
                           seed=a.seed, progress=False, log=lambda m: None, device=a.device,
                           dtype=a.dtype, **recipe)
        save_adapter(a.final, adapter, dtype=torch.bfloat16)
        rec["final"] = {"path": os.path.basename(a.final), "seconds": round(time.perf_counter() - t, 1),
                        "bytes": os.path.getsize(a.final)}
        out.write_text(json.dumps(rec, indent=1))
    p = rec["pooled"]
    print(f"pooled {p['accuracy']:.3f} acc, {p['macro_f1']:.3f} macro-F1, {p['chinese_accuracy']:.3f} "
          f"Chinese ({p['chinese_rows']} rows), {p['rows']} rows -> {out}")


if __name__ == "__main__":
    sys.exit(main())
