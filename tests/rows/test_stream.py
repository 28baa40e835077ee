"""`prefixscore classify` on inputs of any size (issue 21): rows streamed in chunks, every input row
answered in its place (error rows included), SIGINT/SIGTERM stop after the chunk in flight,
--resume continues an output file byte for byte, memory flat in the input's length. The reference
is Classifier.classify_batch on the same rows."""
import io
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from tests.helpers import random_queries
from prefixscore.cli import commands as cli
from prefixscore.classifier import Classifier
from prefixscore.rows.resume import chunk_ends

LABELS = ["Dress", "Jeans", "Other"]
# Subprocesses use one thread: on a busy host, OpenMP threads that spin for a core cost 30x here.
ENV = dict(os.environ, OMP_NUM_THREADS="1")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2"))


@pytest.fixture(scope="module")
def clf(model):
    return Classifier(model, labels=LABELS, chat=False)


@pytest.fixture
def main(clf, monkeypatch, capsys):
    """cli.main in-process with one classifier shared by the calls (the model loads once); the
    options a run records come from the same classifier. -> (exit status, stderr)."""
    monkeypatch.setattr(cli, "make_classifier", lambda a: clf)

    def run(*args):
        capsys.readouterr()
        rc = cli.main(["classify", "--model", clf.loaded.name, "--labels", ",".join(LABELS),
                       "--no-chat", *map(str, args)])
        return rc, capsys.readouterr().err

    return run


def run_cli(model, *args, **kw):
    return subprocess.run([sys.executable, "-m", "prefixscore.cli", "classify", "--model", model,
                           "--labels", ",".join(LABELS), "--no-chat", *map(str, args)],
                          capture_output=True, text=True, env=ENV, timeout=300, **kw)


def jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


class Err(str):
    """Where a test expects an error row: (part of) its error text, in place of a query."""


def check_against_reference(clf, written, queries):
    """Each written row is its input row: the reference's label and scores, or (where `queries`
    holds an error's text instead of a query) an error row with that error."""
    assert [w["row"] for w in written] == list(range(1, len(queries) + 1))
    ok = [i for i, q in enumerate(queries) if not isinstance(q, Err)]
    ref = dict(zip(ok, clf.classify_batch([queries[i] for i in ok])))
    for i, (w, q) in enumerate(zip(written, queries)):
        if i not in ref:
            assert w["label"] is None and w["scores"] is None and q in w["error"], (w, q)
            continue
        r = ref[i]
        assert w["error"] is None and w["query"] == q
        assert all(abs(w["scores"][l] - r.scores[l]) < 1e-4 for l in LABELS), (w, r)
        margin = sorted(r.scores.values())[-1] - sorted(r.scores.values())[-2]
        assert w["label"] == r.label or margin < 1e-4


# ---------------------------------------------------------------- interrupt and resume

def log_lines(n, seed):
    """JSONL 'query logs' with blank, broken and mistyped lines among them, and the query (a
    string) or the reason (a substring of the error) expected for each row."""
    rng = random.Random(seed)
    lines, expect = [], []
    for q in random_queries(n, seed):
        bad = rng.random()
        if bad < 0.002:
            line, want = "", Err("blank line")
        elif bad < 0.004:
            line, want = '{"query": "unclosed', Err("invalid JSON")
        elif bad < 0.006:
            line, want = '{"query": 7}', Err("must be a string, got int")
        else:
            line, want = json.dumps({"id": len(lines) + 1, "query": q}, ensure_ascii=False), q
        lines.append(line)
        expect.append(want)
    return "\n".join(lines) + "\n", expect


@pytest.fixture(scope="module")
def logs(model, clf, tmp_path_factory):
    """8000 rows, an uninterrupted run over them in 50-row chunks (checked against the reference),
    and the arguments of that run."""
    d = tmp_path_factory.mktemp("logs")
    text, expect = log_lines(8000, seed=7)
    src = d / "logs.jsonl"
    src.write_text(text, encoding="utf-8")
    args = ["-i", src, "--chunk-rows", 50]
    clean = d / "clean.jsonl"
    p = run_cli(model, *args, "-o", clean)
    assert p.returncode == 0, p.stderr
    check_against_reference(clf, jsonl(clean), expect)
    return args, clean, expect


def size(path) -> int:
    # (io.check_output creates the output and removes it again before the model loads: an exists()
    # then stat() can fall between the two)
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_then_resume_is_byte_identical(model, logs, tmp_path, sig):
    args, clean, expect = logs
    full = clean.read_bytes()
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "classify", "--model", model,
                          "--labels", ",".join(LABELS), "--no-chat", *map(str, args), "-o", str(out)],
                         stderr=subprocess.PIPE, text=True, env=ENV)
    # A random point of the run: once the output holds that share of the clean output's bytes.
    target = random.Random(sig).uniform(0.05, 0.6) * len(full)
    while size(out) < target and p.poll() is None:
        time.sleep(0.002)
    p.send_signal(sig)
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 128 + sig, err
    last = err.strip().splitlines()[-1]
    done = int(last.split("rows 1-")[1].split()[0])
    assert last.startswith(f"prefixscore: stopped by {signal.Signals(sig).name}: rows 1-{done} ")
    assert "--resume" in last and "Traceback" not in err
    # The chunk in flight was finished and written; nothing after it, nothing torn.
    assert 0 < done < len(expect) and done in set(itertools.islice(chunk_ends(50), 200))
    part = out.read_bytes()
    assert part == full[:len(part)] and part.count(b"\n") == done
    p = run_cli(model, *args, "-o", out, "--resume")
    assert p.returncode == 0, p.stderr
    assert f"resumed after row {done}" in p.stderr
    assert out.read_bytes() == full
    # the sidecar too is an uninterrupted run's (options, and each chunk's end and digest)
    assert (tmp_path / "out.jsonl.meta.json").read_text().replace(str(out), "") == \
        (clean.parent / "clean.jsonl.meta.json").read_text().replace(str(clean), "")


def passes_of(clf, monkeypatch, stop_at=None):
    """Record each engine pass's queries (its composition: the same pass, the same bits); on the
    pass numbered stop_at[0] of a run, a SIGINT (on a CPU that pass completes, and the stop lands
    after it). -> the list of passes, which a test clears between runs."""
    real, passes = type(clf)._launch, []

    def counted(self, batch):
        passes.append(tuple(e.values["query"] for e in batch))
        if stop_at and len(passes) == stop_at[0]:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, batch)

    monkeypatch.setattr(type(clf), "_launch", counted)
    return passes


def some_without_the_prefix(clf, monkeypatch, queries):
    """As if these queries merged into the cached prefix: their requests are computed whole, in
    passes of their own after the chunk's cached passes (Classifier._chunks)."""
    encode_many = type(clf).encode_many

    def encode(self, qs):
        out = encode_many(self, qs)
        for e in out:
            if e.values["query"] in queries:
                e.start = 0
        return out

    monkeypatch.setattr(type(clf), "encode_many", encode)


def rows_shown(monkeypatch, out):
    """Every progress line forced after each write lands (the timer's lines come every 5 s), each
    checked against the output as it is then: -> [(rows the line counted, rows in the output)]."""
    from prefixscore.rows import stream

    seen, state, update = [], stream.Progress.state, stream.Progress.update

    def shown(self):
        rows, share = state(self)
        lines = out.read_bytes().count(b"\n") if out.exists() else 0
        seen.append((rows, max(0, lines - (out.suffix == ".csv"))))  # (a CSV header)
        return rows, share

    monkeypatch.setattr(stream.Progress, "state", shown)
    monkeypatch.setattr(stream.Progress, "update", lambda self, *a: (update(self, *a), self.tick()))
    return seen


@pytest.mark.parametrize("fmt,stops,first", [("jsonl", (9, 4), (32, 96)), ("csv", (2, 3), (0, 32))])
def test_a_stop_keeps_the_passes_done_and_resume_runs_the_rest(main, clf, tmp_path, monkeypatch,
                                                                fmt, stops, first):
    """A stop lands between passes and keeps every row a completed pass answered, the chunk in
    flight's too: they are written, the sidecar records them (a record inside the chunk), and
    progress never counted a row the output lacks. --resume reads the chunk again from its first
    row, cuts it into the same passes, runs none whose rows are all written, and after two stops
    writes an uninterrupted run's bytes and sidecar. Rows without the cached prefix (passes of
    their own) and error rows mixed in; the first stop inside the second chunk (JSONL) or inside
    the first, whose bytes start with the header (CSV)."""
    queries = list(dict.fromkeys(random_queries(400, 5)))[:150]
    lines = [q if i % 23 != 7 else "" for i, q in enumerate(queries)]  # some blank: error rows
    src = tmp_path / "q.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    exact = {queries[i] for i in (20, 40, 41, 75, 130)}
    some_without_the_prefix(clf, monkeypatch, exact)
    flags = ("--chunk-rows", 96)  # chunks of rows 1-32, 33-96, 97-150
    monkeypatch.setattr(clf, "max_batch_tokens", 96)  # passes of a few rows
    stop_at = [None]
    passes = passes_of(clf, monkeypatch, stop_at)
    clean = tmp_path / f"clean.{fmt}"
    assert main("-i", src, "-o", clean, *flags)[0] == 0
    full, whole = clean.read_bytes(), list(passes)
    assert len(whole) > 12 and any(q in exact for p in whole for q in p)
    out = tmp_path / f"out.{fmt}"
    seen = rows_shown(monkeypatch, out)
    done, ran = [], []
    for k in (*stops, None):  # two stops, then the end
        passes.clear()
        stop_at[0] = k
        rc, err = main("-i", src, "-o", out, *flags, *(["--resume"] if done else []))
        ran.append(list(passes))
        written = out.read_bytes()
        assert full.startswith(written)
        if k is None:
            assert rc == 0 and written == full, err
            break
        assert rc == 130 and len(passes) == k, err  # not one pass more
        done.append(int(err.split("rows 1-")[1].split()[0]))
        assert written.count(b"\n") == done[-1] + (fmt == "csv")
        meta = json.loads((tmp_path / f"out.{fmt}.meta.json").read_text())
        assert meta["chunks"][-1][:2] == [done[-1], len(written)]
        assert seen and all(shown <= in_file for shown, in_file in seen) and seen[-1][0] == done[-1]
    assert first[0] < done[0] < first[1] and done[0] < done[1], done  # inside a chunk, then on
    # A resume ran only passes of the uninterrupted run, and none whose rows were all written.
    rows_of = {q: i + 1 for i, q in enumerate(lines) if q}
    for before, resumed in zip(done, ran[1:]):
        assert set(resumed) <= set(whole)
        assert all(max(rows_of[q] for q in p) > before for p in resumed)
    if fmt == "jsonl":  # here a pass ran again for its rows after a written one (row 76 held them)
        assert any(min(rows_of[q] for q in p) <= done[1] for p in ran[2])
    assert sum(map(len, ran)) < len(whole) + 4  # at most the passes in flight done twice
    assert (tmp_path / f"out.{fmt}.meta.json").read_text().replace(str(out), "") == \
        (tmp_path / f"clean.{fmt}.meta.json").read_text().replace(str(clean), "")


def test_passes_queue_across_chunks(main, clf, tmp_path, monkeypatch):
    """Where the engine queues (a GPU; forced here), the next chunk's first pass is launched before
    the last pass of the chunk before it is collected: the same bytes as one pass at a time; a
    stop launches no pass more, and the one queued when it came is collected and written."""
    src = tmp_path / "q.txt"
    src.write_text("\n".join(random_queries(96, 5)) + "\n", encoding="utf-8")
    flags = ("--chunk-rows", 32)
    monkeypatch.setattr(clf, "max_batch_tokens", 64)
    clean = tmp_path / "clean.jsonl"
    assert main("-i", src, "-o", clean, *flags)[0] == 0
    real, events, stop_at = type(clf)._launch, [], [None]

    def recorded(self, batch):
        k = sum(e[0] == "launch" for e in events)
        events.append(("launch", k, len(batch)))
        if k + 1 == stop_at[0]:
            os.kill(os.getpid(), signal.SIGINT)
        finish = real(self, batch)
        return lambda: events.append(("collect", k, len(batch))) or finish()

    monkeypatch.setattr(type(clf), "_launch", recorded)
    monkeypatch.setattr(type(clf.engine), "queues", property(lambda self: True))
    out = tmp_path / "out.jsonl"
    assert main("-i", src, "-o", out, *flags)[0] == 0
    assert out.read_bytes() == clean.read_bytes()
    launches = [e for e in events if e[0] == "launch"]
    ends = list(itertools.accumulate(n for _, _, n in launches))
    first = ends.index(32)  # the last pass of the first chunk
    assert events.index(("launch", first + 1, launches[first + 1][2])) < \
        events.index(("collect", first, launches[first][2]))
    events.clear()
    stop_at[0] = first + 2  # the signal comes with the second chunk's first pass
    rc, err = main("-i", src, "-o", out, *flags)
    kept = 32 + launches[first + 1][2]
    assert rc == 130 and f"stopped by SIGINT: rows 1-{kept} are written" in err, err
    assert [e for e in events if e[0] == "launch"] == launches[:first + 2]
    assert out.read_bytes().count(b"\n") == kept and clean.read_bytes().startswith(out.read_bytes())


def test_closing_the_chunks_waits_for_one_piece_not_the_chunk(monkeypatch):
    """The worker reads and tokenizes a chunk a piece at a time: a stop that closes the chunks
    while it reads the next one waits for the piece in hand, not for the rest of the chunk
    (--chunk-rows in the millions made that seconds)."""
    from types import SimpleNamespace

    from prefixscore.rows import stream
    from prefixscore.rows.io import Row

    monkeypatch.setattr(stream, "PIECE", 100)
    calls, gate = [], threading.Event()
    start = 32 * (2 ** 10 - 1)  # a chunk end of the grid: the chunks after it hold 32,768, 65,536 rows

    class Tokenizer:
        def encode_many(self, queries):
            calls.append(len(queries))
            if len(calls) == 329:  # the next chunk's first piece: held until the stop
                gate.wait(60)
            return [None] * len(queries)

    rows = (Row(n, n, {"query": "q"}, "q") for n in range(start + 1, start + 200_000))
    chunks = stream.tokenized_chunks(Tokenizer(), rows, SimpleNamespace(where=str), 10 ** 6, False, start)
    first = next(chunks)
    assert len(first.rows) == 32768 and len(calls) >= 328
    closed = chunks.gi_frame.f_locals["closed"]  # (the worker's signal, to release it after)
    closer = threading.Thread(target=chunks.close)  # a stop: closing waits for the worker
    closer.start()
    assert closed.wait(60)
    gate.set()
    closer.join(60)
    assert not closer.is_alive() and len(calls) == 329  # the piece in hand, none after


def test_a_second_signal_ends_the_process_at_once():
    script = ("import os, signal, time\n"
              "from prefixscore.rows.stream import StopSignals\n"
              "with StopSignals() as stop:\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(0.1)\n"
              "    assert stop.signum == signal.SIGINT\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(60)\n"
              "print('not stopped')\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert p.returncode == 130 and "stopped at once by a second SIGINT" in p.stderr, p.stderr
    assert "not stopped" not in p.stdout and "Traceback" not in p.stderr


def test_resume_alone_takes_the_recorded_options(main, tmp_path):
    """--resume with none of the job's options continues it with those its sidecar recorded (the
    input, chunk size, --probs...): byte-identical to one uninterrupted run; an option said and in
    conflict is refused, naming it; one said and equal is fine."""
    src = tmp_path / "q.txt"
    src.write_text("\n".join(random_queries(120, 9)) + "\n", encoding="utf-8")
    clean, out = tmp_path / "clean.jsonl", tmp_path / "out.jsonl"
    job = ("-i", src, "--chunk-rows", 16, "--probs", "--top-k", 2)
    assert main(*job, "-o", clean)[0] == 0
    full = clean.read_bytes()
    (tmp_path / "out.jsonl.meta.json").write_bytes((tmp_path / "clean.jsonl.meta.json").read_bytes())
    ends = [i + 1 for i, b in enumerate(full) if b == ord("\n")]
    out.write_bytes(full[:ends[40] + 5])  # 41 rows and a torn one
    rc, err = main("-o", out, "--resume")
    assert rc == 0, err
    assert "--resume: as" in err and "--input" in err and "--chunk-rows" in err and "--probs" in err
    assert "resumed after row 32" in err and out.read_bytes() == full
    out.write_bytes(full[:ends[40]])
    rc, err = main("-o", out, "--resume", "--chunk-rows", 8)
    assert rc == 2 and "written with chunk_rows 16, not 8" in err and "leave the option out" in err
    rc, err = main("-o", out, "--resume", "--chunk-rows", 16, "-i", src)
    assert rc == 0 and out.read_bytes() == full, err


def test_an_edited_row_is_refused_on_resume(main, tmp_path):
    """The sidecar holds each written chunk's end and digest: a resume keeps rows only as they were
    written, and an edited one is refused naming its chunk's rows."""
    src = tmp_path / "q.txt"
    src.write_text("\n".join(random_queries(100, 4)) + "\n", encoding="utf-8")
    out = tmp_path / "out.csv"
    assert main("-i", src, "-o", out, "--chunk-rows", 16)[0] == 0
    full = out.read_bytes()
    meta = json.loads((tmp_path / "out.csv.meta.json").read_text())
    assert [c[0] for c in meta["chunks"]] == [16, 32, 48, 64, 80, 96, 100] and meta["chunks"][-1][1] == len(full)
    lines = full.split(b"\n")
    row20 = lines[20].split(b",")  # the header is line 0: row 20
    label = row20[2]
    other = next(l.encode() for l in LABELS if l.encode() != label)
    edited = b"\n".join(lines[:20] + [b",".join(row20[:2] + [other] + row20[3:])] + lines[21:60])
    out.write_bytes(edited)
    rc, err = main("-i", src, "-o", out, "--chunk-rows", 16, "--resume")
    assert rc == 2 and "rows 17-32 of" in err and "not what was written" in err, err
    out.write_bytes(full[:len(full) // 2])  # untouched: resumes
    rc, err = main("-i", src, "-o", out, "--chunk-rows", 16, "--resume")
    assert rc == 0 and out.read_bytes() == full, err


def test_torn_output_resumes_byte_identical(main, tmp_path):
    """A crash (SIGKILL, power) can leave half a line or half a chunk: --resume drops the torn chunk
    and redoes it whole. CSV, with a query spanning lines, so a cut can fall inside a record."""
    queries = random_queries(230, 11)
    queries[40] = "multi\nline dress"
    src = tmp_path / "q.csv"
    src.write_text("query,id\n" + "".join(f'"{q.replace(chr(34), 2 * chr(34))}",{i}\n'
                                          for i, q in enumerate(queries)), encoding="utf-8")
    clean = tmp_path / "clean.csv"
    assert main("-i", src, "-o", clean, "--chunk-rows", 16)[0] == 0
    full = clean.read_bytes()
    out = tmp_path / "out.csv"
    (tmp_path / "out.csv.meta.json").write_bytes((tmp_path / "clean.csv.meta.json").read_bytes())
    at_record = full.index(b'"multi\nline') + 3
    cuts = [0, 5, full.index(b"\n") + 1, at_record, at_record + 8, len(full) // 2, len(full) - 3,
            len(full)] + random.Random(3).sample(range(len(full)), 6)
    for cut in cuts:
        out.write_bytes(full[:cut])
        rc, err = main("-i", src, "-o", out, "--chunk-rows", 16, "--resume")
        assert rc == 0, err
        assert out.read_bytes() == full, cut
    # Rows kept are whole chunks before the cut: the summary says where it went on.
    out.write_bytes(full[:len(full) // 2])
    rows_before = full[:len(full) // 2].count(b"\n") - 2  # the header and the two-line record
    rc, err = main("-i", src, "-o", out, "--chunk-rows", 16, "--resume")
    kept = int(err.split("resumed after row ")[1].split()[0])
    assert kept % 16 == 0 and rows_before - 16 < kept <= rows_before
    # JSONL writes every bit of a score: rows redone in smaller flat batches would show.
    clean, out = tmp_path / "clean.jsonl", tmp_path / "out.jsonl"
    assert main("-i", src, "-o", clean, "--chunk-rows", 16)[0] == 0
    full = clean.read_bytes()
    (tmp_path / "out.jsonl.meta.json").write_bytes((tmp_path / "clean.jsonl.meta.json").read_bytes())
    ends = [i + 1 for i, b in enumerate(full) if b == ord("\n")]
    for cut in [ends[20], ends[20] - 7, ends[100] + 3] + random.Random(4).sample(range(len(full)), 4):
        out.write_bytes(full[:cut])
        assert main("-i", src, "-o", out, "--chunk-rows", 16, "--resume")[0] == 0
        assert out.read_bytes() == full, cut


def test_resume_refuses_other_options(main, model, tmp_path, capsys, monkeypatch):
    src = tmp_path / "q.txt"
    src.write_text("".join(f"{q}\n" for q in random_queries(40, 2)), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main("-i", src, "-o", out, "--chunk-rows", 8)[0] == 0
    written = out.read_bytes()
    out.write_bytes(written[:len(written) // 2])
    half = out.read_bytes()

    def refused(*args, labels=None, other_model=None):
        argv = ["classify", "--model", other_model or model, "--labels", labels or ",".join(LABELS),
                "--no-chat", "-o", str(out), "--resume", *map(str, args)]
        capsys.readouterr()
        assert cli.main(argv) == 2
        e = capsys.readouterr().err
        assert "Traceback" not in e and e.count("prefixscore: error:") == 1
        assert out.read_bytes() == half  # nothing written, nothing truncated
        return e.strip().splitlines()[-1]

    assert "written with chunk_rows 8, not 16" in refused("-i", src, "--chunk-rows", 16)
    assert "written with keep_columns 'all', not 'none'" in refused(
        "-i", src, "--chunk-rows", 8, "--keep-columns", "none")
    other = tmp_path / "other.txt"
    other.write_text(src.read_text())
    assert "written with input" in refused("-i", other, "--chunk-rows", 8)
    # After the model loads: what the classifier resolves (labels, template, chat, model...).
    monkeypatch.undo()  # each run loads its own classifier from here on
    assert "written with labels ['Dress', 'Jeans', 'Other'], not ['Dress', 'Jeans', 'Shoes']" in \
        refused("-i", src, "--chunk-rows", 8, labels="Dress,Jeans,Shoes")
    assert "written with template" in refused("-i", src, "--chunk-rows", 8, "--template",
                                              "Which? {query}")
    copy = shutil.copytree(model, tmp_path / "copy")  # the same weights elsewhere: another model
    assert f"written with model {str(model)!r}, not {str(copy)!r}" in refused(
        "-i", src, "--chunk-rows", 8, other_model=str(copy))
    # The same path with other rows in it: the row check names the first row that differs.
    src.write_text("something else\n" + src.read_text())
    assert "row 1 of" in refused("-i", src, "--chunk-rows", 8) and "is not input row 1" in \
        refused("-i", src, "--chunk-rows", 8)
    (tmp_path / "out.jsonl.meta.json").unlink()
    assert "has no" in refused("-i", src, "--chunk-rows", 8)
    capsys.readouterr()
    assert cli.main(["classify", "x", "--resume"]) == 2
    assert "--resume continues an output file" in capsys.readouterr().err


# ---------------------------------------------------------------- rows in their place

def test_error_rows_keep_their_place(main, clf, tmp_path):
    long = "coat " * 800  # over the tiny model's context: only the tokenizer can tell
    src = tmp_path / "q.csv"
    src.write_text('id,query,note\n1,red dress,a\n\n2,,b\n3,"jeans, blue",c,extra\n'
                   f'4,{long},d\n5,"two\nlines",e\n6,levis 501,f\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    rc, err = main("-i", src, "-o", out)
    assert rc == 0 and "rows not classified: 4" in err
    got = jsonl(out)
    assert [g["row"] for g in got] == [1, 2, 3, 4, 5, 6, 7]
    assert [g["id"] if "id" in g else None for g in got] == ["1", None, "2", "3", "4", "5", "6"]
    check_against_reference(clf, got, [
        "red dress", Err("blank line"), Err("'query' is missing or empty"),
        Err("4 fields but the header has 3"), Err("over the model's context limit"), "two\nlines",
        "levis 501"])
    assert got[1]["error"] == "blank line" and got[4]["error"].startswith("prompt is")
    # CSV output: the same rows, label and scores empty where the error is.
    out = tmp_path / "out.csv"
    assert main("-i", src, "-o", out, "--keep-columns", "none")[0] == 0
    import csv
    rows = list(csv.reader(open(out, newline="", encoding="utf-8")))
    assert rows[0] == ["row", "query", "label", "score:Dress", "score:Jeans", "score:Other", "error"]
    assert [r[0] for r in rows[1:]] == ["1", "2", "3", "4", "5", "6", "7"]
    assert rows[2][2:] == ["", "", "", "", "blank line"] and rows[1][-1] == "" and rows[1][2] in LABELS
    # Plain lines: output row N is input line N, blank lines included.
    txt = tmp_path / "q.txt"
    txt.write_text("red dress\n\n   \nlevis\n", encoding="utf-8")
    assert main("-i", txt, "-o", out)[0] == 0
    rows = list(csv.reader(open(out, newline="", encoding="utf-8")))
    assert [(r[0], r[1], r[-1]) for r in rows[1:]] == [
        ("1", "red dress", ""), ("2", "", "blank line"), ("3", "   ", "blank line"), ("4", "levis", "")]


def test_a_huge_line_is_refused_untokenized_and_echoed_short(main, clf, tmp_path, monkeypatch):
    """A line far over the context limit (by its length alone: the limit times the longest token
    of the vocabulary) is an error row without reaching the tokenizer (a 50 MB line took a
    minute and 5 GB), and its error row echoes the first 300 characters of it and its length."""
    huge = "wool coat " * 400_000  # 4 MB
    src = tmp_path / "q.csv"
    src.write_text(f"query\nred dress\n{huge}\nlevis 501\n", encoding="utf-8")
    seen = []
    encode_ids = type(clf.prompt).encode_ids
    monkeypatch.setattr(type(clf.prompt), "encode_ids",
                        lambda self, vl: seen.extend(len(v["query"]) for v in vl) or encode_ids(self, vl))
    out = tmp_path / "out.jsonl"
    rc, err = main("-i", src, "-o", out)
    assert rc == 0 and "rows not classified: 1" in err, err
    got = jsonl(out)
    assert got[1]["error"].startswith(f"query is {len(huge)} characters: over the model's context limit")
    assert got[1]["query"] == f"{huge[:300]}... ({len(huge)} characters)"
    assert got[0]["label"] in LABELS and got[2]["label"] in LABELS and got[0]["query"] == "red dress"
    assert seen and max(seen) < 1000  # the tokenizer never saw it


def test_keep_columns(main, tmp_path):
    src = tmp_path / "q.csv"
    src.write_text("id,query,label,ts\n7,red dress,Dress,t1\n8,levis,Jeans,t2\n", encoding="utf-8")
    out = tmp_path / "out.csv"

    def header(*args):
        rc, err = main("-i", src, "-o", out, *args)
        assert rc == 0, err
        return out.read_text(encoding="utf-8").splitlines()

    scores = ["label", "score:Dress", "score:Jeans", "score:Other", "error"]
    lines = header()  # all: the others in the input's order; its "label" is not ours
    assert lines[0].split(",") == ["row", "query", "id", "input:label", "ts"] + scores
    assert lines[1].startswith("1,red dress,7,Dress,t1,")
    assert header("--keep-columns", "none")[0].split(",") == ["row", "query"] + scores
    lines = header("--keep-columns", "ts,id")  # a list: its order
    assert lines[0].split(",") == ["row", "query", "ts", "id"] + scores
    assert lines[2].startswith("2,levis,t2,8,")
    # Another query column: written as `query`, the input's own `query` kept as another column.
    lines = header("--column", "ts")
    assert lines[0].split(",") == ["row", "query", "id", "input:query", "input:label"] + scores
    assert lines[1].startswith("1,t1,7,red dress,Dress,")
    out = tmp_path / "out.jsonl"
    assert main("-i", src, "-o", out, "--keep-columns", "id")[0] == 0
    assert [list(g) for g in jsonl(out)] == [["row", "query", "id", "label", "scores", "error"]] * 2
    j = tmp_path / "q.jsonl"  # JSONL keeps each object's own fields, whatever their type
    j.write_text('{"query": "red dress", "meta": {"a": 1}}\n{"n": 3, "query": "levis"}\n')
    assert main("-i", j, "-o", out)[0] == 0
    assert [{k: g[k] for k in g if k not in ("label", "scores", "error")} for g in jsonl(out)] == [
        {"row": 1, "query": "red dress", "meta": {"a": 1}}, {"row": 2, "query": "levis", "n": 3}]
    rc, err = main("-i", src, "-o", out, "--keep-columns", "id,nope", "--model", "/nonexistent")
    assert rc == 2 and "--keep-columns: the input has no column 'nope'" in err


def test_every_input_format_from_a_pipe(main, tmp_path, monkeypatch):
    """`-i -` with --input-format reads a real pipe (no size, no seeking) like the file itself."""
    queries = ["red dress", "levis 501, blue", 'say "hi"', "连衣裙"]
    texts = {"txt": "".join(q + "\n" for q in queries) + "\n",
             "csv": "query,id\n" + "".join(f'"{q.replace(chr(34), 2 * chr(34))}",{i}\n'
                                           for i, q in enumerate(queries)) + "\n",
             "jsonl": "".join(json.dumps({"query": q, "id": i}) + "\n" for i, q in enumerate(queries))
             + "{oops\n"}
    for fmt, text in texts.items():
        f = tmp_path / f"q.{fmt}"
        f.write_text("\ufeff" + text, encoding="utf-8")  # a byte-order mark is not text either way
        assert main("-i", f, "-o", tmp_path / "file.jsonl")[0] == 0
        for args in (["-i", "-", "--input-format", fmt], ["--input-format", fmt]):
            r, w = os.pipe()
            threading.Thread(target=lambda: (os.write(w, f.read_bytes()), os.close(w))).start()
            with os.fdopen(r, "r") as pipe:
                monkeypatch.setattr(sys, "stdin", pipe)
                assert main(*args, "-o", tmp_path / "pipe.jsonl")[0] == 0
            assert (tmp_path / "pipe.jsonl").read_bytes() == (tmp_path / "file.jsonl").read_bytes()
        got = jsonl(tmp_path / "pipe.jsonl")
        assert [g["query"] for g in got[:4]] == queries and got[-1]["error"] is not None


def test_strict_refuses_the_first_bad_row(main, tmp_path):
    src = tmp_path / "q.txt"
    src.write_text("red dress\nlevis\n\nblue\n", encoding="utf-8")
    rc, err = main("-i", src, "--strict", "--model", "/nonexistent")  # found before the model loads
    assert rc == 2 and err.strip().splitlines()[-1] == f"prefixscore: error: {src}:3: blank line"
    rc, err = main("--strict", "red dress", "", "--model", "/nonexistent")
    assert rc == 2 and err.strip().endswith("prefixscore: error: query 2: empty query")
    j = tmp_path / "q.jsonl"
    j.write_text('{"query": "ok"}\n{"query": 5}\n')
    rc, err = main("-i", j, "--strict")
    assert rc == 2 and f"{j}:2: 'query' must be a string, got int" in err
    # In a later chunk, and found by the tokenizer: the chunks before it are written.
    src.write_text("red dress\n" * 25 + "coat " * 800 + "\nlevis\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    rc, err = main("-i", src, "-o", out, "--strict", "--chunk-rows", 10)
    assert rc == 2 and f"prefixscore: error: {src}:26: prompt is" in err and "Traceback" not in err
    assert [g["row"] for g in jsonl(out)] == list(range(1, 21))
    rc, err = main("-i", src, "-o", out, "--chunk-rows", 10)  # without --strict: an error row
    assert rc == 0 and jsonl(out)[25]["error"].startswith("prompt is")


def test_output_may_not_be_the_input(main, tmp_path):
    src = tmp_path / "q.csv"
    src.write_text("query\nred dress\n")
    rc, err = main("-i", src, "-o", src, "--model", "/nonexistent")
    assert rc == 2 and "is the input file" in err and src.read_text() == "query\nred dress\n"


# ---------------------------------------------------------------- memory and progress

def test_memory_is_flat_in_the_input_length(main, tmp_path):
    """Peak Python memory of a whole run (reading, tokenizing, classifying, writing) with 10x the
    rows: the same, give or take (reading everything first would hold every row and its ids).
    After a warm-up run: a first run's peak holds one-time allocations (8.6 MB against 1.7), and
    how far the tokenizer thread runs ahead of the engine (at most TOKENIZE_AHEAD spans) depends
    on the host's load, so the bound is well under what holding the rows would add, not 0."""
    peaks = []
    for n in (200, 2000, 20000):
        src = tmp_path / f"q{n}.txt"
        src.write_text("".join(f"red dress number {i} in blue\n" for i in range(n)))
        out = tmp_path / f"out{n}.csv"
        tracemalloc.start()
        try:
            assert main("-i", src, "-o", out, "--chunk-rows", 200)[0] == 0
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert out.read_text().count("\n") == n + 1
    # Measured: 1.7 MB for both, +54 KB for +548 KB of input; holding every row would add 15 MB.
    assert peaks[2] - peaks[1] < 1 << 20, peaks


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path):
    """A line per tick of the timer (tick() by hand here): rows, errors, the rate, and for a file
    the share (the bytes of the rows done) and an ETA."""
    from prefixscore.rows.io import RowReader
    from prefixscore.rows.stream import Progress

    src = tmp_path / "q.txt"
    src.write_text("x\n" * 1000)
    reader, clock, out = RowReader(str(src)), Clock(), io.StringIO()
    progress = Progress(reader, stream=out, clock=clock, every=None)
    clock.t = 65.0  # before the first rows (Ray's actors loading the model): how long it has waited
    progress.tick()
    assert out.getvalue() == "classify: waiting for the first rows, 1m05s so far\n"
    reader.close()
    reader, clock, out = RowReader(str(src)), Clock(), io.StringIO()
    progress = Progress(reader, stream=out, clock=clock, every=None)
    for i in range(1, 11):  # 100 rows (200 bytes) written a second, a line every 5 s
        clock.t = float(i)
        progress.update(100 * i, 0, 200 * i)
        if i % 5 == 0:
            progress.tick()
    assert out.getvalue().splitlines() == [
        "classify: 500 rows (0 errors), 100 rows/s, 50%, ETA 0m05s",
        "classify: 1000 rows (0 errors), 100 rows/s, 100%, ETA 0m00s"]
    # Unknown size (a pipe): rows and the rate only. Resumed: the rate counts this run's rows.
    reader.size, out = None, io.StringIO()
    clock.t = 0.0
    progress = Progress(reader, start=400, stream=out, clock=clock, every=None)
    clock.t = 6.0
    progress.update(1000, 3, 0)
    progress.tick()
    assert out.getvalue() == "classify: 1000 rows (3 errors), 100 rows/s\n"
    reader.close()


def test_the_timer_draws_lines_while_the_work_waits():
    """Lines come from a timer thread, not from the work's loop: they keep coming while the loop
    sits in one long engine pass (here: no update at all), and stop with close()."""
    from prefixscore.rows.progress import Bar

    out, clock = io.StringIO(), Clock()
    clock.t = 10.0
    bar = Bar(1000, "item", "score", stream=out, every=0.01, clock=clock)
    bar.update(250)
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and set(lines) == {"score: 250/1000 items, 0.0 items/s, 25%"}
    time.sleep(0.05)
    assert out.getvalue().splitlines() == lines  # none after close


def test_a_bar_on_a_terminal_of_known_width_else_lines(monkeypatch):
    """A tqdm bar where stderr is a terminal of known width (tqdm follows its width, cutting its
    line rather than wrapping it); a terminal of 0 columns, or one whose width cannot be read, gets
    the lines (tqdm there showed a lone carriage return for 85 s)."""
    import fcntl
    import pty
    import struct
    import termios

    from prefixscore.rows import progress
    from prefixscore.rows.progress import Bar, terminal_columns

    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as tty:
        for cols in (0, 13, 120):
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
            assert terminal_columns(tty) == cols
    os.close(leader)

    class Tty(io.StringIO):  # says it is a terminal, and has no width to read
        def isatty(self):
            return True

    assert terminal_columns(Tty()) == 0 and terminal_columns(io.StringIO()) == 0
    out = Tty()
    with Bar(10, "item", "score", stream=out, every=None, clock=Clock()) as b:
        assert b.bar is None
        b.update(5)
        b.tick()
    assert out.getvalue() == "score: 5/10 items, 0.0 items/s, 50%\n"
    monkeypatch.setattr(progress, "terminal_columns", lambda stream: 40)
    with Bar(10, "item", "score", stream=Tty(), every=None) as b:
        assert b.bar is not None and b.bar.dynamic_ncols
        b.update(10)
    assert Bar(10, "item", "score", stream=Tty(), disable=True).bar is None


def test_bar_is_lines_off_a_terminal(tmp_path):
    """score, eval and fine-tuning: off a terminal a line per tick with the share, an ETA and the
    postfix (fine-tuning's loss); disabled: nothing, and no timer."""
    from prefixscore.rows.progress import Bar

    clock, out = Clock(), io.StringIO()
    bar = Bar(1000, "item", "score", stream=out, clock=clock, every=None)
    for i in range(1, 11):  # 100 items a second
        clock.t = float(i)
        bar.update(100)
        bar.set_postfix(loss="0.250", refresh=False)
        if i % 5 == 0:
            bar.tick()
    assert out.getvalue().splitlines() == [
        "score: 500/1000 items, 100.0 items/s, 50%, ETA 0m05s, loss 0.250",
        "score: 1000/1000 items, 100.0 items/s, 100%, ETA 0m00s, loss 0.250"]
    quiet = io.StringIO()
    off = Bar(10, "item", "score", disable=True, stream=quiet, every=0.001)
    off.update(5)
    assert off.ticker is None and quiet.getvalue() == ""


def test_eta_leaves_out_the_start_and_one_slow_minute(tmp_path):
    """The ETA's rate is the run's, less its first fifth of time: a job that starts slowly (model
    warm-up, the first small chunks: a quarter of its pace for a minute) and has one slow minute
    just before three quarters (a busy host) is told at a quarter and at three quarters done the
    time it then still took within 20%. (Here the run's whole pace says 1.21x and 1.24x of the
    truth, the last minute's pace 0.89x and 1.78x; this one 1.06x and 1.14x.)"""
    from prefixscore.rows.io import RowReader
    from prefixscore.rows.stream import Progress

    src = tmp_path / "q.txt"
    src.write_text("x\n" * 20000)  # 40,000 bytes
    reader, clock, out = RowReader(str(src)), Clock(), io.StringIO()
    progress = Progress(reader, stream=out, clock=clock, every=None)
    rows, seen = 0, {}
    for t in range(1, 1000):  # rows/s: 10 for a minute, then 40, but 10 in 380-440 s
        rows = min(20000, rows + (10 if t <= 60 or 380 < t <= 440 else 40))
        clock.t = float(t)
        progress.update(rows, 0, 2 * rows)
        if t % 5 == 0:
            progress.tick()
            m, sec = map(int, out.getvalue().splitlines()[-1].split("ETA ")[1].rstrip("s").split("m"))
            for share in (0.25, 0.75):
                if rows >= share * 20000:
                    seen.setdefault(share, (t, 60 * m + sec))
        if rows == 20000:
            break
    for share, (at, told) in seen.items():
        assert 0.8 <= told / (t - at) <= 1.2, (share, told, t - at)
    reader.close()


def test_progress_moves_with_each_engine_pass(main, clf, tmp_path, monkeypatch):
    """Progress moves after every engine pass, not only when a chunk is written (on a CPU a
    4,096-row chunk is minutes), and never backwards."""
    from prefixscore.rows import stream

    src = tmp_path / "q.txt"
    src.write_text("\n".join(random_queries(64, 2)) + "\n", encoding="utf-8")
    seen = []
    real = stream.Progress.update
    monkeypatch.setattr(stream.Progress, "update",
                        lambda self, rows, errors, pos: seen.append((rows, pos)) or real(self, rows, errors, pos))
    monkeypatch.setattr(clf, "max_batch_tokens", 64)  # several passes a chunk
    assert main("-i", src, "-o", tmp_path / "o.jsonl", "--chunk-rows", 64)[0] == 0
    inside = [r for r, _ in seen if 0 < r < 32]  # during the first chunk (32 rows), before its write
    assert len(inside) >= 2, seen
    size = src.stat().st_size
    assert all(0 <= p <= size for _, p in seen) and seen[-1] == (64, size)
    # The share is the rows done's, though the job read all 64 rows at its start (its first
    # chunk_rows): during the first chunk at most the bytes of its 32 lines, never the file's.
    first = len("".join(src.read_text(encoding="utf-8").splitlines(keepends=True)[:32]).encode())
    assert all(p <= first for r, p in seen if r <= 32) and any(0 < p < first for r, p in seen), seen


def test_each_row_knows_where_it_ends(tmp_path):
    """Row.end: the input's bytes up to the end of that row (the progress of the rows up to it),
    whatever the reader has read past it since."""
    from prefixscore.rows.io import RowReader

    lines = ["levis 501\n", "\n", "红色连衣裙\n", "oversized hoodie"]  # a blank, UTF-8, no last newline
    for fmt, body in (("txt", "".join(lines)), ("jsonl", "".join(json.dumps({"query": l.strip()}) + "\n"
                                                                    for l in lines))):
        src = tmp_path / f"q.{fmt}"
        src.write_bytes(body.encode())
        with RowReader(str(src)) as reader:
            rows = list(reader)
        raw = body.encode().splitlines(keepends=True)
        assert [r.end for r in rows] == list(itertools.accumulate(len(x) for x in raw)), fmt




def test_jsonl_rows_as_the_json_module_reads_them(tmp_path):
    """The JSONL reader decodes with msgspec and falls back to the json module for what msgspec
    refuses: every line gives the row (fields, query, error) the json module's reading gives."""
    import math

    from prefixscore.rows import io as rows_io

    def reference(raw: bytes):
        raw += b"\n"  # as the reader has the line
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return {}, None, "not valid UTF-8"
        except json.JSONDecodeError as e:
            return {}, None, "blank line" if not raw.strip() else f"invalid JSON ({e.msg})"
        if not isinstance(obj, dict):
            return {}, None, "expected a JSON object per line"
        row = rows_io.query_row(1, 1, obj, "query", "jsonl")
        return row.fields, row.query, row.error

    rng = random.Random(5)
    edge = [b'{"query": "a", "x": NaN}', b'{"query": "a", "x": 1e400}', b'{"query": "\\ud800 b"}',
            b'{"query": "a", "id": 123456789012345678901234567890}', b'{"query": "a", "query": "b"}',
            b'\xef\xbb\xbf{"query": "bom"}', b'\xff{"query": "x"}', b'[1, 2]', b'"text"', b'   ',
            b'{"query": 7}', b'{"query": "unclosed', b'{"query": "  "}', b'{"q": "x"}']
    rand = [json.dumps({"query": q, "n": rng.random(), "tags": [q[:3], None, True]}, ensure_ascii=rng.random() < 0.5)
            .encode() for q in random_queries(200, 5)]
    lines = edge + rand
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    with rows_io.RowReader(str(src), "jsonl") as reader:
        got = list(reader)
    assert len(got) == len(lines)
    for raw, row in zip(lines, got):
        fields, query, error = reference(raw)
        same = json.dumps(row.fields, sort_keys=True) == json.dumps(fields, sort_keys=True)
        assert same and row.query == query and row.error == error, (raw, row, fields, error)
    assert math.isnan(got[0].fields["x"]) and got[1].fields["x"] == math.inf


def test_jsonl_lines_take_the_results_own_scores_only_in_label_order():
    """RowFormat.lines writes a Result's own scores dict where its keys are the labels in order
    (the fast path), and every line is what the general path writes, error rows included; scores
    in another order are written in label order."""
    from prefixscore.rows.io import Row
    from prefixscore.rows.writer import RowFormat
    from prefixscore.values import Result

    rng = random.Random(3)
    rows = [Row(i + 1, i + 1, {"query": f"q {i}", "id": i, "label": "x"}, f"q {i}", None if i % 7 else "bad")
            for i in range(60)]
    for order in (LABELS, LABELS[::-1]):
        results = [None if row.error else Result(row.query, rng.choice(LABELS), {l: -10 * rng.random() for l in order})
                   for row in rows]
        form = RowFormat("jsonl", list(LABELS))
        fast = form.lines(rows, results)
        form._plain = lambda results: False
        assert fast == form.lines(rows, results)
        assert [list(json.loads(line)["scores"] or LABELS) for line in fast.splitlines()] == [list(LABELS)] * 60
