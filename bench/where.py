"""Where a server's time goes at fixed open-loop rates: per process CPU (from /proc), the engine's
passes (rows per pass, pass time, share of time in passes, from /metrics), the load processes'
CPU, and optionally py-spy profiles of the engine and the busiest front end at the last rate.

    python -m bench.where --rates 3000,8000,16000 --server-cpus 0-9 --load-cpus 10-15 \
        -- --model /tmp/q05 --device cuda --target-p99-ms 5
    python -m bench.where --rates 20,40 -- --workers 2        # bundled model on CPU

--py-spy PATH profiles at the last rate (`pip install --target /tmp/spy py_spy-*.whl`: the wheel
carries a static binary; raw collapsed stacks land in $OUT/where_spy_{engine,frontend}.txt, with
a summary of the heaviest frames printed). Open loop as bench.http (Poisson arrivals, latency
from the scheduled send). Writes $OUT/where.json (or bench/results/where.json).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import time

from .http import OUT, free_port, load_queries, merge, parse_cpus, start_server, stop_server
from .loadgen import LoadGen, scrape


def tree(root: int) -> list[int]:
    """root and its descendants."""
    kids: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p))
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo += kids.get(out[-1], [])
    return out


def cpu_ticks(pids) -> dict[int, tuple[int, int]]:
    """pid -> (utime + stime in clock ticks, threads)."""
    out = {}
    for p in pids:
        try:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            out[p] = (int(f[11]) + int(f[12]), int(f[17]))
        except (OSError, IndexError, ValueError):
            pass
    return out


def summarize_spy(path: str, top: int = 12) -> list[tuple[float, str]]:
    """The frames most samples were in (inclusive), as shares of all samples."""
    total, incl = 0, collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            total += int(n)
            for frame in set(stack.split(";")):
                incl[frame] += int(n)
    skip = ("<module>", "spawn_main", "_main", "_bootstrap", "BaseProcess.run", "run (asyncio")
    rows = [(v / total, k) for k, v in incl.most_common(top + 12) if not any(s in k for s in skip)]
    return rows[:top]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="3000,8000,16000")
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--server-cpus"), ap.add_argument("--load-cpus")
    ap.add_argument("--load-procs", type=int, default=None)
    ap.add_argument("--py-spy", default=None, help="py-spy binary: profile at the last rate")
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    flags = a.serve_flags[1:] if a.serve_flags[:1] == ["--"] else a.serve_flags
    server_cpus, load_cpus = parse_cpus(a.server_cpus), parse_cpus(a.load_cpus)
    if load_cpus:
        os.sched_setaffinity(0, load_cpus)
    procs = a.load_procs or (len(load_cpus) if load_cpus else 2)
    gen = LoadGen(procs, "http", load_queries(None), load_cpus)
    port, rates, out = free_port(), [float(r) for r in a.rates.split(",")], []
    server = start_server(["--max-queue", "1024", *flags], port, server_cpus, 600.0)
    try:
        gen.serial(port, 50, 10.0)
        busiest: list[int] = []
        print(f"{'rate':>8} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} {'rows/pass':>9} {'pass ms':>8} "
              f"{'in passes':>9}  CPU per server process (engine first) | load processes", flush=True)
        for rate in rates:
            ours = tree(server.pid)
            load = [p for p in tree(os.getpid()) if p not in ours and p != os.getpid()]
            spies = []
            if a.py_spy and rate == rates[-1] and busiest:
                for name, pid in zip(("engine", "frontend"), busiest):
                    path = os.path.join(OUT, f"where_spy_{name}.txt")
                    spies.append((name, path, subprocess.Popen(
                        [a.py_spy, "record", "--pid", str(pid), "--duration", str(int(a.duration)), "--rate", "500",
                         "--format", "raw", "--nonblocking", "-o", path],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            c0, l0, m0, t0 = cpu_ticks(ours), cpu_ticks(load), scrape(port) or {}, time.monotonic()
            outs, dur = gen.open_loop(port, rate, a.duration, 3_000_000, 10.0, 1024, 64, int(rate), 1.0)
            c1, l1, m1, t1 = cpu_ticks(ours), cpu_ticks(load), scrape(port) or {}, time.monotonic()
            row, el = merge(outs, rate, dur, 1.0), t1 - t0
            hz = os.sysconf("SC_CLK_TCK")

            def delta(prefix):
                return sum(v - m0.get(k, 0) for k, v in m1.items() if k.startswith(prefix))

            passes = delta("prefixscore_batch_size_count")
            cpus = sorted((((c1[p][0] - c0[p][0]) / hz / el, p) for p in c1 if p in c0), reverse=True)
            busiest = [p for _, p in cpus[:2]]
            r = {"rate": rate, "achieved_rps": row["achieved_rps"], "p50_ms": row.get("p50_ms"),
                 "p99_ms": row.get("p99_ms"), "errors": row["errors"], "gen": row["gen"],
                 "passes_per_s": passes / el, "rows_per_pass": delta("prefixscore_batch_size_sum") / max(1, passes),
                 "pass_ms": 1e3 * delta("prefixscore_engine_forward_seconds_sum") / max(1, passes),
                 "in_passes": delta("prefixscore_engine_forward_seconds_sum") / el,
                 "server_cpu": [round(x, 2) for x, _ in cpus if x > 0.005],
                 "load_cpu": [round((l1[p][0] - l0[p][0]) / hz / el, 2) for p in l1 if p in l0]}
            for name, path, proc in spies:
                proc.wait()
                if os.path.exists(path):
                    r[f"spy_{name}"] = summarize_spy(path)
            out.append(r)
            print(f"{rate:>8,.0f} {r['achieved_rps']:>9,.0f} {r['p50_ms'] or 0:>8.2f} {r['p99_ms'] or 0:>8.2f} "
                  f"{r['rows_per_pass']:>9.1f} {r['pass_ms']:>8.2f} {r['in_passes']:>9.0%}  {r['server_cpu']} | "
                  f"{r['load_cpu']}", flush=True)
            for key in ("spy_engine", "spy_frontend"):
                for share, frame in r.get(key, []):
                    print(f"    {key[4:]:>8} {share:6.1%}  {frame[:110]}")
            time.sleep(1.0)
    finally:
        print("server exit:", stop_server(server))
    path = os.path.join(OUT, "where.json")
    with open(path, "w") as f:
        json.dump({"serve_flags": flags, "rows": out}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
