"""Legal requests on an idle default server (issue 49's CPU target): lists and a burst.

    python -m bench.burst                                  # bundled model, default serve, this CPU
    python -m bench.burst -- --model /tmp/q05 --device cuda

One `prefixscore serve` with its defaults (flags after `--` added), idle between phases:
  lists      /v1/classify with a list of 20, 100 and 256 real queries (tests/data/intent_dev.csv),
             one request each: status and seconds
  same       64 clients at once, each one query, the same one: statuses, slowest answer
  different  64 clients at once, 64 different queries: statuses, slowest answer
Writes $OUT/burst.json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.engine_loop import real_queries
from bench.long_request import start

OUT = Path(os.environ.get("OUT") or "bench/results")


async def burst(base, queries):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=600) as c:
        t0 = time.monotonic()

        async def one(q):
            r = await c.post("/v1/classify", json={"query": q})
            return r.status_code, time.monotonic() - t0

        out = await asyncio.gather(*(one(q) for q in queries))
    return {"statuses": dict(Counter(s for s, _ in out)), "slowest_s": round(max(t for _, t in out), 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    proc, base = start(a.port, flags, score=False)
    out = {"flags": flags, "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                    capture_output=True, text=True).stdout.strip()}
    try:
        qs = real_queries(256)
        out["lists"] = {}
        for n in (20, 100, 256):
            t = time.monotonic()
            r = httpx.post(base + "/v1/classify", json={"query": qs[:n]}, timeout=600)
            out["lists"][n] = {"status": r.status_code, "seconds": round(time.monotonic() - t, 2)}
            print(f"list of {n}: {out['lists'][n]}")
        out["same"] = asyncio.run(burst(base, [qs[0]] * 64))
        print(f"64 clients, one query: {out['same']}")
        out["different"] = asyncio.run(burst(base, qs[100:164]))
        print(f"64 clients, 64 queries: {out['different']}")
    finally:
        proc.terminate()
        proc.wait(60)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "burst.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / 'burst.json'}")


if __name__ == "__main__":
    main()
