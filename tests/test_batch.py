"""Flat batch plan (batch.py) against a per-token Python reference of the layout, on random batches:
the one-request path and the many-request path."""
import dataclasses
import os
import random

import pytest
import torch

from prefixscore.batch import plan_classify
from prefixscore.labels import LabelTrie
from tests.helpers import eager_graphs


def reference(suffixes, starts, paths, allowed):
    cols = {k: [] for k in ("tokens", "positions", "base_start", "base_end", "own_start")}
    rows, r0 = [], 0
    for s, p in zip(suffixes, starts):
        n = len(s)
        for j, t in enumerate(s):
            for k, v in zip(cols, (t, p + j, r0, r0, r0)):
                cols[k].append(v)
        rows.append(r0 + n - 1)
        at = r0 + n
        for path in paths:
            for j, t in enumerate(path):
                for k, v in zip(cols, (t, p + n + j, r0, r0 + n, at)):
                    cols[k].append(v)
            at += len(path)
            rows.append(at - 1)
        r0 = at
    return cols, rows, allowed.repeat(len(suffixes), 1)


@pytest.mark.parametrize("branches", [True, False])
@pytest.mark.parametrize("B", [1, 2, 7, 64])
def test_plan_matches_reference(smol_tokenizer, B, branches):
    labels = ["Dress", "Jeans", "T-shirt", "Trench Coat", "Hoodie", "Hat"]
    encode = lambda t: smol_tokenizer(t, add_special_tokens=False)["input_ids"]
    trie = LabelTrie.build(smol_tokenizer, labels, "query: x", encode)
    rng = random.Random(B)
    for _ in range(5):
        suffixes = [[rng.randrange(50000) for _ in range(rng.randint(1, 40))] for _ in range(B)]
        starts = [rng.choice([0, 17, 73]) for _ in range(B)]
        plan = plan_classify(suffixes, starts, trie, branches=branches)
        paths = trie.branch_paths() if branches else []
        cols, rows, allowed = reference(suffixes, starts, paths, trie.allowed)
        for k, want in cols.items():
            assert getattr(plan, k).tolist() == want, k
        assert plan.rows.tolist() == rows
        assert torch.equal(plan.allowed, allowed)
        assert plan.seg_offsets.tolist()[-1] == plan.num_tokens and plan.batch == B


def test_graph_runner_buffers_on_cpu(tiny_model, monkeypatch):
    """The graph runner's bookkeeping (one input and one output byte buffer, per-bucket views,
    padding) on the CPU, with each 'graph' replayed as an eager call of the captured body: a run
    through it equals the eager engine call, for batches in several buckets and in a row (stale
    buffer contents from a bigger batch must not leak into a smaller one)."""
    from prefixscore.engine import Engine
    from prefixscore.graphs import GraphRunner
    from prefixscore.kernels.options import KernelOptions
    from prefixscore.weights.loading import load
    from prefixscore.prompt import Prompt

    loaded = load(tiny_model("qwen2"), "cpu", torch.float32)
    # a GPU host: the copy kernel needs CUDA tensors (test_copy_bytes runs it there)
    engine = Engine(loaded, KernelOptions(graph_copies=os.environ.get("TRITON_INTERPRET") == "1"))
    prompt = Prompt(loaded.tokenizer, "Is this a question? {query}", chat=False)
    trie = LabelTrie.build(loaded.tokenizer, [" yes", " no", " maybe so"],
                           prompt.render(query="x"), prompt.encode_text)
    prefix = engine.prefill(prompt.prefix_ids)
    weight = engine.label_weight(trie.columns)
    wire = eager_graphs(monkeypatch)
    runner = wire(GraphRunner(engine, prefix, weight, True, 64))
    assert sorted(set(wire.captured)) == runner.buckets == [1, 2, 4, 8, 16, 32, 64]
    rng = random.Random(0)
    used = set()
    for B in (6, 1, 3, 1):
        queries = ["".join(rng.choice("abcdef ") for _ in range(rng.randint(1, 12))) + "?" for _ in range(B)]
        enc = [prompt.encode(query=q) for q in queries]
        plan = plan_classify([e.ids[e.start:] for e in enc], [e.start for e in enc], trie)
        got = runner.run(plan)
        used.add(next(b for b in runner.buckets if b >= plan.num_tokens))
        want = engine.launch(plan, prefix, weight, True)()
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[1], want[1]) and got[0].shape == (plan.rows.shape[0], len(trie.columns))
    assert len(used) >= 2, used
    # One-request plans reuse the filled input of their layout (GraphRunner.images), tokens
    # rewritten: the input must equal a fresh fill's (layout=None), also after a longer plan left
    # stale tokens behind, and a layout that differs in its first position or its allowed rows
    # only must get its own image.
    P, vocab_size = len(prompt.prefix_ids), loaded.model.config.vocab_size
    seen = set()
    for n, start, all_allowed in ((3, P, False), (5, P, False), (3, P, False), (3, 0, False),
                                  (9, P, False), (3, P, True), (5, P, False), (3, 0, False)):
        plan = plan_classify([[rng.randrange(vocab_size) for _ in range(n)]], [start], trie)
        if all_allowed:  # as a trained head's plan (heads.py)
            plan = dataclasses.replace(plan, allowed=torch.ones_like(plan.allowed))
        images = len(runner.images)
        got = runner.run(plan)
        key = (n, start, all_allowed)
        assert len(runner.images) == images + (key not in seen), key  # filled once per layout
        seen.add(key)
        n_in = runner._in_bytes(runner.bucket_of[plan.num_tokens])  # (the slots differ past it)
        cached = runner.host_in[:n_in].clone()
        fresh = runner.run(dataclasses.replace(plan, layout=None))
        assert torch.equal(cached, runner.host_in[:n_in]), key
        assert torch.equal(got[0], fresh[0]) and torch.equal(got[1], fresh[1])
        want = engine.launch(plan, prefix, weight, True)()
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    # Staged: passes launched back to back use the two slots in turn, each collected later from
    # its own slot; a third launch collects the oldest first (its slot is refilled).
    plans = [plan_classify([[rng.randrange(vocab_size) for _ in range(n)] for n in ns], [P] * len(ns), trie)
             for ns in ((3,), (2, 5), (7,), (1, 1, 1))]
    alone = [runner.run(p) for p in plans]
    finishes = [runner.launch(p) for p in plans]
    for (scores, best), (s2, b2) in zip(alone, (f() for f in finishes)):
        assert torch.equal(scores, s2) and torch.equal(best, b2)
    assert runner.inflight == [None, None]
    # A vocabulary runner (SGLang's default /v1/score mode): any label tokens, up to N of them,
    # as an input; each read-out row's probabilities under the whole vocabulary, as eagerly.
    vocab = wire(GraphRunner(engine, prefix, None, False, 64, vocab=5))
    for ns, tokens in (((3,), [5, 9]), ((2, 6, 1), [7, 11, 13, 17, 19]), ((4,), [23])):
        plan = plan_classify([[rng.randrange(vocab_size) for _ in range(n)] for n in ns], [P] * len(ns), trie)
        got = vocab.run(plan, tokens)[0][:, :len(tokens)]
        want = engine.vocab_probs(plan, prefix, tokens)
        assert got.shape == want.shape == (plan.rows.shape[0], len(tokens))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_scores_do_not_depend_on_the_bucket():
    """One request replayed in every bucket of up to 16 tokens that holds it: bitwise the same
    scores. Padding tokens and the bucket's size must not reach a real row (up to 16 tokens the
    kernels' tiles and K splits are the same; Triton's T % 16 == 0 variant once summed a row's norm
    in another order). Past 16 the tiles change with T, and so may the last bits. Qwen2.5-0.5B
    widths, 6 layers of random weights, 48 requests: the difference showed from layer 8 of 24."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from prefixscore.weights.model_config import ModelConfig
    from prefixscore.engine import Engine
    from prefixscore.kernels.options import KernelOptions
    from prefixscore.weights.loading import from_tensors

    cfg = AutoConfig.for_model("qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                               num_key_value_heads=2, num_hidden_layers=6, vocab_size=4096,
                               max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # std 0.02 like HF's init, norms around 1
        for n, p in hf.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in n else p.normal_(0, 0.02)
    loaded = from_tensors(ModelConfig.from_hf(cfg), hf.state_dict(), None, "random",
                          torch.device("cuda"), torch.bfloat16)
    engine = Engine(loaded, KernelOptions.from_env())
    trie = LabelTrie([str(t) for t in range(100, 109)], [[t] for t in range(100, 109)], None)
    prefix = engine.prefill(list(range(200, 248)))
    weight = engine.label_weight(trie.columns)
    engine.capture(prefix, weight, True, 64)
    runner = engine.graphs[(id(prefix), id(weight), True)]
    rng = random.Random(3)
    for _ in range(48):
        n = rng.randint(1, 16)
        plan = plan_classify([[rng.randrange(4096) for _ in range(n)]], [48], trie)
        own, outs = runner.bucket_of[n], {}
        for Tb in (b for b in runner.buckets if n <= b <= 16):
            runner.bucket_of[n] = Tb
            outs[Tb] = runner.run(plan)
        runner.bucket_of[n] = own
        first = outs[own]
        for Tb, (scores, best) in outs.items():
            assert torch.equal(scores, first[0]) and torch.equal(best, first[1]), (n, Tb)
    # Staged launches (the engine loop's): passes queued back to back, each slot's graph reading
    # its own pinned input while the one before runs, collected later: bitwise each alone.
    plans = [plan_classify([[rng.randrange(4096) for _ in range(rng.randint(1, 16))] for _ in range(b)],
                           [48] * b, trie) for b in (1, 1, 3, 2, 1, 4, 1, 1)]
    alone = [runner.run(p) for p in plans]
    finishes = [engine.launch(p, prefix, weight, True) for p in plans]
    for (scores, best), (s2, b2) in zip(alone, (f() for f in finishes)):
        assert torch.equal(scores, s2) and torch.equal(best, b2)
