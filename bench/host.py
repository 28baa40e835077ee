"""Where the host time of one `classify(query)` call goes, on the main thread and on a worker thread.

    python -m bench.host [--calls 400] -- --model PATH --device cuda   (after --: serve flags)

The server runs the engine on its own thread, and there the same call measured ~0.4 ms slower
(BENCHMARKS.md, W5). This times each phase of the call by wrapping the functions that do it
(tokenize, plan, graph replay launch, wait for the GPU, score assembly; "copies" is the rest of the
graph runner's call: filling the pinned buffers and queueing the H2D/D2H copies) in four modes:
  main      the calling thread
  worker    a worker thread, timed inside it (no hand-off)
  pinned    the worker thread pinned to one CPU (the last, as `prefixscore serve --engine-cpu auto`)
  handoff   submit(classify).result() from the main thread, timed there (two thread wake-ups)
On CPU, "copies" is the whole eager forward. Prints a table of phase medians (µs) and writes
$OUT/host.json (bench/results/host.json).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from .http import load_queries

OUT = Path(os.environ.get("OUT") or "bench/results")
PHASES = ["tokenize", "plan", "copies", "replay", "wait", "assemble", "other"]


class Phases:
    """Accumulates seconds per phase for the call in progress (one call at a time)."""

    def __init__(self):
        self.cur: dict[str, float] = {}

    def wrap(self, obj, name, phase):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[phase] = self.cur.get(phase, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)


def instrument(clf) -> Phases:
    import torch

    import prefixscore.classifier as C
    import prefixscore.engine as E

    ph = Phases()
    ph.wrap(clf.prompt, "encode_many", "tokenize")  # classify() and the server both come here
    ph.wrap(C, "plan_classify", "plan")
    ph.wrap(clf.trie, "assemble", "assemble")
    ph.wrap(clf.trie, "assemble_one", "assemble")  # one request: classify()'s path
    if clf.engine.device.type == "cuda":
        ph.wrap(E.GraphRunner, "run", "runner")  # copies = runner - replay - wait
        ph.wrap(torch.cuda.CUDAGraph, "replay", "replay")
        ph.wrap(torch.cuda.Stream, "synchronize", "wait")
    else:
        ph.wrap(clf.engine, "run", "runner")
    return ph


def run_calls(clf, ph: Phases, queries, n) -> list[dict]:
    rows = []
    for q in itertools.islice(queries, n):
        ph.cur = {}
        t = time.perf_counter()
        clf.classify(q)
        total = time.perf_counter() - t
        c = ph.cur
        row = {k: c.get(k, 0.0) for k in ("tokenize", "plan", "replay", "wait", "assemble")}
        row["copies"] = c.get("runner", 0.0) - row["replay"] - row["wait"]
        row["other"] = total - sum(c.get(k, 0.0) for k in ("tokenize", "plan", "runner", "assemble"))
        row["total"] = total
        rows.append(row)
    return rows


def summary(rows):
    return {k: 1e6 * statistics.median(r[k] for r in rows) for k in PHASES + ["total"]} | {
        "total_p99_us": 1e6 * sorted(r["total"] for r in rows)[int(0.99 * (len(rows) - 1))]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--queries", help="CSV with a query column (default: shared intent_dev.csv)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:split])
    from prefixscore.cli import build_parser
    from prefixscore.cmdline import make_classifier

    clf = make_classifier(build_parser().parse_args(["serve", *argv[split + 1:]]))
    queries = itertools.cycle(load_queries(a.queries))
    for _ in range(50):
        clf.classify(next(queries))
    ph = instrument(clf)
    res = {"device": str(clf.engine.device), "calls": a.calls, "modes": {}}
    pool = ThreadPoolExecutor(1)
    cpu = os.sched_getaffinity(0)

    @contextmanager
    def pinned_to(cpus):
        old = os.sched_getaffinity(0)  # pid 0: the calling thread only
        os.sched_setaffinity(0, cpus)
        try:
            yield
        finally:
            os.sched_setaffinity(0, old)

    def pinned_calls():
        with pinned_to({max(cpu)}):
            return run_calls(clf, ph, queries, a.calls)

    for mode in ("main", "worker", "pinned", "main"):
        run_calls(clf, ph, queries, 30) if mode == "main" else pool.submit(run_calls, clf, ph, queries, 30).result()
        if mode == "main":
            rows = run_calls(clf, ph, queries, a.calls)
        elif mode == "worker":
            rows = pool.submit(run_calls, clf, ph, queries, a.calls).result()
        else:
            rows = pool.submit(pinned_calls).result()
        key = mode if mode not in res["modes"] else mode + "_again"
        res["modes"][key] = summary(rows)
    hand = []
    for q in itertools.islice(queries, a.calls):
        t = time.perf_counter()
        pool.submit(clf.classify, q).result()
        hand.append(time.perf_counter() - t)
    res["modes"]["handoff"] = {"total": 1e6 * statistics.median(hand),
                               "total_p99_us": 1e6 * sorted(hand)[int(0.99 * (len(hand) - 1))]}
    pool.shutdown()

    cols = list(res["modes"])
    print(f"{'phase (median µs)':<18}" + "".join(f"{c:>12}" for c in cols))
    for k in PHASES + ["total", "total_p99_us"]:
        print(f"{k:<18}" + "".join(f"{res['modes'][c].get(k, float('nan')):>12.1f}" for c in cols))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "host.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
