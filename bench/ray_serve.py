"""Ray Serve beside the project's own HTTP server on the same model and queries (issue 24 item 2):
serial latency (one request at a time on one keep-alive connection) of POST /v1/classify through
`prefixscore serve --workers 1` and through a Ray Serve application of one replica
(prefixscore.ray.app: Serve's HTTP proxy, then the replica, which is that same single-process server
behind @serve.ingress). Target: Ray Serve on one GPU adds <= 1 ms p50 over the server.

    python -m bench.ray_serve --model PATH --template T --labels a,b,c     # CPU (OMP_NUM_THREADS=1)
    python -m bench.ray_serve --model Qwen/Qwen3-0.6B --device cuda        # one GPU, shared by both

Both run at once (the server as a subprocess, Ray as a local cluster of --cpus CPUs started here)
and are measured in alternating blocks of --block requests, --n requests each in all after a
warm-up of --warm, so that the host's load (and Ray's idle background: controller, raylet, proxy)
falls on both alike. The client is http.client with pre-encoded bodies, in this process.
"inside p50": the answers' own timing.total_ms (the Frontend's, from admission to the answer): what
the server or replica spends itself; the rest of a Ray Serve request is Serve's proxy and hops. Queries:
tests/data/intent_dev.csv in a seeded shuffle, the same sequence for both. On CPU, torch runs on
one thread in both (OMP_NUM_THREADS=1 for the server and the replica). Writes $OUT/ray_serve.json
(else bench/results/ray_serve.json).
"""
from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "intent_dev.csv"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def queries(n: int, seed: int = 0) -> list[str]:
    with open(DATA, newline="", encoding="utf-8") as f:
        base = [r["query"] for r in csv.DictReader(f)]
    rng = random.Random(seed)
    return [rng.choice(base) for _ in range(n)]


def wait_healthy(port: int, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/healthz")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"nothing healthy on port {port} within {timeout:g} s")


class Serial:
    """One keep-alive connection; each request timed from its send to the end of its body."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"content-type": "application/json"}
        self.inside = []  # the answer's own timing.total_ms: the time inside the server (replica)

    def run(self, bodies: list[bytes]) -> list[float]:
        out = []
        for body in bodies:
            t0 = time.perf_counter()
            self.conn.request("POST", "/v1/classify", body, self.headers)
            r = self.conn.getresponse()
            data = r.read()
            out.append(1e3 * (time.perf_counter() - t0))
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
            self.inside.append(data)
        return out


def stats(ms: list[float]) -> dict:
    s = sorted(ms)
    pct = lambda p: s[min(len(s) - 1, int(p / 100 * len(s)))]  # noqa: E731
    return {"n": len(s), "p50_ms": statistics.median(s), "p90_ms": pct(90), "p99_ms": pct(99),
            "mean_ms": statistics.fmean(s)}


def start_server(a, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "prefixscore.cli", "serve", "--workers", "1", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *model_flags(a)]
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": threads})


def model_flags(a) -> list[str]:
    flags = []
    for name in ("model", "template", "labels", "device"):
        if getattr(a, name) is not None:
            flags += [f"--{name}", getattr(a, name)]
    return flags + (["--no-chat"] if a.no_chat else [])


def start_ray(a, port: int):
    import ray
    from ray import serve

    from prefixscore.ray import app

    gpu = a.device is not None and a.device.startswith("cuda")
    ray.init(address="local", num_cpus=a.cpus, num_gpus=1 if gpu else 0, include_dashboard=False,
             logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}})
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    kw = {k: getattr(a, k) for k in ("device",) if getattr(a, k) is not None}
    if a.no_chat:
        kw["chat"] = False
    serve.run(app(a.model, a.template, a.labels, num_replicas=1, num_gpus=1 if gpu else 0,
                  num_cpus=1, **kw), name="bench", route_prefix="/")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--template")
    p.add_argument("--labels")
    p.add_argument("--device")
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--n", type=int, default=1000, help="timed requests per side")
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--block", type=int, default=100, help="requests per alternating block")
    p.add_argument("--output", help="file name under $OUT or bench/results (default ray_serve.json)")
    p.add_argument("--cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set for every process of the local cluster (Serve's switches, e.g. "
                        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0); repeatable")
    a = p.parse_args(argv)
    # Before ray.init: the cluster's processes (controller, proxy, replica) inherit this environment.
    os.environ.update(kv.split("=", 1) for kv in a.ray_env)

    bodies = [json.dumps({"query": q}, ensure_ascii=False).encode() for q in queries(a.warm + a.n)]
    sport, rport = free_port(), free_port()
    server = start_server(a, sport)
    try:
        start_ray(a, rport)
        wait_healthy(sport, a.ready_timeout, server)
        wait_healthy(rport, a.ready_timeout)
        sides = {"server": Serial(sport), "ray_serve": Serial(rport)}
        for s in sides.values():
            s.run(bodies[:a.warm])
        lat = {k: [] for k in sides}
        timed = bodies[a.warm:]
        for i in range(0, len(timed), a.block):
            order = list(sides) if (i // a.block) % 2 == 0 else list(sides)[::-1]
            for k in order:
                lat[k] += sides[k].run(timed[i:i + a.block])
    finally:
        server.terminate()
        server.wait(60)
        try:
            from ray import serve

            serve.shutdown()
            import ray

            ray.shutdown()
        except Exception:
            pass

    res = {k: stats(v) for k, v in lat.items()}
    for k, side in sides.items():  # parsed now, outside the timed loop (the warm-up's dropped)
        inside = [json.loads(b)["timing"]["total_ms"] for b in side.inside[a.warm:]]
        res[k]["inside_p50_ms"] = statistics.median(inside)
    res["added_p50_ms"] = res["ray_serve"]["p50_ms"] - res["server"]["p50_ms"]
    res["added_p99_ms"] = res["ray_serve"]["p99_ms"] - res["server"]["p99_ms"]
    res["config"] = {k: getattr(a, k) for k in ("model", "template", "labels", "device", "n", "warm",
                                                "block", "cpus", "ray_env")}
    import ray

    res["config"]["ray"] = ray.__version__
    print(f"{'side':<12}{'n':>6}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'inside p50':>12}")
    for k in sides:
        s = res[k]
        print(f"{k:<12}{s['n']:>6}{s['p50_ms']:>9.3f}{s['p90_ms']:>9.3f}{s['p99_ms']:>9.3f}"
              f"{s['mean_ms']:>9.3f}{s['inside_p50_ms']:>12.3f}")
    print(f"Ray Serve adds {res['added_p50_ms']:.3f} ms p50, {res['added_p99_ms']:.3f} ms p99 "
          f"(target on one GPU: <= 1 ms p50)")
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results") / (a.output or "ray_serve.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
