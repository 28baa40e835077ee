"""The HTTP server's own cost: `create_app` around a stub classifier that answers instantly.

    python -m bench.server_stub [--requests 3000]

Serves the real app (uvicorn, httptools, uvloop when installed) in a child process with a stub in
place of the model (tokenize and classify return at once), and times, one request at a time on a
keep-alive connection from this process: GET /healthz (the bare HTTP round trip) and POST
/v1/classify (parse, validate, queue, the engine-thread hand-offs, JSON out). Their difference is
the classify path's overhead apart from the model. Writes $OUT/server_stub.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from .http import GET_HEALTHZ, Conn, pct, post

OUT = Path(os.environ.get("OUT") or "bench/results")


def serve(port):
    import uvicorn

    from prefixscore.classifier import Result
    from prefixscore.server import create_app

    class Encoded:
        def __init__(self, q):
            self.values, self.ids, self.start = {"query": q}, [1, 2, 3], 0

    class Stub:
        prefix_len, labels = 0, ["a", "b"]

        def encode(self, q):
            return Encoded(q)

        def encode_many(self, qs):
            return [Encoded(q) for q in qs]

        def classify_encoded(self, encoded, progress=None):
            return [Result(e.values["query"], "a", {"a": -0.1, "b": -2.3}) for e in encoded]

    sys.setswitchinterval(0.0005)  # as `prefixscore serve`
    uvicorn.run(create_app(Stub(), max_tokens=512), host="127.0.0.1", port=port, log_level="error")


async def measure(port, n):
    for _ in range(100):
        try:
            c = await Conn.open(port)
            break
        except OSError:
            await asyncio.sleep(0.2)
    out = {}
    for name, raw in (("healthz", GET_HEALTHZ), ("classify", post("/v1/classify", {"query": "red dress"}))):
        for _ in range(300):
            await c.request(raw)
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            status, _ = await c.request(raw)
            lat.append(1e6 * (time.perf_counter() - t))
            assert status == 200
        out[name] = {"p50_us": statistics.median(lat), "p99_us": pct(lat, 99), "n": n}
    c.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    a = ap.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = mp.Process(target=serve, args=(port,), daemon=True)
    p.start()
    try:
        res = asyncio.run(measure(port, a.requests))
    finally:
        p.terminate()
        p.join()
    res["classify_minus_healthz_p50_us"] = res["classify"]["p50_us"] - res["healthz"]["p50_us"]
    res["cpus"] = os.cpu_count()
    for k in ("healthz", "classify"):
        print(f"{k:9s} p50 {res[k]['p50_us']:7.1f} us  p99 {res[k]['p99_us']:7.1f} us")
    print(f"classify path over the bare round trip: {res['classify_minus_healthz_p50_us']:.1f} us")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "server_stub.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
