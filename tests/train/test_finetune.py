"""LoRA fine-tuning (prefixscore.train) and adapters merged at load (prefixscore.weights.adapter), on the
tiny random Llama: a keyword task the random model cannot do is learned; the merged engine scores
equal the unmerged peft model's; mismatched adapters and bad data are refused."""
import csv
import random

import pytest
import torch

from tests.hf_reference import hf_generate, hf_scores
from prefixscore import Classifier
from prefixscore.errors import ConfigError, InputError, ModelLoadError
from prefixscore.weights.loading import base_hash, load
from prefixscore.weights.adapter import check_adapter, merge_adapter, read_adapter
from prefixscore.train import finetune, save_adapter
from prefixscore.train.__main__ import main as train_main
from prefixscore.train.lora import TARGETS

TEMPLATE = "q: {query}\na:"
LABELS = ["Dress", "T-shirt", "Trench Coat"]  # T-shirt / Trench Coat share a first token: a branch
KEYWORD = {"Dress": "dress", "T-shirt": "tee", "Trench Coat": "trench"}
FAST = dict(template=TEMPLATE, labels=LABELS, chat=False, lr=2e-2, batch_size=8, progress=False)


def keyword_rows(n=60, seed=0):
    """The label is the keyword in the query; the rest is filler shared by all labels."""
    rng = random.Random(seed)
    filler = "blue red size xl cotton women men summer vintage black".split()
    rows = []
    for i in range(n):
        label = LABELS[i % len(LABELS)]
        words = [rng.choice(filler) for _ in range(rng.randint(1, 3))]
        words.insert(rng.randint(0, len(words)), KEYWORD[label])
        rows.append((" ".join(words), label))
    return rows


ROWS = keyword_rows()


def accuracy(clf, rows):
    res = clf.classify_batch([q for q, _ in rows])
    return sum(r.label == l for r, (_, l) in zip(res, rows)) / len(rows)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def trained(llama, tmp_path_factory):
    """(adapter file, adapter) of the label objective on the keyword task."""
    adapter = finetune(ROWS, model=llama, epochs=5, **FAST)
    path = tmp_path_factory.mktemp("adapter") / "kw.adapter.safetensors"
    save_adapter(path, adapter)
    return path, adapter


def merged(folder, adapter):
    lm = load(folder, "cpu", torch.float32)
    check_adapter(adapter, base_hash(lm), TEMPLATE, LABELS, False)
    return merge_adapter(lm, adapter)


def test_label_objective_learns_the_task(llama, trained):
    path, adapter = trained
    base = Classifier(load(llama, "cpu", torch.float32), TEMPLATE, LABELS, chat=False, graphs=False)
    assert accuracy(base, ROWS) < 0.7  # the random model cannot do it
    t = adapter.meta["training"]
    assert t["val_rows"] > 0 and t["val_acc"] == 1.0 and t["history"][0]["epoch"] == 1
    clf = Classifier(merged(llama, read_adapter(path)), TEMPLATE, LABELS, chat=False, graphs=False)
    assert accuracy(clf, ROWS) == 1.0
    assert accuracy(clf, keyword_rows(30, seed=1)) == 1.0  # new queries


def _peft_model(folder, adapter):
    """The unmerged reference: HF model + peft LoRA layers holding the adapter's A/B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    m = adapter.meta
    net = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                         LoraConfig(r=m["rank"], lora_alpha=m["alpha"], target_modules=TARGETS))
    n = 0
    with torch.no_grad():
        for name, mod in net.named_modules():
            if hasattr(mod, "lora_A") and "default" in mod.lora_A:
                A, B = adapter.lora[f"layers.{name.split('.layers.')[1].split('.')[0]}.{name.split('.')[-1]}"]
                mod.lora_A["default"].weight.copy_(A)
                mod.lora_B["default"].weight.copy_(B)
                n += 1
    assert n == len(adapter.lora) == 2 * len(TARGETS)
    return net.eval()


def test_merged_scores_equal_peft_model(llama, trained):
    path, _ = trained
    adapter = read_adapter(path)  # the round trip through the file
    assert all(B.abs().max() > 0 for _, B in adapter.lora.values())  # trained: the merge matters
    clf = Classifier(merged(llama, adapter), TEMPLATE, LABELS, chat=False, graphs=False)
    queries = [q for q, _ in ROWS[:24]] + ["trench dress tee", "红色 dress"]
    res = clf.classify_batch(queries)
    ours = torch.tensor([[r.scores[l] for l in LABELS] for r in res])
    net = _peft_model(llama, adapter)
    prompts = [e.ids for e in clf.encode_many(queries)]
    ref = torch.tensor(hf_scores(net, prompts, clf.trie))
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    eos = clf.loaded.tokenizer.eos_token_id
    assert [LABELS.index(r.label) for r in res] == hf_generate(net, prompts, clf.trie, eos)
    base = Classifier(load(llama, "cpu", torch.float32), TEMPLATE, LABELS, chat=False, graphs=False)
    unmerged = torch.tensor([[r.scores[l] for l in LABELS] for r in base.classify_batch(queries)])
    assert (unmerged - ours).abs().max() > 0.1


def test_deterministic_for_a_seed(llama):
    a = finetune(ROWS[:24], model=llama, epochs=1, seed=3, **FAST)
    b = finetune(ROWS[:24], model=llama, epochs=1, seed=3, **FAST)
    c = finetune(ROWS[:24], model=llama, epochs=1, seed=4, **FAST)
    for k, (A, B) in a.lora.items():
        assert torch.equal(A, b.lora[k][0]) and torch.equal(B, b.lora[k][1])
    assert any(not torch.equal(A, c.lora[k][0]) for k, (A, _) in a.lora.items())


def test_head_objective(llama, tmp_path):
    adapter = finetune(ROWS, model=llama, epochs=5, objective="head", **FAST)
    save_adapter(tmp_path / "h.safetensors", adapter)
    adapter = read_adapter(tmp_path / "h.safetensors")
    assert adapter.meta["objective"] == "head" and adapter.head["weight"].shape == (3, 64)
    clf = Classifier(merged(llama, adapter), TEMPLATE, LABELS, chat=False, graphs=False)
    head = adapter.head_weights()
    logits = head.logits(clf.features([q for q, _ in ROWS]))
    assert logits.argmax(-1).tolist() == [LABELS.index(l) for _, l in ROWS]
    # Classifier(adapter=) merges the LoRA and decides with the adapter's head: the same log-softmax
    loaded = Classifier(llama, adapter=tmp_path / "h.safetensors", graphs=False)
    res = loaded.classify_batch([q for q, _ in ROWS])
    assert [r.label for r in res] == [l for _, l in ROWS]
    got = torch.tensor([[r.scores[l] for l in LABELS] for r in res])
    torch.testing.assert_close(got, torch.log_softmax(logits, -1), atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="not both"):
        Classifier(llama, adapter=tmp_path / "h.safetensors", head=tmp_path / "h.safetensors")


def test_base_hash_same_weights_any_dtype(llama, tiny_model):
    h = base_hash(load(llama, "cpu", torch.float32))
    assert base_hash(load(llama, "cpu", torch.bfloat16)) == h
    assert base_hash(load(tiny_model("qwen2"), "cpu", torch.float32)) != h


def test_mismatched_adapter_refused(llama, tiny_model, trained):
    _, adapter = trained
    lm = load(llama, "cpu", torch.float32)
    h = base_hash(lm)
    check_adapter(adapter, h, TEMPLATE, LABELS, False)
    other = base_hash(load(tiny_model("qwen2"), "cpu", torch.float32))
    with pytest.raises(ConfigError, match="another base model"):
        check_adapter(adapter, other, TEMPLATE, LABELS, False)
    with pytest.raises(ConfigError, match="template"):
        check_adapter(adapter, h, "{query}", LABELS, False)
    with pytest.raises(ConfigError, match="chat"):
        check_adapter(adapter, h, TEMPLATE, LABELS, True)
    with pytest.raises(ConfigError, match="labels"):
        check_adapter(adapter, h, TEMPLATE, LABELS[::-1], False)
    merge_adapter(lm, adapter)
    with pytest.raises(ConfigError, match="already merged"):
        merge_adapter(lm, adapter)
    with pytest.raises(ConfigError, match="before merging"):
        base_hash(lm)


def test_unreadable_adapter_files(tmp_path, trained):
    with pytest.raises(ModelLoadError, match="not found"):
        read_adapter(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(ModelLoadError, match="not a readable"):
        read_adapter(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ModelLoadError, match="not a prefixscore adapter"):
        read_adapter(tmp_path / "plain.safetensors")
    path, _ = trained  # a damaged file: one B tensor missing
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    t.pop(next(k for k in t if k.endswith("lora_B")))
    save_file(t, str(tmp_path / "damaged.safetensors"), metadata=meta)
    with pytest.raises(ModelLoadError, match="damaged"):
        read_adapter(tmp_path / "damaged.safetensors")


def _csv(path, rows, header=("query", "label")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


@pytest.mark.parametrize("case, match", [
    ("unknown", "not in the label set"), ("empty", "no rows"), ("column", "no column 'label'"),
    ("one_class", "at least two classes"), ("pairs_empty", "no rows"),
])
def test_bad_data(llama, tmp_path, case, match):
    data = {"unknown": lambda: _csv(tmp_path / "d.csv", ROWS[:5] + [("a coat", "Coat")]),
            "empty": lambda: _csv(tmp_path / "d.csv", []),
            "column": lambda: _csv(tmp_path / "d.csv", ROWS[:5], header=("query", "category")),
            "one_class": lambda: _csv(tmp_path / "d.csv", [r for r in ROWS if r[1] == "Dress"]),
            "pairs_empty": lambda: []}[case]()
    with pytest.raises(InputError, match=match):
        finetune(data, model=llama, epochs=1, **FAST)


def test_bad_options(llama):
    with pytest.raises(ConfigError, match="objective"):
        finetune(ROWS, model=llama, objective="lm", **FAST)
    with pytest.raises(ConfigError, match="positive"):
        finetune(ROWS, model=llama, rank=0, **FAST)


def test_command_line(llama, tmp_path, capsys):
    data = _csv(tmp_path / "d.csv", ROWS[:24])
    out = tmp_path / "cli.adapter.safetensors"
    args = ["finetune", data, "-o", str(out), "--model", str(llama), "--template", TEMPLATE,
            "--no-chat", "--labels", ",".join(LABELS), "--epochs", "1", "--quiet"]
    assert train_main(args) == 0
    assert f"saved {out}: label adapter, rank 8, {len(LABELS)} labels" in capsys.readouterr().err
    adapter = read_adapter(out)
    m = adapter.meta
    assert (m["template"], m["chat"], m["labels"], m["objective"], m["rank"]) == (TEMPLATE, False, LABELS, "label", 8)
    assert repr(adapter).startswith("Adapter('label', rank 8,") and "\n" not in repr(adapter)  # no tensors
    bad = _csv(tmp_path / "bad.csv", [("x", "Dress")])
    assert train_main(["finetune", bad, "-o", str(out), "--model", str(llama), "--template", TEMPLATE,
                       "--no-chat", "--labels", ",".join(LABELS), "--quiet"]) == 2
    assert "at least two classes" in capsys.readouterr().err


class _KeywordTeacher:
    """Stands in for a prompted Classifier: its decisions are the targets (distillation)."""
    labels = LABELS

    def classify_batch(self, queries):
        from prefixscore.classifier import Result

        return [Result(q, next(l for l, k in KEYWORD.items() if k in q.split()), {}) for q in queries]


def test_teacher_targets(llama):
    queries = [q for q, _ in ROWS]
    adapter = finetune(queries, model=llama, epochs=5, teacher=_KeywordTeacher(), **FAST)
    assert adapter.meta["training"]["teacher"] and adapter.meta["training"]["val_acc"] == 1.0


def test_classifier_loads_an_adapter(llama, trained, tmp_path):
    """Classifier(model_path, adapter=file) merges at load: the same scores as merging by hand,
    the adapter's template/labels/chat as defaults, and a mismatch refused before any work."""
    path, _ = trained
    want = Classifier(merged(llama, read_adapter(path)), TEMPLATE, LABELS, chat=False, graphs=False)
    clf = Classifier(llama, adapter=path, graphs=False)  # template, labels, chat from the file
    assert clf.labels == LABELS and clf.prompt.template == TEMPLATE and clf.prompt.chat is False
    queries = [q for q, _ in ROWS[:12]]
    assert [(r.label, r.scores) for r in clf.classify_batch(queries)] == \
        [(r.label, r.scores) for r in want.classify_batch(queries)]
    with pytest.raises(ConfigError, match="labels"):
        Classifier(llama, labels=list(reversed(LABELS)), adapter=path, graphs=False)
    with pytest.raises(ConfigError, match="path"):
        Classifier(load(llama, "cpu", torch.float32), adapter=path, graphs=False)


def test_cli_classify_with_an_adapter(llama, trained, capsys):
    path, _ = trained
    from prefixscore.cli.commands import main

    want = Classifier(llama, adapter=path, graphs=False).classify("trench dress tee")
    assert main(["classify", "--model", str(llama), "--device", "cpu", "--adapter", str(path),
                 "trench dress tee"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split(",")
    assert row[:3] == ["1", "trench dress tee", want.label]


def test_refit_trains_again_on_every_row(llama):
    """--refit: after early stopping picks the best epoch on the validation rows, a fresh run on all
    rows for that many epochs; the result still solves the task and differs from the first run."""
    first = finetune(ROWS, model=llama, epochs=4, **FAST)
    again = finetune(ROWS, model=llama, epochs=4, refit=True, **FAST)
    t = again.meta["training"]
    assert t["refit"] and len(t["refit_history"]) == t["best_epoch"] == first.meta["training"]["best_epoch"]
    assert all("val_acc" not in r for r in t["refit_history"])
    assert any(not torch.equal(a[1], first.lora[k][1]) for k, a in again.lora.items())
    lm = load(llama, "cpu", torch.float32)
    check_adapter(again, base_hash(lm), TEMPLATE, LABELS, False)
    clf = Classifier(merge_adapter(lm, again), TEMPLATE, LABELS, chat=False, graphs=False)
    assert accuracy(clf, keyword_rows(30, seed=7)) == 1.0


def test_bfloat16_file_is_half_the_size(trained, tmp_path):
    """save_dtype bfloat16 (the shipped seed adapter): half the bytes, the same weights to bf16
    precision (relative 2^-8), read back as fp32."""
    path, adapter = trained
    small = tmp_path / "bf16.safetensors"
    save_adapter(small, adapter, torch.bfloat16)
    assert small.stat().st_size < 0.6 * path.stat().st_size
    back = read_adapter(small)
    for k, (A, B) in adapter.lora.items():
        assert back.lora[k][0].dtype == torch.float32
        torch.testing.assert_close(back.lora[k][0], A, rtol=2 ** -8, atol=1e-6)
        torch.testing.assert_close(back.lora[k][1], B, rtol=2 ** -8, atol=1e-6)


def test_eval_puts_zero_shot_and_adapter_side_by_side(llama, trained, tmp_path, capsys):
    import json

    from prefixscore.cli.commands import main

    path, _ = trained
    seen = {tuple(r) for r in ROWS}
    fresh = [r for r in keyword_rows(40, seed=1) if tuple(r) not in seen][:30]
    data = _csv(tmp_path / "d.csv", fresh)
    rep = tmp_path / "rep.json"
    assert main(["eval", data, "--model", str(llama), "--device", "cpu", "--adapter", str(path),
                 "--json", str(rep)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[2].startswith("zero-shot") and lines[3].startswith(f"adapter {path}"), out
    r = json.loads(rep.read_text())
    assert [m["mode"] for m in r["modes"]] == ["zero-shot", f"adapter {path}"]  # not its training rows
    assert r["mode"] == f"adapter {path}" and r["accuracy"] == 1.0 == r["modes"][1]["accuracy"]
    assert r["modes"][0]["accuracy"] < 1.0  # the random model without the adapter cannot do it
    assert "confusion of adapter" in out
    # on exactly the rows it was trained on (any order), eval says so
    assert main(["eval", _csv(tmp_path / "all.csv", list(reversed(ROWS))), "--model", str(llama),
                 "--device", "cpu", "--adapter", str(path)]) == 0
    assert f"adapter {path} (trained on these rows)" in capsys.readouterr().out
    # and on a file holding some of them, how many
    assert main(["eval", _csv(tmp_path / "some.csv", ROWS[:7] + fresh), "--model", str(llama),
                 "--device", "cpu", "--adapter", str(path)]) == 0
    assert f"adapter {path} (trained on 7 of these {7 + len(fresh)} rows)" in capsys.readouterr().out


def test_seed_adapter_is_the_default_task_only(tmp_path, monkeypatch, capsys):
    """classify/eval/serve with no model, template, labels, head or adapter flag use the shipped
    seed adapter (and say so); any of those flags, or --no-adapter, keeps the raw model."""
    import argparse

    from prefixscore.weights import adapter
    from prefixscore.cli import common as cmdline

    fake = tmp_path / "seed.safetensors"
    fake.write_bytes(b"x")
    monkeypatch.setattr(adapter, "SEED_ADAPTER", fake)
    base = dict(model=None, template=None, template_file=None, labels=None, labels_file=None,
                head=None, chat=None, adapter=None, no_adapter=False)

    def choose(**kw):
        a = argparse.Namespace(**(base | kw))
        cmdline.seed_adapter_default(a)
        return a.adapter

    assert choose() == "seed" and "shipped seed adapter" in capsys.readouterr().err
    for flag in ("model", "template", "labels", "head"):
        assert choose(**{flag: "x"}) is None, flag
    # serve's --score-template keeps the seed task (/v1/score gets base weights of its own)
    assert choose(score_template="x") == "seed"
    assert choose(score_template="x", labels="a,b") is None
    assert choose(chat=False) is None and choose(no_adapter=True) is None
    assert choose(adapter="mine.safetensors") == "mine.safetensors"
    with pytest.raises(ConfigError, match="--no-adapter"):
        choose(adapter="mine.safetensors", no_adapter=True)
    fake.unlink()
    assert choose() is None and "missing" in capsys.readouterr().err


@pytest.mark.parametrize("objective", ["label", "head"])
def test_bfloat16_base_weights_train(llama, objective):
    """dtype bfloat16 (a GPU's default: frozen base weights in bf16, LoRA and head in fp32), run on
    CPU: the mixed-dtype path trains and learns the keyword task."""
    adapter = finetune(ROWS, model=llama, epochs=5, objective=objective, dtype="bfloat16", **FAST)
    assert adapter.meta["training"]["val_acc"] >= 0.9
    assert all(A.dtype == torch.float32 for A, _ in adapter.lora.values())


def test_command_line_teacher(llama, tmp_path, capsys):
    """finetune --teacher MODEL: a file with only a query column, targets from the teacher's
    zero-shot decisions. Student = teacher's model and prompt: it starts at full agreement (LoRA
    starts at zero), so the validation accuracy against the teacher is 1.0."""
    data = tmp_path / "q.csv"
    data.write_text("query\n" + "\n".join(q for q, _ in ROWS[:24]) + "\n")
    out = tmp_path / "t.adapter.safetensors"
    flags = ["--template", TEMPLATE, "--no-chat", "--labels", ",".join(LABELS)]
    assert train_main(["finetune", str(data), "-o", str(out), "--model", str(llama), *flags,
                       "--teacher", str(llama), "--teacher-template", TEMPLATE, "--no-teacher-chat",
                       "--epochs", "1", "--lr", "1e-6"]) == 0  # not --quiet: it drops the info lines
    assert "teacher:" in capsys.readouterr().err
    t = read_adapter(out).meta["training"]
    assert t["teacher"] and t["val_acc"] == 1.0
    assert train_main(["finetune", str(data), "-o", str(out), "--model", str(llama), *flags,
                       "--quiet"]) == 2  # no label column and no teacher
    assert "label" in capsys.readouterr().err


def test_scorer_merges_an_adapter(llama, tiny_model, trained, tmp_path, capsys):
    """Scorer(adapter=) and `score --adapter` merge it like Classifier does: the scores equal a
    Scorer over weights merged by hand (and differ from the raw model's); another base is refused."""
    import json

    from prefixscore import Scorer
    from prefixscore.cli.commands import main

    path, adapter = trained
    template = "Is the item relevant to the query?\nQuery: {query}\nItem: {item}\nAnswer:"
    reqs = [("trench coat", ["beige trench", "blue jeans", "cotton tee"]), ("dress", ["red dress"])]
    want = Scorer(merged(llama, adapter), template, chat=False, graphs=False).score_batch(reqs)
    got = Scorer(llama, template, chat=False, adapter=path, graphs=False).score_batch(reqs)
    raw = Scorer(llama, template, chat=False, graphs=False).score_batch(reqs)
    flat = lambda rs: [s for r in rs for item in r for s in item.scores.values()]  # noqa: E731
    assert flat(got) == pytest.approx(flat(want), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(flat(got), flat(raw))) > 1e-3  # the adapter changed them
    with pytest.raises(ConfigError, match="another base model"):
        Scorer(tiny_model("qwen2"), template, chat=False, adapter=path, graphs=False)
    src = tmp_path / "req.jsonl"
    src.write_text("".join(json.dumps({"query": q, "items": it}) + "\n" for q, it in reqs))
    assert main(["score", "--model", str(llama), "--device", "cpu", "--template", template,
                 "--no-chat", "--adapter", str(path), "-i", str(src)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [s for r in rows for item in r["scores"] for s in item] == pytest.approx(
        flat(want), abs=1e-4)
