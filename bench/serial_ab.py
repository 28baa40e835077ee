"""One request at a time through two servers, alternated: is the new server's single-request path
no slower than another commit's? (Issue "serve at engine speed": `--workers 1` one-request p50 no
worse than the old server, on CPU with the bundled model.)

    python -m bench.serial_ab --old /tmp/old --rounds 3 -- --workers 1
Starts `prefixscore serve` from this tree and from the --old tree (a `git worktree add` of the
other commit) in turn, each on its own port, sends --requests real queries one at a time on one
keep-alive connection, and prints p50/p99 per round and the median of the rounds' p50s.
Flags after `--` go to the new server only (the old one may not know them).
"""
from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "bench" / "results")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tree: Path, flags, queries, n):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *flags], cwd=tree, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                c.request("GET", "/healthz")
                h = c.getresponse()
                h.read()
                if h.status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        ms = []
        for i in range(n + 20):
            body = json.dumps({"query": queries[i % len(queries)]})
            t = time.perf_counter()
            c.request("POST", "/v1/classify", body, {"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            if i >= 20:  # warm-up
                ms.append(1e3 * (time.perf_counter() - t))
            assert r.status == 200
        ms.sort()
        return {"p50_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))]}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="a worktree of the commit to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    with open(ROOT / "tests" / "data" / "intent_dev.csv", newline="", encoding="utf-8") as f:
        queries = [r["query"] for r in csv.DictReader(f)]
    rows = {"old": [], "new": []}
    for k in range(a.rounds):
        for name, tree, fl in (("old", Path(a.old), []), ("new", ROOT, flags)):
            r = run(tree, fl, queries, a.requests)
            rows[name].append(r)
            print(f"round {k + 1} {name}: p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms", flush=True)
    out = {k: {"rounds": v, "median_p50_ms": statistics.median(r["p50_ms"] for r in v)} for k, v in rows.items()}
    out["new_flags"], out["cpus"] = flags, os.cpu_count()
    print(f"median p50: old {out['old']['median_p50_ms']:.2f} ms, new {out['new']['median_p50_ms']:.2f} ms")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "serial_ab.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
