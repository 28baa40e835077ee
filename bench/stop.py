"""How soon does `prefixscore classify` stop on Ctrl-C, what does each --batch-tokens cost in rows/s,
and does `--resume` alone finish the job byte for byte?

    python -m bench.stop                                   # the bundled model on this CPU (~6 min)
    python -m bench.stop --batch-tokens 512,2048 --rows 1500

For each --batch-tokens value: one uninterrupted run of a log of intent_dev queries (--rows text
lines) to JSONL, its rows/s from the summary line; then --signals runs of the same command, each
sent SIGINT --after seconds after its first progress line (which comes 5 s into its classifying),
timed from the signal to the "stopped by" line and to the process's exit, its output's rows then
counted against the last progress line's; each is then continued with the same command and
`--resume` alone, and its output compared with the uninterrupted one's bytes. Writes
$OUT/stop.json.

    python -m bench.stop --rows 3000 --batch-tokens 1024 --after 25   # 30 s into a 3,000-row run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.eta import query_log

OUT = Path(os.environ.get("OUT") or "bench/results")


def classify(log: Path, out: Path, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "prefixscore.cli", "classify", "-i", str(log), "-o", str(out), *flags]


def full_run(cmd: list[str]) -> float:
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-2000:]}")
    # "classified N queries in S s (M ms/query)" is the summary line: S from the first row read
    line = next(l for l in p.stderr.splitlines() if l.startswith("classified "))
    n, secs = re.match(r"classified (\d+) queries in ([\d.]+) s", line).groups()
    return int(n) / float(secs), time.monotonic() - t0


def interrupted(cmd: list[str], out: Path, after: float) -> dict:
    """Start `cmd`, wait for its first progress line that counts rows (the model loaded, rows
    flowing: lines come every 5 s) and `after` seconds more, send SIGINT; the seconds to its stop line and to its exit, and
    the rows then in the output against the last progress line's and the stop line's."""
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    first, stop_line, lines, shown = threading.Event(), [], [], []

    def read():
        for line in p.stderr:
            lines.append(line)
            counted = re.match(r"classify: (\d+) rows", line)  # (not "waiting for the first rows")
            if counted:
                shown.append(int(counted.group(1)))
                first.set()
            if "stopped by SIGINT" in line:
                stop_line.append((time.monotonic(), int(line.split("rows 1-")[1].split()[0])))
        first.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    first.wait()
    time.sleep(after)
    sent = time.monotonic()
    p.send_signal(signal.SIGINT)
    rc = p.wait()
    exited = time.monotonic()
    t.join()
    if rc != 130 or not stop_line:
        raise SystemExit(f"the job did not stop as asked (exit {rc}): {''.join(lines)[-2000:]}")
    return {"to_stop_line_s": stop_line[0][0] - sent, "to_exit_s": exited - sent,
            "rows_last_progress_line": shown[-1], "rows_stop_line": stop_line[0][1],
            "rows_in_output": out.read_bytes().count(b"\n")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1500)
    ap.add_argument("--batch-tokens", default="512,1024,2048")
    ap.add_argument("--signals", type=int, default=3)
    ap.add_argument("--after", type=float, default=4.0, help="seconds after the first progress line")
    ap.add_argument("cli_flags", nargs=argparse.REMAINDER, help="-- then flags for prefixscore classify")
    a = ap.parse_args()
    flags = a.cli_flags[1:] if a.cli_flags[:1] == ["--"] else a.cli_flags
    work, log = query_log(a.rows, "stop")
    runs = []
    print(f"{'batch tokens':>12} {'rows/s':>7} {'to stop line s':>15} {'to exit s':>10} {'resumed == whole':>17}")
    for bt in [int(x) for x in a.batch_tokens.split(",")]:
        f = [*flags, "--batch-tokens", str(bt)]
        ref = work / f"ref{bt}.jsonl"
        rate, _ = full_run(classify(log, ref, f))
        stops = []
        for i in range(a.signals):
            out = work / f"cut{bt}_{i}.jsonl"
            s = interrupted(classify(log, out, f), out, a.after + i)  # a different point each time
            subprocess.run(classify(log, out, ["--resume"]), check=True, capture_output=True)
            s["identical"] = out.read_bytes() == ref.read_bytes()
            stops.append(s)
        r = {"batch_tokens": bt, "rows_per_s": rate, "stops": stops,
             "to_stop_line_s": statistics.median(s["to_stop_line_s"] for s in stops),
             "to_exit_s": statistics.median(s["to_exit_s"] for s in stops),
             "to_exit_max_s": max(s["to_exit_s"] for s in stops),
             "output_holds_last_line": all(s["rows_in_output"] >= s["rows_last_progress_line"]
                                           for s in stops),
             "identical": all(s["identical"] for s in stops)}
        runs.append(r)
        print(f"{bt:>12} {rate:>7.1f} {r['to_stop_line_s']:>15.2f} {r['to_exit_s']:>10.2f} "
              f"{str(r['identical']):>17}", flush=True)
    res = {"rows": a.rows, "flags": flags, "host": platform.node(), "cpus": os.cpu_count(),
           "method": "median of --signals SIGINTs, each --after+i s after the first progress line",
           "runs": runs}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "stop.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {OUT / 'stop.json'}")


if __name__ == "__main__":
    main()
