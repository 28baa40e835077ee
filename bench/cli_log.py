"""The CLI on a synthetic query log (issue 21 item 6): rows/s and peak RSS of `prefixscore classify
-i log.jsonl -o out.jsonl`, beside `Classifier.classify_batch` on the same rows in memory, and the
model's own footprint (RSS once the classifier is built, before any row is read).

    python -m bench.cli_log --rows 1000000 --model /tmp/q05 --device cuda   # the H200
    python -m bench.cli_log --rows 100000 --model TINY                      # CPU, a tiny model

Each side runs in its own process (peak RSS from os.wait4); rows/s counts the classification only
(the CLI's own summary line; classify_batch's call), not the model load; and classify_batch on the
log's first 4,096 rows (median of 5), the rate the whole log should hold. Writes $OUT/cli_log.json.
Targets: CLI rows/s >= 90% of classify_batch; CLI peak RSS <= 1.5x the model's footprint.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "intent_dev.csv"

# classify_batch in a child: load, report the footprint, read the rows, time the call.
BATCH = r"""
import json, resource, sys, time
from prefixscore import Classifier
args = json.loads(sys.argv[1])
clf = Classifier(args["model"], device=args["device"], adapter=args["adapter"])
model_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
queries = [json.loads(l)["query"] for l in open(args["log"], encoding="utf-8")]
clf.classify_batch(queries[:2048])  # warm-up
t = time.perf_counter()
clf.classify_batch(queries)
seconds = time.perf_counter() - t
small = []  # the 4,096-row rate the whole log should hold: median of 5 calls on its first rows
for _ in range(5):
    t = time.perf_counter()
    clf.classify_batch(queries[:4096])
    small.append(time.perf_counter() - t)
print(json.dumps({"seconds": seconds, "model_rss_kib": model_rss,
                  "rows_per_s_4096": 4096 / sorted(small)[2]}))
"""


def make_log(path: Path, rows: int, seed: int = 0) -> None:
    """JSONL rows {"id", "ts", "query"}: intent_dev's queries with a random word added (so the
    tokenizer sees varied text), as a search log would carry them."""
    with open(DATA, newline="", encoding="utf-8") as f:
        base = [r["query"] for r in csv.DictReader(f)]
    words = "women men kids sale black white red blue cotton linen oversized vintage xl 2024".split()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            q = f"{rng.choice(base)} {rng.choice(words)}"
            f.write(json.dumps({"id": i, "ts": 1700000000 + i, "query": q}, ensure_ascii=False) + "\n")


def run_child(cmd) -> tuple[str, str, int]:
    """(stdout, stderr, peak RSS KiB) of a child process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        out.seek(0), err.seek(0)
        o, e = out.read().decode(), err.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:4]} failed:\n{e[-3000:]}")
    return o, e, usage.ru_maxrss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--device", default=None)
    ap.add_argument("--adapter", default=None, help="e.g. seed (the bundled model's default)")
    ap.add_argument("--tag", default="", help="written as cli_log_TAG.json")
    ap.add_argument("--work", default=None, help="folder for the log and the output (default: a temp dir)")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="cli_log_"))
    work.mkdir(parents=True, exist_ok=True)
    log, out = work / "log.jsonl", work / "out.jsonl"
    t = time.perf_counter()
    make_log(log, a.rows)
    print(f"log: {a.rows} rows, {log.stat().st_size / 2**20:.0f} MiB, written in {time.perf_counter() - t:.0f} s")

    flags = (["--model", a.model] if a.model else []) + (["--device", a.device] if a.device else []) \
        + (["--adapter", a.adapter] if a.adapter else ["--no-adapter"])
    _, err, cli_rss = run_child([sys.executable, "-m", "prefixscore.cli", "classify", "-i", str(log),
                                 "-o", str(out), *flags])
    m = re.search(r"classified (\d+) queries in ([\d.]+) s", err)
    if not m:
        raise SystemExit(f"no summary line in the CLI's stderr:\n{err[-2000:]}")
    cli_s = float(m.group(2))
    args = json.dumps({"model": a.model, "device": a.device, "adapter": a.adapter, "log": str(log)})
    o, _, batch_rss = run_child([sys.executable, "-c", BATCH, args])
    b = json.loads(o.strip().splitlines()[-1])
    rec = {"rows": a.rows, "model": a.model or "bundled", "device": a.device, "adapter": a.adapter,
           "cli_seconds": cli_s, "cli_rows_per_s": a.rows / cli_s, "cli_peak_rss_mib": cli_rss / 1024,
           "batch_seconds": b["seconds"], "batch_rows_per_s": a.rows / b["seconds"],
           "batch_peak_rss_mib": batch_rss / 1024, "model_rss_mib": b["model_rss_kib"] / 1024,
           "batch_4096_rows_per_s": b["rows_per_s_4096"]}
    rec["cli_over_batch"] = rec["cli_rows_per_s"] / rec["batch_rows_per_s"]
    rec["cli_rss_over_model"] = rec["cli_peak_rss_mib"] / rec["model_rss_mib"]
    print(f"{'':22} {'rows/s':>10} {'peak RSS MiB':>13}")
    print(f"{'prefixscore classify':22} {rec['cli_rows_per_s']:10.0f} {rec['cli_peak_rss_mib']:13.0f}")
    print(f"{'classify_batch':22} {rec['batch_rows_per_s']:10.0f} {rec['batch_peak_rss_mib']:13.0f}")
    print(f"{'classify_batch, 4,096':22} {rec['batch_4096_rows_per_s']:10.0f}")
    print(f"{'model alone':22} {'':10} {rec['model_rss_mib']:13.0f}")
    print(f"CLI / classify_batch rows/s {rec['cli_over_batch']:.2f} (target >= 0.90); "
          f"CLI peak RSS / model {rec['cli_rss_over_model']:.2f} (target <= 1.5)")
    dest = Path(os.environ.get("OUT") or "bench/results")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"cli_log{'_' + a.tag if a.tag else ''}.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
