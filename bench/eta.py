"""Does `prefixscore classify`'s progress tell the truth on a big file? Its lines (a line every 5 s
when stderr is not a terminal: rows, rows/s, the share done and an ETA) against what happened.

    python -m bench.eta --rows 20000                 # the bundled model on this CPU (~8 min)
    python -m bench.eta --rows 1000000 -- --model /tmp/q05 --device cuda

A log of intent_dev queries cycled to --rows (text lines), classified to a JSONL file; flags after
`--` go to `prefixscore classify`. For each progress line: the share it printed against rows done
/ rows, and its ETA against the time the job then still took (the finish: the process's exit
less its teardown, i.e. the summary line's arrival). Writes $OUT/eta.json.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "intent_dev.csv"
OUT = Path(os.environ.get("OUT") or "bench/results")
LINE = re.compile(r"classify: (\d+) rows \((\d+) errors\), (\d+) rows/s(?:, (\d+)%, ETA (\d+)m(\d+)s)?")


def query_log(rows: int, prefix: str) -> tuple[Path, Path]:
    """(a new work folder, the text log in it): intent_dev's queries cycled to `rows` lines."""
    with open(DATA, newline="", encoding="utf-8") as f:
        qs = [r["query"] for r in csv.DictReader(f)]
    work = Path(tempfile.mkdtemp(prefix=prefix))
    log = work / "log.txt"
    log.write_text("".join(qs[i % len(qs)] + "\n" for i in range(rows)), encoding="utf-8")
    return work, log


def summary(lines: list[dict]) -> dict:
    """At the first line with a quarter, a half, three quarters of the rows done: the ETA it showed
    against the time the job then still took (ratio: shown / took)."""
    at = {}
    for share in (0.25, 0.5, 0.75):
        r = next((r for r in lines if r["true_pct"] >= 100 * share and r["eta_s"] is not None), None)
        if r is not None and r["left_s"] > 0:
            at[f"{100 * share:.0f}%"] = {"t": round(r["t"], 1), "rows": r["rows"], "eta_s": r["eta_s"],
                                         "left_s": round(r["left_s"], 1),
                                         "ratio": round(r["eta_s"] / r["left_s"], 3)}
    return at


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("cli_flags", nargs=argparse.REMAINDER, help="-- then flags for prefixscore classify")
    a = ap.parse_args()
    flags = a.cli_flags[1:] if a.cli_flags[:1] == ["--"] else a.cli_flags
    work, log = query_log(a.rows, "eta")
    cmd = [sys.executable, "-m", "prefixscore.cli", "classify", "-i", str(log), "-o", str(work / "out.jsonl"), *flags]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines, end = [], None
    for line in p.stderr:
        now = time.monotonic() - t0
        m = LINE.search(line)
        if m:
            rows, _, rate, pct, mm, ss = m.groups()
            lines.append({"t": now, "rows": int(rows), "rate": int(rate),
                          "pct": None if pct is None else int(pct),
                          "eta_s": None if mm is None else 60 * int(mm) + int(ss)})
        elif line.startswith("classified "):
            end = now
    p.wait()
    if p.returncode != 0 or end is None:
        raise SystemExit(f"the job failed (exit {p.returncode})")
    for r in lines:
        r["true_pct"] = 100 * r["rows"] / a.rows
        r["left_s"] = end - r["t"]
        r["eta_error_s"] = None if r["eta_s"] is None else r["eta_s"] - r["left_s"]
    print(f"{'t s':>7} {'rows':>7} {'shown %':>8} {'done %':>7} {'ETA s':>7} {'took s':>7}")
    for r in lines:
        print(f"{r['t']:>7.0f} {r['rows']:>7} {str(r['pct']):>8} {r['true_pct']:>7.1f} "
              f"{str(r['eta_s']):>7} {r['left_s']:>7.0f}")
    out = {"rows": a.rows, "flags": flags, "seconds": end, "at": summary(lines), "lines": lines}
    print(json.dumps(out["at"]))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "eta.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / 'eta.json'}")


if __name__ == "__main__":
    main()
