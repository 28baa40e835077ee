"""W5: the classifier through `prefixscore serve` under open-loop load (DESIGN.md §6).

    python -m bench.http                                  # bundled model, seed prompt, auto device
    python -m bench.http --rates 50,100,200 -- --model PATH --device cuda --batch-window-ms 0

Flags after `--` go to both the in-process classifier and `prefixscore serve` (model, template,
labels, device, dtype, mode, batch window, cache ...). Run it as a module (`-m`): a file named
http.py on sys.path would shadow the standard library's `http`.

  inproc  clf.classify(q), one call at a time, in this process, before the server starts
  serial  one HTTP request at a time on a keep-alive connection (closed loop);
          server overhead = serial p50 - inproc p50 (the goal: <= 0.5 ms)
  open    open-loop Poisson arrivals at each offered rate: a timer thread fires every request at its
          scheduled time whether or not earlier ones finished, and latency counts from that
          scheduled time, so a slow server cannot slow the load down (no coordinated omission).
          Rates rise until p99 passes --stop-p99-ms, requests fail, or the server falls behind.
Reports p50/p99 per rate and the highest rate held at p99 < 5 ms. Loopback only; every phase is
bounded in time and count. Writes $OUT/http.json (bench/results/http.json without OUT).
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import gc
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
OUT = Path(os.environ.get("OUT") or "bench/results")
TARGET_P99_MS = 5.0
KEEP_ALIVE_S = 4.0  # below uvicorn's 5 s keep-alive timeout


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def stats(ms):
    return {"p50_ms": statistics.median(ms), "p90_ms": pct(ms, 90), "p99_ms": pct(ms, 99),
            "max_ms": max(ms), "n": len(ms)}


def load_queries(path: str | None) -> list[str]:
    path = Path(path) if path else SHARED / "data" / "intent_dev.csv"
    with open(path, newline="", encoding="utf-8") as f:
        return [r["query"] for r in csv.DictReader(f)]


# ---------------------------------------------------------------- a minimal HTTP/1.1 client

class Conn:
    """One keep-alive connection; requests are pre-encoded bytes, responses parsed just enough."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(r, w)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        n = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                n = int(line[15:])
        return status, await self.reader.readexactly(n)

    def close(self):
        self.writer.close()


def post(path: str, obj) -> bytes:
    body = json.dumps(obj).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


async def serial(port, raws, n) -> tuple[list[float], list[dict]]:
    """One request at a time: client-side latency (ms) and the server's own timing."""
    c = await Conn.open(port)
    lat, timing = [], []
    for i in range(n):
        t = time.perf_counter()
        status, body = await c.request(raws[i % len(raws)])
        lat.append(1e3 * (time.perf_counter() - t))
        assert status == 200, body
        if body.startswith(b'{"results"'):
            timing.append(json.loads(body)["timing"])
    c.close()
    return lat, timing


async def open_loop(port, raws, rate, duration, max_requests, timeout, max_conns, seed):
    """Poisson arrivals at `rate`/s for `duration` s (at most max_requests). -> per-request
    (latency ms from the scheduled time, status or error name)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    n = max(1, min(max_requests, int(rate * duration)))
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    idle: list[Conn] = []
    opened = 0
    free = asyncio.Condition()
    results: list = [None] * n
    done = asyncio.Event()
    left = n

    async def one(i, scheduled):
        nonlocal opened, left
        conn = None
        try:
            async with free:
                while not idle and opened >= max_conns:
                    await free.wait()
                while idle and time.perf_counter() - idle[-1].since > KEEP_ALIVE_S:
                    idle.pop().close()  # the server may have closed it: never reuse a stale one
                    opened -= 1
                if idle:
                    conn = idle.pop()
                else:
                    opened += 1
            if conn is None:
                conn = await Conn.open(port)
            status, _ = await asyncio.wait_for(conn.request(raws[i % len(raws)]), timeout)
            results[i] = (1e3 * (time.perf_counter() - scheduled), status)
            conn.since = time.perf_counter()
            idle.append(conn)
        except Exception as e:  # a timeout or a broken connection: count it, drop the connection
            results[i] = (1e3 * (time.perf_counter() - scheduled), type(e).__name__)
            if conn is not None:
                conn.close()
            opened -= 1
        finally:
            async with free:
                free.notify()
            left -= 1
            if left == 0:
                done.set()

    def fire(i, scheduled):
        loop.create_task(one(i, scheduled))

    def timer(t0):
        # A thread sleeps to each arrival (event-loop timers are millisecond-coarse) and hands the
        # request to the loop, which sends it at once.
        for i, a in enumerate(arrivals):
            d = t0 + a - time.perf_counter()
            if d > 0:
                time.sleep(d)
            loop.call_soon_threadsafe(fire, i, t0 + a)

    t0 = time.perf_counter() + 0.05
    th = threading.Thread(target=timer, args=(t0,), daemon=True)
    th.start()
    try:
        await asyncio.wait_for(done.wait(), duration + timeout + 5)
    except asyncio.TimeoutError:
        pass
    th.join()
    wall = time.perf_counter() - t0
    for c in idle:
        c.close()
    return [r for r in results if r is not None], n, wall


# ---------------------------------------------------------------- phases

def call_times(classify, queries, n, warm=50):
    """ms of classify(q), one call at a time, in this thread and then handed to a worker thread
    with this one waiting (as the server's engine thread runs it): separates the cost of the
    thread from the cost of HTTP."""
    from concurrent.futures import ThreadPoolExecutor

    it = itertools.cycle(queries)
    pool = ThreadPoolExecutor(1)
    out = []
    for call in (classify, lambda q: pool.submit(classify, q).result()):
        for _ in range(warm):
            call(next(it))
        ms = []
        for _ in range(n):
            q = next(it)
            t = time.perf_counter()
            call(q)
            ms.append(1e3 * (time.perf_counter() - t))
        out.append(ms)
    pool.shutdown()
    return out


def inprocess(serve_flags, queries, n):
    """clf.classify(q) one at a time, with the same flags as the server."""
    from prefixscore.cli import build_parser, make_classifier

    a = build_parser().parse_args(["serve", *serve_flags])
    clf = make_classifier(a)
    ms, thread_ms = call_times(clf.classify, queries, n)
    info = {"device": str(clf.engine.device), "dtype": str(clf.engine.dtype), "model": clf.loaded.name,
            "prefix_tokens": clf.prefix_len, "labels": len(clf.labels),
            "classify_on_a_worker_thread": stats(thread_ms)}
    device = clf.engine.device
    del clf
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()  # leave the GPU to the server
    return stats(ms), info


def start_server(serve_flags, port, ready_timeout):
    cmd = [sys.executable, "-m", "prefixscore.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning", "--max-queue", "65536", "--max-connections", "4096",
           *serve_flags]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(GET_HEALTHZ)
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="25,50,100,200,400,800,1600,3200,6400,12800",
                    help="offered requests/s, in rising order")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of load per rate")
    ap.add_argument("--max-requests", type=int, default=20000, help="at most this many per rate")
    ap.add_argument("--serial", type=int, default=500, help="requests in the closed-loop phases")
    ap.add_argument("--timeout", type=float, default=10.0, help="per-request timeout (s)")
    ap.add_argument("--max-conns", type=int, default=1024, help="client connections at most")
    ap.add_argument("--stop-p99-ms", type=float, default=100.0, help="stop raising the rate past this p99")
    ap.add_argument("--queries", default=None, help="CSV with a query column (default: intent_dev.csv)")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then flags for prefixscore serve")
    a = ap.parse_args()
    serve_flags = a.serve_flags[1:] if a.serve_flags[:1] == ["--"] else a.serve_flags
    queries = load_queries(a.queries)
    raws = [post("/v1/classify", {"query": q}) for q in queries]
    try:
        import uvloop  # the client's own overhead, kept small

        uvloop.install()
    except ImportError:
        pass

    import importlib.util

    # uvicorn picks httptools and uvloop when they are installed, else pure-Python h11 / asyncio
    stack = {m: importlib.util.find_spec(m) is not None for m in ("httptools", "uvloop")}
    out = {"serve_flags": serve_flags, "cpus": os.cpu_count(), "server_stack": stack}
    print(f"server stack: {stack}", flush=True)
    out["inproc"], out["engine"] = inprocess(serve_flags, queries, a.serial)
    th = out["engine"]["classify_on_a_worker_thread"]
    print(f"in-process classify(q): p50 {out['inproc']['p50_ms']:.3f} ms  p99 {out['inproc']['p99_ms']:.3f} ms; "
          f"on a worker thread p50 {th['p50_ms']:.3f} ms", flush=True)
    port = free_port()
    proc = start_server(serve_flags, port, a.ready_timeout)
    try:
        asyncio.run(serial(port, raws, 50))  # warm the server
        lat, timing = asyncio.run(serial(port, raws, a.serial))
        out["serial"] = stats(lat)
        out["serial_server_timing_p50_ms"] = {k: statistics.median(t[k] for t in timing) for k in timing[0]}
        out["healthz_rtt"] = stats(asyncio.run(serial(port, [GET_HEALTHZ], a.serial))[0])
        out["overhead_p50_ms"] = out["serial"]["p50_ms"] - out["inproc"]["p50_ms"]
        print(f"HTTP serial: p50 {out['serial']['p50_ms']:.3f} ms  p99 {out['serial']['p99_ms']:.3f} ms  "
              f"-> server overhead p50 {out['overhead_p50_ms']:.3f} ms  (GET /healthz round trip "
              f"p50 {out['healthz_rtt']['p50_ms']:.3f} ms)", flush=True)
        out["open_loop"] = []
        print(f"{'offered/s':>10s} {'achieved/s':>10s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} "
              f"{'max ms':>8s} {'errors':>7s}", flush=True)
        for i, rate in enumerate(float(r) for r in a.rates.split(",")):
            res, n, wall = asyncio.run(open_loop(port, raws, rate, a.duration, a.max_requests,
                                                 a.timeout, a.max_conns, seed=i))
            ok = [ms for ms, st in res if st == 200]
            errors = {}
            for _, st in res:
                if st != 200:
                    errors[str(st)] = errors.get(str(st), 0) + 1
            errors["lost"] = n - len(res)
            row = {"offered_rps": rate, "achieved_rps": len(ok) / wall, "sent": n,
                   "errors": {k: v for k, v in errors.items() if v}, **(stats(ok) if ok else {})}
            out["open_loop"].append(row)
            print(f"{rate:10.0f} {row['achieved_rps']:10.0f} {row.get('p50_ms', float('nan')):8.2f} "
                  f"{row.get('p90_ms', float('nan')):8.2f} {row.get('p99_ms', float('nan')):8.2f} "
                  f"{row.get('max_ms', float('nan')):8.1f} {sum(row['errors'].values()):7d}", flush=True)
            if row["errors"] or not ok or row["p99_ms"] > a.stop_p99_ms or len(ok) < 0.9 * n:
                break
        held = [r["offered_rps"] for r in out["open_loop"]
                if not r["errors"] and r.get("p99_ms", 1e9) < TARGET_P99_MS]
        out["max_rps_p99_under_5ms"] = max(held) if held else None
        print(f"highest offered rate held at p99 < {TARGET_P99_MS:g} ms: {out['max_rps_p99_under_5ms']}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "http.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / 'http.json'}")


if __name__ == "__main__":
    main()
