"""`prefixscore classify --ray` and prefixscore.ray (issue 21 item 5) on a real local Ray cluster
(2 CPUs, no GPU, no mocks): Ray Data writes the rows the in-process command writes, file for file;
an actor killed mid-run is restarted and its batch retried, no row lost or written twice; finished
files are skipped on --resume, whichever mode wrote them; without Ray, --ray is one error line."""
import json
import os
import random
import signal
import sys
import threading
import time
import uuid

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from prefixscore.cli import commands as cli  # noqa: E402
from prefixscore.classifier import Classifier  # noqa: E402

LABELS = ["Dress", "Jeans", "Other"]
TEMPLATE = "Is this query about a dress, jeans or other?\nquery: {query}\nanswer:"
WORDS = "dress jeans shirt coat skirt tee hoodie knit blue red 连衣裙 牛仔裤 vintage xl".split()

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread here


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of this module's own: 2 CPUs (one actor, one reader), every worker on one
    OpenMP thread, and a token in their environment that tells this cluster's processes apart."""
    token = uuid.uuid4().hex
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
             object_store_memory=256 * 2**20, logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PREFIXSCORE_TEST_RAY": token}})
    yield token
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2"))


@pytest.fixture(scope="module")
def clf(model):
    return Classifier(model, TEMPLATE, LABELS, chat=False)


@pytest.fixture
def classify(clf, monkeypatch, capsys):
    """cli.main's classify with this module's model: in-process with the shared classifier, or, with
    --ray, on the cluster (its actors load the model from its path). -> (exit status, stderr)."""
    monkeypatch.setattr(cli, "make_classifier", lambda a: clf)

    def run(*args):
        capsys.readouterr()
        rc = cli.main(["classify", "--model", clf.loaded.name, "--template", TEMPLATE, "--labels",
                       ",".join(LABELS), "--no-chat", *map(str, args)])
        return rc, capsys.readouterr().err

    return run


def query(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def scores(row: dict) -> dict | None:
    """A row's scores: a JSONL `scores` object, else the score:LABEL columns (None: an error row)."""
    if "scores" in row:
        return row["scores"]
    return {k: v for k, v in row.items() if k.startswith("score:")}


def same_results(got: list[dict], want: list[dict]):
    """Rows alike but for the scores' last bits (Ray's batches are not the CLI's chunks, and a
    row's rounding follows its flat batch): every other column equal, scores within 1e-4, and
    the label equal unless the best two scores tie within that."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        rest = [{k: v for k, v in r.items() if not k.startswith("score") and k != "label"} for r in (g, w)]
        assert rest[0] == rest[1], (g, w)
        if w["label"] is None:
            assert g["label"] is None and w["error"], (g, w)
            continue
        gs, ws = scores(g), scores(w)
        assert gs.keys() == ws.keys() and all(abs(gs[k] - v) < 1e-4 for k, v in ws.items()), (g, w)
        top = sorted(ws.values())
        assert g["label"] == w["label"] or top[-1] - top[-2] < 1e-4, (g, w)


def jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_parquet_100k_rows_give_the_in_process_labels(cluster, classify, tmp_path):
    rng = random.Random(0)
    n = 100_000
    queries = [query(rng) for _ in range(n)]
    for i in range(0, n, 9973):  # rows without a query keep their place as error rows
        queries[i] = rng.choice([None, "", "   "])
    table = pa.table({"id": pa.array(range(n), pa.int64()), "query": queries,
                      "ts": pa.array([1_700_000_000_000 + i for i in range(n)], pa.timestamp("ms"))})
    src = tmp_path / "logs" / "day1.parquet"
    src.parent.mkdir()
    pq.write_table(table, src, row_group_size=20_000)
    rc, err = classify("-i", src, "-o", tmp_path / "ref.parquet")
    assert rc == 0, err
    rc, err = classify("-i", tmp_path / "logs" / "*.parquet", "-o", tmp_path / "out", "--ray")
    assert rc == 0, err
    assert "classified 99989 queries on Ray" in err, err
    got, want = pq.read_table(tmp_path / "out" / "day1.parquet"), pq.read_table(tmp_path / "ref.parquet")
    assert got.schema == want.schema  # the same columns, typed alike (ts stays a timestamp)
    groups = [[f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)]
              for f in map(pq.ParquetFile, (tmp_path / "out" / "day1.parquet", tmp_path / "ref.parquet"))]
    assert groups[0] == groups[1]  # a row group per CLI chunk: 32, 64, ... 4096 rows
    assert got["row"].to_pylist() == list(range(1, n + 1))
    assert sum(e is not None for e in got["error"].to_pylist()) == 11
    same_results(got.to_pylist(), want.to_pylist())
    assert sorted(os.listdir(tmp_path / "out")) == ["day1.parquet", "day1.parquet.meta.json"]


def ray_processes(token: str) -> dict[int, str]:
    """pid -> process title of this cluster's processes (their environment holds the token)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if token.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[int(pid)] = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
    return out


def test_a_killed_actor_is_retried_without_losing_or_doubling_rows(cluster, classify, model, tmp_path):
    """SIGKILL the classifying actor once rows are coming out: Ray restarts it and runs its batch
    again, and the output has every row once, as the in-process run writes it."""
    from prefixscore.ray import classify_files

    rng = random.Random(1)
    lines = []
    for i in range(20_000):
        r = rng.random()
        lines.append("" if r < 0.001 else '{"query": "unclosed' if r < 0.002 else
                     json.dumps({"id": i, "query": query(rng)}, ensure_ascii=False))
    src = tmp_path / "log.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc, err = classify("-i", src, "-o", tmp_path / "ref.jsonl", "--chunk-rows", 2000)
    assert rc == 0, err
    out, result = tmp_path / "out", {}

    def run():
        try:
            result["summary"] = classify_files(str(src), f"{out}/", chunk_rows=2000, quiet=True,
                                               model=model, template=TEMPLATE, labels=LABELS, chat=False)
        except BaseException as e:  # noqa: BLE001 (re-raised by the test)
            result["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    partial, killed = out / "log.jsonl.partial", None
    while worker.is_alive() and killed is None:
        time.sleep(0.05)
        try:  # (renamed to its final name when the run ends: exists() then stat() would race)
            started = partial.stat().st_size > 0  # the actor is classifying
        except FileNotFoundError:
            started = False
        if started:
            actors = [pid for pid, title in ray_processes(cluster).items()
                      if title.startswith("ray::MapWorker(")]
            if actors:
                os.kill(actors[0], signal.SIGKILL)
                killed, written = actors[0], partial.read_bytes().count(b"\n")
    worker.join(timeout=300)
    assert "error" not in result, result.get("error")
    assert killed is not None, "the run ended before an actor could be killed"
    assert written < len(lines), "the actor was killed once every row was out"
    assert killed not in ray_processes(cluster)
    got, want = jsonl(out / "log.jsonl"), jsonl(tmp_path / "ref.jsonl")
    assert [r["row"] for r in got] == list(range(1, len(lines) + 1))  # each row once, in order
    same_results(got, want)
    assert result["summary"]["rows"] == len(lines)


def test_resume_skips_finished_files_whichever_mode_wrote_them(cluster, classify, tmp_path):
    """A directory of CSV, JSONL and text files: the in-process and the Ray run write the same rows
    file for file; --resume skips what either finished (the same options recorded), and redoes a
    file whose input changed or whose output is gone."""
    rng = random.Random(2)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.csv").write_text("id,query\n" + "".join(f"{i},{query(rng)}\n" for i in range(300))
                                + "300,\n301,\"two, fields\",extra\n", encoding="utf-8")
    (logs / "b.jsonl").write_text("".join(json.dumps({"query": query(rng), "n": i}) + "\n"
                                          for i in range(500)) + "\n[1]\n", encoding="utf-8")
    (logs / "c.txt").write_text("".join(query(rng) + "\n" for _ in range(200)) + "\n", encoding="utf-8")
    (logs / "empty.jsonl").write_text("", encoding="utf-8")
    (logs / "notes.md").write_text("not an input\n")
    rc, err = classify("-i", logs, "-o", tmp_path / "here", "--chunk-rows", 64)
    assert rc == 0, err
    rc, err = classify("-i", logs, "-o", tmp_path / "ray", "--chunk-rows", 64, "--ray")
    assert rc == 0, err
    names = ["a.csv", "b.jsonl", "c.csv", "empty.jsonl"]
    for d in ("here", "ray"):
        assert sorted(os.listdir(tmp_path / d)) == sorted(names + [f"{n}.meta.json" for n in names])
    from prefixscore.rows.io import RowReader

    for name in names:
        with RowReader(str(tmp_path / "here" / name)) as h, RowReader(str(tmp_path / "ray" / name)) as r:
            want, got = [dict(row.fields) for row in h], [dict(row.fields) for row in r]
        if name.endswith(".csv"):  # CSV cells are text: the scores as written, to 6 digits
            for row in want + got:
                row.update({k: float(v) if v else None for k, v in row.items() if k.startswith("score:")})
                row.update({k: v or None for k, v in row.items() if k in ("label", "error")})
        same_results(got, want)
    here = tmp_path / "here"
    stamps = {p: p.stat().st_mtime_ns for p in here.iterdir()}
    # What the in-process run finished is finished for --ray too (the same options recorded).
    rc, err = classify("-i", logs, "-o", here, "--chunk-rows", 64, "--resume", "--ray")
    assert rc == 0 and "0 file(s) written" in err and "4 finished before, skipped" in err, err
    assert stamps == {p: p.stat().st_mtime_ns for p in here.iterdir()}
    rc, err = classify("-i", logs, "-o", here, "--chunk-rows", 64, "--resume", "--mode", "logits")
    assert rc == 2 and "was written with mode 'logprobs', not 'logits'" in err, err  # not skipped
    with open(logs / "b.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"query": "red dress"}) + "\n")  # this input changed: redone
    (here / "c.csv").unlink()  # gone: redone
    (here / "c.csv.partial").write_text("row,query\n1,torn")  # a partial output never counts
    rc, err = classify("-i", logs, "-o", here, "--chunk-rows", 64, "--resume", "--ray")
    assert rc == 0 and "2 file(s) written" in err and "2 finished before, skipped" in err, err
    assert [r["row"] for r in jsonl(here / "b.jsonl")] == list(range(1, 504))
    assert not (here / "c.csv.partial").exists()
    rc, err = classify("-i", logs, "-o", here, "--chunk-rows", 64, "--resume")  # --ray's, skipped too
    assert rc == 0 and err.count("finished before, skipped") == 4, err


def test_classify_dataset_adds_the_result_columns(cluster, clf, model):
    from prefixscore.ray import classify_dataset

    items = [{"query": "red summer dress", "label": "gold"}, {"query": "", "label": None},
             {"query": "blue jeans", "label": "x"}]
    ds = classify_dataset(ray.data.from_items(items), model=model, template=TEMPLATE, labels=LABELS,
                          chat=False, probs=True)
    rows = ds.take_all()
    assert list(rows[0]) == ["query", "input:label", "label", *(f"score:{l}" for l in LABELS),
                             *(f"prob:{l}" for l in LABELS), "error"]
    assert rows[1]["label"] is None and rows[1]["error"] == "'query' is missing or empty"
    for row, want in zip([rows[0], rows[2]], clf.classify_batch(["red summer dress", "blue jeans"])):
        assert row["input:label"] in ("gold", "x") and row["error"] is None
        assert row["label"] == want.label
        assert all(abs(row[f"score:{l}"] - want.scores[l]) < 1e-4 for l in LABELS)


def test_without_ray_one_error_line(classify, tmp_path, monkeypatch):
    import prefixscore.ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    for name in ("data", "files"):
        monkeypatch.delitem(sys.modules, f"prefixscore.ray.{name}", raising=False)
        monkeypatch.delattr(prefixscore.ray, name, raising=False)
    (tmp_path / "q.txt").write_text("red dress\n")
    rc, err = classify("-i", tmp_path / "q.txt", "-o", tmp_path / "out", "--ray")
    assert rc == 2
    assert err == "prefixscore: error: Ray Data is not installed: pip install 'prefixscore[ray]'\n"


def test_ray_needs_files(classify, tmp_path):
    rc, err = classify("red dress", "--ray")
    assert rc == 2 and "give them with -i" in err
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.txt").write_text("y\n")
    rc, err = classify("-i", tmp_path / "*.txt")
    assert rc == 2 and "give -o DIR" in err
    rc, err = classify("-i", tmp_path / "*.txt", "--format", "csv", "-o", tmp_path / "o")
    assert rc == 0, err
    rc, err = classify("-i", tmp_path / "nothing*.csv", "-o", tmp_path / "o")
    assert rc == 2 and "no input files match" in err
