"""Trained label heads (heads.py): fit, save/load, refusal of mismatches, data errors, few-shot."""
import csv
import inspect
import math
import random

import pytest
import torch

from prefixscore import Classifier, ConfigError, InputError, ModelLoadError
from prefixscore.cli.commands import main
from prefixscore.weights.heads import classify_with_head, head_scores, load_head, read_head, save_head
from prefixscore.train.fit_heads import (
    FitOptions, compare_modes, few_shot_template, fit_head, modes_rows, stratified_folds,
)
from prefixscore.weights.loading import load

LABELS = ["Alpha", "Beta", "Gamma"]
# No token of one label's words (with or without a leading space) appears in another's.
WORDS = {"Alpha": ["apple", "apricot", "avocado"], "Beta": ["boat", "bus", "bicycle"],
         "Gamma": ["guitar", "gong", "violin"]}
BARE = "{query}"  # head mode with no instruction at all: nothing before the query
INSTR = "Which group does this query belong to: Alpha, Beta or Gamma?\nquery: {query}"
# Classifier(..., head=path) is wired in classifier.py by its owner; until then those checks skip.
HAS_HEAD_ARG = "head" in inspect.signature(Classifier).parameters


def synthetic(n, seed):
    """Separable rows: every word of a query is one of its label's distinctive words (a random tiny
    model mixes the whole context into the read-out row, so filler words would blur the classes)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = LABELS[i % len(LABELS)]
        rows.append((" ".join(rng.choice(WORDS[label]) for _ in range(rng.randint(1, 2))), label))
    return rows


def write_csv(path, rows, header=("query", "label")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if header:
            w.writerow(header)
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    path = tiny_model("qwen2")
    return path, load(path, "cpu", torch.float32)


@pytest.fixture(scope="module")
def bare_clf(tiny):
    return Classifier(tiny[1], BARE, LABELS, chat=False)


@pytest.fixture(scope="module")
def fitted(bare_clf):
    rows = synthetic(60, seed=0)
    x = bare_clf.features([q for q, _ in rows])
    y = torch.tensor([LABELS.index(l) for _, l in rows])
    head, info = fit_head(x, y, LABELS, FitOptions(seed=0), log=None)
    return head, info


def test_empty_template_has_no_prefix(bare_clf):
    """'{query}' without the chat wrapper: no cached prefix at all, every token is the query's."""
    assert bare_clf.prefix_len == 0
    e = bare_clf.encode("apple bus")
    assert e.start == 0 and e.ids == bare_clf.loaded.tokenizer("apple bus")["input_ids"]


def test_fit_separable_reaches_100(bare_clf, fitted):
    head, info = fitted
    assert info["val_rows"] > 0 and info["val_acc"] == 1.0 and info["refit_train_acc"] == 1.0
    test = synthetic(30, seed=1)
    pred = head.logits(bare_clf.features([q for q, _ in test])).argmax(-1).tolist()
    assert [LABELS[p] for p in pred] == [l for _, l in test]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fit_is_deterministic(bare_clf, kind):
    rows = synthetic(30, seed=2)
    x = bare_clf.features([q for q, _ in rows])
    y = torch.tensor([LABELS.index(l) for _, l in rows])
    opts = FitOptions(kind=kind, hidden=16, epochs=30, seed=3)
    (a, ia), (b, ib) = (fit_head(x, y, LABELS, opts, log=None) for _ in range(2))
    assert ia == ib
    for k, v in a.tensors().items():
        assert torch.equal(v, b.tensors()[k])


def test_fit_logs_accuracy_per_epoch(bare_clf):
    rows = synthetic(30, seed=2)
    x = bare_clf.features([q for q, _ in rows])
    lines = []
    fit_head(x, torch.tensor([LABELS.index(l) for _, l in rows]), LABELS,
             FitOptions(epochs=5, refit=False), log=lines.append)
    assert len(lines) == 5 and all("acc" in l and "val" in l for l in lines)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_save_load_round_trip_identical_scores(tiny, tmp_path, kind):
    """The fused label-head path (linear) / normed rows + MLP, before and after the file; also the
    same as the head applied to Classifier.features. With an instruction: the cached-prefix path."""
    clf = Classifier(tiny[1], INSTR, LABELS, chat=True)
    assert clf.prefix_len > 0
    rows = synthetic(45, seed=4)
    queries = [q for q, _ in rows]
    x = clf.features(queries)
    head, _ = fit_head(x, torch.tensor([LABELS.index(l) for _, l in rows]), LABELS,
                       FitOptions(kind=kind, hidden=32, epochs=40), log=None)
    path = tmp_path / f"{kind}.safetensors"
    save_head(path, head, clf, {"note": "test"})
    loaded = load_head(path, clf)
    assert loaded.kind == kind and loaded.labels == LABELS and loaded.meta["training"] == {"note": "test"}
    batch = [clf.encode(q) for q in queries]
    s0, b0 = head_scores(clf, head, batch)
    s1, b1 = head_scores(clf, loaded, batch)
    assert torch.equal(s0, s1) and torch.equal(b0, b1)
    ref = torch.log_softmax(head.logits(x), -1)
    assert torch.allclose(s0, ref, atol=1e-4)
    results = classify_with_head(clf, loaded, queries)
    assert [r.label for r in results] == [LABELS[i] for i in ref.argmax(-1).tolist()]
    if HAS_HEAD_ARG:
        via = Classifier(tiny[1], INSTR, LABELS, chat=True, head=str(path)).classify_batch(queries)
        assert [r.scores for r in via] == [r.scores for r in results]


def test_saved_file_is_plain_safetensors_with_metadata(bare_clf, fitted, tmp_path):
    from safetensors import safe_open

    head, info = fitted
    a = tmp_path / "a.safetensors"
    save_head(a, head, bare_clf, info)
    with safe_open(str(a), "pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == {"weight", "bias", "model_signature"}
    assert meta["template"] == BARE and meta["chat"] == "false" and meta["kind"] == "linear"
    assert meta["model"] == bare_clf.loaded.name and meta["hidden_size"] == "64"


def test_mismatches_are_refused(tiny, tiny_model, bare_clf, fitted, tmp_path):
    path = tmp_path / "head.safetensors"
    save_head(path, fitted[0], bare_clf)
    other_model = Classifier(str(tiny_model("llama")), BARE, LABELS, chat=False)  # same shapes
    with pytest.raises(ConfigError, match="another model"):
        load_head(path, other_model)
    with pytest.raises(ConfigError, match="template"):
        load_head(path, Classifier(tiny[1], "query: {query}", LABELS, chat=False))
    with pytest.raises(ConfigError, match="chat=False"):
        load_head(path, Classifier(tiny[1], BARE, LABELS, chat=True))
    with pytest.raises(ConfigError, match="labels"):
        load_head(path, Classifier(tiny[1], BARE, ["Alpha", "Beta", "Delta"], chat=False))
    with pytest.raises(ConfigError, match="same order"):
        load_head(path, Classifier(tiny[1], BARE, LABELS[::-1], chat=False))
    # The same weights in another dtype are the same model.
    bf16 = Classifier(load(tiny[0], "cpu", torch.bfloat16), BARE, LABELS, chat=False)
    assert load_head(path, bf16).weight.dtype == torch.bfloat16


def test_bad_head_files(bare_clf, tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        read_head(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelLoadError, match="safetensors"):
        read_head(junk)
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(3, 64)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ModelLoadError, match="not a prefixscore head"):
        read_head(tmp_path / "plain.safetensors")


def test_fit_head_command(tiny, tmp_path, capsys):
    data = write_csv(tmp_path / "train.csv", synthetic(45, seed=5))
    out = tmp_path / "head.safetensors"
    args = ["--model", str(tiny[0]), "--labels", ",".join(LABELS), "--template", BARE, "--no-chat",
            "-o", str(out)]
    assert main(["fit-head", data, *args, "--epochs", "40"]) == 0
    stdout = capsys.readouterr().out
    assert "epoch   1" in stdout and "val loss" in stdout and "saved" in stdout
    assert read_head(out).meta["training"]["source"] == "labels"
    # Distillation: unlabeled queries, the prompted model's decisions as targets.
    unlabeled = write_csv(tmp_path / "q.csv", [(q,) for q, _ in synthetic(30, seed=6)], header=("query",))
    assert main(["fit-head", unlabeled, *args, "--teacher", "--teacher-template", INSTR,
                 "--epochs", "5"]) == 0
    assert read_head(out).meta["training"]["source"] == "teacher"


@pytest.mark.parametrize("content,msg", [
    ("text,label\nred apple,Alpha\n", "no column 'query'"),
    ("query,label\nred apple,Alpha\nblue boat,Delta\n", "labels not in the label set: 'Delta'"),
    ("", "file is empty"),
    ("query,label\n", "no rows"),
    ("query,label\nred apple,\n", "'label' is missing or empty"),
])
def test_bad_data_files(tiny, tmp_path, capsys, content, msg):
    data = tmp_path / "bad.csv"
    data.write_text(content, encoding="utf-8")
    rc = main(["fit-head", str(data), "--model", str(tiny[0]), "--labels", ",".join(LABELS),
               "-o", str(tmp_path / "h.safetensors")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("prefixscore: error:") and msg in err


def test_fit_rejects_bad_targets():
    with pytest.raises(InputError, match="index the 3 labels"):
        fit_head(torch.randn(4, 8), torch.tensor([0, 1, 2, 3]), LABELS, log=None)
    with pytest.raises(ConfigError, match="kind"):
        fit_head(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]), LABELS, FitOptions(kind="svm"))


def test_few_shot_template():
    rows = synthetic(60, seed=7)
    t = few_shot_template(INSTR, rows, 2, LABELS, seed=0)
    instruction, slot = INSTR.split("\n")
    assert t.startswith(instruction + "\n") and t.endswith("\n" + slot)
    lines = t[len(instruction) + 1: -len(slot) - 1].split("\n")
    examples = list(zip(lines[::2], lines[1::2]))  # the slot line filled, then the label on its own line
    assert len(lines) == 2 * len(examples) == 2 * 2 * len(LABELS)
    for q, l in examples:
        assert q.startswith("query: ") and (q.removeprefix("query: "), l) in rows
    assert sorted(l for _, l in examples) == sorted(LABELS * 2)
    assert t == few_shot_template(INSTR, rows[::-1], 2, LABELS, seed=0)  # row order does not matter
    assert t != few_shot_template(INSTR, rows, 2, LABELS, seed=1)
    assert few_shot_template(INSTR, rows, 0, LABELS) == INSTR
    seed_like = few_shot_template("Pick a label.\nquery:{query}", [("red apple", "Alpha")], 1, LABELS)
    assert seed_like == "Pick a label.\nquery:red apple\nAlpha\nquery:{query}"
    cue = few_shot_template("{query}\nAnswer:", [("red apple", "Alpha")], 1, LABELS)
    assert cue == "red apple\nAnswer: Alpha\n{query}\nAnswer:"
    with pytest.raises(InputError, match="Delta"):
        few_shot_template(INSTR, [("x", "Delta")], 1, LABELS)


def test_few_shot_examples_are_in_the_cached_prefix(tiny):
    rows = synthetic(30, seed=8)
    zero = Classifier(tiny[1], INSTR, LABELS, chat=True)
    few = Classifier(tiny[1], few_shot_template(INSTR, rows, 2, LABELS), LABELS, chat=True)
    assert few.prefix_len > zero.prefix_len + 6
    e = few.encode("gong bus")
    assert e.start == few.prefix_len and len(e.ids) - e.start == len(zero.encode("gong bus").ids) - zero.prefix_len


def test_stratified_folds_balanced():
    y = [0] * 10 + [1] * 7 + [2] * 3
    f = stratified_folds(y, 4, seed=0)
    assert sorted(f.count(k) for k in range(4)) == [5, 5, 5, 5]
    for c in range(3):
        per = [sum(1 for i in range(20) if y[i] == c and f[i] == k) for k in range(4)]
        assert max(per) - min(per) <= 1
    assert f == stratified_folds(y, 4, seed=0)


def test_compare_modes(tiny):
    rows = synthetic(60, seed=9)
    done = []  # eval-modes' progress: rows as passes complete, the whole work in the end
    rep = compare_modes(tiny[1], [q for q, _ in rows], [l for _, l in rows], LABELS, INSTR, chat=True,
                        shots=(1,), folds=2, latency_queries=2, log=None, progress=done.append)
    assert sum(done) == modes_rows(60, (1,)) == 4 * 60 and len(done) > 4
    names = [m["mode"] for m in rep["modes"]]
    assert names == ["prompt, zero-shot", "prompt, 1-shot", "head (linear), with instruction",
                     "head (linear), no instruction"]
    assert rep["modes"][-1]["prefix_tokens"] == 0 and rep["modes"][-1]["accuracy"] > 0.8  # 30 rows/fold
    assert rep["modes"][1]["prefix_tokens"] > rep["modes"][0]["prefix_tokens"]
    assert all(m["head_path_agrees"] for m in rep["modes"][2:])
    assert all(sum(map(sum, m["confusion"])) == 60 for m in rep["modes"])


@pytest.mark.skipif(not HAS_HEAD_ARG, reason="Classifier(head=...) is not wired in yet")
def test_classifier_with_head(tiny, bare_clf, fitted, tmp_path):
    path = tmp_path / "head.safetensors"
    save_head(path, fitted[0], bare_clf)
    clf = Classifier(tiny[1], head=str(path))  # template, labels and chat flag come from the file
    assert (clf.prompt.template, clf.prompt.chat, clf.labels, clf.prefix_len) == (BARE, False, LABELS, 0)
    test = synthetic(15, seed=1)
    res = clf.classify_batch([q for q, _ in test])
    assert [r.label for r in res] == [l for _, l in test]
    assert all(abs(sum(math.exp(v) for v in r.scores.values()) - 1) < 1e-5 for r in res)
    raw = Classifier(tiny[1], head=str(path), mode="logits").classify_batch([q for q, _ in test])
    assert [r.label for r in raw] == [r.label for r in res]
    with pytest.raises(ConfigError, match="template"):
        Classifier(tiny[1], "query: {query}", head=str(path))
    with pytest.raises(ModelLoadError, match="not found"):
        Classifier(tiny[1], head=str(tmp_path / "missing.safetensors"))


def test_compare_modes_errors_name_the_row(tiny):
    rows = synthetic(11, seed=3) + [("{x} " + "apple " * 470, "Alpha")]  # braces: never an example
    queries, gold = [q for q, _ in rows], [l for _, l in rows]
    # It fits behind the zero-shot prefix, not behind a 1-shot one: the error comes from inside a
    # fold, and names the row of the whole set (12), not the row's place in its fold.
    with pytest.raises(InputError, match="^query 12: prompt is"):
        compare_modes(tiny[1], queries, gold, LABELS, INSTR, chat=False, shots=(1,), folds=3,
                      latency_queries=2, log=None)
    with pytest.raises(ConfigError, match="latency_queries must be at least 1"):
        compare_modes(tiny[1], queries, gold, LABELS, INSTR, latency_queries=0, log=None)
    with pytest.raises(ConfigError, match="at least two labels"):
        compare_modes(tiny[1], queries, ["Alpha"] * len(rows), ["Alpha"], INSTR, log=None)
    with pytest.raises(InputError, match="'Alpha '"):
        compare_modes(tiny[1], queries, gold[:-1] + ["Alpha "], LABELS, INSTR, log=None)


def test_head_file_errors(bare_clf, fitted, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with pytest.raises(InputError, match=f"cannot write output file {tmp_path}: Is a directory"):
        save_head(tmp_path, fitted[0], bare_clf)
    path = tmp_path / "head.safetensors"
    save_head(path, fitted[0], bare_clf)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "kind": "mlp"})  # an mlp head without out_weight
    with pytest.raises(ModelLoadError, match="damaged head file"):
        read_head(path)
