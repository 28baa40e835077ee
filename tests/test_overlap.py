"""Batch APIs tokenize on a worker thread while the engine runs (DESIGN.md §7): the results equal
the one-call-at-a-time paths, in input order; errors still name the right query; the tokenizer
really runs beside the engine; no thread outlives a call. Also the allow_special_tokens option."""
import json
import random
import sys
import threading

import pytest

from tests.helpers import random_queries
from prefixscore import ConfigError, InputError
from prefixscore import classifier as classifier_mod
from prefixscore import overlap
from prefixscore.classifier import Classifier
from prefixscore.overlap import doubling_spans, run_ahead
from prefixscore.scorer import Scorer

LABELS = ["Dress", "Jeans", "T-shirt", "Trench Coat", "Other"]  # T-shirt / Trench Coat branch
TEMPLATE = "Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\nAnswer:"
TOL = 1e-5  # CPU matmuls round a row differently with the batch's size: one query alone vs many


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2"))


@pytest.fixture(scope="module")
def clf(model):
    return Classifier(model, labels=LABELS, chat=False, max_batch_tokens=120)


@pytest.fixture
def small_chunks(monkeypatch):
    """Tokenizer calls of 4, 8, 16 queries: many chunks even for a short input."""
    monkeypatch.setattr(classifier_mod, "TOKENIZE_FIRST", 4)
    monkeypatch.setattr(classifier_mod, "TOKENIZE_MAX", 16)


def workers():
    return [t for t in threading.enumerate() if t.name.startswith("prefixscore-tokenize")]


def close(a, b):
    return a.label == b.label and max(abs(a.scores[l] - b.scores[l]) for l in a.scores) < TOL


def test_spans_and_run_ahead():
    assert doubling_spans([1] * 10, 2, 4) == [(0, 2), (2, 6), (6, 10)]
    assert doubling_spans([5, 1, 1, 9, 3], 2, 8) == [(0, 1), (1, 4), (4, 5)]
    assert doubling_spans([], 2, 4) == []
    spans = doubling_spans([1] * 100, 3, 16)
    assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(100))
    assert [x for chunk in run_ahead(lambda lo, hi: list(range(lo, hi)), spans) for x in chunk] == list(range(100))
    calls = []

    def fn(lo, hi):
        calls.append(lo)
        if lo == 6:
            raise InputError("bad chunk")
        return lo

    with pytest.raises(InputError, match="bad chunk"):
        list(run_ahead(fn, [(i, i + 1) for i in range(100)], depth=2))
    assert 6 in calls and len(calls) < 100 and not workers()  # the rest cancelled, the thread joined


def test_classify_batch_equals_one_at_a_time(clf, small_chunks):
    queries = random_queries(300, 7)
    batch = clf.classify_batch(queries)
    assert [r.query for r in batch] == queries
    # The same batches as classify_encoded (max_batch_tokens is under the first batch's budget, and
    # every query has the cached prefix), so the same bits; one at a time, the same within TOL.
    encoded = clf.encode_many(queries)
    assert all(e.start > 0 for e in encoded)
    assert [r.to_dict() for r in batch] == [r.to_dict() for r in clf.classify_encoded(encoded)]
    alone = [clf.classify(q) for q in queries]
    assert all(close(a, b) for a, b in zip(batch, alone))
    streamed = list(clf.classify_batch_iter(queries))
    assert len(streamed) > 10 and [r.to_dict() for b in streamed for r in b] == [r.to_dict() for r in batch]
    assert not workers()


def test_classify_batch_pauses_the_collector_and_restores_it(clf, small_chunks):
    """No cyclic collection while classify_batch holds every result (each full collection scanned
    them all: prefixscore.collector), the collector's state restored after, also when it raises
    and when the caller had it off."""
    import gc

    seen = []
    assert gc.isenabled()
    clf.classify_batch(random_queries(40, 3), progress=lambda n: seen.append(gc.isenabled()))
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(InputError):
        clf.classify_batch(["red dress", "x" * 100_000])
    assert gc.isenabled()
    gc.disable()
    try:
        clf.classify_batch(random_queries(10, 4))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_batches_ramp_up_and_keep_order(model, small_chunks, monkeypatch):
    """The first batch's budget starts small and doubles; a request without the cached prefix runs
    after the cached batch that passes it; results still come out in input order."""
    monkeypatch.setattr(classifier_mod, "FIRST_BATCH_TOKENS", 40)
    clf = Classifier(model, labels=LABELS, chat=False, max_batch_tokens=400)
    queries = list(dict.fromkeys(random_queries(260, 3)))[:200]
    exact = {17, 18, 95}
    encode_many = clf.encode_many

    def some_exact(qs):  # as if these queries merged into the prefix: computed without the cache
        out = encode_many(qs)
        for e in out:
            if queries.index(e.values["query"]) in exact:
                e.start = 0
        return out

    monkeypatch.setattr(clf, "encode_many", some_exact)
    sizes, runs = [], []
    run = clf._launch

    def recorded(batch):
        if batch[0].start:  # the budget ramps for batches of the cached prefix
            sizes.append(sum(len(e.ids) - e.start + clf._branch_tokens() for e in batch))
        runs.append([e.start for e in batch])
        return run(batch)

    monkeypatch.setattr(clf, "_launch", recorded)
    streamed = list(clf.classify_batch_iter(queries))
    got = [r for b in streamed for r in b]
    assert [r.query for r in got] == queries
    assert all(len(set(starts)) == 1 for starts in runs)  # one prefix per batch
    assert sizes[0] <= 40 < max(sizes) <= 400 and sizes.index(max(sizes)) > 2
    assert [starts for starts in runs if starts[0] == 0] == [[0, 0], [0]]
    alone = [clf.classify_encoded([e])[0] for e in some_exact(queries)]
    assert all(close(a, b) for a, b in zip(got, alone))


def test_errors_name_the_query(clf, small_chunks, monkeypatch):
    queries = random_queries(200, 11)
    ran = []
    run = clf._launch
    monkeypatch.setattr(clf, "_launch", lambda batch: ran.append(len(batch)) or run(batch))
    for bad, msg in (("  ", "empty query"), (7, "query must be a string, got int")):
        with pytest.raises(InputError, match=f"^query 37: {msg}$"):
            clf.classify_batch(queries[:36] + [bad] + queries[36:])
        with pytest.raises(InputError, match=f"^query 37: {msg}$"):  # at the call: before any batch
            clf.classify_batch_iter(queries[:36] + [bad] + queries[36:])
    assert not ran
    # Over the context limit only the tokenizer can tell: the batches before it have run.
    long = queries[:136] + ["trench coat " * 400] + queries[136:]
    with pytest.raises(InputError, match=r"^query 137: prompt is \d+ tokens, over the model's context limit"):
        clf.classify_batch(long)
    done = []
    with pytest.raises(InputError, match="^query 137: prompt is"):
        for batch in clf.classify_batch_iter(long):
            done += batch
    assert 0 < len(done) < 136 and [r.query for r in done] == queries[:len(done)]
    assert not workers()
    clf.truncate = True
    try:
        res = clf.classify_batch(long)
    finally:
        clf.truncate = False
    assert len(res) == 201 and len(res[136].query) < len(long[136])


def test_passes_queue_ahead_where_the_engine_queues(clf, small_chunks, monkeypatch):
    """Where a launch returns before its pass has run (an eager CUDA pass), batch k+1 is launched
    before batch k is collected, with the same batches and answers as one at a time; on a CPU,
    where a launch computes, each batch is answered before the next is planned (a stop waits for
    one pass). The order of launches and collections, not timing, is checked."""
    queries = random_queries(200, 21)
    one_at_a_time = clf.classify_batch(queries)
    launch, events = clf._launch, []

    def recorded(batch):
        k = sum(e[0] == "launch" for e in events)
        events.append(("launch", k))
        finish = launch(batch)
        return lambda: events.append(("collect", k)) or finish()

    monkeypatch.setattr(clf, "_launch", recorded)
    got = clf.classify_batch(queries)
    assert got == one_at_a_time
    n = sum(e[0] == "launch" for e in events)
    assert n > 3 and events == [e for k in range(n) for e in (("launch", k), ("collect", k))]
    events.clear()
    monkeypatch.setattr(type(clf.engine), "queues", property(lambda self: True))
    got = clf.classify_batch(queries)
    assert [(r.query, r.label) for r in got] == [(r.query, r.label) for r in one_at_a_time]
    assert all(a.scores == pytest.approx(b.scores, abs=1e-5) for a, b in zip(got, one_at_a_time))
    assert events[:3] == [("launch", 0), ("launch", 1), ("collect", 0)]
    assert events[-1] == ("collect", n - 1) and len(events) == 2 * n
    for k in range(n - 1):  # each collected once, after its successor was launched
        assert events.index(("launch", k + 1)) < events.index(("collect", k))
    # a query only the tokenizer can fault: the batches before it are answered, then the error
    long = queries[:136] + ["trench coat " * 400] + queries[136:]
    done = []
    with pytest.raises(InputError, match="^query 137: prompt is"):
        for batch in clf.classify_batch_iter(long):
            done += batch
    assert 0 < len(done) < 137 and [r.query for r in done] == queries[:len(done)]


def test_cli_file_mode_streams_and_names_the_query(model, tmp_path, capsys, small_chunks):
    from prefixscore.cli.commands import main

    queries = [q for q in random_queries(120, 5) if q.strip() == q and "\n" not in q]
    src, out = tmp_path / "q.txt", tmp_path / "out.jsonl"
    src.write_text("\n".join(queries) + "\n")
    args = ["classify", "-i", str(src), "-o", str(out), "--model", model, "--labels", ",".join(LABELS),
            "--no-chat", "--batch-tokens", "120"]
    assert main(args) == 0
    # The CLI classifies chunks of rows (32, then 64...): the reference runs each chunk alone.
    clf = Classifier(model, labels=LABELS, chat=False, max_batch_tokens=120)
    ref = [r for a, b in ((0, 32), (32, 96), (96, 120)) for r in clf.classify_batch(queries[a:b])]
    want = [{"row": n, **r.to_dict(), "error": None} for n, r in enumerate(ref, 1)]
    assert [json.loads(line) for line in out.read_text().splitlines()] == want
    queries[80] = "coat " * 800
    src.write_text("\n".join(queries) + "\n")
    capsys.readouterr()
    assert main(args + ["--strict"]) == 2  # refused, naming the line, after the chunks before it
    assert f"prefixscore: error: {src}:81: prompt is" in capsys.readouterr().err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < len(written) < 80 and written == want[:len(written)]
    assert main(args) == 0  # without --strict: an error row in its place, the rest classified
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written[80]["error"].startswith("prompt is") and written[80]["label"] is None
    # Its chunk ran without it: the reference too (a row's last bits depend on its flat batch).
    mid = clf.classify_batch(queries[32:80] + queries[81:96])
    ref = ref[:32] + mid[:48] + [None] + mid[48:] + ref[96:]
    assert [w for w in written if w["row"] != 81] == \
        [{"row": n, **r.to_dict(), "error": None} for n, r in enumerate(ref, 1) if r is not None]


def test_tokenizer_runs_beside_the_engine(clf, small_chunks, monkeypatch):
    """Deterministic, no timing: the first engine call waits until a later chunk has been
    tokenized, which only a tokenizer on another thread can do meanwhile (a serial one would
    time out here and fail)."""
    monkeypatch.setattr(classifier_mod, "FIRST_BATCH_TOKENS", 1)  # batch 0 closes inside chunk 0
    engine_busy, tokenized = threading.Event(), threading.Event()
    threads, during = set(), []
    encode_many, run = clf.encode_many, clf._launch

    def encode(qs):
        threads.add(threading.current_thread().name)
        if qs[0] != queries[0]:  # a later chunk: let the engine start first
            during.append(engine_busy.wait(10))
        out = encode_many(qs)
        if engine_busy.is_set():
            tokenized.set()
        return out

    def engine(batch):
        if not engine_busy.is_set():
            engine_busy.set()
            assert tokenized.wait(10), "no chunk was tokenized while the engine ran"
        return run(batch)

    monkeypatch.setattr(clf, "encode_many", encode)
    monkeypatch.setattr(clf, "_launch", engine)
    queries = random_queries(100, 13)
    res = clf.classify_batch(queries)
    assert [r.query for r in res] == queries
    assert during and all(during)
    assert threads and all(t.startswith("prefixscore-tokenize") for t in threads)
    # One query (the latency path) and short lists: no thread at all.
    threads.clear()
    engine_busy.set()
    clf.classify("red dress")
    clf.classify_batch(queries[:classifier_mod.TOKENIZE_FIRST])
    assert threads == {threading.current_thread().name}


def test_stopping_early_joins_the_thread(clf, small_chunks):
    before = sys.getswitchinterval()
    it = clf.classify_batch_iter(random_queries(300, 17))
    try:
        assert next(it) and workers()
        assert sys.getswitchinterval() == pytest.approx(overlap.SWITCH_INTERVAL)
    finally:
        it.close()
    assert not workers() and sys.getswitchinterval() == before  # the interpreter's setting restored


def requests(n, seed):
    rng = random.Random(seed)
    qs = random_queries(4 * n, seed)
    return [(rng.choice(qs), rng.sample(qs, rng.randint(1, 9))) for _ in range(n)]


@pytest.fixture(scope="module")
def scorer(model):
    return Scorer(model, TEMPLATE, LABELS, chat=False, max_batch_tokens=300)


def test_score_batch_equals_one_at_a_time(scorer, small_chunks):
    reqs = requests(60, 2)
    batch = scorer.score_batch(reqs)
    flat = [r for res in batch for r in res]
    assert [r.item for r in flat] == [it for _, items in reqs for it in items]
    ref = scorer.run([scorer.prepare(q, items) for q, items in reqs])  # the same passes
    assert [r.to_dict() for res in batch for r in res] == [r.to_dict() for res in ref for r in res]
    alone = [r for q, items in reqs for r in scorer.score(q, items)]
    assert all(close(a, b) for a, b in zip(flat, alone))
    assert not workers()


def test_score_batch_errors_and_overlap(scorer, small_chunks, monkeypatch):
    reqs = requests(60, 4)
    launched = []
    launch = scorer._launch_pass
    monkeypatch.setattr(scorer, "_launch_pass", lambda *a: launched.append(1) or launch(*a))
    bad = reqs[:4] + [("q", ["ok", ""])] + reqs[4:]
    with pytest.raises(InputError, match=r"^request 5: items\[1\] is empty$"):
        scorer.score_batch(bad)
    assert not launched  # found before any pass
    long = reqs[:39] + [("q", ["coat " * 800])] + reqs[39:]
    with pytest.raises(InputError, match=r"^request 40: items\[0\]: the prompt is \d+ tokens"):
        scorer.score_batch(long)
    assert launched and not workers()
    # Requests are prepared on the worker thread while a pass runs. The first request alone fills
    # more than a pass, so the first pass launches before any other request is needed.
    first = ("a first request, long enough", [q for q in random_queries(40, 9) if q.strip()])
    engine_busy, prepared = threading.Event(), threading.Event()
    threads, prepare = set(), scorer.prepare

    def prep(query, items):
        threads.add(threading.current_thread().name)
        if query != first[0]:
            engine_busy.wait(10)
        out = prepare(query, items)
        if engine_busy.is_set():
            prepared.set()
        return out

    def engine(*a):
        if not engine_busy.is_set():
            engine_busy.set()
            assert prepared.wait(10), "no request was prepared while a pass ran"
        return launch(*a)

    monkeypatch.setattr(scorer, "prepare", prep)
    monkeypatch.setattr(scorer, "_launch_pass", engine)
    assert len(scorer.score_batch([first] + reqs)) == 1 + len(reqs)
    assert prepared.is_set() and threads and all(t.startswith("prefixscore-tokenize") for t in threads)


def test_allow_special_tokens(model, monkeypatch, tmp_path):
    assert Classifier(model, labels=LABELS, chat=False).prompt.special_tokens is False
    assert Classifier(model, labels=LABELS, chat=False, allow_special_tokens=True).prompt.special_tokens is True
    assert Scorer(model, TEMPLATE, LABELS, chat=False, allow_special_tokens=True).prompt.special_tokens is True
    # What it changes (prompt.py): a query's or an item's <|im_end|> is that token only when allowed.
    tok = Classifier(model, labels=LABELS, chat=False).loaded.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    text = "red dress<|im_end|>jeans"
    for allow in (False, True):
        c = Classifier(model, labels=LABELS, chat=False, allow_special_tokens=allow)
        s = Scorer(model, TEMPLATE, LABELS, chat=False, allow_special_tokens=allow)
        assert (end in c.encode(text).ids) is allow
        prep = s.prepare(text, [text, "jeans"])
        assert (end in prep.full[0][s.prefix_len:]) is allow and (end in prep.shared) is allow
    for bad in ("yes", 1, None):  # refused before a model loads
        with pytest.raises(ConfigError, match="allow_special_tokens is true or false"):
            Classifier("/nonexistent", allow_special_tokens=bad)
        with pytest.raises(ConfigError, match="allow_special_tokens is true or false"):
            Scorer("/nonexistent", allow_special_tokens=bad)
    # The command line: the flag reaches Classifier (make_classifier) and Scorer (score).
    import argparse

    from prefixscore import scorer as scorer_mod  # (cli/score imports it when the command runs)
    from prefixscore.cli import commands as cli

    seen = []

    class Stub:
        def __init__(self, *a, **kw):
            seen.append(kw["spec"].allow_special_tokens)  # (both take a ModelSpec)
            raise ConfigError("stub")

    monkeypatch.setattr(classifier_mod, "Classifier", Stub)
    monkeypatch.setattr(scorer_mod, "Scorer", Stub)
    req = tmp_path / "r.jsonl"
    req.write_text('{"query": "q", "items": ["a"]}\n')
    for args in (["classify", "x"], ["score", "-i", str(req)]):
        assert cli.main(args) == 2 and cli.main(args + ["--allow-special-tokens"]) == 2
    assert seen == [False, True, False, True]
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["classify"].format_help().split())
    assert ("--allow-special-tokens parse special-token text such as <|im_end|> inside queries as "
            "control tokens (default: plain text)") in text


def test_decide_encoded_equals_classify_encoded(model):
    """The engine loop's compact form (label indices, score rows) is classify_encoded's answers,
    bit for bit, over several flat batches and for one request alone."""
    clf = Classifier(model, device="cpu", max_batch_tokens=64)
    encoded = clf.encode_many(random_queries(40, seed=21))
    want = clf.classify_encoded(encoded)
    best, scores = clf.decide_encoded(encoded)
    assert [clf.labels[b] for b in best] == [r.label for r in want]
    assert scores == [list(r.scores.values()) for r in want]
    one = clf.classify_encoded(encoded[:1])[0]  # alone: CPU rounds a row by its batch's size
    one_best, one_scores = clf.decide_encoded(encoded[:1])
    assert clf.labels[one_best[0]] == one.label and one_scores[0] == list(one.scores.values())
