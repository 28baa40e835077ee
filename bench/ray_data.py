"""Ray Data beside the in-process command on the same rows (issue 21 item 5): rows/s of
`prefixscore classify --ray` (prefixscore.ray.file_jobs, one actor) and of the in-process run
(the CLI's ClassifyJob over one Classifier), each reading, classifying and writing one synthetic
Parquet log. Target: Ray Data on one GPU >= 80% of the in-process rate.

    python -m bench.ray_data --rows 200000 --model TINY            # CPU: one actor of one CPU
    python -m bench.ray_data --rows 20000                          # CPU, the bundled model
    python -m bench.ray_data --rows 1000000 --device cuda          # a GPU: one actor, num_gpus=1

In-process: the Classifier built once, each run timed from opening the log to closing the output
(model load excluded, as the CLI's summary line excludes it). Ray: a local cluster of --cpus CPUs,
each run a fresh classify_files call (its actor loads the model). A warm-up run of each, then
--repeats runs of each, the two sides taking turns (the host's load shifts). Ray's rate
is its steady one: the rows that came back after the first block over the time since (Ray's start,
the actor's model load and its first block excluded); its wall time, start-up included, is shown
beside it. Medians. On CPU both sides use --threads torch threads (default 1: the actor's one CPU).
Writes $OUT/ray_data.json (else bench/results/ray_data.json).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "intent_dev.csv"


def make_log(path: Path, rows: int, seed: int = 0) -> None:
    """Parquet rows {id, ts, query}: intent_dev's queries with a random word added, as cli_log's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(DATA, newline="", encoding="utf-8") as f:
        base = [r["query"] for r in csv.DictReader(f)]
    words = "women men kids sale black white red blue cotton linen oversized vintage xl 2024".split()
    rng = random.Random(seed)
    queries = [f"{rng.choice(base)} {rng.choice(words)}" for _ in range(rows)]
    pq.write_table(pa.table({"id": pa.array(range(rows), pa.int64()),
                             "ts": pa.array([1_700_000_000 + i for i in range(rows)], pa.int64()),
                             "query": queries}), path, row_group_size=65536)


def steady(s: dict) -> float:
    """Ray's rows/s once its first block is back (nan: one block held every row)."""
    return s["steady_rows"] / s["seconds"] if s["steady_rows"] else float("nan")


def run_both(a, log: Path, work: Path, kw: dict) -> tuple[list[float], list[dict]]:
    """(seconds of each timed in-process run, classify_files' summary of each timed Ray run),
    the two interleaved so that a change in the host's load falls on both alike; run 0 warms up."""
    import ray

    from prefixscore import Classifier
    from prefixscore.rows.io import RowReader
    from prefixscore.rows.resume import model_record
    from prefixscore.rows.stream import ClassifyJob

    clf = Classifier(**kw)
    ray.init(address="local", num_cpus=a.cpus, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(a.threads)}})
    try:
        from prefixscore.ray import data
        from prefixscore.ray.file_jobs import classify_files

        data.quiet_logs()
        local, runs = [], []
        for i in range(1 + a.repeats):
            t = time.perf_counter()  # in-process: read, tokenize, classify, write; no model load
            with RowReader(str(log)) as reader:
                job = ClassifyJob(reader, str(work / f"in_process_{i}.parquet"), chunk_rows=a.chunk_rows,
                                  quiet=True)
                job.run(clf, model_record(clf, kw.get("adapter")), err=lambda msg: None)
            secs = time.perf_counter() - t
            s = classify_files(str(log), str(work / f"ray_{i}") + "/", actors=1, quiet=True,
                               chunk_rows=a.chunk_rows, info=lambda msg: None, **kw)
            print(f"run {i}{' (warm-up)' if not i else ''}: in-process {a.rows / secs:.0f} rows/s, "
                  f"Ray steady {steady(s):.0f} rows/s", flush=True)
            if i:
                local.append(secs)
                runs.append(s)
        return local, runs
    finally:
        ray.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--adapter", default=None, help="e.g. seed (the bundled model's CLI default)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-rows", type=int, default=4096,
                    help="the CLI's chunk, each side (Ray's blocks: about a chunk's rows each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU, each side")
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="the local Ray cluster's CPUs")
    ap.add_argument("--work", default=None, help="folder for the log and the outputs (default: a temp dir)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import torch

    torch.set_num_threads(a.threads)
    work = Path(a.work or tempfile.mkdtemp(prefix="ray_data_"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.parquet"
    make_log(log, a.rows)
    kw = {k: v for k, v in (("model", a.model), ("adapter", a.adapter), ("device", a.device)) if v}
    local, ray_runs = run_both(a, log, work, kw)
    rec = {"rows": a.rows, "model": a.model or "bundled", "adapter": a.adapter,
           "device": a.device or ("cuda" if torch.cuda.is_available() else "cpu"),
           "threads": a.threads, "cpus": a.cpus, "repeats": a.repeats, "chunk_rows": a.chunk_rows,
           "in_process_seconds": local, "in_process_rows_per_s": a.rows / statistics.median(local),
           "ray_runs": ray_runs, "ray_steady_rows_per_s": statistics.median(map(steady, ray_runs)),
           "ray_wall_seconds": statistics.median(r["wall"] for r in ray_runs),
           "ray_startup_seconds": statistics.median(r["startup"] for r in ray_runs)}
    rec["ray_end_to_end_rows_per_s"] = a.rows / rec["ray_wall_seconds"]
    rec["ray_over_in_process"] = rec["ray_steady_rows_per_s"] / rec["in_process_rows_per_s"]
    print(f"{a.rows} rows of Parquet, model {rec['model']}, {rec['device']}, {a.threads} torch thread(s) "
          f"a side, Ray: one actor on a local cluster of {a.cpus} CPUs; median of {a.repeats}")
    print(f"{'':34} {'rows/s':>8} {'wall s':>8}")
    print(f"{'in-process (prefixscore classify)':34} {rec['in_process_rows_per_s']:8.0f} "
          f"{statistics.median(local):8.1f}")
    print(f"{'Ray Data, steady':34} {rec['ray_steady_rows_per_s']:8.0f}")
    print(f"{'Ray Data, end to end':34} {rec['ray_end_to_end_rows_per_s']:8.0f} "
          f"{rec['ray_wall_seconds']:8.1f}  (first rows back after {rec['ray_startup_seconds']:.1f} s)")
    print(f"Ray steady / in-process: {rec['ray_over_in_process']:.2f} (target >= 0.80 on one GPU)")
    dest = Path(os.environ.get("OUT") or "bench/results")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "ray_data.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
