"""Several classifiers over one model (Classifier.many): they answer exactly what separately built
classifiers answer, share the weights and the engine, and report what each one adds."""
import random

import pytest
import torch

from prefixscore import Classifier
from prefixscore.errors import ConfigError

CATEGORY = dict(template="Which category is this query about? Answer with one label.\nquery: {query}",
                labels=["Dress", "Jeans", "Hoodie", "T-shirt", "Trench Coat"])
GENDER = dict(template="Who is this product for?\nquery: {query}\nAnswer:",
              labels=["women", "men", "kids", "unisex"])
WORDS = "red blue linen denim slim oversized kids women men summer cotton 连衣裙 501 hoodie".split()


def queries(seed, n=12):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(n)]


def same(a, b, tol):
    assert [r.label for r in a] == [r.label for r in b]
    for x, y in zip(a, b):
        assert x.scores.keys() == y.scores.keys()
        assert max(abs(x.scores[k] - y.scores[k]) for k in x.scores) <= tol


def check_many(path, device, dtype, tol, seed):
    many = Classifier.many({"category": CATEGORY, "gender": {**GENDER, "mode": "logprobs"}},
                           model=str(path), device=device, dtype=dtype, chat=False)
    alone = {n: Classifier(str(path), device=device, dtype=dtype, chat=False, **spec)
             for n, spec in (("category", CATEGORY), ("gender", GENDER))}
    cat, gen = many["category"], many["gender"]
    assert cat.loaded is gen.loaded and cat.engine is gen.engine  # one copy of the weights
    assert cat.prefix_kv is not gen.prefix_kv and cat.prompt.prefix_ids != gen.prompt.prefix_ids
    qs = queries(seed)
    # interleaved: one classifier's calls must not disturb the other's (shared graph pool on GPU)
    for q in qs[:4]:
        same([cat.classify(q)], [alone["category"].classify(q)], tol)
        same([gen.classify(q)], [alone["gender"].classify(q)], tol)
    same(cat.classify_batch(qs), alone["category"].classify_batch(qs), tol)
    same(gen.classify_batch(qs), alone["gender"].classify_batch(qs), tol)
    mem = gen.memory
    e = cat.engine  # every weight a forward reads: parameters, the fused QKV and gate/up, the head
    weights = [*e.model.parameters(), e.lm_head, e.model.inv_freq,
               *(w for layer in e.model.layers for w in (layer.self_attn.wqkv, layer.self_attn.bqkv,
                                                         layer.mlp.wgu, layer.mlp.bgu) if w is not None)]
    assert mem["model_bytes"] == sum({t.data_ptr(): t.numel() * t.element_size() for t in weights}.values())
    assert 0 < mem["prefix_kv"] and mem["label_rows"] == (
        len(gen.trie.columns) * cat.engine.config.hidden_size * (2 if dtype == "bfloat16" else 4))
    return many


def test_many_equals_separate_classifiers(tiny_model):
    check_many(tiny_model("qwen2"), "cpu", "float32", 1e-5, seed=random.randrange(1 << 30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_many_share_graph_pool_on_gpu(tiny_model):
    """bf16 on the GPU: graphs of both classifiers in one memory pool, replayed in turn; scores
    within bf16 noise of separately built classifiers (2e-2, DESIGN.md §5), decisions equal."""
    many = check_many(tiny_model("qwen2"), "cuda", "bfloat16", 2e-2, seed=random.randrange(1 << 30))
    assert many["category"].engine.pool is not None
    # the fused pass on the GPU: graphs over the bank (small batches) and eager (past them)
    from prefixscore.many import GRAPH_TOKENS, bank_of, decide_many

    clfs = [many["category"], many["gender"]]
    seed = random.randrange(1 << 30)
    for sizes in [(1, 1), (3, 2), (40, 30)]:
        batches = [c.encode_many(queries(seed + sum(sizes), n)) for c, n in zip(clfs, sizes)]
        for c, b, (best, scores) in zip(clfs, batches, decide_many(clfs, batches)):
            want_best, want_scores = c.decide_encoded(b)
            for d, w, r, ws in zip(best, want_best, scores, want_scores):
                assert max(abs(x - y) for x, y in zip(r, ws)) <= 5e-2
                top = sorted(ws, reverse=True)
                assert d == w or top[0] - top[1] <= 5e-2  # bf16 near-ties may flip
    assert bank_of(clfs).capture_info["buckets"][-1] == GRAPH_TOKENS


def test_many_refuses_bad_specs(tiny_model):
    path = str(tiny_model("qwen2"))
    for bad, match in [({}, "non-empty dict"), ({"": CATEGORY}, "non-empty string"),
                       ({"a": ["x"]}, "options are a dict"),
                       ({"a": {**CATEGORY, "model": path}}, "share one model"),
                       ({"a": {**CATEGORY, "adapter": "seed"}}, "share one model")]:
        with pytest.raises(ConfigError, match=match):
            Classifier.many(bad, model=path, device="cpu")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_pass_equals_classifiers_alone(tiny_model, arch):
    """decide_many: several classifiers' requests in one flat pass over the bank of their prefixes
    and label rows give the decisions and scores each classifier gives alone (fp32, 1e-5), for
    one request each, batches of several, a classifier with no requests, and multi-token labels."""
    from prefixscore.many import bank_of, decide_many
    from prefixscore.prompt import Encoded

    many = Classifier.many({"category": CATEGORY, "gender": GENDER,
                            "short": dict(template="{query}", labels=["yes", "no"])},
                           model=str(tiny_model(arch)), device="cpu", chat=False)
    clfs = list(many.values())
    seed = random.randrange(1 << 30)
    for sizes in [(1, 1, 1), (5, 3, 0), (0, 7, 2), (1, 0, 0)]:
        batches = [c.encode_many(queries(seed + sum(sizes), n)) if n else [] for c, n in zip(clfs, sizes)]
        fused = decide_many(clfs, batches)
        for c, b, (best, scores) in zip(clfs, batches, fused):
            if not b:
                assert (best, scores) == ([], [])
                continue
            want_best, want_scores = c.decide_encoded(b)
            assert best == want_best
            assert max(abs(x - y) for r, w in zip(scores, want_scores) for x, y in zip(r, w)) <= 1e-5
    # one request each reuses the plan of its layout (lengths, first positions): other tokens of the
    # same lengths must be read, not the first call's
    rng = random.Random(seed)
    first = [c.encode_many(queries(seed, 1)) for c in clfs]
    layouts = len(bank_of(clfs).layouts)
    for _ in range(3):
        batches = [[Encoded(b[0].values, None, b[0].ids[:b[0].start] + [rng.randrange(1000) for _ in
                                                                          b[0].ids[b[0].start:]],
                            b[0].start)] for b in first]
        for c, b, got in zip(clfs, batches, decide_many(clfs, batches)):
            want_best, want_scores = c.decide_encoded(b)
            assert got[0] == want_best
            assert max(abs(x - y) for x, y in zip(got[1][0], want_scores[0])) <= 1e-5
    assert len(bank_of(clfs).layouts) <= layouts + 1  # one more layout at most, built once


def test_classifiers_asked_together(tiny_model):
    """Classifier.many's dict asks several classifiers at once (one fused pass while it fits the
    bank's graphs, else each in turn): the same Results as each classifier's own classify, keyed
    by name in the order asked; clear errors for unknown names and a bare string."""
    from prefixscore.errors import ConfigError, InputError
    from prefixscore.many import GRAPH_TOKENS

    many = Classifier.many({"category": CATEGORY, "gender": GENDER}, model=str(tiny_model("qwen2")),
                           device="cpu", chat=False)
    qs = queries(random.randrange(1 << 30), 5)
    long = [" ".join(["oversized"] * 40)] * (GRAPH_TOKENS // 20)  # past the bank: in turn
    for batch in (qs[:1], qs, long):
        got = many.classify_batch(batch, names=["gender", "category"])
        assert [list(r) for r in got] == [["gender", "category"]] * len(batch)
        for name in ("gender", "category"):
            same([r[name] for r in got], many[name].classify_batch(batch), 1e-5)
    one = many.classify(qs[0])
    assert list(one) == ["category", "gender"]
    same([one["gender"]], [many["gender"].classify(qs[0])], 1e-5)
    with pytest.raises(ConfigError, match="unknown classifier 'brand'"):
        many.classify("x", names=["brand"])
    with pytest.raises(InputError, match="list of strings"):
        many.classify_batch("levis 501")
