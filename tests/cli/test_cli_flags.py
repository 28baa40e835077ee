"""The everyday flags (issue 21 item 4): --version, classify --probs / --top-k, --show-prompt, the
warning for labels under the seed prompt, eval's per-label report and --predictions, --quiet /
--verbose, PREFIXSCORE_* variables and --config under the command line; and Parquet in and out.
Each is checked against something computed apart from the code under test: a softmax or a sort of
the scores, Classifier.prefix_len, a hand-counted confusion table, the CSV/JSONL output of the
same rows."""
import argparse
import csv
import io
import json
import math
import os
import signal
import subprocess
import sys

import pytest

import prefixscore
from prefixscore.cli import commands as cli, common as cmdline
from prefixscore.classifier import Classifier, Result
from prefixscore.errors import ConfigError

LABELS = ["Dress", "Jeans", "Other"]
TEMPLATE = "Is this query about a dress, jeans or something else?\nquery: {query}\nanswer:"
QUERIES = ["red dress", "blue jeans", "levis 501", "summer maxi dress", "socks", "连衣裙"]
BASE = ["--labels", ",".join(LABELS), "--template", TEMPLATE, "--no-chat"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2"))


@pytest.fixture(scope="module")
def clfs(model):
    """The classifier each mode's runs share (the model loads once per mode)."""
    return {mode: Classifier(model, TEMPLATE, LABELS, chat=False, mode=mode) for mode in ("logprobs", "logits")}


@pytest.fixture
def run(clfs, model, monkeypatch, capsys):
    """cli.main in-process on the shared classifiers: -> (exit status, stdout, stderr)."""
    monkeypatch.setattr(cli, "make_classifier", lambda a, graphs=True: clfs[a.mode])

    def go(command, *args, base=True):
        capsys.readouterr()
        rc = cli.main([command, "--model", model, *(BASE if base else []), *map(str, args)])
        out, err = capsys.readouterr()
        return rc, out, err

    return go


def fails(capsys, *args):
    """main() exits 2 with one 'prefixscore: error:' line, the last on stderr; -> that line."""
    capsys.readouterr()
    assert cli.main(list(map(str, args))) == 2
    err = capsys.readouterr().err
    assert err.count("prefixscore: error:") == 1 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def softmax(xs):  # in float64, apart from the code under test
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"prefixscore {prefixscore.__version__}\n"
    p = subprocess.run([sys.executable, "-m", "prefixscore.cli", "--version"], capture_output=True,
                       text=True, timeout=120)
    assert (p.returncode, p.stdout) == (0, f"prefixscore {prefixscore.__version__}\n"), p.stderr


# ---------------------------------------------------------------- --probs and --top-k

@pytest.mark.parametrize("mode", ["logprobs", "logits"])
def test_probs_are_the_softmax_of_the_scores(run, clfs, tmp_path, mode):
    plain, probs = tmp_path / "plain.jsonl", tmp_path / "probs.jsonl"
    assert run("classify", *QUERIES, "--mode", mode, "-o", plain)[0] == 0
    assert run("classify", *QUERIES, "--mode", mode, "-o", probs, "--probs")[0] == 0
    ref = clfs[mode].classify_batch(QUERIES)
    for p, w, r in zip(jsonl(plain), jsonl(probs), ref):
        assert list(w) == ["row", "query", "label", "scores", "probs", "error"]
        assert {k: v for k, v in w.items() if k != "probs"} == p  # the rest as without --probs
        assert w["scores"] == pytest.approx(r.scores, abs=1e-5)
        want = softmax([w["scores"][l] for l in LABELS])
        assert [w["probs"][l] for l in LABELS] == pytest.approx(want, rel=1e-12)
        assert sum(w["probs"].values()) == pytest.approx(1.0)
        if mode == "logprobs":  # log-probabilities under constrained decoding: exp is the distribution
            assert [w["probs"][l] for l in LABELS] == pytest.approx([math.exp(w["scores"][l]) for l in LABELS],
                                                                    abs=1e-5)
    # CSV: the default columns unchanged, prob:LABEL after the scores, to 6 digits like them
    rc, out, _ = run("classify", *QUERIES, "--mode", mode)
    header = next(csv.reader(io.StringIO(out)))
    assert header == ["row", "query", "label"] + [f"score:{l}" for l in LABELS] + ["error"]
    rc, out, _ = run("classify", *QUERIES, "--mode", mode, "--probs")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == header[:-1] + [f"prob:{l}" for l in LABELS] + ["error"]
    for row, w in zip(rows, jsonl(probs)):
        assert [row[f"prob:{l}"] for l in LABELS] == [f"{w['probs'][l]:.6g}" for l in LABELS]


def test_top_k_is_the_best_scores_in_order(run, tmp_path, capsys):
    full, top = tmp_path / "full.jsonl", tmp_path / "top.jsonl"
    assert run("classify", *QUERIES, "-o", full, "--probs")[0] == 0
    assert run("classify", *QUERIES, "-o", top, "--probs", "--top-k", 2)[0] == 0
    for f, t in zip(jsonl(full), jsonl(top)):
        assert list(t) == ["row", "query", "label", "top", "error"] and t["label"] == f["label"]
        ranked = sorted(LABELS, key=lambda l: f["scores"][l], reverse=True)
        assert [e["label"] for e in t["top"]] == ranked[:2]
        assert t["top"] == [{"label": l, "score": f["scores"][l], "prob": f["probs"][l]} for l in ranked[:2]]
    # CSV: label_i, score_i (and prob_i) columns; K over the label count is every label
    rc, out, _ = run("classify", *QUERIES, "--top-k", 5)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == ["row", "query", "label", "label_1", "score_1", "label_2", "score_2",
                             "label_3", "score_3", "error"]
    for row, f in zip(rows, jsonl(full)):
        ranked = sorted(LABELS, key=lambda l: f["scores"][l], reverse=True)
        assert [row[f"label_{i}"] for i in (1, 2, 3)] == ranked
        assert [row[f"score_{i}"] for i in (1, 2, 3)] == [f"{f['scores'][l]:.6g}" for l in ranked]
    # an error row keeps its place, empty
    src = tmp_path / "q.txt"
    src.write_text("red dress\n\nsocks\n")
    assert run("classify", "-i", src, "-o", top, "--top-k", 1)[0] == 0
    assert [(r["top"] is None, r["error"]) for r in jsonl(top)] == [(False, None), (True, "blank line"),
                                                                   (False, None)]
    assert "--top-k must be at least 1, got 0" in fails(capsys, "classify", "x", "--top-k", 0,
                                                          "--model", "/nonexistent")


def test_input_columns_named_like_the_new_outputs_keep_their_data(run, tmp_path):
    """An input column called `probs` or `label_1` is renamed input:NAME only where the output has
    a column of that name; without the flags it is written as it was."""
    src = tmp_path / "q.csv"
    src.write_text("query,probs,label_1\nred dress,p,l\n")
    rc, out, _ = run("classify", "-i", src)
    assert next(csv.reader(io.StringIO(out)))[:4] == ["row", "query", "probs", "label_1"]
    rc, out, _ = run("classify", "-i", src, "--top-k", 1)
    row = next(csv.DictReader(io.StringIO(out)))
    assert row["probs"] == "p" and row["input:label_1"] == "l" and row["label_1"] in LABELS
    o = tmp_path / "o.jsonl"
    assert run("classify", "-i", src, "-o", o, "--probs")[0] == 0
    w = jsonl(o)[0]
    assert w["input:probs"] == "p" and w["label_1"] == "l" and set(w["probs"]) == set(LABELS)


def test_resume_with_probs_and_top_k(run, tmp_path, capsys):
    """--probs and --top-k are recorded with the output; a resume that leaves them out takes them
    from the record, one that gives another is refused, and a record from before they existed
    resumes as their defaults."""
    src = tmp_path / "q.txt"
    src.write_text("".join(f"{q} {i}\n" for i in range(40) for q in QUERIES[:1]))
    out = tmp_path / "out.jsonl"
    assert run("classify", "-i", src, "-o", out, "--chunk-rows", 8, "--probs")[0] == 0
    full = out.read_bytes()
    out.write_bytes(full[: len(full) // 2])
    rc, _, err = run("classify", "-i", src, "-o", out, "--chunk-rows", 8, "--resume", "--top-k", 2)
    assert rc == 2 and "written with top_k None, not 2" in err
    rc, _, err = run("classify", "-i", src, "-o", out, "--chunk-rows", 8, "--resume")
    assert rc == 0 and "--probs" in err and out.read_bytes() == full
    plain = tmp_path / "plain.jsonl"
    assert run("classify", "-i", src, "-o", plain, "--chunk-rows", 8)[0] == 0
    meta = json.loads((tmp_path / "plain.jsonl.meta.json").read_text())
    del meta["options"]["probs"], meta["options"]["top_k"]  # as written before the flags existed
    (tmp_path / "plain.jsonl.meta.json").write_text(json.dumps(meta))
    whole = plain.read_bytes()
    plain.write_bytes(whole[: len(whole) // 3])
    assert run("classify", "-i", src, "-o", plain, "--chunk-rows", 8, "--resume")[0] == 0
    assert plain.read_bytes() == whole


# ---------------------------------------------------------------- --show-prompt

def shown(out: str) -> dict:
    """The numbers --show-prompt prints."""
    lines = out.splitlines()
    get = lambda start: next(l for l in lines if l.startswith(start))  # noqa: E731
    prefix = get("pinned prefix (")
    return {"prefix_len": int(prefix.split("(")[1].split()[0]),
            "prefix_ids": json.loads(prefix.split("ids: ")[1]),
            "suffix_ids": json.loads(get("suffix (").split("ids: ")[1]),
            "query": get("prompt for the query ").split("query ", 1)[1].rstrip(":"),
            "paths": {l: json.loads(get(f"  {l} ")[get(f"  {l} ").index("["):].split("]")[0] + "]")
                      for l in LABELS}}


def test_show_prompt_classify(model, clfs, tmp_path, capsys):
    """The real make_classifier: the model loads, nothing is classified, and the split is that of an
    independently built Classifier."""
    capsys.readouterr()
    assert cli.main(["classify", "--model", model, *BASE, "--show-prompt", "levis 501", "socks"]) == 0
    out, err = capsys.readouterr()
    ref = clfs["logprobs"]
    e = ref.encode("levis 501")
    got = shown(out)
    assert got["query"] == "'levis 501'" and "classified" not in err and "row,query" not in out
    assert got["prefix_len"] == ref.prefix_len and got["prefix_ids"] == ref.prompt.prefix_ids
    assert got["suffix_ids"] == e.ids[e.start:] and e.start == ref.prefix_len
    assert ref.prompt.prefix_ids + got["suffix_ids"] == ref.encode("levis 501").ids
    assert [got["paths"][l] for l in LABELS] == ref.trie.paths
    assert e.text in out  # the whole rendered prompt
    # The first query of --input, else an example; --top-k/--probs/-o are not needed to show it
    src = tmp_path / "q.jsonl"
    src.write_text('{"query": ""}\n{"query": "knit sweater"}\n')
    assert cli.main(["classify", "--model", model, *BASE, "--show-prompt", "-i", str(src)]) == 0
    assert shown(capsys.readouterr().out)["query"] == "'knit sweater'"
    assert cli.main(["classify", "--model", model, *BASE, "--show-prompt"]) == 0
    assert shown(capsys.readouterr().out)["query"] == "'example query'"


def test_show_prompt_eval(run, clfs, tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("query,label\nblue jeans,Jeans\nred dress,Dress\n")
    rc, out, err = run("eval", data, "--show-prompt")
    assert rc == 0 and "accuracy" not in out
    got, ref = shown(out), clfs["logprobs"]
    assert got["query"] == "'blue jeans'" and got["prefix_len"] == ref.prefix_len
    e = ref.encode("blue jeans")
    assert got["suffix_ids"] == e.ids[e.start:]


def test_show_prompt_shared_first_token(model):
    """Labels that share a first token: the trie's branching node is shown with its children."""
    from prefixscore.cli.show import describe

    clf = Classifier(model, TEMPLATE, ["T-shirt", "Trench Coat", "Jeans"], chat=False, graphs=False)
    text = describe(clf, "x")
    assert "1 branching node(s)" in text and "after 'T':" in text
    clf.head = argparse.Namespace(kind="linear")  # a head decides: no label tokens to show
    assert "decided by a trained linear head" in describe(clf, "x")


# ---------------------------------------------------------------- labels under the seed prompt

def test_labels_without_template_warn(tmp_path, capsys, monkeypatch):
    """Said before the model loads (here: a missing one), under --quiet too; not with a template,
    an adapter or head, or the seed labels themselves."""
    warning = "warning: --labels without --template"

    def stderr(*args):
        capsys.readouterr()
        assert cli.main(["classify", "x", "--model", "/nonexistent", *map(str, args)]) == 2
        return capsys.readouterr().err

    assert warning in stderr("--labels", "yes,no")
    assert warning in stderr("--labels", "yes,no", "--quiet")
    lf = tmp_path / "labels.txt"
    lf.write_text("yes\nno\n")
    assert warning in stderr("--labels-file", lf)
    assert warning not in stderr("--labels", "yes,no", "--template", "{query}?")
    assert warning not in stderr("--labels", "Dress,Jeans,Shirt,Trench Coat,Skirt,T-shirt,Hoodie,Knitwear,Other")
    assert warning not in stderr("--labels", "yes,no", "--adapter", tmp_path / "a.safetensors")
    assert warning not in stderr("--labels", "yes,no", "--head", tmp_path / "h.safetensors")
    # serve builds its engine's config itself: the same warning
    import prefixscore.serve.launch as launch

    def stop(front, engine):
        raise ConfigError("stop")

    monkeypatch.setattr(launch, "serve", stop)
    capsys.readouterr()
    assert cli.main(["serve", "--labels", "yes,no"]) == 2
    assert warning in capsys.readouterr().err


# ---------------------------------------------------------------- eval: per label, --predictions

class Stub:
    """A classifier whose answers are fixed: query -> predicted label (score 0, the others -1)."""

    def __init__(self, answers, labels=("A", "B", "C")):
        self.answers, self.labels, self.adapter_meta = answers, list(labels), None
        self.prompt = argparse.Namespace(template="{query}", chat=False)

    def classify_batch_iter(self, queries, progress=None):
        yield [Result(q, self.answers[q], {l: 0.0 if l == self.answers[q] else -1.0 - i
                                           for i, l in enumerate(self.labels)}) for q in queries]


def test_eval_per_label_and_predictions(tmp_path, monkeypatch, capsys):
    """Against a table counted by hand. Gold -> predicted: A->A, A->A, A->B, B->B, B->A, B->A, C->C,
    C->C, D->A. A: 2 of the 5 predicted A are A (precision 0.4), 2 of its 3 rows found (recall 2/3);
    B: 1 of 2 predicted, 1 of 3 found; C: all right; D: never predicted (0, as scikit-learn's
    zero_division=0)."""
    rows = [("q1", "A", "A"), ("q2", "A", "A"), ("q3", "A", "B"), ("q4", "B", "B"), ("q5", "B", "A"),
            ("q6", "B", "A"), ("q7", "C", "C"), ("q8", "C", "C"), ("q9", "D", "A")]
    labels = ["A", "B", "C", "D"]
    data = tmp_path / "d.csv"
    data.write_text("query,label\n" + "".join(f"{q},{g}\n" for q, g, _ in rows))
    # zero-shot says A for everything, the head (compared after it, so reported) the table's answers
    stubs = {None: Stub({q: "A" for q, _, _ in rows}, labels),
             "h.safetensors": Stub({q: p for q, _, p in rows}, labels)}
    monkeypatch.setattr(cli, "make_classifier", lambda a, graphs=True: stubs[a.head])
    rep, pred = tmp_path / "rep.json", tmp_path / "pred.csv"
    assert cli.main(["eval", str(data), "--labels", "A,B,C,D", "--head", "h.safetensors", "--json", str(rep),
                     "--predictions", str(pred)]) == 0
    out = capsys.readouterr().out
    want = {"A": (0.4, 2 / 3, 0.5, 3), "B": (0.5, 1 / 3, 0.4, 3), "C": (1.0, 1.0, 1.0, 2), "D": (0.0, 0.0, 0.0, 1)}
    r = json.loads(rep.read_text())
    assert len(r["modes"]) == 2 and r["mode"] == "head h.safetensors"
    for l, (p, rc, f1, n) in want.items():
        got = r["per_label"][l]
        assert (got["precision"], got["recall"], got["f1"], got["support"]) == pytest.approx((p, rc, f1, n))
        assert f"\n{l.ljust(8)}{p:9.3f}  {rc:6.3f}  {f1:6.3f}  {n:7d}\n" in out.split("per label")[1]
    assert r["macro_f1"] == pytest.approx(0.475) and r["accuracy"] == pytest.approx(5 / 9)
    assert r["modes"][0]["per_label"]["A"]["precision"] == pytest.approx(3 / 9)  # zero-shot's own
    got = list(csv.DictReader(pred.open()))
    assert [(g["query"], g["gold"], g["predicted"]) for g in got] == rows
    assert [float(g[f"score:{g['predicted']}"]) for g in got] == [0.0] * 9
    assert (float(got[2]["score:A"]), float(got[2]["score:D"])) == (-1.0, -4.0)
    # JSONL for a .jsonl name, the scores as numbers
    pj = tmp_path / "pred.jsonl"
    assert cli.main(["eval", str(data), "--labels", "A,B,C,D", "--predictions", str(pj), "-q"]) == 0
    assert jsonl(pj)[2] == {"query": "q3", "gold": "A", "predicted": "A",
                            "scores": {"A": 0.0, "B": -2.0, "C": -3.0, "D": -4.0}}
    # an unwritable --predictions fails before any model loads
    assert "cannot write output file" in fails(capsys, "eval", data, "--labels", "A,B,C,D", "--predictions",
                                               tmp_path / "no" / "p.csv", "--model", "/nonexistent")


def test_eval_predictions_are_the_classifiers(run, clfs, tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("query,label\n" + "".join(f"{q},{LABELS[i % 3]}\n" for i, q in enumerate(QUERIES)))
    pred = tmp_path / "p.jsonl"
    rc, out, _ = run("eval", data, "--predictions", pred)
    assert rc == 0
    ref = clfs["logprobs"].classify_batch(QUERIES)
    for p, r, i in zip(jsonl(pred), ref, range(len(QUERIES))):
        assert (p["query"], p["gold"], p["predicted"]) == (r.query, LABELS[i % 3], r.label)
        assert p["scores"] == pytest.approx(r.scores, abs=1e-5)


# ---------------------------------------------------------------- --quiet and --verbose

def subcommands():
    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_quiet_and_verbose_on_every_command():
    commands = subcommands()
    assert {"classify", "eval", "score", "serve", "finetune", "fit-head", "eval-modes"} <= set(commands)
    for name, parser in commands.items():
        opts = {s for act in parser._actions for s in act.option_strings}
        assert {"--quiet", "-q", "--verbose", "-v", "--config"} <= opts, name


def test_quiet_and_verbose_lines(run, capsys):
    rc, out, err = run("classify", "red dress")
    assert rc == 0 and "classified 1 queries" in err
    rc, out2, err = run("classify", "red dress", "--quiet")
    assert rc == 0 and out2 == out and err == ""
    rc, _, err = run("classify", "-i", "/nonexistent.txt", "--quiet")  # errors still shown
    assert rc == 2 and err.startswith("prefixscore: error: input file not found")
    rc, out3, err = run("classify", "red dress", "--verbose")
    assert rc == 0 and out3 == out and "debug: prefixscore.rows.stream: rows 1-1 written" in err
    assert "classified 1 queries" in err
    # the last given wins; the level is the process's again after the command
    rc, _, err = run("classify", "red dress", "--verbose", "--quiet")
    assert rc == 0 and err == ""
    cmdline.err("said")
    assert capsys.readouterr().err == "said\n"


def test_progress_is_quiet(monkeypatch):
    from prefixscore.rows import progress
    from prefixscore.rows.io import RowReader
    from prefixscore.rows.stream import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(progress, "terminal_columns", lambda stream: 80)
    reader = RowReader(queries=["a"])
    tty = Terminal()
    assert Progress(reader, stream=tty, quiet=True).bar is None
    shown = Progress(reader, stream=Terminal())
    assert shown.bar is not None
    shown.close()
    lines = io.StringIO()
    p = Progress(reader, stream=lines, every=0.001, quiet=True)
    p.update(10, 0, 0)
    assert p.ticker is None and lines.getvalue() == ""


def test_serve_takes_quiet_and_verbose_as_its_log_level(monkeypatch):
    import prefixscore.serve.launch as launch

    seen = []

    def stop(front, engine):
        seen.append(front.log_level)
        raise ConfigError("stop")

    monkeypatch.setattr(launch, "serve", stop)
    for args, level in ([], "info"), (["-v"], "debug"), (["--quiet"], "warning"), \
            (["--quiet", "--log-level", "error"], "error"):
        assert cli.main(["serve", "--no-adapter", *args]) == 2
        assert seen[-1] == level, args


# ---------------------------------------------------------------- environment and config file

@pytest.fixture
def options(monkeypatch, capsys):
    """The options a command gets, as make_classifier would see them: -> a function of the command
    line returning that namespace (the command stops there)."""
    for k in list(os.environ):
        if k.startswith("PREFIXSCORE_") and not k.startswith(("PREFIXSCORE_TEST", "PREFIXSCORE_CACHE")):
            monkeypatch.delenv(k)
    seen = []

    def record(a, graphs=True):
        seen.append(a)
        raise ConfigError("stop")

    monkeypatch.setattr(cli, "make_classifier", record)

    def get(*args):
        capsys.readouterr()
        assert cli.main(list(map(str, args))) == 2
        assert "prefixscore: error: stop" in capsys.readouterr().err
        return seen[-1]

    return get


def test_environment_under_the_command_line(options, monkeypatch, tmp_path, capsys):
    env = monkeypatch.setenv
    a = options("classify", "x")
    assert (a.model, a.device, a.batch_tokens, a.chat, a.truncate) == (None, None, None, None, False)
    env("PREFIXSCORE_MODEL", "/models/m")
    env("PREFIXSCORE_DEVICE", "cpu")
    env("PREFIXSCORE_BATCH_TOKENS", "123")
    env("PREFIXSCORE_CHAT", "0")
    env("PREFIXSCORE_TRUNCATE", "yes")
    env("PREFIXSCORE_LABELS", "-a,+b")  # a value may start with '-'
    env("PREFIXSCORE_PORT", "not a number")  # serve's: not classify's business
    env("PREFIXSCORE_DTYPE", "")  # empty: not given
    a = options("classify", "x")
    assert (a.model, a.device, a.batch_tokens, a.chat, a.truncate, a.labels, a.dtype) == \
        ("/models/m", "cpu", 123, False, True, "-a,+b", None)
    # the command line wins
    a = options("classify", "x", "--batch-tokens", 16384, "--chat", "--device", "cuda:1", "--model", "/m2")
    assert (a.batch_tokens, a.chat, a.device, a.model, a.truncate) == (16384, True, "cuda:1", "/m2", True)
    # every command: eval's own flags too
    data = tmp_path / "d.csv"
    data.write_text("q,gold\nx,-a\n")
    env("PREFIXSCORE_COLUMN", "q")
    env("PREFIXSCORE_LABEL_COLUMN", "gold")
    a = options("eval", data)
    assert (a.column, a.label_column, a.model, a.batch_tokens) == ("q", "gold", "/models/m", 123)
    # quiet from the environment, verbose from the command line: the command line's
    env("PREFIXSCORE_QUIET", "1")
    assert options("classify", "x").verbosity == "quiet"
    assert options("classify", "x", "--verbose").verbosity == "verbose"
    # a bad value names its variable
    env("PREFIXSCORE_BATCH_TOKENS", "lots")
    assert fails(capsys, "classify", "x") == ("prefixscore: error: environment variable "
                                             "PREFIXSCORE_BATCH_TOKENS: argument --batch-tokens: invalid int "
                                             "value: 'lots'")
    env("PREFIXSCORE_BATCH_TOKENS", "1")
    env("PREFIXSCORE_TRUNCATE", "maybe")
    assert "PREFIXSCORE_TRUNCATE: --truncate is a switch" in fails(capsys, "classify", "x")


def test_config_file_under_the_environment(options, monkeypatch, tmp_path, capsys):
    cfg = tmp_path / "p.toml"
    cfg.write_text('batch-tokens = 7\ndevice = "cpu"\nlabels = ["yes", "no"]\nchat = false\nquiet = true\n')
    a = options("classify", "x", "--config", cfg)
    assert (a.batch_tokens, a.device, a.labels, a.chat, a.verbosity) == (7, "cpu", "yes,no", False, "quiet")
    monkeypatch.setenv("PREFIXSCORE_BATCH_TOKENS", "99")
    a = options("classify", "x", "--config", cfg, "--device", "cuda")
    assert (a.batch_tokens, a.device) == (99, "cuda")  # environment over the file, command line over both
    monkeypatch.setenv("PREFIXSCORE_CONFIG", str(cfg))  # the file from the environment
    assert options("classify", "x").labels == "yes,no"
    cfg.write_text("port = 1\n")  # serve's option: unknown to classify
    assert "unknown option 'port'" in fails(capsys, "classify", "x")


def test_serve_reads_the_environment_too(monkeypatch, tmp_path):
    """serve's options through the same mechanism: the environment between its config file and its
    command line; PREFIXSCORE_API_KEY keeps its meaning."""
    import prefixscore.serve.launch as launch

    seen = []

    def stop(front, engine):
        seen.append((front, engine))
        raise ConfigError("stop")

    monkeypatch.setattr(launch, "serve", stop)
    cfg = tmp_path / "s.toml"
    cfg.write_text("port = 9000\nmax-queue = 77\nmax-queries = 8\n")
    monkeypatch.setenv("PREFIXSCORE_PORT", "9001")
    monkeypatch.setenv("PREFIXSCORE_API_KEY", "k3y\n")
    monkeypatch.setenv("PREFIXSCORE_BATCH_TOKENS", "512")
    assert cli.main(["serve", "--config", str(cfg), "--no-adapter"]) == 2
    front, engine = seen[-1]
    assert (front.port, front.max_queue, front.api_key, engine.spec.max_batch_tokens) == (9001, 77, "k3y", 512)
    assert cli.main(["serve", "--config", str(cfg), "--no-adapter", "--port", "8000"]) == 2
    assert seen[-1][0].port == 8000


# ---------------------------------------------------------------- Parquet

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # the parquet extra (in the test extra): only these tests need it
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(pa is None, reason="pyarrow is not installed")


def csv_cells(values):
    """A Parquet row's values as classify writes them in CSV."""
    return ["" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v) for v in values]


@needs_pyarrow
def test_parquet_output_is_the_csv_and_jsonl_output(run, tmp_path):
    src = tmp_path / "q.csv"
    qs = QUERIES * 7 + ["", "knit"]  # 44 rows: more than the first chunk; one blank
    src.write_text("id,query\n" + "".join(f"{i},{q}\n" for i, q in enumerate(qs)), encoding="utf-8")
    outs = {fmt: tmp_path / f"out.{fmt}" for fmt in ("csv", "jsonl", "parquet")}
    for fmt, out in outs.items():
        rc, _, err = run("classify", "-i", src, "-o", out, "--probs", "--chunk-rows", 16)
        assert rc == 0, err
    table = pq.read_table(outs["parquet"])
    rows = table.to_pylist()
    header = next(csv.reader(outs["csv"].open()))
    assert table.column_names == header
    assert [csv_cells(r.values()) for r in rows] == list(csv.reader(outs["csv"].open()))[1:]
    for r, j in zip(rows, jsonl(outs["jsonl"])):  # every bit of each score, as JSONL holds it
        assert (r["row"], r["query"], r["id"], r["label"], r["error"]) == \
            (j["row"], j["query"], j["id"], j["label"], j["error"])
        assert [r[f"score:{l}"] for l in LABELS] == (list(j["scores"].values()) if j["scores"] else [None] * 3)
        assert [r[f"prob:{l}"] for l in LABELS] == (list(j["probs"].values()) if j["probs"] else [None] * 3)
    assert rows[42]["error"] == "'query' is missing or empty"
    assert str(table.schema.field("row").type) == "int64" and str(table.schema.field("score:Dress").type) == "double"
    # a row group per chunk: the chunks end at rows 16, 32, 44
    assert [pq.ParquetFile(outs["parquet"]).metadata.row_group(i).num_rows for i in range(3)] == [16, 16, 12]
    # --top-k: CSV's columns too
    top = tmp_path / "top.parquet"
    assert run("classify", "-i", src, "-o", top, "--top-k", 2)[0] == 0
    rc, out, _ = run("classify", "-i", src, "--top-k", 2)
    assert [csv_cells(r.values()) for r in pq.read_table(top).to_pylist()] == list(csv.reader(io.StringIO(out)))[1:]


@needs_pyarrow
def test_parquet_input_is_the_jsonl_input(run, tmp_path):
    """The same rows as Parquet (typed: an int id, a timestamp, a list, a null query) and as JSONL
    give the same output; Parquet to Parquet keeps the input's column types."""
    import datetime

    qs = QUERIES * 6  # 36 rows
    ids = list(range(len(qs)))
    ts = [datetime.datetime(2024, 1, 1 + i % 28, 12) for i in ids]
    tags = [[q.split()[0]] for q in qs]
    qs[5] = None
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "query": qs, "ts": ts, "tags": tags}), src, row_group_size=10)
    js = tmp_path / "in.jsonl"
    js.write_text("".join(json.dumps({"id": i, "query": q, "ts": t.isoformat(), "tags": g}, ensure_ascii=False)
                          + "\n" for i, q, t, g in zip(ids, qs, ts, tags)), encoding="utf-8")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run("classify", "-i", src, "-o", a, "--chunk-rows", 8)[0] == 0
    assert run("classify", "-i", js, "-o", b, "--chunk-rows", 8)[0] == 0
    assert a.read_text() == b.read_text()
    assert jsonl(a)[5]["error"] == "'query' is missing or empty"
    # --resume checks the rows written (timestamps as ISO text there) against the Parquet input
    full = a.read_bytes()
    a.write_bytes(full[: len(full) * 2 // 3])
    rc, _, err = run("classify", "-i", src, "-o", a, "--chunk-rows", 8, "--resume")
    assert rc == 0 and "resumed after row" in err and a.read_bytes() == full
    # CSV out (kept values in CSV's form)
    rc, out_p, _ = run("classify", "-i", src, "--chunk-rows", 8)
    rc, out_j, _ = run("classify", "-i", js, "--chunk-rows", 8)
    assert out_p == out_j
    # Parquet out keeps the types; --keep-columns picks columns
    o = tmp_path / "o.parquet"
    assert run("classify", "-i", src, "-o", o, "--keep-columns", "ts")[0] == 0
    t = pq.read_table(o)
    assert t.column_names[:3] == ["row", "query", "ts"] and t.schema.field("ts").type == pa.timestamp("us")
    assert t.column("ts").to_pylist() == ts
    # the whole input, progress by rows (no byte position in a Parquet file)
    from prefixscore.rows.io import RowReader

    with RowReader(str(src)) as reader:
        assert reader.total == 36 and reader.columns == ["id", "query", "ts", "tags"]
        reader.read_only([])
        assert [r.fields for r in reader][:1] == [{"query": "red dress"}]


@needs_pyarrow
def test_parquet_stop_leaves_a_complete_file(run, clfs, tmp_path, monkeypatch):
    """SIGINT stops at the next pass boundary and closes the writer: the file is readable and
    holds the rows written (the first chunk, one pass, completed); it cannot be resumed, and says
    so."""
    clf = clfs["logprobs"]
    real = clf._launch

    def interrupted(batch):  # the signal arrives during the first pass (16 rows)
        os.kill(os.getpid(), signal.SIGINT)
        return real(batch)

    monkeypatch.setattr(clf, "_launch", interrupted)
    src = tmp_path / "q.txt"
    src.write_text("\n".join(QUERIES * 20) + "\n")
    out = tmp_path / "o.parquet"
    rc, _, err = run("classify", "-i", src, "-o", out, "--chunk-rows", 16)
    assert rc == 130 and "rows 1-16 are written" in err and "Parquet file cannot be resumed" in err
    assert pq.read_table(out).column("row").to_pylist() == list(range(1, 17))
    assert not (tmp_path / "o.parquet.meta.json").exists()


@needs_pyarrow
def test_parquet_errors(tmp_path, monkeypatch, capsys):
    no_model = ["--model", "/nonexistent"]
    pqf = tmp_path / "q.parquet"
    pq.write_table(pa.table({"text": ["a"]}), pqf)
    assert "--resume does not continue a Parquet file" in fails(
        capsys, "classify", "x", "-o", tmp_path / "o.parquet", "--resume", *no_model)
    assert "give -o OUT.parquet" in fails(capsys, "classify", "x", "--format", "parquet", *no_model)
    assert "no column 'query' (columns: text)" in fails(capsys, "classify", "-i", pqf, *no_model)
    assert "not from stdin" in fails(capsys, "classify", "-i", "-", "--input-format", "parquet", *no_model)
    bad = tmp_path / "bad.parquet"
    bad.write_text("query\nnot parquet\n")
    assert "not a readable Parquet file" in fails(capsys, "classify", "-i", bad, *no_model)
    assert "output file" in fails(capsys, "classify", "-i", pqf, "--column", "text", "-o", pqf, *no_model)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    for args in (["-i", pqf, "--column", "text"], ["x", "-o", tmp_path / "o.parquet"]):
        assert fails(capsys, "classify", *args, *no_model) == \
            "prefixscore: error: Parquet needs pyarrow: pip install 'prefixscore[parquet]'"


def _eval_rows(seed):
    """Fresh labeled rows (the seed is in every failure message): random queries, commas, quotes and
    CJK among them, random gold labels."""
    import random

    from tests.helpers import random_queries

    rng = random.Random(seed)
    queries = random_queries(40, seed)
    return [(i, q, rng.choice(LABELS), rng.random()) for i, q in enumerate(queries)]


@needs_pyarrow
def test_eval_reads_parquet_and_stdin_as_csv(run, clfs, tmp_path, monkeypatch):
    """eval on the same rows as CSV, JSONL, Parquet (typed: an int id and a float column beside) and
    CSV/JSONL piped on stdin: the same report; --predictions as CSV, JSONL and Parquet hold the same
    rows, Parquet's scores every bit of the classifier's own."""
    import random

    seed = random.randrange(2 ** 32)
    rows = _eval_rows(seed)
    files = {"csv": tmp_path / "d.csv", "jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "d.parquet"}
    with open(files["csv"], "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("id", "query", "label", "w")] + rows)
    files["jsonl"].write_text("".join(json.dumps({"id": i, "query": q, "label": g, "w": w}, ensure_ascii=False)
                                      + "\n" for i, q, g, w in rows), encoding="utf-8")
    pq.write_table(pa.table({"id": [r[0] for r in rows], "query": [r[1] for r in rows],
                             "label": [r[2] for r in rows], "w": [r[3] for r in rows]}), files["parquet"],
                   row_group_size=16)
    reports, preds = {}, {}
    for fmt, src in files.items():
        rep, pred = tmp_path / f"rep_{fmt}.json", tmp_path / f"pred_{fmt}.{fmt}"
        rc, out, err = run("eval", src, "--json", rep, "--predictions", pred)
        assert rc == 0 and f"{src}: {len(rows)} rows" in out, (seed, err)
        reports[fmt] = {k: v for k, v in json.loads(rep.read_text()).items() if k not in ("ms_per_query", "modes")}
        preds[fmt] = pred
    for fmt in ("csv", "jsonl"):  # from a pipe, in the format --input-format names
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(files[fmt].read_bytes())))
        rep = tmp_path / f"rep_stdin_{fmt}.json"
        rc, out, err = run("eval", "-", "--input-format", fmt, "--json", rep)
        assert rc == 0 and f"<stdin>: {len(rows)} rows" in out, (seed, err)
        reports[f"stdin {fmt}"] = {k: v for k, v in json.loads(rep.read_text()).items()
                                   if k not in ("ms_per_query", "modes")}
    for fmt, r in reports.items():
        assert r == reports["csv"], (seed, fmt)
    assert reports["csv"]["n"] == len(rows)
    ref = clfs["logprobs"].classify_batch([q for _, q, _, _ in rows])
    table = pq.read_table(preds["parquet"])
    assert table.column_names == ["query", "gold", "predicted"] + [f"score:{l}" for l in LABELS]
    assert str(table.schema.field("score:Dress").type) == "double"
    got = table.to_pylist()
    assert [(g["query"], g["gold"], g["predicted"]) for g in got] == \
        [(q, g, r.label) for (_, q, g, _), r in zip(rows, ref)], seed
    assert [[g[f"score:{l}"] for l in LABELS] for g in got] == [[r.scores[l] for l in LABELS] for r in ref], seed
    assert [{"query": g["query"], "gold": g["gold"], "predicted": g["predicted"],
             "scores": {l: g[f"score:{l}"] for l in LABELS}} for g in got] == jsonl(preds["jsonl"]), seed
    with open(preds["csv"], newline="", encoding="utf-8") as f:
        assert list(csv.reader(f))[1:] == [[g["query"], g["gold"], g["predicted"]]
                                           + [f"{g[f'score:{l}']:.6g}" for l in LABELS] for g in got], seed


@needs_pyarrow
def test_eval_input_errors(tmp_path, monkeypatch, capsys):
    """A user's mistake in eval's input is one error line naming the file (and the row), before any
    model loads."""
    no_model = ["--model", "/nonexistent", "--labels", ",".join(LABELS)]
    d = tmp_path / "d.parquet"

    def eval_fails(table, *args):
        pq.write_table(pa.table(table), d)
        return fails(capsys, "eval", d, *args, *no_model)

    assert f"{d}: no column 'label' (columns: query, id)" in eval_fails({"query": ["a"], "id": [1]})
    assert f"{d}: no column 'query' (columns: text, label)" in eval_fails({"text": ["a"], "label": ["Dress"]})
    assert f"{d}: no column 'text'" in eval_fails({"query": ["a"], "label": ["Dress"]}, "--column", "text")
    assert f"{d} row 3: 'query' is missing or empty" in eval_fails(
        {"query": ["a", "b", None], "label": ["Dress"] * 3})
    assert f"{d} row 2: 'label' is missing or empty" in eval_fails({"query": ["a", "b"], "label": ["Dress", " "]})
    assert f"{d} row 1: 'label' must be a string, got int" in eval_fails({"query": ["a"], "label": [1]})
    assert "gold labels not in the label set: 'Sandals'" in eval_fails({"query": ["a"], "label": ["Sandals"]})
    assert f"{d}: no rows" in eval_fails({"query": pa.array([], pa.string()), "label": pa.array([], pa.string())})
    # the label column is named by --label-column; a typed Parquet column of text is read as text
    pq.write_table(pa.table({"query": ["a"], "gold": pa.array(["Dress"]).dictionary_encode()}), d)
    assert "no column 'label'" in fails(capsys, "eval", d, *no_model)
    assert "does not exist" in fails(capsys, "eval", d, "--label-column", "gold", *no_model)  # read: on to the model
    bad = tmp_path / "bad.parquet"
    bad.write_text("query,label\na,Dress\n")
    assert "not a readable Parquet file" in fails(capsys, "eval", bad, *no_model)
    assert "input file not found" in fails(capsys, "eval", tmp_path / "none.parquet", *no_model)
    # stdin: text unless told, and never Parquet
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"query,label\na,Dress\n")))
    assert "stdin is read as plain text unless --input-format" in fails(capsys, "eval", "-", *no_model)
    assert "not from stdin" in fails(capsys, "eval", "-", "--input-format", "parquet", *no_model)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"query,label\na,\n")))
    assert "<stdin>:2: 'label' is missing or empty" in fails(capsys, "eval", "-", "--input-format", "csv", *no_model)
    # --predictions to Parquet: checked before the model loads
    pq.write_table(pa.table({"query": ["a"], "label": ["Dress"]}), d)
    assert "cannot write output file" in fails(capsys, "eval", d, "--predictions", tmp_path / "no" / "p.parquet",
                                               *no_model)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    for args in ([d], [tmp_path / "d.csv", "--predictions", tmp_path / "p.parquet"]):
        (tmp_path / "d.csv").write_text("query,label\na,Dress\n")
        assert fails(capsys, "eval", *args, *no_model) == \
            "prefixscore: error: Parquet needs pyarrow: pip install 'prefixscore[parquet]'"


def test_batch_tokens_default_by_device(options):
    """A CPU's passes are 2,048 tokens (a 16,384-token pass took 8 s: Ctrl-C waits for one), a
    GPU's 16,384; a number given is kept whatever the device."""
    from prefixscore.cli.common import CPU_BATCH_TOKENS, GPU_BATCH_TOKENS, batch_tokens, model_spec

    assert model_spec(options("classify", "x", "--device", "cpu")).max_batch_tokens == CPU_BATCH_TOKENS == 1024
    assert batch_tokens(options("classify", "x", "--device", "cuda:3")) == GPU_BATCH_TOKENS  # said, if absent
    import torch
    want = GPU_BATCH_TOKENS if torch.cuda.is_available() else CPU_BATCH_TOKENS
    assert batch_tokens(options("classify", "x")) == want
    assert batch_tokens(options("classify", "x", "--device", "cpu", "--batch-tokens", 512)) == 512
