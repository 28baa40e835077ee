"""The command line, run as a user would: real subprocesses, files in and out, exit codes."""
import csv
import json
import subprocess
import sys

import pytest

from prefixscore.cli.commands import main


def run(*args, stdin=None):
    """As a user runs it: a fresh process."""
    return subprocess.run([sys.executable, "-m", "prefixscore.cli", *args], capture_output=True,
                          text=True, input=stdin, timeout=600)


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2"))


README_QUERIES = {"beige trench coat women": "Trench Coat", "levis 501 straight leg": "Jeans",
                  "红色连衣裙": "Dress"}


def test_default_model_just_works(bundled):
    """The README's first command: the bundled model with the shipped seed adapter (said on
    stderr) gets its three example queries right; --no-adapter runs the raw model and the seed
    prompt, which answers for the nine labels too (wrongly, mostly: zero-shot is 10%)."""
    p = run("classify", *README_QUERIES)
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(p.stdout.splitlines()))
    assert {r["query"]: r["label"] for r in rows} == README_QUERIES, p.stdout
    assert "shipped seed adapter" in p.stderr and "classified 3 queries" in p.stderr
    p = run("classify", "--no-adapter", "beige trench coat women")
    assert p.returncode == 0 and "shipped seed adapter" not in p.stderr, p.stderr
    rows = list(csv.DictReader(p.stdout.splitlines()))
    assert rows[0]["label"] in {"Dress", "Jeans", "Shirt", "Trench Coat", "Skirt", "T-shirt", "Hoodie",
                                "Knitwear", "Other"}


def test_files_in_and_out(model, tmp_path):
    src = tmp_path / "q.csv"
    src.write_text("id,text\n1,red dress\n2,\"jeans, blue\"\n3,连衣裙\n")
    out = tmp_path / "out.jsonl"
    p = run("classify", "-i", str(src), "--column", "text", "-o", str(out), "--model", model,
            "--labels", "Dress,Jeans,Other")
    assert p.returncode == 0, p.stderr
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [g["query"] for g in got] == ["red dress", "jeans, blue", "连衣裙"]
    assert all(set(g["scores"]) == {"Dress", "Jeans", "Other"} for g in got)
    p = run("classify", "--model", model, "--format", "jsonl", stdin="a\n\nb\n")  # stdin, blank kept
    assert p.returncode == 0, p.stderr
    got = [json.loads(l) for l in p.stdout.splitlines()]
    assert [(g["row"], g["query"], g["error"]) for g in got] == [(1, "a", None), (2, "", "blank line"),
                                                                 (3, "b", None)]


def test_eval_reports_accuracy_and_confusion(model, tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("query,label\nred dress,Dress\nblue jeans,Jeans\nsocks,Other\n")
    rep = tmp_path / "rep.json"
    p = run("eval", str(data), "--model", model, "--labels", "Dress,Jeans,Other", "--json", str(rep))
    assert p.returncode == 0, p.stderr
    assert "accuracy" in p.stdout and "gold \\ predicted" in p.stdout
    r = json.loads(rep.read_text())
    assert r["n"] == 3 and sum(map(sum, r["confusion"])) == 3


@pytest.mark.parametrize("args,msg", [
    (["classify", "-i", "/nonexistent.csv"], "not found"),
    (["classify", "x", "--labels", "A,A"], "duplicate"),
    (["classify", "x", "--template", "no slot here"], "slot"),
    (["classify", "x", "--model", "/nonexistent/model"], "does not exist"),
    (["classify", "   ", "--strict"], "query 1: empty query"),
])
def test_errors_are_one_line_and_exit_2(args, msg, capsys):
    assert main(args) == 2  # in-process: same code path as the console script, without a new process
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_bad_data_files(model, tmp_path, capsys):
    def fails(*args):
        assert main(list(args)) == 2
        return capsys.readouterr().err

    bad = tmp_path / "bad.csv"
    bad.write_text("text,label\nx,Dress\n")
    assert "no column 'query'" in fails("eval", str(bad), "--model", model)
    bad.write_text("query,label\nx,Sandals\n")
    assert "Sandals" in fails("eval", str(bad), "--model", model)
    bad.write_text("query,label\n,Dress\n")
    assert ":2:" in fails("eval", str(bad), "--model", model)
    bad.write_text("")
    assert "empty" in fails("eval", str(bad), "--model", model)
    j = tmp_path / "bad.jsonl"
    j.write_text('{"query": "ok"}\n{not json}\n')
    assert ":2: invalid JSON" in fails("classify", "-i", str(j), "--model", model, "--strict")


NO_MODEL = ["--model", "/nonexistent/model"]  # an error about anything else came before the model load


def fails(capsys, *args):
    """main() exits 2 with one 'prefixscore: error:' line, the last on stderr; -> that line."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.count("prefixscore: error:") == 1 and "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("prefixscore: error:")
    return last


def test_bad_output_path_fails_before_the_model_loads(tmp_path, capsys):
    data = tmp_path / "d.csv"
    data.write_text("query,label\nred dress,Dress\nblue jeans,Jeans\n")
    req = tmp_path / "r.jsonl"
    req.write_text('{"query": "q", "items": ["a"]}\n')
    for bad, why in ((tmp_path, "Is a directory"), (tmp_path / "no" / "o.csv", "No such file or directory")):
        for args in (["classify", "x", "-o", str(bad)], ["score", "-i", str(req), "-o", str(bad)],
                     ["eval", str(data), "--json", str(bad)], ["eval-modes", str(data), "--json", str(bad)],
                     ["fit-head", str(data), "-o", str(bad)]):
            assert f"cannot write output file {bad}: {why}" in fails(capsys, *args, *NO_MODEL), args
    ok = tmp_path / "new.csv"
    assert "does not exist" in fails(capsys, "classify", "x", "-o", str(ok), *NO_MODEL)
    assert not ok.exists()  # the check leaves no empty file behind


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_write_error_is_one_line(model, capsys):
    assert "cannot write output file /dev/full: No space left on device" in fails(
        capsys, "classify", "x", "-o", "/dev/full", "--model", model)


def test_score_options_refused(tmp_path, capsys):
    req = tmp_path / "r.jsonl"
    req.write_text('{"query": "q", "items": ["a"]}\n')
    for chunk in ("0", "-1"):
        assert "--chunk must be positive" in fails(capsys, "score", "-i", str(req), "--chunk", chunk, *NO_MODEL)
    assert "score does not take --head" in fails(capsys, "score", "-i", str(req), "--head", "h.st", *NO_MODEL)
    for key in ('"labels": ["maybe", "nah"]', '"label_token_ids": [5, 6]', '"apply_softmax": true'):
        req.write_text('{"query": "q", "items": ["a"]}\n{"query": "q", "items": ["a"], %s}\n' % key)
        assert f"{req}:2: '{key.split(chr(34))[1]}' per request is not supported" in fails(
            capsys, "score", "-i", str(req), *NO_MODEL)


def test_bom_and_encoding(model, tmp_path, capsys):
    from prefixscore.rows.io import read_text as _read_text
    from prefixscore.rows.io import read_rows

    bom = "\ufeff"
    for name, text in (("q.csv", "query,label\nlevis,Jeans\n"), ("q.txt", "levis\n"),
                       ("q.jsonl", '{"query": "levis"}\n')):
        (tmp_path / name).write_text(bom + text, encoding="utf-8")
        assert read_rows(str(tmp_path / name)) == [{"query": "levis"}]
    (tmp_path / "labels.txt").write_text(bom + "Dress\nJeans\n", encoding="utf-8")
    assert _read_text(str(tmp_path / "labels.txt"), "labels") == "Dress\nJeans\n"
    p = run("classify", "--model", model, "--labels-file", str(tmp_path / "labels.txt"),
            stdin=bom + "red dress\n")
    assert p.returncode == 0, p.stderr
    header, row = p.stdout.splitlines()
    assert header == "row,query,label,score:Dress,score:Jeans,error" and row.startswith("1,red dress,")
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9\n".encode("latin-1"))
    for flag, what in (("--labels-file", "labels"), ("--template-file", "template")):
        assert f"{what} file {tmp_path / 'latin1.txt'}: not valid UTF-8" in fails(
            capsys, "classify", "x", flag, str(tmp_path / "latin1.txt"), *NO_MODEL)


def test_malformed_csv(tmp_path):
    from prefixscore.errors import InputError
    from prefixscore.rows.io import read_rows

    f = tmp_path / "bad.csv"

    def error(text):
        f.write_text(text, encoding="utf-8")
        with pytest.raises(InputError) as e:
            read_rows(str(f), columns=("query", "label"))
        return str(e.value)

    # an unclosed quote would swallow every row after it; named by the line it opens on
    assert f"{f}:3: malformed CSV" in error('query,label\nlevis,Jeans\n"red dress,Dress\nfoo,Bar\n')
    assert f"{f}:2: malformed CSV" in error('query,label\n"levis" 501,Jeans\n')
    assert f"{f}:3: 3 fields but the header has 2" in error("query,label\nlevis,Jeans\nred, dress,Dress\n")
    # lines, not record numbers: a quoted field over three lines and two blank lines come first
    assert f"{f}:8: 'query' is missing or empty" in error(
        'query,label\n"multi\nline\nquery",Dress\n\n\nlevis,Jeans\n,Dress\n')
    long = "dress " * 30000  # 180000 characters, over csv's default field limit of 131072
    f.write_text(f"query\n{long}\nlevis\n", encoding="utf-8")
    assert read_rows(str(f)) == [{"query": long}, {"query": "levis"}]


def test_misleading_messages(tmp_path, capsys):
    j = tmp_path / "n.jsonl"
    j.write_text('{"query": "ok"}\n{"query": 5}\n')
    assert f"{j}:2: 'query' must be a string, got int" in fails(capsys, "classify", "-i", str(j), "--strict",
                                                               *NO_MODEL)
    d = tmp_path / "d.csv"
    d.write_text("query,label\nlevis 501,Jeans \n")
    assert "gold labels not in the label set: 'Jeans ' (the labels: 'Dress', 'Jeans')" in fails(
        capsys, "eval", str(d), "--labels", "Dress,Jeans", *NO_MODEL)
    # an adapter's labels, read from its file before any model loads (one that does not exist is
    # never reached)
    d.write_text("query,label\nred dress,Gown\n")
    said = fails(capsys, "eval", str(d), "--adapter", "seed", *NO_MODEL)
    assert "gold labels not in the label set: 'Gown' (the labels: 'Dress', 'Jeans'" in said, said
    assert "at least two labels" in fails(capsys, "classify", "x", "--labels", "Dress", *NO_MODEL)
    d.write_text("query,label\nlevis 501,Jeans\n")
    assert "at least two labels" in fails(capsys, "eval", str(d), "--labels", "Jeans", *NO_MODEL)
    assert "latency_queries must be at least 1" in fails(
        capsys, "eval-modes", str(d), "--labels", "Dress,Jeans ", "--latency-queries", "0", *NO_MODEL)
    assert "--soft" in fails(capsys, "fit-head", str(d), "-o", str(tmp_path / "h.st"), "--soft", *NO_MODEL)


def expected_output(results, labels, fmt):
    """The output format (CSV with a header, or JSONL): per row its 1-based input row number, the
    query, label, scores and an empty error."""
    import io

    if fmt == "jsonl":
        return "".join(json.dumps({"row": n, **r.to_dict(), "error": None}, ensure_ascii=False,
                                  separators=(",", ":")) + "\n" for n, r in enumerate(results, 1))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["row", "query", "label"] + [f"score:{l}" for l in labels] + ["error"])
    for n, r in enumerate(results, 1):
        w.writerow([n, r.query, r.label] + [f"{r.scores[l]:.6g}" for l in labels] + [""])
    return buf.getvalue()


def test_results_stream_to_the_output_file(model, tmp_path, monkeypatch, capsys):
    from prefixscore.classifier import Classifier

    labels = ["Dress", "Jeans", "Other"]
    queries = [f"red dress number {i}" for i in range(40)] + ["連衣裙, red", 'say "levis"']
    src = tmp_path / "q.txt"
    src.write_text("\n".join(queries) + "\n")
    args = ["classify", "-i", str(src), "--model", model, "--labels", ",".join(labels), "--no-chat",
            "--batch-tokens", "64"]
    # The CLI classifies chunks of rows (32, then up to 4096): the reference runs each chunk alone.
    clf = Classifier(model, labels=labels, chat=False, max_batch_tokens=64)
    results = clf.classify_batch(queries[:32]) + clf.classify_batch(queries[32:])
    for fmt in ("csv", "jsonl"):
        out = tmp_path / f"out.{fmt}"
        assert main(args + ["-o", str(out)]) == 0
        assert out.read_bytes().decode() == expected_output(results, labels, fmt)
    capsys.readouterr()
    # Stopped hard (a second Ctrl-C) in the fourth flat batch: the whole chunks of 10 rows before it
    # are on disk, in the same format.
    chunked = [r for i in range(0, len(queries), 10) for r in clf.classify_batch(queries[i:i + 10])]
    run_batch, calls = Classifier._launch, []

    def interrupted(self, batch):
        calls.append(len(batch))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return run_batch(self, batch)

    monkeypatch.setattr(Classifier, "_launch", interrupted)
    out = tmp_path / "out.csv"
    assert main(args + ["-o", str(out), "--chunk-rows", "10"]) == 130
    done = out.read_bytes().count(b"\n") - 1
    assert done > 0 and done % 10 == 0 and done < sum(calls)
    assert out.read_bytes().decode() == expected_output(chunked[:done], labels, "csv")


def test_closed_pipe_is_quiet(model, tmp_path):
    src = tmp_path / "many.txt"
    src.write_text("".join(f"a rather long query about a red dress, number {i}\n" for i in range(3000)))
    p = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "classify", "-i", str(src), "--model",
                          model, "--batch-tokens", "2048"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("row,query,label")  # `| head -1`
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=600) in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err


def test_first_touch_needs_no_torch():
    """--version, --help and every command's option errors answer before torch (about a second to
    import on a CPU host) is imported; a close flag or command is named."""
    code = """
import contextlib, io, sys
from prefixscore.cli.commands import main
said = {}
for argv in (["--version"], ["--help"], ["classify", "--top-l", "3"], ["clasify", "x"],
             ["eval", "--bad-flag"], ["score", "--bad-flag"], ["serve", "--prot", "1"],
             ["finetune", "--bad-flag"], ["fit-head", "--bad-flag"], ["eval-modes", "--bad-flag"],
             ["fit-item-encoder", "--bad-flag"], ["embed-items", "--bad-flag"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as e:
            said[argv[0]] = (e.code, err.getvalue())
print("torch" in sys.modules)
print(said["classify"][1].splitlines()[-1])
print(said["clasify"][1].splitlines()[-1])
print(said["serve"][1].splitlines()[-1])
print(said["--version"][0], sorted({code for code, _ in said.values()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "False", out
    assert lines[1].endswith("unrecognized arguments: --top-l (did you mean --top-k?)"), out
    assert lines[1].startswith("prefixscore classify: error:"), out  # the command's own usage
    assert lines[2].endswith("(did you mean classify?)"), out
    assert lines[3].endswith("(did you mean --port?)"), out
    assert lines[4] == "0 [0, 2]", out


def test_bash_completion_from_the_parsers():
    """`prefixscore completion bash`: commands, each command's flags and a flag's choices (its own
    command's), as bash completes them."""
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = subprocess.run([sys.executable, "-m", "prefixscore.cli", "completion", "bash"],
                            capture_output=True, text=True, check=True).stdout
    probe = script + """
ask() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=(); _prefixscore; echo "${COMPREPLY[*]}"; }
ask prefixscore cla
ask prefixscore classify --to
ask prefixscore classify --mode l
ask prefixscore score --mode s
ask prefixscore serve --log-f
"""
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["classify", "--top-k", "logprobs logits", "softmax", "--log-format"], out
