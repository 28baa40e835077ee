"""Text in vs token ids in, on the same rows in the same run: does the in-process API hide its
tokenizer behind the engine? (Issue "serve at engine speed", item 2; targets: text >= 90% of ids.)

    python -m bench.overlap -- --model /tmp/q05 --device cuda      (the H200 run)
    python -m bench.overlap --rows 256 --items 10 --requests 2     (a CPU smoke run, bundled model)

  W2 text   Classifier.classify_batch(queries): tokenizing chunk k+1 on a worker thread while the
            engine runs chunk k; the seed prompt in its chat template, real queries (intent_dev.csv,
            cycled to --rows)
  W2 ids    Classifier.classify_encoded(encoded) on the same queries tokenized beforehand
  W3 text   Scorer.score_batch([(query, items)]): ~50-token queries, --items items of ~150 tokens,
            built from real queries; the W3 yes/no prompt
  W3 ids    Scorer.run(prepared) on the same requests prepared beforehand
Each form runs --repeats times, interleaved (text, ids, text, ids ...) after a warm-up; the table
shows the median rate and writes $OUT/overlap.json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT") or "bench/results")
DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "intent_dev.csv"
W3_TEMPLATE = ("Is the item relevant to the query? Answer yes or no.\nQuery: {query}\nItem: {item}")


def queries():
    with open(DATA, newline="", encoding="utf-8") as f:
        return [r["query"] for r in csv.DictReader(f)]


def texts_of(tok, qs, n_tokens, count, offset):
    """count texts of about n_tokens each, real queries joined with ', '."""
    out, i = [], offset
    for _ in range(count):
        words, n = [], 0
        while n < n_tokens:
            q = qs[i % len(qs)]
            words.append(q)
            n += len(tok(q, add_special_tokens=False)["input_ids"]) + 1
            i += 1
        out.append(", ".join(words))
    return out


def model_flags(rest: list[str], known: bool = False):
    """The flags after `--`: -> (--model, --device, --dtype as a namespace, the flags as given).
    known: other flags may follow (a server's), else they are an error."""
    flags = rest[1:] if rest[:1] == ["--"] else rest
    fa = argparse.ArgumentParser()
    for f in ("--model", "--device", "--dtype"):
        fa.add_argument(f)
    return (fa.parse_known_args(flags)[0] if known else fa.parse_args(flags)), flags


def sync(device):
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def rate(fn, n, device, repeats):
    """Rows per second of fn() for each repeat (n rows per call)."""
    out = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(n / (time.perf_counter() - t))
    return out


def interleaved(forms: dict, n, device, repeats):
    for fn in forms.values():  # warm-up: graphs, allocator, the tokenizer's thread pool
        fn()
    rates = {k: [] for k in forms}
    for _ in range(repeats):
        for k, fn in forms.items():
            rates[k] += rate(fn, n, device, 1)
    return {k: {"median_per_s": statistics.median(v), "all": v} for k, v in rates.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096, help="W2 queries per call")
    ap.add_argument("--requests", type=int, default=8, help="W3 requests per call")
    ap.add_argument("--items", type=int, default=100, help="W3 items per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("model_flags", nargs=argparse.REMAINDER, help="-- --model PATH --device cuda ...")
    a = ap.parse_args(argv)
    m, _ = model_flags(a.model_flags)

    from prefixscore import Classifier, Scorer

    clf = Classifier(m.model, device=m.device, dtype=m.dtype)
    device = clf.engine.device
    qs = queries()
    rows = [qs[i % len(qs)] for i in range(a.rows)]
    encoded = clf.encode_many(rows)
    out = {"device": str(device), "model": clf.loaded.name, "rows": a.rows}
    out["w2"] = interleaved({"text": lambda: clf.classify_batch(rows),
                             "ids": lambda: clf.classify_encoded(encoded)}, a.rows, device, a.repeats)
    want = [r.label for r in clf.classify_encoded(encoded)]
    out["w2"]["same_labels"] = [r.label for r in clf.classify_batch(rows)] == want

    sc = Scorer(clf.loaded, W3_TEMPLATE, ["yes", "no"], mode="softmax", max_batch_tokens=clf.max_batch_tokens)
    tok = clf.loaded.tokenizer
    reqs = [(texts_of(tok, qs, 50, 1, 97 * k)[0], texts_of(tok, qs, 150, a.items, 13 * k))
            for k in range(a.requests)]
    prepared = [sc.prepare(q, items) for q, items in reqs]
    n_items = a.requests * a.items
    out["w3"] = interleaved({"text": lambda: sc.score_batch(reqs),
                             "ids": lambda: sc.run(prepared)}, n_items, device, a.repeats)
    out["w3"]["tokens_per_item"] = statistics.mean(len(x) for p in prepared for x in getattr(p, "items", [[0]]))
    del clf, sc

    print(f"{'workload':10s} {'text /s':>10s} {'ids /s':>10s} {'text/ids':>9s}  target")
    for w, unit in (("w2", "req"), ("w3", "items")):
        t, i = out[w]["text"]["median_per_s"], out[w]["ids"]["median_per_s"]
        out[w]["ratio"] = t / i
        print(f"{w:10s} {t:10.0f} {i:10.0f} {t / i:9.2f}  >= 0.90 ({unit}/s; {a.repeats} runs, median)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "overlap.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / 'overlap.json'}")


if __name__ == "__main__":
    main()
