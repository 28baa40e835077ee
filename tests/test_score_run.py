"""A score request a pass at a time (score_run.ScoreRun, the engine loop's unit of multi-item work)
against the unchunked path (Scorer.score_call: the query part in the same pass as its items), on a
tiny random Llama in fp32 with fresh random inputs.

Chunking the query part changes only the order of sums (a chunk's attention reads the rows before
it from the K/V, then its own, merged by log-sum-exp), so scores agree to fp32 rounding, not
bitwise: a few ulps of each activation, over a few layers, at scores of size ~1: 1e-5."""
import numpy as np
import pytest
import torch

from prefixscore import Scorer
from prefixscore.score_input import Prepared, ScoreCall
from prefixscore.score_run import CHUNK_MIN

ATOL = 1e-5


@pytest.fixture(scope="module", params=["own", "bank"])
def scorer(tiny_model, request):
    """own: each long request's K/V a buffer of its own (the eager path); bank: regions of the
    engine's K/V bank, its rows named by index in every pass (as the GPU's graphs take them)."""
    sc = Scorer(tiny_model("llama"), "Is the item relevant? Query: {query}{item}", ["yes", "no"],
                chat=False, device="cpu", dtype=torch.float32)
    if request.param == "bank":
        sc.engine.make_bank(700)
    return sc


def run_all(sc, body, tokens, depth=None):
    run = sc.begin(sc.input.parse(body), depth, tokens)
    steps = []
    while not run.finished:
        steps.append((run.filling, run.step(tokens)))
    return run, steps


def check(a, b):
    sa, sb = np.asarray(a["scores"]), np.asarray(b["scores"])
    assert sa.shape == sb.shape
    assert np.abs(sa - sb).max() < ATOL, np.abs(sa - sb).max()


@pytest.mark.parametrize("softmax", [True, False])
def test_long_token_query_chunked_equals_one_pass(scorer, softmax):
    rng = np.random.default_rng()
    query = rng.integers(10, 2000, 380).tolist()  # (the tiny model's context: 512)
    items = [rng.integers(10, 2000, rng.integers(1, 9)).tolist() for _ in range(7)]
    body = {"query": query, "items": items, "apply_softmax": softmax, "label_token_ids": [5, 9]}
    want = scorer.score_request(body)
    run, steps = run_all(scorer, body, tokens=100)
    check(run.answer(), want)
    chunks = [cost for filling, cost in steps if filling]
    # the query part (it does not start with the pinned prefix: from position 0) in chunks of the
    # budget, then the items against its K/V: each item's tokens once, the query part once
    assert chunks == [100, 100, 100, 80] and run.kv.filled == 380
    assert run.computed == 380 + sum(map(len, items)) <= want["usage"]["prompt_tokens"]


def test_text_query_and_items_that_merge_across_the_slot(scorer):
    """The template puts the item right after the query, so an item's text may merge with the
    query's last word (" shoe" + "s"): chunked, each item still sees its own prompt's tokens."""
    words = ["red", "blue", "shoe", "dress", "running", "coat", "green", "wool"]
    rng = np.random.default_rng()
    query = " ".join(rng.choice(words, 120)) + " shoe"
    items = ["s for running", " trail", "laces", " yoga mat", "box", " x"]
    body = {"query": query, "items": items, "apply_softmax": True}
    want = scorer.score_request(body)
    run, steps = run_all(scorer, body, tokens=120)
    assert any(f for f, _ in steps)
    check(run.answer(), want)


def test_items_that_share_less_of_the_query_part(scorer):
    """Items whose prompts leave the query part early (what a tokenizer merge across the slot
    does, here deeper than any real one) attend to that many rows of the request's K/V (causal:
    exactly the rows their own prompts give) and compute the rest of their prompt themselves."""
    rng = np.random.default_rng()
    P = scorer.prefix_ids
    query = rng.integers(10, 2000, 300).tolist()
    tail = lambda n: rng.integers(10, 2000, n).tolist()  # noqa: E731
    full = [P + query + tail(3), P + query[:250] + tail(6), P + query + tail(2),
            P + query[:10] + tail(4), P + query + tail(5)]
    prep = Prepared(full, full, P + query)
    call = ScoreCall(None, prep, None, [5, 9], True)
    want = scorer.score_call(call)
    run = scorer.begin(call, tokens=100)
    while not run.finished:
        run.step(100)
    assert run._plan[2] == 300 and run.kv.filled == len(P) + 300
    check(run.answer(), want)


def test_embedding_items_after_a_chunked_query(scorer):
    rng = np.random.default_rng()
    H = scorer.config.hidden_size
    query = " ".join(rng.choice(["red", "blue", "shoe", "dress", "coat"], 250))
    items = [torch.randn(H).numpy(), "a wool coat", torch.randn(H).numpy()]
    body = {"query": query, "items": items, "apply_softmax": True}
    want = scorer.score_request(body)
    run, steps = run_all(scorer, body, tokens=100)
    assert sum(f for f, _ in steps) == 3
    check(run.answer(), want)


def test_short_query_runs_items_with_it_and_depth_stops_early(scorer):
    """A query part under a chunk stays in every run of items (the pinned prefix's graphs), and
    only the first `depth` items run."""
    rng = np.random.default_rng()
    query = rng.integers(10, 2000, CHUNK_MIN).tolist()
    items = [rng.integers(10, 2000, 5).tolist() for _ in range(10)]
    body = {"query": query, "items": items, "apply_softmax": True, "label_token_ids": [5, 9]}
    want = scorer.score_request(body)
    run, steps = run_all(scorer, body, tokens=CHUNK_MIN + 10, depth=6)
    assert run.kv is None and not any(f for f, _ in steps)
    assert len(steps) == 3 and run.done == 6  # two items a run: the query part, then 5 + 5
    assert np.abs(np.asarray(run.answer()["scores"]) - np.asarray(want["scores"][:6])).max() < ATOL


def test_chunks_shrink_as_the_kv_fills(scorer):
    """With a cost per K/V row, a chunk's tokens weighed by the rows they attend to stay within
    the budget: later chunks are shorter (never under CHUNK_MIN)."""
    query = list(range(10, 450))
    body = {"query": query, "items": [[5]], "apply_softmax": True, "label_token_ids": [5, 9]}
    sizes, tokens, w = [], 100, 1 / 400
    run = scorer.begin(scorer.input.parse(body), tokens=tokens)
    while run.filling:
        before = run.kv.filled
        cost = run.step(tokens, kv_weight=w)
        sizes.append(run.kv.filled - before)
        assert cost <= tokens * 1.01 or sizes[-1] <= CHUNK_MIN  # (the floor, or the last piece)
    assert sizes[0] == 100 and sizes == sorted(sizes, reverse=True) and min(sizes[:-1]) >= CHUNK_MIN
    assert sum(sizes) == 440 and len(set(sizes)) > 2


@pytest.fixture(scope="module")
def gpu_scorer(tiny_model):
    return Scorer(tiny_model("qwen2"), "Is the item relevant? Query: {query}{item}", ["yes", "no"],
                  chat=False, device="cuda", dtype=torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("softmax,labels", [(True, "own"), (True, [5, 9]), (False, [5, 9])])
def test_gpu_chunked_query_part(gpu_scorer, softmax, labels):
    """On the GPU (Triton attention over the request's K/V in the engine's bank, bf16): chunked
    against one pass, within bf16 rounding compounded over the layers (0.02 of a probability;
    vocabulary probabilities: 0.1 in log). The chunks replay the bank's extend graphs, the items
    its graphs for the scorer's own labels, for any label set under softmax, or for the
    vocabulary mode."""
    sc = gpu_scorer
    bank = sc.engine.bank
    replayed = []
    for key, g in sc.engine.graphs.items():
        if key[0] == id(bank.kv):
            for graphs in g.slot_graphs.values():
                for graph in graphs:
                    replay = graph.replay
                    graph.replay = lambda replay=replay, key=key: replayed.append(key[1]) or replay()
    rng = np.random.default_rng()
    query = rng.integers(10, 2000, 400).tolist()
    items = [rng.integers(10, 2000, rng.integers(1, 9)).tolist() for _ in range(9)]
    body = {"query": query, "items": items, "apply_softmax": softmax,
            **({} if labels == "own" else {"label_token_ids": labels})}
    want = np.asarray(sc.score_request(body)["scores"])
    run, steps = run_all(sc, body, tokens=128)
    got = np.asarray(run.answer()["scores"])
    assert sum(f for f, _ in steps) == 4 and run.kv.bank is bank and bank.used == {}
    assert "extend" in replayed
    kind = id(sc.head.weight) if labels == "own" else "labels" if softmax else "vocab"
    assert set(replayed) == {"extend", kind}, replayed
    if softmax:
        assert np.abs(got - want).max() <= 0.02
    else:
        assert np.abs(np.log(got) - np.log(want)).max() <= 0.1


@pytest.mark.parametrize("mode", ["logprobs", "logits"])
def test_long_classify_prompt_in_chunks(tiny_model, mode):
    """PromptRun: a classify prompt prefilled a chunk a pass, its last tokens with the label head
    and the trie's branches (multi-token labels that share first tokens), against
    decide_encoded of the whole prompt."""
    from prefixscore import Classifier
    from prefixscore.score_run import PromptRun

    labels = ["Trench Coat", "T-shirt", "Jeans", "Dress"] if mode == "logprobs" else ["Jeans", "Dress", "Shirt"]
    clf = Classifier(tiny_model("llama"), template="Which label fits the query? query: {query}",
                     labels=labels, chat=False, mode=mode, device="cpu", dtype=torch.float32)
    words = ["red", "blue", "shoe", "dress", "running", "coat", "green", "wool"]
    query = " ".join(np.random.default_rng().choice(words, 300))
    enc = clf.encode(query)
    (want_best,), (want,) = clf.decide_encoded([enc])
    run = PromptRun(clf, enc.ids, enc.start)
    while not run.finished:
        run.step(100)
    best, got = run.answer
    assert run.passes == -(-(len(enc.ids) - enc.start) // 100) and run.kv.filled < len(enc.ids)
    assert best == want_best and np.abs(np.asarray(got) - np.asarray(want)).max() < ATOL


@pytest.mark.parametrize("softmax", [True, False])
def test_bank_passes_through_graph_runners(tiny_model, monkeypatch, softmax):
    """A long request over the engine's K/V bank, its chunks and items replayed by the bank's graph
    runners (on the CPU: each 'graph' its captured body, run eagerly): padding tokens write only
    the bank's trash row, the chunks fill the request's region as the eager path does, and the
    answer equals the unchunked one. A second request that finds no room runs on a K/V of its
    own; the first's region goes back when it finishes."""
    from prefixscore.graphs import GraphRunner
    from tests.helpers import eager_graphs

    sc = Scorer(tiny_model("llama"), "Is the item relevant? Query: {query}{item}", ["yes", "no"],
                chat=False, device="cpu", dtype=torch.float32)
    eng = sc.engine
    bank = eng.make_bank(500)
    wire = eager_graphs(monkeypatch)
    runners = {(id(bank.kv), "extend"): GraphRunner(eng, bank.kv, None, False, 64, True, write_kv=bank.trash),
               (id(bank.kv), id(sc.head.weight), True): GraphRunner(eng, bank.kv, sc.head.weight, True, 64, True),
               (id(bank.kv), "vocab"): GraphRunner(eng, bank.kv, None, False, 64, True, vocab=4)}
    launched = []
    for key, r in runners.items():
        wire(r)
        launch = r.launch
        r.launch = lambda *a, key=key, launch=launch: launched.append(key[1]) or launch(*a)
    eng.graphs.update(runners)
    rng = np.random.default_rng()
    bodies = [{"query": rng.integers(10, 2000, 300).tolist(),
               "items": [rng.integers(10, 2000, rng.integers(1, 9)).tolist() for _ in range(5)],
               "apply_softmax": softmax, **({} if softmax else {"label_token_ids": [5, 9]})}
              for _ in range(2)]  # (softmax: the scorer's own labels, whose graphs it has)
    wants = [sc.score_request(b) for b in bodies]
    before = [k.clone() for k, _ in bank.kv]
    runs = [sc.begin(sc.input.parse(b), tokens=60) for b in bodies]
    assert runs[0].kv.bank is bank and runs[1].kv.bank is None  # 2 x 300 rows: no room for both
    while not all(r.finished for r in runs):
        for r in runs:
            if not r.finished:
                r.step(60)
    for r, want in zip(runs, wants):
        check(r.answer(), want)
    assert {"extend", id(sc.head.weight) if softmax else "vocab"} == set(launched)
    lo, hi = runs[0].kv.range(runs[0].kv.filled)
    for (k, _), k0 in zip(bank.kv, before):  # rows outside the region and the trash: untouched
        changed = (k != k0).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed and set(changed) <= set(range(lo, hi)) | {bank.trash}
    assert bank.used == {}  # (the finished request's region went back)
    assert sc.begin(sc.input.parse(bodies[1]), tokens=60).kv.bank is bank


def test_every_scorer_pass_replays_a_graph(tiny_model, monkeypatch):
    """Engine.capture_scorer's runners on the CPU (tests/helpers.eager_graphs): text items, token-id
    items, embedding items, a request's own label set under softmax, SGLang's default mode, and a
    long query part (its chunks and items over the K/V bank) all replay graphs, none eagerly, with
    the answers of the eager engine."""
    from prefixscore.engine import Engine
    from prefixscore.graphs import GraphRunner
    from tests.helpers import eager_graphs

    sc = Scorer(tiny_model("llama"), "Is the item relevant? Query: {query}\nItem: {item}", ["yes", "no"],
                chat=False, device="cpu", dtype=torch.float32)
    eng = sc.engine
    rng = np.random.default_rng()
    H = sc.config.hidden_size
    words = ["red", "blue", "shoe", "dress", "running", "coat", "green", "wool"]
    text = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    bodies = [{"query": text(5), "items": [text(3), text(6)], "apply_softmax": True},
              {"query": rng.integers(10, 2000, 6).tolist(), "items": [rng.integers(10, 2000, 4).tolist()],
               "apply_softmax": True},
              {"query": text(4), "items": [rng.standard_normal(H).astype(np.float32), text(2)],
               "apply_softmax": True},
              {"query": text(4), "items": [text(3)], "apply_softmax": True, "label_token_ids": [5, 9, 11]},
              {"query": text(4), "items": [text(3), text(2)], "apply_softmax": False, "label_token_ids": [5, 9]},
              {"query": text(200), "items": [text(3), rng.standard_normal(H).astype(np.float32)],
               "apply_softmax": True}]
    want = []
    for b in bodies:  # eagerly: no graphs yet
        run = sc.begin(sc.input.parse(b), tokens=64)
        while not run.finished:
            run.step(64)
        want.append(run.answer())
    wire = eager_graphs(monkeypatch)
    monkeypatch.setattr(Engine, "captures", property(lambda self: True))
    eng.capture_scorer(sc.prefix_kv, sc.head.weight, True, 64)
    used, eager = set(), []
    for key, runner in eng.graphs.items():
        wire(runner)
    launch = GraphRunner.launch
    monkeypatch.setattr(GraphRunner, "launch", lambda self, *a: used.add(
        next(k for k, r in eng.graphs.items() if r is self)) or launch(self, *a))
    forward = Engine.forward_scores
    monkeypatch.setattr(Engine, "forward_scores", lambda self, *a, prune=False, **k: (
        eager.append(a[0].shape) if prune else None) or forward(self, *a, prune=prune, **k))
    monkeypatch.setattr(Engine, "hidden", lambda *a, **k: eager.append(a[1].num_tokens))
    for b, w in zip(bodies, want):
        run = sc.begin(sc.input.parse(b), tokens=64)
        while not run.finished:
            run.step(64)
        check(run.answer(), w)
        assert not eager, b
    bank, P = eng.bank.kv, sc.prefix_kv
    assert used == {(id(P), id(sc.head.weight), True), (id(P), "labels", True), (id(P), "vocab"),
                    (id(bank), "extend"), (id(bank), id(sc.head.weight), True)}, used
