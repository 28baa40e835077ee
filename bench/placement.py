"""Does `classify(query)` depend on the thread or the CPU it runs on? (W5: the engine thread runs the
same call 0.2-0.3 ms slower than the main thread in some runs and faster in others.)

    python -m bench.placement [--queries CSV]      (on a CUDA machine; carries .carry/ as bench.gpu)

  threads  a classifier built on the main thread and one built on a persistent worker thread (it
           captures its CUDA graphs there), each timed on both threads, in interleaved rounds
  cpus     a pure-Python loop pinned to each CPU in turn (median of rounds): how unequal the CPUs
           are; then classify() pinned to the fastest and to the slowest of them, and unpinned
Writes $OUT/placement.json (bench/results/placement.json without OUT).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .gpu import real_form_model, wall_times
from .http import load_queries

OUT = Path(os.environ.get("OUT") or "bench/results")


def python_loop_ms() -> float:
    t = time.perf_counter()
    s = 0
    for i in range(100_000):
        s += i * i
    return 1e3 * (time.perf_counter() - t)


def main():
    from prefixscore import Classifier

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", default=".carry/intent_dev.csv")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    it = itertools.cycle(load_queries(a.queries))
    worker = ThreadPoolExecutor(1)  # one persistent thread
    cpus = sorted(os.sched_getaffinity(0))

    def on_worker(fn, cpu=None):
        def run():
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            try:
                return fn()
            finally:
                os.sched_setaffinity(0, set(cpus))
        return worker.submit(run).result()

    def p50(clf):
        return statistics.median(wall_times(lambda: clf.classify(next(it)), a.calls, 100))

    folder = str(real_form_model())
    built_main = Classifier(folder, device="cuda")
    built_worker = on_worker(lambda: Classifier(folder, device="cuda"))
    out = {"threads": [], "cpus": []}
    for r in range(a.rounds):
        row = {"built on main, run on main": p50(built_main),
               "built on main, run on worker": on_worker(lambda: p50(built_main)),
               "built on worker, run on worker": on_worker(lambda: p50(built_worker)),
               "built on worker, run on main": p50(built_worker)}
        out["threads"].append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()), flush=True)
    loops = {c: [] for c in cpus}
    for _ in range(5):
        for c in cpus:
            loops[c].append(on_worker(lambda: min(python_loop_ms() for _ in range(3)), c))
    speed = {c: statistics.median(v) for c, v in loops.items()}
    out["python_loop_ms_per_cpu"] = speed
    print("pure-Python loop per CPU (ms): " + " ".join(f"{c}:{v:.2f}" for c, v in speed.items()))
    fast, slow = min(speed, key=speed.get), max(speed, key=speed.get)
    for r in range(a.rounds):
        row = {f"pinned to the fastest CPU ({fast})": on_worker(lambda: p50(built_main), fast),
               f"pinned to the slowest CPU ({slow})": on_worker(lambda: p50(built_main), slow),
               "worker, unpinned": on_worker(lambda: p50(built_main)), "main": p50(built_main)}
        out["cpus"].append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "placement.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
