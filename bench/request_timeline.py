"""Where one request's time goes, per server layout (issue 32): one request at a time on a
keep-alive connection, over HTTP and gRPC, beside the in-process call, in one run.

    python -m bench.request_timeline                                  # bundled model on this CPU
    python -m bench.request_timeline --configs 1,auto --grpc --server-cpus 0-9 -- --model /tmp/q05 --device cuda

Flags after `--` go to the in-process classifier and `prefixscore serve` (as bench.http's). Each
config ("1": --workers 1, one process; "auto": the default worker count; "N": --workers N) runs
a fresh server. Stages, medians over --n requests after warm-up, from the client's clock and the
`timing` the server puts in each answer (frontend.classify's spans):
  tokenize     the front end's tokenizer call (timing.tokenize_ms)
  to engine    handed to the engine and back: IPC out (a thread hand-off with --workers 1), the
               engine's queue and batching, IPC back, the answer's decoding (timing.queue_ms:
               frontend.classify's span less tokenize and the pass)
  engine pass  the engine's call for the batch the request rode in (timing.forward_ms)
  outside      everything outside frontend.classify: the client's send and read (Python: httpx,
               grpcio), loopback, HTTP parsing, routing and validation, the response's encoding
               (round trip - timing.total_ms)
  in process   Classifier.classify(q) with no server: the floor (bench.http's child, pinned alike)
A row's stages add up to its round trip.

With --wrk PATH (Debian's wrk; its libluajit beside it or on LD_LIBRARY_PATH), each layout also
runs wrk on --load-cpus, POSTing real queries to /v1/classify (bench/wrk_classify.lua):
  wrk 1      one connection, one request at a time, for --wrk-seconds: p50/p99 from a client
             that costs microseconds, not Python's ~0.2 ms (the "outside" stage above includes it)
  wrk N      closed loop on --wrk-conns connections (issue 32's capacity: 256): req/s and p99
Writes $OUT/request_timeline.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from .http import (OUT, free_port, inprocess, load_queries, parse_cpus, start_server, stop_server,
                   warm_count, workers_flags)

STAGES = ("tokenize_ms", "queue_ms", "forward_ms")
NAMES = {"tokenize_ms": "tokenize", "queue_ms": "to engine", "forward_ms": "engine pass"}


def timeline(rtts: list[float], timings: list[dict]) -> dict:
    """Medians of the stages, and `outside` = round trip - the server's span, request by request."""
    out = {NAMES[k]: statistics.median(t[k] for t in timings) for k in STAGES}
    out["outside"] = statistics.median(r - t["total_ms"] for r, t in zip(rtts, timings))
    out["round trip"] = statistics.median(rtts)
    out["round trip p99"] = sorted(rtts)[min(len(rtts) - 1, int(0.99 * len(rtts)))]
    return out


def http_serial(port: int, queries, n: int) -> dict:
    import httpx

    it = itertools.cycle(queries)
    rtts, timings = [], []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        for i in range(warm_count(n) + n):
            t = time.perf_counter()
            r = c.post("/v1/classify", json={"query": next(it)})
            ms = 1e3 * (time.perf_counter() - t)
            r.raise_for_status()
            if i >= warm_count(n):
                rtts.append(ms)
                timings.append(r.json()["timing"])
    return timeline(rtts, timings)


def grpc_serial(port: int, queries, n: int) -> dict:
    import grpc

    from prefixscore.serve.proto import prefixscore_pb2 as pb

    it = itertools.cycle(queries)
    rtts, timings = [], []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary("/prefixscore.v1.PrefixScore/Classify", pb.ClassifyRequest.SerializeToString,
                              pb.ClassifyResponse.FromString)
        for i in range(warm_count(n) + n):
            t = time.perf_counter()
            r = call(pb.ClassifyRequest(queries=[next(it)]), timeout=30)
            ms = 1e3 * (time.perf_counter() - t)
            if i >= warm_count(n):
                rtts.append(ms)
                tm = r.timing
                timings.append({"tokenize_ms": tm.tokenize_ms, "queue_ms": tm.queue_ms,
                                "forward_ms": tm.forward_ms, "total_ms": tm.total_ms})
    return timeline(rtts, timings)


LUA = Path(__file__).with_name("wrk_classify.lua")


def wrk(a, port: int, conns: int, bodies: str) -> dict:
    """One wrk run against /v1/classify: its done() line, parsed, plus req/s and the error count."""
    binary = Path(a.wrk).resolve()
    env = {**os.environ, "WRK_BODIES": bodies,
           "LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    threads = max(1, min(conns, len(a.load_cpus) if a.load_cpus else 2))
    cmd = [str(binary), "-t", str(threads), "-c", str(conns), "-d", f"{a.wrk_seconds:g}s",
           "--timeout", "10s", "-s", str(LUA), f"http://127.0.0.1:{port}"]
    if a.load_cpus:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(a.load_cpus))), *cmd]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.wrk_seconds + 60)
    line = next((l for l in run.stdout.splitlines() if l.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result (exit {run.returncode}): {run.stdout[-500:]} {run.stderr[-500:]}")
    r = json.loads(line[len("WRK_JSON "):])
    r["errors"] = sum(r[k] for k in ("connect", "read", "write", "status", "timeout"))
    return {"conns": conns, "req_s": r["requests"] / (r["duration_us"] / 1e6),
            "p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3, "max_ms": r["max_us"] / 1e3,
            "errors": r["errors"], "raw": r}


def run_config(config: str, a, queries) -> dict:
    port = free_port()
    grpc_port = free_port() if a.grpc else None
    flags = workers_flags(config) + (["--grpc-port", str(grpc_port)] if a.grpc else []) + a.serve_flags
    proc = start_server(flags, port, a.server_cpus, a.ready_timeout)
    try:
        rows = {"http": http_serial(port, queries, a.n)}
        if a.grpc:
            rows["grpc"] = grpc_serial(grpc_port, queries, a.n)
        if a.wrk:
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
                f.writelines(json.dumps({"query": q}) + "\n" for q in queries)
            try:
                for conns in (1, a.wrk_conns):
                    rows[f"wrk {conns}"] = wrk(a, port, conns, f.name)
                    print(f"--workers {config} wrk {conns}: {json.dumps(rows[f'wrk {conns}'])}", flush=True)
            finally:
                os.unlink(f.name)
    finally:
        rows_exit = stop_server(proc)
    return {"config": config, "rows": rows, "exit": rows_exit}


def print_table(inproc: dict, configs: list[dict]) -> None:
    cols = ["tokenize", "to engine", "engine pass", "outside", "round trip", "round trip p99"]
    print(f"{'layout':>16} " + " ".join(f"{c:>14}" for c in cols))
    print(f"{'in process':>16} " + " ".join(f"{'':>14}" for _ in cols[:4])
          + f" {inproc['p50_ms']:>14.3f} {inproc['p99_ms']:>14.3f}")
    for c in configs:
        for name, row in c["rows"].items():
            if name.startswith("wrk"):
                print(f"{name + ' --workers ' + c['config']:>16} {row['req_s']:>10.0f} req/s  p50 "
                      f"{row['p50_ms']:.3f}  p99 {row['p99_ms']:.3f} ms  errors {row['errors']}")
    for c in configs:
        for proto, row in c["rows"].items():
            if proto.startswith("wrk"):
                continue
            name = f"{proto} --workers {c['config']}"
            print(f"{name:>16} " + " ".join(f"{row[k]:>14.3f}" for k in cols))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1,auto", help="server layouts: 1, auto, N (--workers N)")
    ap.add_argument("--n", type=int, default=1000, help="timed requests per layout and protocol")
    ap.add_argument("--grpc", action="store_true", help="also over gRPC (--grpc-port)")
    ap.add_argument("--server-cpus", default=None, help="pin the server and the in-process phase")
    ap.add_argument("--queries", default=None, help="CSV with a query column (default: intent_dev)")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--wrk", default=None, help="path of a wrk binary: also its serial and closed-loop runs")
    ap.add_argument("--wrk-conns", type=int, default=256, help="connections of the closed-loop wrk run")
    ap.add_argument("--wrk-seconds", type=float, default=10.0, help="seconds of each wrk run")
    ap.add_argument("--load-cpus", default=None, help="pin wrk: 10-15")
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then flags for prefixscore serve")
    a = ap.parse_args()
    a.serve_flags = a.serve_flags[1:] if a.serve_flags[:1] == ["--"] else a.serve_flags
    a.server_cpus, a.load_cpus = parse_cpus(a.server_cpus), parse_cpus(a.load_cpus)
    queries = load_queries(a.queries)
    inproc = inprocess(a.serve_flags, queries, a.n, a.server_cpus)
    configs = []
    for config in a.configs.split(","):
        configs.append(run_config(config, a, queries))
        print(f"--workers {config}: {json.dumps(configs[-1]['rows'])}", flush=True)
    print_table(inproc["inproc"], configs)
    out = {"args": {k: v for k, v in vars(a).items() if k not in ("server_cpus", "load_cpus")}, "engine": inproc["engine"],
           "inproc": inproc["inproc"], "configs": configs}
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "request_timeline.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":  # spawn re-imports this module in the in-process child
    main()
