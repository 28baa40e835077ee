"""The shipped seed adapter is what its cross-validation measured (issue 33: 5-fold CV >= 90%), was
trained on no row the folds test except its own fold's, and answers the README's queries. The CV
itself trains ten adapters (bench/finetune_cv.py, minutes each on a GPU): its record is checked
against the shipped file here, not rerun."""
import csv
import json
from pathlib import Path

from safetensors import safe_open

from prefixscore.prompt import SEED_LABELS, SEED_TEMPLATE
from prefixscore.rows.report import row_keys, rows_digest, trained_on

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "prefixscore" / "adapters" / "seed.safetensors"
CV = ROOT / "bench" / "results" / "finetune_cv_seed_extra_e4.json"


def rows(name):
    with open(ROOT / "tests" / "data" / name, newline="", encoding="utf-8") as f:
        return [(r["query"], r["label"]) for r in csv.DictReader(f)]


def norm(q):
    return " ".join(q.lower().split())


def test_training_rows_never_repeat_dev_rows():
    """intent_train.csv adds to every fold's training part: a row of intent_dev in it would be
    trained on by the fold that tests it."""
    dev, train = rows("intent_dev.csv"), rows("intent_train.csv")
    assert not {norm(q) for q, _ in dev} & {norm(q) for q, _ in train}
    assert len({norm(q) for q, _ in train}) == len(train)  # no duplicate either
    assert {l for _, l in train} == set(SEED_LABELS)


def test_shipped_adapter_is_the_cross_validated_recipe():
    meta = safe_open(str(ADAPTER), "pt").metadata()
    training, cv = json.loads(meta["training"]), json.loads(CV.read_text())
    every = rows("intent_dev.csv") + rows("intent_train.csv")
    q, l = [r[0] for r in every], [r[1] for r in every]
    assert training["data_sha256"] == rows_digest(q, l)  # exactly these rows, no more
    assert training["row_keys"] == row_keys(q, l)
    assert meta["template"] == SEED_TEMPLATE == cv["template"] and json.loads(meta["chat"]) is cv["chat"] is True
    assert json.loads(meta["labels"]) == list(SEED_LABELS)
    for k, v in cv["recipe"].items():  # what the folds ran is what the shipped file was made with
        if k == "val_fraction":
            assert training["val_rows"] == 0 and v == 0
        else:
            assert training[k] == v, k
    assert int(meta["rank"]) == 8 and training["rows"] == 450 + cv["extra_rows"]
    assert [f["fold"] for f in cv["per_fold"]] == [0, 1, 2, 3, 4]
    assert sum(f["rows"] for f in cv["per_fold"]) == cv["pooled"]["rows"] == 450
    assert cv["pooled"]["accuracy"] >= 0.90
    assert ADAPTER.stat().st_size <= 8 * 2**20


def test_eval_counts_the_rows_an_adapter_saw():
    """`eval` says how many of the rows it scores the adapter was trained on: all of intent_dev for
    the shipped one, none of a file it never saw."""
    training = json.loads(safe_open(str(ADAPTER), "pt").metadata()["training"])
    dev = rows("intent_dev.csv")
    assert trained_on(training, [q for q, _ in dev], [l for _, l in dev]) == 450
    assert trained_on(training, ["levis 501 bootcut never seen"], ["Jeans"]) == 0
    assert trained_on(training, [dev[0][0]], ["Other" if dev[0][1] != "Other" else "Dress"]) == 0
    old = {"data_sha256": rows_digest(["a"], ["Other"])}  # an adapter from before row keys
    assert trained_on(old, ["a"], ["Other"]) == 1 and trained_on(old, ["b"], ["Other"]) == 0


README_PYTHON = {"levis 501": "Jeans", "oversized hoodie": "Hoodie", "红色连衣裙": "Dress",
                 "beige trench coat women": "Trench Coat", "levis 501 straight leg": "Jeans"}


def test_readme_queries(bundled):
    """The README's Python example and first command, as written (`bundled`: skip where the GPU
    run carries only the tokenizer)."""
    from prefixscore import Classifier

    clf = Classifier(adapter="seed", device="cpu")
    got = {q: r.label for q, r in zip(README_PYTHON, clf.classify_batch(list(README_PYTHON)))}
    assert got == README_PYTHON
