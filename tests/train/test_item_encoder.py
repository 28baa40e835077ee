"""Item encoders (issue 34, DESIGN.md §9) on a tiny random Llama: fitting by distillation from the
text scorer improves ranking agreement over the untrained map; the student the fit trains (HF,
inputs_embeds) scores soft tokens as the Scorer does; the encoder file round-trips and refuses
another base model; the agreement measures against their definitions."""
import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixscore import Scorer
from prefixscore.errors import ConfigError
from prefixscore.train import ranking
from prefixscore.train.item_encoder import ItemEncoder, ItemMap, item_features
from prefixscore.train.item_fit import FitOptions, Student, fit_item_encoder, scorer_margins
from prefixscore.weights.loading import base_hash, load

DATA = Path(__file__).resolve().parents[1] / "data"
TEMPLATE = "Query: {query}\nItem: {item}\nRelevant:"
LABELS = ["yes", "no"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


def catalogue(n=48) -> ranking.Catalogue:
    with open(DATA / "catalogue.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:n]
    return ranking.Catalogue([r["id"] for r in rows], [r["text"] for r in rows], [r["label"] for r in rows])


def queries(n=64) -> tuple[list[str], list[str]]:
    with open(DATA / "intent_dev.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:n]
    return [r["query"] for r in rows], [r["label"] for r in rows]


@pytest.fixture(scope="module")
def llama(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def scorer(llama):
    return Scorer(llama, TEMPLATE, LABELS, chat=False)


@pytest.fixture(scope="module")
def fitted(llama, scorer):
    q, l = queries()
    opts = FitOptions(epochs=6, lr=3e-3, val_fraction=0.0, seed=0)
    return fit_item_encoder(catalogue(), q, query_labels=l, model=llama, candidates=8,
                            eval_fraction=0.25, opts=opts, log=lambda m: None, progress=False,
                            scorer=scorer)


def test_fit_improves_agreement_over_the_untrained_map(fitted):
    _, info = fitted
    got = info["agreement"]["heldout_queries"]
    print(info["agreement"])
    assert got["trained"]["spearman"] > got["untrained"]["spearman"] + 0.1
    assert got["trained"]["ndcg@10"] > got["untrained"]["ndcg@10"]


def test_trained_encoder_records_its_base_and_training(fitted, scorer):
    enc, info = fitted
    assert enc.meta["base_model"] == base_hash(scorer.loaded)
    assert enc.meta["template"] == TEMPLATE and enc.meta["labels"] == LABELS
    assert info["history"][-1]["train_loss"] < info["history"][0]["train_loss"]


def test_student_scores_soft_tokens_as_the_scorer_does(llama, scorer):
    """What the fit trains (HF inputs_embeds, the slot's K/V shared) is what the product scores."""
    cat = catalogue(12)
    feats = item_features(scorer.loaded, cat.texts)
    g = torch.Generator().manual_seed(0)
    m = ItemMap(64, scale=2.0, mu=feats.mean(0), sd=feats.std(0))
    torch.nn.init.normal_(m.linear.weight, std=0.05, generator=g)
    with torch.no_grad():
        vecs = m(feats)
    student = Student(scorer, llama)
    for q in ["red dress", "牛仔裤 女"]:
        with torch.no_grad():
            ours = student.margins(q, vecs).numpy()
        ref = scorer_margins(scorer, [q], [list(vecs)])[0]
        assert np.abs(ours - ref).max() < 1e-4


@pytest.mark.parametrize("pooling", ["prompt", "mean", "last"])
def test_item_features_match_transformers(llama, scorer, pooling):
    """prompt: the read-out row of the scorer's prompt with the item in its slot and an empty query;
    mean / last: the item's text read alone; each beside its mean token embedding."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    texts = ["red wrap dress", "牛仔裤 女 高腰", "Anker power bank - 20000mAh"]
    got = item_features(scorer.loaded, texts, pooling, prompt=scorer.prompt)
    for t, row in zip(texts, got):
        alone = scorer.tokenizer(t, add_special_tokens=False)["input_ids"]
        ids = scorer.prompt.encode_ids([{"query": "", "item": t}])[0] if pooling == "prompt" else alone
        with torch.no_grad():
            h = hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            emb = hf.model.embed_tokens.weight[alone].mean(0)
        want = h.mean(0) if pooling == "mean" else h[-1]
        assert torch.allclose(row[:64], emb, atol=1e-5) and torch.allclose(row[64:], want, atol=1e-4)


def test_encoder_file_round_trips_and_refuses_another_base(fitted, scorer, tiny_model, tmp_path):
    enc, _ = fitted
    path = tmp_path / "enc.safetensors"
    enc.save(path)
    back = ItemEncoder.load(path)
    texts = catalogue(6).texts
    assert torch.equal(back.embed(scorer.loaded, texts), enc.embed(scorer.loaded, texts))
    assert back.meta["base_model"] == enc.meta["base_model"] and back.pooling == enc.pooling
    assert back.check_model(scorer.loaded) is back
    other = load(tiny_model("qwen2"), "cpu", torch.float32)
    with pytest.raises(ConfigError, match="fitted for base model"):
        back.check_model(other, str(path))


@pytest.mark.parametrize("kind,rank", [("linear", 8), ("mlp", 0)])
def test_every_map_round_trips(tmp_path, kind, rank):
    g = torch.Generator().manual_seed(1)
    m = ItemMap(16, kind, 32, 1.5, torch.randn(32, generator=g), torch.rand(32, generator=g) + 0.5, rank)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=g)
    ItemEncoder(m, "mean", meta={"base_model": "x"}).save(tmp_path / "e.safetensors")
    back = ItemEncoder.load(tmp_path / "e.safetensors")
    x = torch.randn(5, 32, generator=g)
    with torch.no_grad():
        assert torch.equal(back.map(x), m(x))
    assert (back.map.kind, back.map.rank, back.meta) == (kind, rank, {"base_model": "x"})


def test_unreadable_encoder_files(tmp_path):
    from prefixscore.item_table import write_table

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="not a readable safetensors"):
        ItemEncoder.load(bad)
    table = tmp_path / "table.safetensors"  # an item table, not an encoder
    write_table(table, ["a"], torch.zeros(1, 4))
    with pytest.raises(ConfigError, match="not a prefixscore item encoder"):
        ItemEncoder.load(table)
    with pytest.raises(ConfigError, match="no such item encoder"):
        ItemEncoder.load(tmp_path / "missing.safetensors")


def test_agreement_measures():
    t = np.random.default_rng(0).permutation(np.linspace(-1.0, 2.0, 20))
    assert ranking.ndcg(t, t) == 1.0 and ranking.ndcg(t * 3 + 1, t) == 1.0  # any order-keeping map
    assert ranking.ndcg(-t, t) < 0.3
    assert ranking.spearman(t, t) == pytest.approx(1.0) and ranking.spearman(-t, t) == pytest.approx(-1.0)
    a, b = [1, 2, 2, 3], [1, 2, 3, 4]  # ties take their average rank: ranks 1, 2.5, 2.5, 4
    assert ranking.spearman(a, b) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1])
    assert 0.3 < ranking.random_ndcg([t] * 5) < 0.7
    # gains graded from the teacher within each query: only the order of the student's scores counts
    assert ranking.agreement([t], [t]) == {"ndcg@10": 1.0, "spearman": 1.0, "ndcg@10_p": 1.0, "queries": 1}
    floor = ranking.random_order([t] * 5)
    assert abs(floor["spearman"]) < 0.2 and floor["ndcg@10_p"] > floor["ndcg@10"]


def test_candidates_mix_lexical_label_and_random_items():
    cat = catalogue(60)
    q, l = queries(6)
    pool = list(range(0, 60, 2))
    cands = ranking.candidates(q, cat, pool, 10, query_labels=l, seed=3)
    assert cands == ranking.candidates(q, cat, pool, 10, query_labels=l, seed=3)
    for c in cands:
        assert len(c) == len(set(c)) == 10 and set(c) <= set(pool)
