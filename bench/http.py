"""W5: the classifier through `prefixscore serve`, one request at a time and under open-loop load,
for several server layouts in one run (DESIGN.md §6-7).

    python -m bench.http                                        # bundled model, seed prompt
    python -m bench.http --rates 5,10,20 --duration 2 --serial 50 --configs 1,2 --load-procs 2
    python -m bench.http --server-cpus 0-9 --load-cpus 10-15 -- --model PATH --device cuda

Flags after `--` go to both the in-process classifier and `prefixscore serve` (model, template,
labels, device, dtype, mode, chat, batch window ...). Run it as a module (`-m`): a file named
http.py on sys.path would shadow the standard library's `http`.

Phases, all in one run:
  inproc   clf.classify(q), one call at a time, with no server: the floor HTTP is compared with.
           It runs in a child process (pinned like the server), which exits before any server
           starts, so its model and GPU memory are gone by then.
  per config in --configs ("1": --workers 1, today's single-process server with the engine on a
  thread; "auto": the server's default worker count; "N": --workers N), a fresh server each:
    serial  one request at a time on a keep-alive connection (closed loop): p50/p99, and the
            server's overhead = serial p50 - inproc p50
    open    open-loop Poisson arrivals at rising --rates, fired by --load-procs processes
            (bench/loadgen.py: pre-encoded requests, keep-alive, latency counted from each
            request's scheduled send time, so a slow server cannot slow the load down: no
            coordinated omission). A rate "holds" when the server answered >= 95% of it, without
            errors, and the generator kept to its schedule (late sends, p99 <= --lag-ms). Rates
            rise until one does not hold or p99 passes --stop-p99-ms; --refine bisects between the
            last rate that held and the first that did not. capacity = the highest rate that held.
            Then the load runs again at --at fractions of capacity (50% and 80%): their p99s.
    stop    SIGTERM; the server must exit 0.
Then a summary table beside the targets (the 16-CPU H200 host), $OUT/http.json (or
bench/results/http.json) and $OUT/http_latency.png (p50/p99 against the offered rate for every
config; needs matplotlib). Loopback only; every phase is bounded in time and count.

Measuring the generator: every open-loop row reports the lateness of the sends (actual - scheduled,
p99 over all processes) and each process's achieved send rate against its share; a row where the
generator lagged is flagged and never counts as held. --server-cpus/--load-cpus pin the server
(and the in-process phase) and the load processes to disjoint CPUs so they do not compete.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .loadgen import GET_HEALTHZ, LoadGen, status_name

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
HELD_FRACTION = 0.95  # a rate holds when the server answers at least this share of it

# The targets of the issue "serve at engine speed", on a 16-CPU H200 host.
TARGETS = {"serial_p50_ms": 1.0, "overhead_ms": 0.3, "capacity_rps": 30_000.0,
           "p99_at_50_ms": 5.0, "p99_at_80_ms": 10.0}


# ---------------------------------------------------------------- small helpers

def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def stats(ms) -> dict:
    xs = sorted(ms)
    if not xs:
        return {"n": 0}
    return {"p50_ms": pct(xs, 50), "p90_ms": pct(xs, 90), "p99_ms": pct(xs, 99), "max_ms": xs[-1],
            "n": len(xs)}


def parse_cpus(spec: str | None) -> set[int] | None:
    """'0-9,12' -> {0, ..., 9, 12}; None stays None (no pinning)."""
    if not spec:
        return None
    cpus = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def load_queries(path: str | None) -> list[str]:
    path = Path(path) if path else ROOT / "tests" / "data" / "intent_dev.csv"
    with open(path, newline="", encoding="utf-8") as f:
        return [r["query"] for r in csv.DictReader(f)]


def fmt_rate(x) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_ms(x, digits=2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# ---------------------------------------------------------------- phase 1: in-process

def warm_count(n: int) -> int:
    """Calls before timing: 50 (graphs, caches, connections), fewer for a short smoke run."""
    return min(50, max(5, n // 10))


def call_times(classify, queries, n):
    """ms of classify(q), one call at a time: in this thread, and handed to a worker thread with
    this one waiting (as --workers 1 runs its engine), which separates the thread's cost from
    HTTP's. The two kinds alternate call by call, so both see the same machine (clocks, other
    load), not one the first half of the run and the other the second."""
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    it = itertools.cycle(queries)
    pool = ThreadPoolExecutor(1)
    kinds = (classify, lambda q: pool.submit(classify, q).result())
    for _ in range(warm_count(n)):
        for call in kinds:
            call(next(it))
    out = ([], [])
    for _ in range(n):
        for call, ms in zip(kinds, out):
            q = next(it)
            t = time.perf_counter()
            call(q)
            ms.append(1e3 * (time.perf_counter() - t))
    pool.shutdown()
    return out


def _inprocess_child(conn, serve_flags, queries, n, cpus) -> None:
    """In a child process pinned like the server: the classifier built from the same flags as
    `prefixscore serve`, timed one call at a time. Also resolves the server's default worker
    count under that CPU set (what the "auto" config will run)."""
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        from prefixscore.cli.commands import build_parser
        from prefixscore.cli.common import make_classifier
        from prefixscore.serve.config import default_workers

        a = build_parser().parse_args(["serve", *serve_flags])
        clf = make_classifier(a)
        ms, thread_ms = call_times(clf.classify, queries, n)
        conn.send({"inproc": stats(ms), "default_workers": default_workers(),
                   "engine": {"device": str(clf.engine.device), "dtype": str(clf.engine.dtype),
                              "model": str(clf.loaded.name), "prefix_tokens": clf.prefix_len,
                              "labels": len(clf.labels),
                              "classify_on_a_worker_thread": stats(thread_ms)}})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def inprocess(serve_flags, queries, n, cpus) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_inprocess_child, args=(child, serve_flags, queries, n, cpus))
    p.start()
    try:
        out = parent.recv()
    except EOFError:
        out = {"error": f"the in-process phase died (exit {p.exitcode})"}
    p.join()
    if "error" in out:
        raise SystemExit(f"in-process phase failed:\n{out['error']}")
    return out


# ---------------------------------------------------------------- the server under test

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_flags(config: str) -> list[str]:
    return [] if config == "auto" else ["--workers", str(int(config))]


def start_server(flags: list[str], port: int, cpus, ready_timeout: float) -> subprocess.Popen:
    """`prefixscore serve` as a subprocess (pinned to `cpus`; its processes inherit the mask),
    ready once GET /healthz answers 200. The queue limit is raised so overload shows as latency
    (and 503 after --max-queue-ms), not as early 429s, and the connection limit above it (the
    server requires that); flags after `--` still override both."""
    cmd = [sys.executable, "-m", "prefixscore.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", "--max-queue", "16384", "--max-connections", "32768", *flags]
    proc = subprocess.Popen(cmd, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        if healthz(port) == 200:
            return proc
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server was not ready within {ready_timeout:g} s")


def healthz(port: int) -> int | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(GET_HEALTHZ)
            head = s.recv(64)
            return int(head[9:12]) if head.startswith(b"HTTP/1.1 ") else None
    except (OSError, ValueError):
        return None


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int | str:
    """SIGTERM, as a supervisor stops it: -> its exit status ('killed' if it did not exit)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "killed"


# ---------------------------------------------------------------- phase 2: serial

def serial_phase(gen: LoadGen, a, ports, inproc_p50: float) -> dict:
    port, grpc_port = ports
    gen.serial(port, warm_count(a.serial), a.timeout, grpc_port=grpc_port)  # warm the server
    r = gen.serial(port, a.serial, a.timeout, grpc_port=grpc_port, bodies=True)
    ok = [ms for ms, st in zip(r["lat"], r["status"]) if st == 200]
    if len(ok) < len(r["lat"]):
        raise RuntimeError(f"serial phase: {len(r['lat']) - len(ok)} of {len(r['lat'])} requests failed")
    out = {"serial": stats(ok)}
    out["overhead_p50_ms"] = out["serial"]["p50_ms"] - inproc_p50
    timing = r.get("timing") or []
    if timing:
        out["server_timing_p50_ms"] = {k: statistics.median(t[k] for t in timing) for k in timing[0]}
    h = gen.serial(port, a.serial, a.timeout, payload="healthz")
    out["healthz_rtt"] = stats([ms for ms, st in zip(h["lat"], h["status"]) if st == 200])
    return out


# ---------------------------------------------------------------- phase 3: open loop

def merge(outs: list[dict], rate: float, duration: float, lag_ms: float) -> dict:
    """One row from the load processes' arrays: percentiles over all requests, errors by kind,
    achieved rate, and whether the generator kept to its schedule."""
    ok, late, errors, procs = [], [], {}, []
    start = outs[0]["start"]
    last_done = 0.0
    for o in outs:
        for ms, st in zip(o["lat"], o["status"]):
            if st == 200:
                ok.append(ms)
            else:
                errors[status_name(st)] = errors.get(status_name(st), 0) + 1
        late.extend(o["late"])
        last_done = max(last_done, o["last_done"])
        share = o["n"] / duration
        proc_late = sorted(o["late"])
        procs.append({"share_rps": share, "send_rps": o["n"] / max(duration, o["last_send"] - start),
                      "late_p50_ms": pct(proc_late, 50), "late_p99_ms": pct(proc_late, 99),
                      "late_max_ms": proc_late[-1], "cpu_s": o["cpu_s"], "conns_opened": o["opened"],
                      "conn_limited": o["conn_limited"], "conn_errors": o["conn_errors"]})
    n = sum(o["n"] for o in outs)
    row = {"offered_rps": rate, "sent": n, "duration_s": duration, "ok": len(ok), "errors": errors,
           **stats(ok)}
    # Answers trail the arrivals by a request's own latency even when the server keeps up:
    # the span of answers, less the fastest one, against the span of arrivals.
    span = max(duration, last_done - start - (min(ok) / 1e3 if ok else 0.0))
    row["achieved_rps"] = len(ok) / span if ok else 0.0
    late.sort()
    lagging = [k for k, p in enumerate(procs)
               if p["late_p99_ms"] > lag_ms or p["send_rps"] < 0.98 * p["share_rps"]]
    row["gen"] = {"late_p99_ms": pct(late, 99), "late_max_ms": late[-1] if late else 0.0,
                  "min_send_fraction": min(p["send_rps"] / p["share_rps"] for p in procs),
                  "lagged": bool(lagging), "lagging_procs": lagging, "procs": procs}
    return row


def held(row: dict) -> bool:
    return (not row["errors"] and row["ok"] > 0 and not row["gen"]["lagged"]
            and row["achieved_rps"] >= HELD_FRACTION * row["offered_rps"])


def lag_only(row: dict) -> bool:
    """Not held only because the generator lagged (an H200 run lost every phase to load processes
    at 1.0-1.2 ms late p99 against --lag-ms 1 at 6,000 req/s)."""
    return (row["gen"]["lagged"] and not row["errors"] and row["ok"] > 0
            and row["achieved_rps"] >= HELD_FRACTION * row["offered_rps"])


def open_phase(gen: LoadGen, a, ports, rate: float, seed: int, phase: str) -> dict:
    outs, duration = gen.open_loop(ports[0], rate, a.duration, a.max_requests, a.timeout, a.max_conns,
                                   a.conns, seed, a.spin_ms, grpc_port=ports[1])
    row = merge(outs, rate, duration, a.lag_ms)
    row["phase"] = phase
    row["held"] = held(row)
    print_row(row)
    time.sleep(a.pause)  # let whatever the server still holds drain before the next phase
    return row


def find_capacity(gen: LoadGen, a, ports) -> tuple[list[dict], float | None, bool, str]:
    """Rising rates, then bisection (geometric) between the last that held and the first that did
    not. -> rows, capacity (the highest rate that held), whether that is only a lower bound (no
    rate failed), and why the ramp stopped."""
    rows, seed = [], 0
    held_max = fail_min = None
    why = "every rate held (capacity is at least the last one)"
    for rate in a.rates:
        seed += 1
        row = open_phase(gen, a, ports, rate, seed, "ramp")
        rows.append(row)
        if lag_only(row):  # the generator's hiccup, not the server's: that rate once more
            seed += 1
            row = open_phase(gen, a, ports, rate, seed, "ramp again")
            rows.append(row)
        if row["held"]:
            held_max = rate
        else:
            fail_min = rate
            why = ", ".join(w for w, bad in (
                ("the generator lagged", row["gen"]["lagged"]), ("errors", row["errors"]),
                (f"achieved < {HELD_FRACTION:.0%} of offered",
                 row["achieved_rps"] < HELD_FRACTION * rate)) if bad)
            break
        if row.get("p99_ms", 0) > a.stop_p99_ms:
            why = f"p99 passed {a.stop_p99_ms:g} ms (capacity is at least this rate)"
            break
    if held_max is not None and fail_min is not None:
        lo, hi = held_max, fail_min
        for _ in range(a.refine):
            seed += 1
            mid = math.sqrt(lo * hi)
            row = open_phase(gen, a, ports, mid, seed, "refine")
            rows.append(row)
            lo, hi = (mid, hi) if row["held"] else (lo, mid)
        held_max = lo
    return rows, held_max, fail_min is None, why


def run_config(config: str, gen: LoadGen, a, serve_flags, inproc: dict, default_workers: int) -> dict:
    workers = default_workers if config == "auto" else int(config)
    name = f"workers={config}" + (f" ({workers})" if config == "auto" else "")
    res = {"config": config, "name": name, "workers": workers}
    print(f"\n== {name}: {'one process, the engine on a thread' if workers == 1 else f'{workers} front-end processes + an engine process'}",
          flush=True)
    ports = (free_port(), free_port() if a.proto == "grpc" else None)
    flags = [*workers_flags(config), *(["--grpc-port", str(ports[1])] if ports[1] else []), *serve_flags]
    t = time.monotonic()
    try:
        proc = start_server(flags, ports[0], a.server_cpus, a.ready_timeout)
    except RuntimeError as e:
        print(f"  {e}: skipped", flush=True)
        return {**res, "error": str(e)}
    res["ready_s"] = time.monotonic() - t
    try:
        res.update(serial_phase(gen, a, ports, inproc["p50_ms"]))
        s, h = res["serial"], res["healthz_rtt"]
        print(f"  serial ({a.proto}, one at a time): p50 {s['p50_ms']:.3f} ms  p99 {s['p99_ms']:.3f} ms"
              f"  -> overhead over in-process p50 {res['overhead_p50_ms']:+.3f} ms"
              f"  (GET /healthz p50 {h.get('p50_ms', float('nan')):.3f} ms)", flush=True)
        if "server_timing_p50_ms" in res:
            print("  server's own timing p50: " + "  ".join(
                f"{k.removesuffix('_ms')} {v:.3f}" for k, v in res["server_timing_p50_ms"].items()) + " ms")
        print_header()
        rows, capacity, lower_bound, why = find_capacity(gen, a, ports)
        res.update(capacity_rps=capacity, capacity_is_lower_bound=lower_bound, ramp_stop=why)
        if capacity:
            for frac in a.at:
                rows.append(open_phase(gen, a, ports, frac * capacity, 100 + int(100 * frac), f"{frac:.0%} cap"))
                res[f"p99_at_{round(100 * frac)}_ms"] = rows[-1].get("p99_ms")
        res["open_loop"] = rows
        print(f"  capacity {'≥ ' * lower_bound}{fmt_rate(capacity)} req/s  (ramp stopped: {why})" + "".join(
            f";  p99 at {f:.0%} {fmt_ms(res.get(f'p99_at_{round(100 * f)}_ms'))} ms"
            for f in (a.at if capacity else ())), flush=True)
    except Exception as e:  # record it and go on to the next config
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        res["exit_code"] = stop_server(proc)
        if res["exit_code"] != 0:
            hint = (" (killed by the signal: uvicorn re-raises a SIGTERM it caught once its graceful "
                    "shutdown is done)" if res["exit_code"] == -signal.SIGTERM else "")
            print(f"  the server exited with {res['exit_code']} on SIGTERM (expected 0){hint}", flush=True)
    return res


# ---------------------------------------------------------------- output

COLS = (("phase", 10, "s"), ("offered/s", 10, "r"), ("achieved/s", 11, "r"), ("p50 ms", 8, "m"),
        ("p90 ms", 8, "m"), ("p99 ms", 8, "m"), ("max ms", 8, "m"), ("errors", 7, "s"),
        ("late p99", 9, "m"), ("send %", 7, "s"), ("", 0, "s"))


def print_header() -> None:
    print("  " + " ".join(f"{c:>{w}s}" if w else c for c, w, _ in COLS), flush=True)


def print_row(r: dict) -> None:
    g = r["gen"]
    notes = [] if r["held"] else ["not held"]
    if g["lagged"]:
        notes.append(f"GENERATOR LAGGED (procs {g['lagging_procs']})")
    if r["errors"]:
        notes.append(", ".join(f"{k}: {v}" for k, v in r["errors"].items()))
    waited = sum(p["conn_limited"] for p in g["procs"])
    if waited:  # the server held so many requests that the client ran out of connections
        notes.append(f"{waited} sends waited for a connection (--max-conns)")
    cells = (r["phase"], fmt_rate(r["offered_rps"]), fmt_rate(r["achieved_rps"]), fmt_ms(r.get("p50_ms")),
             fmt_ms(r.get("p90_ms")), fmt_ms(r.get("p99_ms")), fmt_ms(r.get("max_ms"), 1),
             str(sum(r["errors"].values())), fmt_ms(g["late_p99_ms"], 3),
             f"{100 * g['min_send_fraction']:.0f}", "; ".join(notes))
    print("  " + " ".join(f"{c:>{w}s}" if w else c for c, (_, w, _) in zip(cells, COLS)), flush=True)


def summary(out: dict) -> list[dict]:
    """The final table: one line per config beside the targets; ✓/✗ per target."""
    inproc = out["inproc"]["p50_ms"]
    rows = []
    for c in out["configs"]:
        rows.append({"config": c["name"], "serial_p50_ms": c.get("serial", {}).get("p50_ms"),
                     "overhead_ms": c.get("overhead_p50_ms"), "capacity_rps": c.get("capacity_rps"),
                     "lower_bound": bool(c.get("capacity_is_lower_bound")),
                     "p99_at_50_ms": c.get("p99_at_50_ms"), "p99_at_80_ms": c.get("p99_at_80_ms"),
                     "exit_code": c.get("exit_code"), "error": c.get("error")})

    def mark(key, v):
        if v is None:
            return " "
        good = v >= TARGETS[key] if key == "capacity_rps" else v <= TARGETS[key]
        return "✓" if good else "✗"

    print(f"\nsummary: in-process classify(q) p50 {inproc:.3f} ms; targets are for the 16-CPU H200 host")
    head = ("config", "serial p50 ms", "overhead ms", "capacity req/s", "p99@50% ms", "p99@80% ms", "exit")
    widths = (20, 14, 12, 15, 11, 11, 5)
    print(" ".join(f"{h:>{w}s}" for h, w in zip(head, widths)))
    t = TARGETS
    print(" ".join(f"{c:>{w}s}" for c, w in zip(
        ("target", f"≤ {t['serial_p50_ms']:.2f}", f"≤ {t['overhead_ms']:.2f}", f"≥ {t['capacity_rps']:,.0f}",
         f"≤ {t['p99_at_50_ms']:.1f}", f"≤ {t['p99_at_80_ms']:.1f}", "0"), widths)))
    for r in rows:
        cells = (r["config"], f"{fmt_ms(r['serial_p50_ms'], 3)} {mark('serial_p50_ms', r['serial_p50_ms'])}",
                 f"{fmt_ms(r['overhead_ms'], 3)} {mark('overhead_ms', r['overhead_ms'])}",
                 f"{'≥' * r['lower_bound']}{fmt_rate(r['capacity_rps'])} {mark('capacity_rps', r['capacity_rps'])}",
                 f"{fmt_ms(r['p99_at_50_ms'])} {mark('p99_at_50_ms', r['p99_at_50_ms'])}",
                 f"{fmt_ms(r['p99_at_80_ms'])} {mark('p99_at_80_ms', r['p99_at_80_ms'])}", str(r["exit_code"]))
        print(" ".join(f"{c:>{w}s}" for c, w in zip(cells, widths)) + (f"  error: {r['error']}" if r["error"] else ""))
    return rows


def plot(out: dict, path: Path) -> str | None:
    """p50 (dashed) and p99 (solid) against the offered rate, every config on one figure, with the
    in-process p50 and the p99 targets for reference."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not importable: no plot (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for k, c in enumerate(out["configs"]):
        rows = sorted((r for r in c.get("open_loop", []) if r.get("n")), key=lambda r: r["offered_rps"])
        if not rows:
            continue
        x = [r["offered_rps"] for r in rows]
        ax.plot(x, [r["p99_ms"] for r in rows], "o-", color=f"C{k}", label=f"{c['name']} p99")
        ax.plot(x, [r["p50_ms"] for r in rows], "s--", color=f"C{k}", alpha=0.6, label=f"{c['name']} p50")
        if c.get("capacity_rps"):
            ax.axvline(c["capacity_rps"], color=f"C{k}", ls=":", lw=1)
    ax.axhline(out["inproc"]["p50_ms"], color="gray", ls="-.", lw=1, label="in-process p50")
    for y in (TARGETS["p99_at_50_ms"], TARGETS["p99_at_80_ms"]):
        ax.axhline(y, color="red", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    # Ticks at the ramp's rates (every plotted rate when the ramp had few)
    rates = [(r["offered_rps"], r.get("phase")) for c in out["configs"] for r in c.get("open_loop", [])]
    ticks = sorted({x for x, phase in rates if phase == "ramp"})
    if len(ticks) < 3:
        ticks = sorted({x for x, _ in rates})
    ax.set_xticks(ticks, [fmt_rate(t) for t in ticks], fontsize=8)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("offered rate (req/s, open loop, Poisson)")
    ax.set_ylabel("latency from scheduled send (ms)")
    ax.set_title(f"prefixscore serve, {out['meta']['proto']}: latency against rate "
                 f"(dotted verticals: capacity; red: p99 targets)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ---------------------------------------------------------------- main

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1,auto",
                    help="server layouts, comma-separated: 1 (one process), auto (the default worker "
                         "count), N (--workers N)")
    ap.add_argument("--proto", default="http", choices=["http", "grpc"],
                    help="grpc: prefixscore.v1.PrefixScore/Classify on --grpc-port (needs "
                         "prefixscore.serve.proto)")
    ap.add_argument("--rates", default="100,300,1000,3000,6000,10000,15000,20000,30000,40000,50000,65000,80000",
                    help="offered requests/s, rising")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of load per rate")
    ap.add_argument("--max-requests", type=int, default=300_000, help="at most this many per rate")
    ap.add_argument("--refine", type=int, default=2,
                    help="bisection steps between the last rate that held and the first that did not")
    ap.add_argument("--at", default="0.5,0.8", help="fractions of capacity to run again (their p99s)")
    ap.add_argument("--stop-p99-ms", type=float, default=200.0, help="stop raising the rate past this p99")
    ap.add_argument("--serial", type=int, default=1000, help="requests in the closed-loop phases")
    ap.add_argument("--load-procs", type=int, default=None,
                    help="load processes (default: max(2, CPUs // 4), at most the --load-cpus)")
    ap.add_argument("--server-cpus", default=None, help="pin the server (and the in-process phase): 0-9")
    ap.add_argument("--load-cpus", default=None, help="pin the load processes: 10-15")
    ap.add_argument("--conns", type=int, default=64,
                    help="keep-alive connections opened before each phase, over all load processes "
                         "(so every front end gets some)")
    ap.add_argument("--max-conns", type=int, default=1024, help="client connections at most, in all")
    ap.add_argument("--timeout", type=float, default=10.0, help="per-request timeout (s)")
    ap.add_argument("--spin-ms", type=float, default=1.0,
                    help="the pacer spins this long before each send instead of sleeping on the "
                         "loop's millisecond-coarse timer")
    ap.add_argument("--lag-ms", type=float, default=1.0,
                    help="a load process whose sends are later than this at p99 lagged")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between open-loop phases")
    ap.add_argument("--queries", default=None, help="CSV with a query column (default: tests/data/intent_dev.csv)")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a server to be ready")
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then flags for the classifier and the server")
    a = ap.parse_args()
    a.serve_flags = a.serve_flags[1:] if a.serve_flags[:1] == ["--"] else a.serve_flags
    a.rates = [float(r) for r in a.rates.split(",")]
    a.at = [float(f) for f in a.at.split(",")] if a.at else []
    a.configs = [c.strip() for c in a.configs.split(",")]
    for c in a.configs:
        if c != "auto" and not c.isdigit():
            ap.error(f"--configs: {c!r} is neither 'auto' nor a worker count")
    a.server_cpus, a.load_cpus = parse_cpus(a.server_cpus), parse_cpus(a.load_cpus)
    if a.load_procs is None:
        a.load_procs = max(2, (os.cpu_count() or 2) // 4)
        if a.load_cpus:
            a.load_procs = min(a.load_procs, len(a.load_cpus))
    return a


def main():
    a = parse_args()
    queries = load_queries(a.queries)
    import importlib.util

    # uvicorn picks httptools and uvloop when they are installed, else pure-Python h11 / asyncio
    stack = {m: importlib.util.find_spec(m) is not None for m in ("httptools", "uvloop")}
    meta = {"serve_flags": a.serve_flags, "cpus": os.cpu_count(), "proto": a.proto, "configs": a.configs,
            "server_cpus": sorted(a.server_cpus) if a.server_cpus else None,
            "load_cpus": sorted(a.load_cpus) if a.load_cpus else None, "load_procs": a.load_procs,
            "duration_s": a.duration, "server_stack": stack, "targets": TARGETS, "queries": len(queries)}
    print(f"{os.cpu_count()} CPUs; server on {meta['server_cpus'] or 'any'}, {a.load_procs} load processes on "
          f"{meta['load_cpus'] or 'any'}; server stack {stack}", flush=True)
    ip = inprocess(a.serve_flags, queries, a.serial, a.server_cpus)
    out = {"meta": meta, "inproc": ip["inproc"], "engine": ip["engine"], "configs": []}
    th = ip["engine"]["classify_on_a_worker_thread"]
    print(f"in-process classify(q): p50 {ip['inproc']['p50_ms']:.3f} ms  p99 {ip['inproc']['p99_ms']:.3f} ms;"
          f" on a worker thread p50 {th['p50_ms']:.3f} ms  ({ip['engine']['model']} on "
          f"{ip['engine']['device']})", flush=True)
    gen = LoadGen(a.load_procs, a.proto, queries, a.load_cpus)
    try:
        for config in a.configs:
            out["configs"].append(run_config(config, gen, a, a.serve_flags, ip["inproc"], ip["default_workers"]))
    finally:
        gen.close()
    out["summary"] = summary(out)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "http.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / 'http.json'}")
    png = plot(out, OUT / "http_latency.png")
    if png:
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
