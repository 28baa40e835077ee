"""The pair cache (issue 34, item 4): one 100-item /v1/score request computed against the same
request answered from the cache, through `prefixscore serve` (target: repeated <= 10% of uncached).

    python -m bench.pair_cache                          # bundled model on this CPU (~1-2 min)
    python -m bench.pair_cache --n 50 -- --device cuda --model /tmp/q05

One server (--workers 1, the pair cache on: --cache-size 100000), one keep-alive client, one request
at a time. A query and --items short product texts (colour + material + product, fixed);
  uncached  each request's query differs in a number ("... size 10", "... size 11": the same token
            count), so every item misses and is computed (the cache fills; never read back)
  repeated  one fixed request, sent once to fill the cache, then --n times: every item a hit
Each phase --n requests after --warmup unmeasured ones; client-side wall time per request. Checks:
uncached answers report cached 0, repeated ones cached = --items, the same scores as the first
answer and usage 0. Flags after `--` go to `prefixscore serve`. Writes $OUT/pair_cache_<tag>.json
(default bench/results/pair_cache_cpu.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import httpx

from .http import free_port, start_server, stats, stop_server

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
TEMPLATE = "Is the item relevant to the query? Answer yes or no.\nQuery: {query}\nItem: {item}"
COLOURS = ["black", "white", "red", "navy", "beige", "olive", "grey", "pink", "brown", "blue"]
THINGS = ["running shoes", "wool coat", "denim jacket", "leather boots", "cotton t-shirt",
          "linen shirt", "rain jacket", "yoga pants", "canvas sneakers", "knit sweater"]
TARGET_RATIO = 0.10


def items(n: int) -> list[str]:
    """n short product texts: every colour with every product, then a size."""
    out = [f"{c} {t}" for t in THINGS for c in COLOURS]
    return [out[i % len(out)] + ("" if i < len(out) else f" size {i // len(out)}") for i in range(n)]


def timed(client: httpx.Client, bodies: list[dict]) -> tuple[list[float], list[dict]]:
    lat, answers = [], []
    for body in bodies:
        t = time.perf_counter()
        r = client.post("/v1/score", json=body)
        lat.append(1e3 * (time.perf_counter() - t))
        if r.status_code != 200:
            raise RuntimeError(f"/v1/score answered {r.status_code}: {r.text[:300]}")
        answers.append(r.json())
    return lat, answers


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="measured requests per phase (20)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured requests per phase first (3)")
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--query", default="running shoes women")
    ap.add_argument("--tag", default="cpu", help="the JSON's name: pair_cache_TAG.json")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then flags for prefixscore serve")
    a = ap.parse_args()
    flags = a.serve_flags[1:] if a.serve_flags[:1] == ["--"] else a.serve_flags
    its = items(a.items)
    port = free_port()
    serve = ["--workers", "1", "--cache-size", "100000", "--score-template", TEMPLATE,
             "--max-queries", str(max(256, a.items)), *flags]
    load_before = os.getloadavg()
    proc = start_server(serve, port, None, a.ready_timeout)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            total = a.warmup + a.n
            uncached_bodies = [{"query": f"{a.query} size {10 + i}", "items": its} for i in range(total)]
            lat_u, ans_u = timed(client, uncached_bodies)
            repeated = {"query": a.query, "items": its}
            _, (fill,) = timed(client, [repeated])
            lat_r, ans_r = timed(client, [repeated] * total)
            metrics = client.get("/metrics").text
    finally:
        status = stop_server(proc)
    lat_u, lat_r = lat_u[a.warmup:], lat_r[a.warmup:]
    assert all(x["cached"] == 0 and all(x["scored"]) for x in ans_u), "an uncached request hit the cache"
    assert fill["cached"] == 0 and fill["usage"]["prompt_tokens"] > 0
    for x in ans_r:
        assert x["cached"] == a.items and x["scores"] == fill["scores"], "a repeated answer differs"
        assert x["usage"]["prompt_tokens"] == 0
    u, r = stats(lat_u), stats(lat_r)
    ratio = r["p50_ms"] / u["p50_ms"]
    entries = next((float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("prefixscore_cache_entries")), None)
    cache_bytes = next((float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("prefixscore_cache_bytes")), None)
    res = {
        "what": "one /v1/score request of --items items: computed (every item a miss) against "
                "answered from the pair cache (every item a hit); client-side wall ms, one at a time",
        "items": a.items, "n": a.n, "warmup": a.warmup, "query": a.query, "template": TEMPLATE,
        "serve_flags": serve, "prompt_tokens_uncached": fill["usage"]["prompt_tokens"],
        "uncached": u, "repeated": r, "ratio_p50": ratio, "ratio_p99": r["p99_ms"] / u["p99_ms"],
        "target_ratio": TARGET_RATIO, "met": ratio <= TARGET_RATIO,
        "cache_entries": entries, "cache_bytes": cache_bytes,
        "bytes_per_entry": cache_bytes / entries if entries else None, "server_exit": status,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 # other work on the host shows here: it slows both phases, the uncached one most
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
    }
    print(f"\n{'':10} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}   ({a.n} requests of {a.items} items)")
    for name, s in (("uncached", u), ("repeated", r)):
        print(f"{name:10} {s['p50_ms']:9.2f} {s['p99_ms']:9.2f} {s['max_ms']:9.2f}")
    print(f"repeated / uncached: p50 {ratio:.2%}, p99 {res['ratio_p99']:.2%} (target <= "
          f"{TARGET_RATIO:.0%}: {'met' if res['met'] else 'NOT met'}); cache {entries:.0f} entries, "
          f"{cache_bytes / 1024:.0f} KiB")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"pair_cache_{a.tag}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
