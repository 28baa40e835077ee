"""The command line, run as a user would: real subprocesses, files in and out, exit codes."""
import csv
import json
import subprocess
import sys

import pytest

from prefixscore.cli import main


def run(*args, stdin=None):
    """As a user runs it: a fresh process."""
    return subprocess.run([sys.executable, "-m", "prefixscore.cli", *args], capture_output=True,
                          text=True, input=stdin, timeout=600)


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2"))


def test_default_model_just_works(bundled):
    p = run("classify", "beige trench coat women")
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(p.stdout.splitlines()))
    assert rows[0]["query"] == "beige trench coat women"
    assert rows[0]["label"] in {"Dress", "Jeans", "Shirt", "Trench Coat", "Skirt", "T-shirt", "Hoodie",
                                "Knitwear", "Other"}
    assert "classified 1 queries" in p.stderr


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
    p = run("classify", "--model", model, "--format", "jsonl", stdin="a\n\nb\n")  # stdin, blank skipped
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.splitlines()) == 2


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
    (["classify", "   "], "empty"),
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
    assert ":2: invalid JSON" in fails("classify", "-i", str(j), "--model", model)
