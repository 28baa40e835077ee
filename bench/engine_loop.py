"""The engine loop's host work (issue 48), in process, on the GPU: what each kind of pass costs the
host, how busy the loop keeps the GPU, and the one-item score call.

    python -m bench.engine_loop -- --model /tmp/q05 --device cuda          (the H200 run)
    python -m bench.engine_loop --quick                                      (a CPU smoke run)

  passes     per kind of pass, p50 / p99 of the host's time to launch it (planning, copies,
             launches: what the GPU waits on unless the pass before covers it) and of the whole
             pass (launch to answer): classify 1 and 64 real queries, multi-item 8 items (the
             scorer's labels with softmax; SGLang's default vocabulary mode; a request's label
             set with softmax), 8 embedding items, a 256-token query-part chunk over 4,096 rows
             of a request's K/V (in the engine's bank): on a GPU each a graph replay
  one item   Scorer.score_request of one 8-token item behind a real query, whole call p50 / p99,
             apply_softmax false (vocabulary graphs) and true, beside a scorer without graphs
  loop       --rows real queries sent to EngineLoop as front ends would (messages of 64 rows),
             drained at saturation, staged (pass N+1 launched before N is collected) and not:
             rows/s, passes, and the GPU's busy share of the loop's wall time (the union of its
             kernels' intervals, torch.profiler, in a second drain), beside
             Classifier.classify_batch on the same text and classify_encoded on its ids
Writes $OUT/engine_loop.json (bench/results without OUT); each section as it finishes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

OUT = Path(os.environ.get("OUT") or "bench/results")
ROOT = Path(__file__).resolve().parents[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summary(ms):
    return {"p50_ms": round(statistics.median(ms), 4), "p99_ms": round(pct(ms, 99), 4), "n": len(ms)}


def real_queries(n):
    import csv

    with open(ROOT / "tests" / "data" / "intent_dev.csv", newline="") as f:
        qs = [r["query"] for r in csv.DictReader(f)]
    # past the dev set's length each repeat gets a number, so no two rows of a pass are the same
    # (the loop computes identical rows once: repeats would measure that, not the engine)
    return [qs[i % len(qs)] + (f" {i // len(qs)}" if i >= len(qs) else "") for i in range(n)]


def sync(device):
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed_passes(launch, n, device):
    """launch() -> collect: host time to launch and whole pass time, ms."""
    host, whole = [], []
    for i in range(n + 5):
        sync(device)
        t0 = time.perf_counter()
        collect = launch()
        t1 = time.perf_counter()
        collect()
        t2 = time.perf_counter()
        if i >= 5:
            host.append(1e3 * (t1 - t0))
            whole.append(1e3 * (t2 - t0))
    return {"host": summary(host), "whole": summary(whole)}


def passes(clf, sc, n, device):
    import torch

    from prefixscore.spans import plan_items

    qs = real_queries(64)
    enc1, enc64 = [clf.encode(qs[0])], [clf.encode(q) for q in qs]
    out = {"classify 1": timed_passes(lambda: clf.launch_encoded(enc1), n, device),
           "classify 64": timed_passes(lambda: clf.launch_encoded(enc64), n, device)}
    items = [q + " shoes" for q in qs[:8]]
    prep = sc.prepare(qs[10], items)
    own = sc._groups(prep, 0, False)
    vocab_cols = [p[0] for p in sc.trie.paths]

    def items_pass(mode, head, spans=own):
        plan = plan_items(spans, head.trie, [])
        if mode == "vocab":
            return lambda: (lambda r: lambda: r)(sc.engine.vocab_probs(plan, spans[0].kv, vocab_cols))
        return lambda: sc.engine.launch(plan, spans[0].kv, head.weight, True, head.trie.columns)

    other = sc._head(None, [11, 12], single=True)
    out["items 8, scorer's labels, softmax"] = timed_passes(items_pass("softmax", sc.head), n, device)
    out["items 8, vocabulary"] = timed_passes(items_pass("vocab", sc.head), n, device)
    out["items 8, request labels, softmax"] = timed_passes(items_pass("softmax", other), n, device)
    H = sc.config.hidden_size
    vecs = [torch.randn(H) * 0.02 for _ in range(8)]
    sspans = sc._groups(sc.prepare(qs[10], vecs), 0, False)
    out["embedding items 8"] = timed_passes(items_pass("softmax", sc.head, sspans), n, device)
    # a query part of 4,096 tokens in the request's K/V (the bank's, where it has one), then each
    # timed chunk the next 256 tokens after it (written over the same rows each time)
    kv = sc.engine.query_kv(sc.prefix_kv, sc.prefix_len + 4096 + 256, banked=True)
    sc.engine.extend(kv, list(range(100, 100 + 4096)))()
    filled, chunk = kv.filled, list(range(200, 456))

    def one_chunk():
        kv.filled = filled
        return sc.engine.extend(kv, chunk)

    out["query-part chunk 256 over 4,096 rows"] = timed_passes(one_chunk, n, device)
    return out


def one_item(sc, plain, n, device):
    qs = real_queries(n + 10)
    out = {}
    for name, s in (("graphs", sc), ("no graphs", plain)):
        for softmax in (False, True):
            ms = []
            for i, q in enumerate(qs):
                body = {"query": q, "items": ["red cotton summer dress"], "apply_softmax": softmax}
                sync(device)
                t = time.perf_counter()
                s.score_request(body)
                ms.append(1e3 * (time.perf_counter() - t))
            out[f"{name}, apply_softmax {str(softmax).lower()}"] = summary(ms[10:])
    return out


def loop_rate(clf, rows, device, staged):
    """Rows/s of EngineLoop draining `rows` real queries sent in messages of 64 (as front ends
    send them), its passes, and the GPU's busy share of the loop's wall time: the union of the
    kernels' intervals over the wall time, from torch.profiler in a second drain (the first,
    unprofiled, gives the rate; the profiler's host overhead would lower it), each after a
    warm-up drain (without it the staged run, first, paid for the kernels' compiles)."""
    from prefixscore.serve import protocol as P
    from prefixscore.serve.engine_loop import EngineLoop

    loop = EngineLoop(clf)
    loop.warmup()
    loop.staged = staged and loop.staged
    qs = real_queries(rows)
    msgs = []
    for k in range(0, rows, 64):
        enc = [clf.encode(q) for q in qs[k:k + 64]]
        data, offsets = P.pack_ids([e.ids for e in enc], [e.start for e in enc])
        msgs.append(P.ClassifyReq(0, list(range(k, k + len(enc))), data, offsets,
                                  [e.start for e in enc], [1e18] * len(enc)))

    def drain():
        got = []
        sync(device)
        t0 = time.perf_counter()
        loop.serve([(m, got.append) for m in msgs], passes=0)
        while len(loop.lanes) or loop.inflight:
            loop.serve([])
        sync(device)
        return got, time.perf_counter() - t0

    drain()  # warm-up: the eager shapes of passes past the graphs compile their kernels here
    got, wall = drain()
    out = {"rows_per_s": round(sum(len(o.rids) for o in got) / wall), "wall_s": round(wall, 3),
           "passes": len(got), "rows_per_pass": round(statistics.mean(o.batch_size for o in got), 1)}
    if str(device).startswith("cuda"):
        out["gpu_busy_share"] = round(busy_share(drain), 3)
    return out


def busy_share(drain) -> float:
    """The union of the CUDA kernels' intervals during drain(), over its wall time (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, wall = drain()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA")
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # microseconds; overlapping kernels (streams) counted once
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e6 / wall


def batch_rate(clf, rows, device):
    """Classifier.classify_batch on the same text (tokenizing included) and classify_encoded on
    its ids, rows/s, after a warm-up call each."""
    qs = real_queries(rows)
    out = {}
    for name, call, arg in (("text", clf.classify_batch, qs),
                            ("ids", clf.classify_encoded, [clf.encode(q) for q in qs])):
        call(arg[:512])
        sync(device)
        t = time.perf_counter()
        call(arg)
        sync(device)
        out[f"{name}_rows_per_s"] = round(rows / (time.perf_counter() - t))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=200, help="timed passes / calls per figure")
    ap.add_argument("--rows", type=int, default=32768, help="rows through the engine loop")
    ap.add_argument("--sections", default="passes,one,loop")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="-- --model M --device D")
    a = ap.parse_args()
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    opts = dict(zip(flags[::2], flags[1::2]))
    model, device = opts.get("--model"), opts.get("--device", "cpu")
    if a.quick:
        a.n, a.rows = 10, 256
    from prefixscore import Classifier, Scorer

    t0 = time.perf_counter()
    clf = Classifier(model, device=device)
    sc = Scorer(clf.loaded, "Is the item relevant to the query? Answer yes or no.\nQuery: {query}\nItem: {item}",
                ["yes", "no"], mode="softmax")
    plain = Scorer(clf.loaded, "Is the item relevant to the query? Answer yes or no.\nQuery: {query}\nItem: {item}",
                   ["yes", "no"], mode="softmax", graphs=False)
    out = {"device": str(clf.engine.device), "ready_s": round(time.perf_counter() - t0, 1),
           "capture": sc.capture_info}
    try:
        import torch

        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        pass
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "engine_loop.json"

    def save():
        path.write_text(json.dumps(out, indent=1, default=str))

    sections = a.sections.split(",")
    if "passes" in sections:
        out["passes"] = passes(clf, sc, a.n, device)
        save()
        print(f"{'pass':<48} {'host p50':>9} {'host p99':>9} {'whole p50':>10} {'whole p99':>10}")
        for k, v in out["passes"].items():
            print(f"{k:<48} {v['host']['p50_ms']:>9.3f} {v['host']['p99_ms']:>9.3f} "
                  f"{v['whole']['p50_ms']:>10.3f} {v['whole']['p99_ms']:>10.3f}")
    if "one" in sections:
        out["one_item"] = one_item(sc, plain, a.n, device)
        save()
        for k, v in out["one_item"].items():
            print(f"score_request, one 8-token item, {k:<34} p50 {v['p50_ms']:.3f}  p99 {v['p99_ms']:.3f} ms")
    if "loop" in sections:
        out["loop"] = {"staged": loop_rate(clf, a.rows, device, True),
                       "unstaged": loop_rate(clf, a.rows, device, False),
                       "classify_batch": batch_rate(clf, a.rows, device)}
        save()
        for k, v in out["loop"].items():
            print(f"{k:<16} {v}")
    print(f"wrote {path}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
