"""Items as embeddings (one soft token in the item's slot) against transformers' inputs_embeds on
the same sequence: the prompt before the slot, the vector, the prompt after it. Every architecture,
text and embedding items mixed in one request, every item form, and the errors that name the item."""
import base64
import random

import numpy as np
import pytest
import torch

from tests.helpers import ARCHS, random_queries
from tests.test_scorer import (  # noqa: F401
    LABELS, TEMPLATES, assert_matches_hf, hf_trie, models, random_items)
from prefixscore import InputError
from prefixscore.item_table import write_table
from prefixscore.weights.loading import base_hash
from prefixscore.score_input import SOFT
from prefixscore.scorer import Scorer


def vectors(sc, n, seed):
    """Random vectors at the scale of the model's own token embeddings."""
    g = torch.Generator().manual_seed(seed)
    emb = sc.loaded.model.embed_tokens.weight
    return [torch.randn(emb.shape[1], generator=g) * emb.float().std().item() for _ in range(n)]


def mixed_requests(sc, n, seed):
    rng = random.Random(seed)
    out = []
    for q in random_queries(n, seed):
        items = random_items(rng, rng.randint(1, 6))
        vecs = iter(vectors(sc, len(items), rng.randrange(1 << 30)))
        out.append((q, [next(vecs) if rng.random() < 0.6 else it for it in items]))
    return out


def check_mixed(sc, hf, requests):
    """Our scores and decisions against HF on each item's sequence (prep.full: SOFT where a vector
    stands), the vector through inputs_embeds."""
    prompts, soft = [], []
    for q, items in requests:
        prep = sc.prepare(q, items)
        prompts += prep.full
        soft += prep.soft if prep.soft is not None else [None] * len(items)
    ours = [r for res in sc.score_batch(requests) for r in res]
    ref, greedy = hf_trie(hf, prompts, sc.trie, soft=soft)
    assert_matches_hf(sc, ours, ref, greedy, [str(p) for p in prompts])
    return ours


@pytest.mark.parametrize("arch", ARCHS)
def test_embedding_items_match_inputs_embeds(arch, models):
    ours, hf, _ = models(arch)
    template, chat = TEMPLATES["chat" if arch == "qwen2" else "query_first"]
    sc = Scorer(ours, template, LABELS, chat=chat)
    requests = mixed_requests(sc, 6, seed=hash(arch) % 1000)
    assert any(not isinstance(i, str) for _, items in requests for i in items)
    check_mixed(sc, hf, requests)


@pytest.mark.parametrize("layout", ["packed", "alone"])
def test_layouts_and_item_first(layout, models):
    ours, hf, _ = models("llama")
    for name in ("query_first", "item_first"):
        template, chat = TEMPLATES[name]
        sc = Scorer(ours, template, ["yes", "no"], chat=chat, layout=layout)
        check_mixed(sc, hf, mixed_requests(sc, 4, seed=7))


def test_every_item_form_gives_the_same_scores(models, tmp_path):
    ours, _, _ = models("qwen3")
    v = vectors(Scorer(ours, "Is {item} right for {query}?", ["yes", "no"], chat=False), 1, 3)[0]
    half = v.half()
    table = tmp_path / "items.safetensors"
    write_table(table, ["sku-1", 42], torch.stack([half, half]), {"base_model": base_hash(ours)})
    sc = Scorer(ours, "Is {item} right for {query}?", ["yes", "no"], chat=False, item_table=table)
    forms = [half, half.numpy(), {"embedding": half.float().tolist()},
             {"embedding": base64.b64encode(half.numpy().tobytes()).decode()},
             {"embedding": base64.b64encode(half.float().numpy().tobytes()).decode(), "dtype": "float32"},
             {"embedding": base64.b64encode(half.bfloat16().view(torch.int16).numpy().tobytes()).decode(),
              "dtype": "bfloat16"},
             {"id": "sku-1"}, {"id": 42}]
    res = sc.score("red dress", forms + ["a red dress", {"text": "a red dress"}])
    first = res[0].scores
    for r in res[:6] + res[6:8]:
        if r.item is forms[5]:  # bf16 rounds the fp16 values: close, not equal
            assert max(abs(r.scores[k] - first[k]) for k in first) < 1e-2
        else:
            assert r.scores == pytest.approx(first, abs=1e-6), r.item
    assert res[-1].scores == pytest.approx(res[-2].scores, abs=1e-6)  # {"text"} is the text
    assert res[0].item is forms[0] and res[6].item == {"id": "sku-1"}  # items come back as given


def test_one_soft_token_in_the_slot(models):
    ours, _, _ = models("llama")
    template, chat = TEMPLATES["query_first"]
    sc = Scorer(ours, template, ["yes", "no"], chat=chat)
    prep = sc.prepare("blue jeans", [vectors(sc, 1, 0)[0], "jeans"])
    (soft_ids, text_ids), shared = prep.full, prep.shared
    assert soft_ids.count(SOFT) == 1 and SOFT not in text_ids
    at = soft_ids.index(SOFT)
    assert soft_ids[:at] == shared  # the query part the text items share
    tail = sc.tokenizer(template.split("{item}")[1], add_special_tokens=False)["input_ids"]
    assert soft_ids[at + 1:] == tail
    assert prep.soft[1] is None and prep.items[1] == "jeans"


def test_bad_embedding_items_name_the_item(models):
    ours, _, _ = models("llama")
    sc = Scorer(ours, "Is {item} right for {query}?", ["yes", "no"], chat=False)
    H = sc.config.hidden_size
    ok = [0.0] * H
    cases = [
        ([0.0] * (H - 1), "items[1]: the embedding has 63 values, the model's hidden size is 64"),
        ({"embedding": [0.0] * (H + 1)}, "items[1]: the embedding has 65 values"),
        ({"embedding": base64.b64encode(np.zeros(H, np.float32).tobytes()).decode()},
         "items[1]: the embedding has 128 values"),  # float32 bytes read as float16
        ({"embedding": "not base64!"}, "items[1]: the embedding is not valid base64"),
        ({"embedding": base64.b64encode(b"abc").decode()}, "not a whole number of float16 values"),
        ({"embedding": ok[:-1] + [float("nan")]}, "items[1]: the embedding has a value that is not a finite"),
        ({"embedding": ["x"] * H}, "items[1]: the embedding must be a non-empty list of numbers"),
        ({"embedding": "AAAA", "dtype": "int8"}, "items[1]: dtype 'int8'"),
        ({"embedding": ok, "dtype": "float16"}, "dtype is for base64 embeddings"),
        ({"id": "sku-1"}, "items[1]: an item by id needs an item table"),
        ({"vector": ok}, "items[1]: an item is a string"),
        (np.zeros((2, H), np.float32), "items[1]: an embedding item is a 1-D float vector"),
        (torch.zeros(H, dtype=torch.int64), "items[1]: an embedding item is a 1-D float vector"),
        (7, "items[1] must be a string or an embedding item"),
    ]
    for bad, msg in cases:
        item = np.asarray(bad, np.float32) if isinstance(bad, list) else bad
        with pytest.raises(InputError, match=None) as e:
            sc.score("jeans", ["fine", item])
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(InputError, match="items\\[0\\]: id 'nope' is not in the item table"):
        from prefixscore.item_table import ItemTable
        sc.item_table = ItemTable(["a"], torch.zeros(1, H))
        sc.score("jeans", [{"id": "nope"}])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_embedding_items(tiny_model):
    """On the GPU in bf16 (the fused path: layer 0's norm reads sums of squares the embedding
    kernel leaves, which the override must replace): probabilities as close to HF fp32 (on the
    CPU, through inputs_embeds) as twice HF bf16's own distance from it, at least 2e-2 (the bound
    bench.gpu's correctness check uses; 2e-2 alone failed on the H200 by 4e-5 for llama),
    decisions equal where HF's top two are further apart."""
    from transformers import AutoModelForCausalLM

    from prefixscore.weights.loading import load

    for arch in ARCHS:
        path = tiny_model(arch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        template, chat = TEMPLATES["query_first"]
        sc = Scorer(load(path, "cuda", torch.bfloat16), template, [" yes", " no", " maybe"],
                    chat=chat, mode="softmax")
        requests = mixed_requests(sc, 16, seed=ARCHS.index(arch))
        prompts, soft = [], []
        for q, items in requests:
            prep = sc.prepare(q, items)
            prompts += prep.full
            soft += prep.soft if prep.soft is not None else [None] * len(items)
        ours = torch.tensor([[r.scores[l] for l in sc.labels] for res in sc.score_batch(requests)
                             for r in res])
        ref = torch.tensor(hf_trie(hf, prompts, sc.trie, soft=soft)[0]).exp()
        ref16 = torch.tensor(hf_trie(hf.to(torch.bfloat16), prompts, sc.trie, soft=soft)[0]).exp()
        bound = max(2 * (ref16 - ref).abs().max().item(), 2e-2)
        assert (ours - ref).abs().max() <= bound, (arch, bound)
        top2 = ref.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 4e-2
        assert (ours.argmax(-1) == ref.argmax(-1))[clear].all(), arch


def test_cli_score_with_an_item_table(models, tmp_path, capsys):
    """`prefixscore score --item-table`: JSONL requests mixing text, {"id"} and {"embedding"}
    items; the same scores as the Scorer; an unknown id is one line naming file, line and item."""
    import json

    from prefixscore.cli.commands import main

    ours, _, path = models("qwen2")
    template = TEMPLATES["query_first"][0]
    sc = Scorer(ours, template, ["yes", "no"], chat=False, mode="softmax")
    v = vectors(sc, 2, 5)
    table = tmp_path / "items.parquet"
    write_table(table, ["a", "b"], torch.stack(v), {"base_model": base_hash(ours)})
    items = ["red silk dress", {"id": "b"}, {"embedding": v[0].tolist()}]
    src = tmp_path / "req.jsonl"
    src.write_text(json.dumps({"query": "red dress", "items": items}) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["score", "-i", str(src), "-o", str(out), "--model", str(path), "--device", "cpu",
            "--template", template, "--no-chat", "--labels", "yes,no", "--mode", "softmax",
            "--item-table", str(table)]
    assert main(args) == 0
    got = json.loads(out.read_text())["scores"]
    want = [[r.scores[l] for l in sc.labels] for r in sc.score("red dress", ["red silk dress", v[1], v[0]])]
    assert np.allclose(got, want, atol=1e-5)
    src.write_text(json.dumps({"query": "red dress", "items": ["x", {"id": "zzz"}]}) + "\n")
    out.unlink()
    assert main(args) == 2
    assert f"{src}:1: items[1]: id 'zzz' is not in the item table" in capsys.readouterr().err


def test_depth_returns_embedding_items_as_given(models):
    ours, _, _ = models("llama")
    sc = Scorer(ours, "Is {item} right for {query}?", ["yes", "no"], chat=False)
    v = vectors(sc, 3, 1)
    res = sc.score("jeans", [v[0], "blue jeans", v[1], v[2]], depth=2)
    assert [r.scored for r in res] == [True, True, False, False]
    assert res[0].item is v[0] and res[2].item is v[1] and res[3].item is v[2]


def test_a_table_for_another_model_is_refused(models, tmp_path):
    """A table records the base model it was made for (embed-items writes base_model): another
    base or another hidden size is a ConfigError when the Scorer loads it."""
    from prefixscore import ConfigError

    ours, _, _ = models("llama")
    other, _, _ = models("qwen2")
    H = ours.model.config.hidden_size
    good = tmp_path / "good.safetensors"
    write_table(good, ["a"], torch.zeros(1, H), {"base_model": base_hash(ours)})
    assert Scorer(ours, "Is {item} right for {query}?", ["yes", "no"], chat=False,
                  item_table=good).item_table.ids == ["a"]
    with pytest.raises(ConfigError, match="was made for base model"):
        Scorer(other, "Is {item} right for {query}?", ["yes", "no"], chat=False, item_table=good)
    wide = tmp_path / "wide.parquet"
    write_table(wide, ["a"], torch.zeros(1, H + 1))
    with pytest.raises(ConfigError, match=f"its vectors have {H + 1} values"):
        Scorer(ours, "Is {item} right for {query}?", ["yes", "no"], chat=False, item_table=wide)
    for name in ("bare.parquet", "bare.safetensors"):  # no record of its model: refused, not guessed
        write_table(tmp_path / name, ["a"], torch.zeros(1, H))
        with pytest.raises(ConfigError, match=f"does not record the base model.*{base_hash(ours)}"):
            Scorer(ours, "Is {item} right for {query}?", ["yes", "no"], chat=False,
                   item_table=tmp_path / name)
