"""HTTP service in one process (`--workers 1`: the engine loop on a thread): a real uvicorn on
127.0.0.1 (in a thread, or `prefixscore serve` in a subprocess) and a real HTTP client. Tiny random
model, CPU. The multi-process server: test_serve_procs.py; hardening: test_serve_hardening.py."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import random_queries
from tests.serve.helpers import (JSON, LIMITS, Wrapped, check, metric, post_all, ready, running,
                                 unlabelled)
from prefixscore import Classifier, ConfigError, InputError
from prefixscore.serve import create_app

@pytest.fixture(scope="module")
def server(clf):
    with running(create_app(clf, **LIMITS)) as (base, _):
        yield base


# ---------------------------------------------------------------- endpoints

def test_classify_one_and_many(server, clf):
    queries = ["beige trench coat women", "levis 501", "红色连衣裙", "  oversized hoodie 😀"]
    r = httpx.post(server + "/v1/classify", json={"query": queries[0]})
    assert r.status_code == 200, r.text
    body = r.json()
    check(body["results"], clf.classify_batch(queries[:1]))
    assert body["batch_size"] == 1 and not body["results"][0]["cached"]
    assert set(body["timing"]) == {"queue_ms", "tokenize_ms", "forward_ms", "total_ms"}
    assert body["timing"]["forward_ms"] > 0 and body["timing"]["total_ms"] >= body["timing"]["forward_ms"]
    r = httpx.post(server + "/v1/classify", json={"query": queries})
    assert r.status_code == 200, r.text
    check(r.json()["results"], clf.classify_batch(queries))


def test_healthz_docs_metrics(server, clf):
    h = httpx.get(server + "/healthz")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["labels"] == clf.labels
    for page in ("/docs", "/redoc"):  # offline: every script, sheet and icon from this server
        r = httpx.get(server + page)
        assert r.status_code == 200, r.text
        refs = re.findall(r'(?:src|href)="([^"]+)"', r.text) + re.findall(r"https?://[^\s'\"<>]+", r.text)
        assert refs and all(u.startswith("/docs-assets/") for u in refs), refs
        for u in refs:
            a = httpx.get(server + u)
            assert a.status_code == 200 and len(a.content) > 1000, u
    schema = httpx.get(server + "/openapi.json").json()
    assert {"/v1/classify", "/healthz", "/metrics"} <= set(schema["paths"])
    httpx.post(server + "/v1/classify", json={"query": "red dress"})
    httpx.post(server + "/v1/classify", json={"query": ""})
    m = httpx.get(server + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    assert metric(text, 'prefixscore_http_requests_total{endpoint="/v1/classify",status="200"}') >= 1
    assert metric(text, 'prefixscore_http_requests_total{endpoint="/v1/classify",status="422"}') >= 1
    assert metric(text, "prefixscore_batch_size_count") >= 1
    for stage in ("queue", "tokenize", "forward", "total"):
        assert metric(text, f'prefixscore_latency_seconds_count{{stage="{stage}"}}') >= 1
    for name in ("prefixscore_queue_depth", "prefixscore_cache_hit_ratio"):
        assert any(unlabelled(line).startswith(name + " ") for line in text.splitlines())


def test_score_without_scorer_is_501(server):
    r = httpx.post(server + "/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [1]})
    assert r.status_code == 501 and "--score-template" in r.json()["detail"]
    assert "/v1/score" not in httpx.get(server + "/openapi.json").json()["paths"]


def test_score_sglang_shape(clf, scorer):
    """/v1/score answers exactly what Scorer.score_request answers, errors included (422)."""
    tok = clf.loaded.tokenizer
    yes, no = tok(" yes")["input_ids"][-1], tok(" no")["input_ids"][-1]
    q_ids = tok("wool coat")["input_ids"]
    requests = [
        {"query": "wool coat", "items": [" a long camel coat", " flip flops"], "label_token_ids": [yes, no]},
        {"query": "wool coat", "items": " flip flops", "label_token_ids": [yes, no], "apply_softmax": True},
        {"query": "wool coat", "items": ["s", " parka"], "labels": ["yes", "no"], "apply_softmax": True},
        {"query": "wool coat", "items": ["parka"]},  # the scorer's own labels
        {"query": q_ids, "items": [tok(" parka")["input_ids"]], "label_token_ids": [yes, no],
         "item_first": True},
        {"query": "q", "items": ["a"], "labels": ["yes"], "label_token_ids": [yes]},  # errors
        {"query": "q", "items": ["a"], "label_token_ids": [10 ** 9]},
        {"query": "q", "items": [""]},
    ]
    with running(create_app(clf, scorer=scorer, **LIMITS)) as (base, _):
        assert "/v1/score" in httpx.get(base + "/openapi.json").json()["paths"]
        for req in requests:
            r = httpx.post(base + "/v1/score", json={**req, "model": "anything"})
            try:
                want = scorer.score_request(req)
            except InputError as e:
                assert r.status_code == 422 and r.json()["detail"] == str(e), r.text
                continue
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["object"] == "scoring" and got["labels"] == want["labels"]
            assert got["model"] == os.path.basename(clf.loaded.name)  # a name, not the host's path
            assert got["usage"] == want["usage"] and len(got["scores"]) == len(want["scores"])
            for a, b in zip(got["scores"], want["scores"]):
                assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
        for req, status, says in [  # checked by the server before the scorer
            ({"query": "q"}, 422, "items are required"),
            ({"query": "q", "items": ["a"] * 9}, 413, "limit of 8"),
            ({"query": "q", "items": ["\ud800"]}, 422, "surrogate"),
            ({"query": 5, "items": ["a"]}, 422, "query"),
            ({"query": "q", "items": ["a"], "apply_softmax": "yes"}, 422, "apply_softmax"),
            ({"query": "q", "items": ["a"], "label_token_ids": ["9891"]}, 422, "label_token_ids"),
            ({"query": "q", "items": ["a"], "label_token_ids": [True]}, 422, "label_token_ids"),
        ]:
            r = httpx.post(base + "/v1/score", content=json.dumps(req), headers=JSON)
            assert r.status_code == status and says in r.json()["detail"], (req, r.text)
        assert httpx.get(base + "/healthz").status_code == 200  # bad requests are not engine faults


# ---------------------------------------------------------------- limits and errors

@pytest.mark.parametrize("body, headers, status, says", [
    (b'{"query": ', JSON, 422, "JSON decode error"),
    (b'{"query": "caf\xe9"}', JSON, 400, "not valid UTF-8"),
    (b'{"query": 5}', JSON, 422, "valid string"),
    (b'{"query": ["ok", 5]}', JSON, 422, "valid string"),
    (b'{"query": null}', JSON, 422, "query"),
    (b'{"queries": ["x"]}', JSON, 422, "query: Field required"),
    (b'{"query": "x", "extra": 1}', JSON, 422, "extra"),
    (b'["x"]', JSON, 422, "valid dictionary"),
    (b'{"query": ""}', JSON, 422, "empty query"),
    (b'{"query": ["ok", "  "]}', JSON, 422, "query[1]: empty query"),
    (b'{"query": []}', JSON, 422, "empty list"),
    (b'{"query": "\\ud800"}', JSON, 422, "lone surrogate"),
    (b'{"query": "x"}', {"content-type": "text/plain"}, 422, "content-type: application/json"),
    (b'{"query": ["q"' + b', "q"' * 8 + b"]}", JSON, 413, "limit of 8 (--max-queries)"),
    (b'{"query": "' + b"dress " * 100 + b'"}', JSON, 422, "limit of 48 tokens per query (--max-tokens)"),
    (b'{"query": "' + b"x" * 5000 + b'"}', JSON, 413, "limit of 4096 bytes (--max-body-bytes)"),
])
def test_bad_requests(server, body, headers, status, says):
    r = httpx.post(server + "/v1/classify", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert says in r.json()["detail"]


def test_body_limit_without_content_length(server):
    def chunks():  # chunked transfer: the limit must hold while streaming, not only on the header
        yield b'{"query": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    r = httpx.post(server + "/v1/classify", content=chunks(), headers=JSON)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["detail"]


def test_wrong_method_and_path(server):
    assert httpx.get(server + "/v1/classify").status_code == 405
    # no admin route (vLLM's load_lora_adapter): a POST there finds only GET /v1/models/{id}
    assert httpx.post(server + "/v1/models/load", json={"path": "/etc/passwd"}).status_code == 405
    assert httpx.get(server + "/v1/models/load").status_code == 404  # no such model
    assert httpx.post(server + "/v1/load_lora_adapter", json={"lora_path": "/tmp"}).status_code == 404


def test_context_limit(clf):
    # a query over the model's context (512 positions) is a 422, not a crash
    with running(create_app(clf, max_tokens=10_000, max_body_bytes=1 << 20)) as (base, _):
        r = httpx.post(base + "/v1/classify", json={"query": "dress " * 600})
        assert r.status_code == 422 and "context limit" in r.json()["detail"]


def test_api_key(clf, scorer):
    with running(create_app(clf, scorer=scorer, api_key="s3cret")) as (base, _):
        url = base + "/v1/classify"
        assert httpx.post(url, json={"query": "x"}).status_code == 401
        r = httpx.post(url, json={"query": "x"}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.post(url, json={"query": "x"}, headers={"authorization": "Bearer s3cret"}).status_code == 200
        # Without the key nothing about the body is answered: 401 before a 422 for bad JSON.
        for path in ("/v1/classify", "/v1/score", "/v1/nowhere"):
            r = httpx.post(base + path, content=b'{"query": ', headers=JSON)
            assert r.status_code == 401 and "API key" in r.json()["detail"], (path, r.text)
        assert httpx.get(base + "/healthz").status_code == 200  # probes need no key
        assert httpx.head(base + "/healthz").status_code == 200  # nor HEAD (RFC 9110)
        assert httpx.head(base + "/metrics").status_code == 200
    for key in ("k3y\n", " k3y", "clé", "a\tb"):  # no client could send these in a header
        with pytest.raises(ConfigError, match="printable ASCII"):
            create_app(clf, api_key=key)


@pytest.mark.parametrize("text, says", [
    ("bogus = 1\n", "unknown option 'bogus'"),
    ('port = "abc"\n', "argument --port: invalid int value"),
    ('mode = "fast"\n', "argument --mode: invalid choice"),
    ("port = \n", "config file"),
    ("api-key = false\n", "api-key takes a value, not false"),
    ("max-queue = false\n", "max-queue takes a value"),
    ('truncate = "yes"\n', "truncate is a switch"),
    ('labels = ["small, medium", "large"]\n', "contains a comma"),
])
def test_bad_config_file(tmp_path, capsys, text, says):
    from prefixscore.cli.commands import main

    cfg = tmp_path / "serve.toml"
    cfg.write_text(text)
    assert main(["serve", "--config", str(cfg)]) == 2  # before any model is loaded
    assert says in capsys.readouterr().err


def test_config_file_under_the_command_line(tmp_path, monkeypatch):
    """File values fill what the command line leaves out; a flag given on the command line wins,
    even one equal to its default; values may start with '-'."""
    import prefixscore.cli.commands as cli
    import prefixscore.serve.launch as launch

    seen = []

    def stop(front, engine):  # the options as they reach the server: record them and stop there
        seen.append((front, engine))
        raise ConfigError("stop")

    monkeypatch.setattr(launch, "serve", stop)
    cfg = tmp_path / "serve.toml"
    cfg.write_text('port = 9000\nmax-queue = 77\nmax-queries = 8\napi-key = "-abc"\nlabels = ["-1", "+1"]\n'
                   'template = "--{query}"\nchat = false\ntruncate = true\n')
    assert cli.main(["serve", "--config", str(cfg), "--port", "8000", "--chat"]) == 2
    front, engine = seen[0]
    assert (front.port, front.max_queue, front.api_key) == (8000, 77, "-abc")
    assert (engine.spec.labels, engine.spec.template) == (("-1", "+1"), "--{query}")
    assert engine.spec.chat is True and engine.spec.truncate is True


def test_bad_config(clf):
    with pytest.raises(ConfigError, match="max-queue"):
        create_app(clf, max_queue=0)
    with pytest.raises(ConfigError, match="max-queries"):
        create_app(clf, max_queries=100, max_queue=10)
    with pytest.raises(ConfigError, match="max-connections"):
        create_app(clf, max_queue=100, max_queries=8, max_connections=100)  # overload must be our 429, not a refusal
    for window in (float("inf"), float("nan"), -1.0, 1e9):  # inf once killed the engine thread
        with pytest.raises(ConfigError, match="batch-window-ms"):
            create_app(clf, batch_window_ms=window)
    with pytest.raises(ConfigError, match="cache-ttl"):
        create_app(clf, cache_ttl=-1.0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_engine_cpu(clf):
    from prefixscore.serve.engine_proc import engine_cpu

    cpus = os.sched_getaffinity(0)
    assert engine_cpu("none", "cuda") is None
    assert engine_cpu("auto", "cpu") is None  # CPU inference keeps its OpenMP workers' CPUs
    assert engine_cpu("auto", "cuda") == (max(cpus) if len(cpus) >= 4 else None)
    with pytest.raises(ConfigError, match="CPU number"):
        engine_cpu("fast", "cuda")
    with pytest.raises(ConfigError, match="may run on CPUs"):
        engine_cpu(str(max(cpus) + 1), "cuda")
    # the engine thread pins itself; the calling thread keeps its CPUs
    seen = []

    class Recording:
        def __getattr__(self, name):
            return getattr(clf, name)

        def decide_encoded(self, encoded):
            seen.append(os.sched_getaffinity(0))
            return clf.decide_encoded(encoded)

    cpu = min(cpus)
    with running(create_app(Recording(), engine_cpu=cpu)) as (base, _):
        assert httpx.post(base + "/v1/classify", json={"query": "red dress"}).status_code == 200
    assert seen and all(s == {cpu} for s in seen)
    assert os.sched_getaffinity(0) == cpus


def test_engine_spin(clf):
    """An engine thread that polls for the next batch (busy, off the GIL) answers the same as one
    that sleeps, batches requests that arrive while it works, and ends with the app."""
    from prefixscore.serve.engine_proc import spin_seconds

    assert spin_seconds("auto", "cuda") == 2e-3 and spin_seconds("auto", "cpu") == 0.0
    assert spin_seconds("0.5", "cpu") == 0.5e-3
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="engine-spin-ms"):
            spin_seconds(bad, "cuda")
    wrapped = Wrapped(clf, delay=0.01)
    queries = [f"spin {i}" for i in range(30)]
    want = clf.classify_batch(queries)
    app = create_app(wrapped, engine_spin_ms=50)
    with running(app) as (base, _):
        warm = len(wrapped.batches)
        for q, w in zip(queries[:3], want):  # one at a time: each picked up while polling
            check(httpx.post(base + "/v1/classify", json={"query": q}).json()["results"], [w])
        responses = post_all(base, [{"query": q} for q in queries])
    for r, w in zip(responses, want):
        assert r.status_code == 200, r.text
        check(r.json()["results"], [w])
    batches = wrapped.batches[warm + 3:]
    assert sum(batches) == len(queries) and max(batches) > 1
    app.state.client.thread.join(5)
    assert not app.state.client.thread.is_alive()


def test_fast_classify_path():
    """FastClassify answers valid JSON itself and hands everything else, body intact, to the FastAPI
    route. (The API key is Guard's, in front of it: test_api_key.)"""
    from prefixscore.serve.frontend import ApiError
    from prefixscore.serve.http import ClassifyRequest, FastClassify, authorized

    inner_calls, answered = [], []

    async def inner(scope, receive, send):
        inner_calls.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def answer(req: ClassifyRequest):
        answered.append(req.query)
        if req.query == "full":
            raise ApiError(429, "queue full", retry_after=0.2)
        return b'{"ok": 1}'

    def call(body, ctype=b"application/json"):
        sent = []
        headers = [(b"content-type", ctype)]
        scope = {"type": "http", "method": "POST", "path": "/v1/classify", "headers": headers}

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(m):
            sent.append(m)

        asyncio.run(FastClassify(inner, answer)(scope, receive, send))
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    assert call(b'{"query": "red dress"}') == (200, {b"content-type": b"application/json",
                                                   b"content-length": b"9"}, b'{"ok": 1}')
    assert call(b'{"query": ["a", "b"]}', ctype=b"application/json; charset=utf-8")[0] == 200
    status, headers, body = call(b'{"query": "full"}')
    assert status == 429 and headers[b"retry-after"] == b"1" and json.loads(body) == {"detail": "queue full"}
    assert answered == ["red dress", ["a", "b"], "full"] and inner_calls == []
    for body, kw in [(b'{"query": 3}', {}), (b'{"q": "x"}', {}), (b"not json", {}),
                     (b'{"query": "x"}', {"ctype": b"application/vnd.api+json"})]:
        assert call(body, **kw)[0] == 299 and inner_calls[-1] == body, (body, kw)
    auth = lambda *values: [(b"host", b"x")] + [(b"authorization", v) for v in values]
    assert authorized(auth(b"bearer k"), "k") and authorized(auth(b"Bearer  k "), "k")
    assert not any(authorized(auth(*h), "k") for h in ((), (b"Bearer no",), (b"Basic k",), (b"k",),
                                                      (b"Bearer",), (b"Bearer k", b"Bearer k"),
                                                      (b"Bearer k", b"Bearer no")))


def test_fast_path_and_route_agree(server):
    """The same queries through FastClassify (application/json) and through the FastAPI route
    (a +json content type, which FastClassify leaves to FastAPI): the same answers."""
    qs = ["red dress", "levis 501 straight leg", "红色连衣裙"]
    fast = httpx.post(server + "/v1/classify", json={"query": qs})
    route = httpx.post(server + "/v1/classify", content=json.dumps({"query": qs}),
                       headers={"content-type": "application/vnd.api+json"})
    assert fast.status_code == route.status_code == 200
    strip = lambda r: [(x["query"], x["label"], x["scores"]) for x in r.json()["results"]]
    assert strip(fast) == strip(route)


# ---------------------------------------------------------------- result cache

def test_cache_identical_results(clf, server):
    queries = random_queries(12, seed=7)
    bodies = [{"query": queries[i:i + 3]} for i in range(0, 12, 3)]
    # one request at a time, so both servers run the same batches: results must be bit-identical
    plain = [httpx.post(server + "/v1/classify", json=b).json()["results"] for b in bodies]
    with running(create_app(clf, cache_size=8, cache_ttl=0.5, **LIMITS)) as (base, _):
        first = [httpx.post(base + "/v1/classify", json=b).json()["results"] for b in bodies]
        again = httpx.post(base + "/v1/classify", json=bodies[-1]).json()
        assert [r["cached"] for r in again["results"]] == [True] * 3 and again["batch_size"] == 0
        assert again["timing"]["forward_ms"] == 0
        for got, want in zip(first + [again["results"]], plain + [plain[-1]]):
            assert [{**r, "cached": False} for r in got] == want
        text = httpx.get(base + "/metrics").text
        assert metric(text, "prefixscore_cache_hits_total") == 3
        assert metric(text, "prefixscore_cache_misses_total") == 12
        assert metric(text, "prefixscore_cache_hit_ratio") == pytest.approx(3 / 15)
        # LRU: size 8, so the first request's queries were evicted; TTL: everything expires
        assert not any(r["cached"] for r in httpx.post(base + "/v1/classify", json=bodies[0]).json()["results"])
        time.sleep(0.6)
        assert not any(r["cached"] for r in httpx.post(base + "/v1/classify", json=bodies[-1]).json()["results"])


# ---------------------------------------------------------------- batching, concurrency, overload

def test_200_concurrent_clients(clf):
    """Every client gets its own answers (no mixing) while requests share batches."""
    wrapped = Wrapped(clf)
    queries = random_queries(300, seed=3)
    bodies, refs, i = [], [], 0
    for n in range(200):  # mostly single queries, some lists of 2-3
        k = 1 + (n % 7 == 0) + (n % 11 == 0)
        bodies.append({"query": queries[i] if k == 1 else queries[i:i + k]})
        refs.append(queries[i:i + k])
        i += k
    want = clf.classify_batch(queries[:i])
    with running(create_app(wrapped, max_queue=1024)) as (base, _):
        warm = len(wrapped.batches)
        responses = post_all(base, bodies)
    j = 0
    for resp, ref in zip(responses, refs):
        assert resp.status_code == 200, resp.text
        check(resp.json()["results"], want[j:j + len(ref)])
        j += len(ref)
    batches = wrapped.batches[warm:]
    # requests joined running batches; a query repeated within one pass is computed once
    assert len(set(queries[:i])) <= sum(batches) <= i and max(batches) > 1


def test_batch_window(clf):
    wrapped = Wrapped(clf)
    with running(create_app(wrapped, batch_window_ms=300)) as (base, _):
        warm = len(wrapped.batches)
        t0 = time.perf_counter()
        responses = post_all(base, [{"query": q} for q in ("a", "b", "c", "d", "e")])
        took = time.perf_counter() - t0
    assert [r.status_code for r in responses] == [200] * 5
    assert wrapped.batches[warm:] == [5]  # all joined one batch within the window
    assert 0.25 < took < 2.0  # and the batch did not wait much longer than the window
    assert all(r.json()["timing"]["queue_ms"] < 1000 for r in responses)


def test_overload_429(clf):
    wrapped = Wrapped(clf, delay=0.3)
    queries = [f"query {i}" for i in range(40)]
    want = clf.classify_batch(queries)
    with running(create_app(wrapped, max_queue=6, max_queries=2)) as (base, _):
        responses = post_all(base, [{"query": q} for q in queries])
        text = httpx.get(base + "/metrics").text
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429} and codes.count(429) >= 10
    for r, w in zip(responses, want):
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and "queue full" in r.json()["detail"]
        else:
            check(r.json()["results"], [w])  # accepted requests still succeed, correctly
    assert metric(text, 'prefixscore_http_requests_total{endpoint="/v1/classify",status="429"}') == codes.count(429)


def test_engine_fault_503(clf):
    wrapped = Wrapped(clf, delay=0.1)
    with running(create_app(wrapped)) as (base, _):
        wrapped.fail = True
        responses = post_all(base, [{"query": f"q{i}"} for i in range(5)])
        assert [r.status_code for r in responses] == [503] * 5
        assert "device lost" in responses[0].json()["detail"]
        h = httpx.get(base + "/healthz")
        assert h.status_code == 503 and h.json()["status"] == "unhealthy"
        assert httpx.post(base + "/v1/classify", json={"query": "x"}).status_code == 503
        assert metric(httpx.get(base + "/metrics").text, "prefixscore_engine_faults_total") == 1


def test_engine_loop_bug_503(clf):
    """An exception in the engine loop itself (not in a batch) ends the engine thread: the requests
    it took get 503 (none hangs), /healthz turns unhealthy, and later requests get 503 too."""
    app = create_app(clf)
    with running(app) as (base, _):
        engine = app.state.client.engine

        def broken(items):
            raise RuntimeError("bug in the loop")

        engine.serve = broken
        r = httpx.post(base + "/v1/classify", json={"query": "x"}, timeout=10)
        assert r.status_code == 503 and "bug in the loop" in r.json()["detail"]
        assert httpx.get(base + "/healthz").json()["status"] == "unhealthy"
        r = httpx.post(base + "/v1/classify", json={"query": "y"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_restart_engine(clf):
    """With restart_engine an engine thread that dies (here: a BaseException, as a tokenizer or a
    library might raise) fails what it held with 503, and a new thread serves the next requests."""
    wrapped = Wrapped(clf)
    app = create_app(wrapped, restart_engine=True)
    with running(app) as (base, _):
        wrapped.fail_once = True
        r = httpx.post(base + "/v1/classify", json={"query": "x"}, timeout=10)
        assert r.status_code == 503 and "device lost once" in r.json()["detail"]
        ready(base)
        r = httpx.post(base + "/v1/classify", json={"query": "red dress"}, timeout=10)
        assert r.status_code == 200, r.text
        check(r.json()["results"], clf.classify_batch(["red dress"]))
        assert app.state.client.restarts == 1
        text = httpx.get(base + "/metrics").text
        assert metric(text, "prefixscore_engine_faults_total") == 1


def test_truncate_to_max_tokens(tiny_model):
    """With truncation on, a query over --max-tokens is cut to fit, not refused."""
    clf = Classifier(tiny_model("llama"), device="cpu", truncate=True)
    with running(create_app(clf, max_tokens=20)) as (base, _):
        r = httpx.post(base + "/v1/classify", json={"query": "dress " * 100})
        assert r.status_code == 200, r.text
        seen = r.json()["results"][0]["query"]
        assert ("dress " * 100).startswith(seen) and len(seen) < 600
        assert len(clf.encode(seen).ids) - clf.prefix_len <= 20
        check(r.json()["results"], clf.classify_batch([seen]))


def test_healthz_starting_until_warm(clf):
    gate = threading.Event()
    wrapped = Wrapped(clf, gate=gate)
    with running(create_app(wrapped), wait_ready=False) as (base, _):
        h = httpx.get(base + "/healthz")
        assert h.status_code == 503 and h.json()["status"] == "starting"
        waiting = []
        t = threading.Thread(target=lambda: waiting.append(httpx.post(base + "/v1/classify", json={"query": "x"}, timeout=30)))
        t.start()  # a request that arrives while warming up waits for the engine
        time.sleep(0.2)
        gate.set()
        t.join(30)
        assert waiting[0].status_code == 200
        assert httpx.get(base + "/healthz").status_code == 200


def test_shutdown_drains(clf):
    wrapped = Wrapped(clf, delay=0.2)
    queries = [f"drain {i}" for i in range(8)]
    want = clf.classify_batch(queries)
    app = create_app(wrapped)
    with running(app) as (base, server):
        wrapped.gate = threading.Event()  # hold the engine until every request is accepted

        async def go():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                sent = [asyncio.create_task(c.post("/v1/classify", json={"query": q})) for q in queries]
                while app.state.frontend.admission.inflight < len(queries):
                    await asyncio.sleep(0.01)
                server.should_exit = True  # what SIGTERM does
                wrapped.gate.set()
                return await asyncio.gather(*sent)

        responses = asyncio.run(go())
        for r, w in zip(responses, want):
            assert r.status_code == 200, r.text
            check(r.json()["results"], [w])
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # and no new connections after
            httpx.post(base + "/v1/classify", json={"query": "late"})


def test_cli_serve_config_file_sigterm(clf, tiny_model, tmp_path):
    """`prefixscore serve --config` as its own process: config file, API key from the environment,
    and SIGTERM while requests wait in the (3 s) batch window: they all finish."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'model = "{tiny_model("llama")}"\nport = {port}\nbatch-window-ms = 3000\n'
                   f'device = "cpu"\ncache_size = 100\nlog-level = "warning"\n')
    env = {**os.environ, "PREFIXSCORE_API_KEY": "k3y", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "serve", "--config", str(cfg)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve did not become ready"
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        queries = ["red dress", "levis 501", "hoodie"]

        async def go():
            async with httpx.AsyncClient(base_url=base, timeout=30,
                                         headers={"authorization": "Bearer k3y"}) as c:
                sent = [asyncio.create_task(c.post("/v1/classify", json={"query": q})) for q in queries]
                while metric((await c.get("/metrics")).text, "prefixscore_queue_depth") < 3:
                    await asyncio.sleep(0.02)  # all accepted, waiting in the batch window
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*sent)

        responses = asyncio.run(go())
        assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
        check([r.json()["results"][0] for r in responses], clf.classify_batch(queries))
        assert proc.wait(30) == 0  # drained, then a clean exit (not by the signal)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- fuzzing over the schema

def test_schemathesis_no_5xx(clf, scorer):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from prefixscore.serve import compat
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    with running(create_app(clf, scorer=scorer, **LIMITS)) as (base, _):
        schema = schemathesis.openapi.from_url(base + "/openapi.json")
        ops = [r.ok() for r in schema.get_all_operations()]
        assert {op.path for op in ops} == {"/v1/classify", "/v1/score", "/healthz", "/metrics",
                                           "/v1/models/{model}", *compat.PATHS}
        for op in ops:
            post = op.method == "post"  # a GET without parameters has no invalid form
            for mode in [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * post:
                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=30 if post else 3, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                def fuzz(case):
                    case.call_and_validate(base_url=base, checks=[not_a_server_error])

                fuzz()


def test_bad_request_fails_alone_in_its_batch(clf):
    """A request with an over-long query among requests that share a batch gets its 422 (from the
    front end, before the engine) and the others their answers, in one engine batch."""
    wrapped = Wrapped(clf)
    good = [f"good {i}" for i in range(5)]
    want = clf.classify_batch(good)
    app = create_app(wrapped, **LIMITS)
    with running(app) as (base, _):
        wrapped.gate = threading.Event()  # hold the engine so every request joins one batch

        async def go():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                first = asyncio.create_task(c.post("/v1/classify", json={"query": "holder"}))
                while wrapped.held == 0:
                    await asyncio.sleep(0.01)
                sent = [asyncio.create_task(c.post("/v1/classify", json={"query": q})) for q in good]
                sent.insert(2, asyncio.create_task(c.post("/v1/classify", json={"query": ["ok", "word " * 200]})))
                while app.state.frontend.admission.inflight < len(good) + 1:  # the bad one: 422 at once
                    await asyncio.sleep(0.01)
                wrapped.gate.set()
                return await first, await asyncio.gather(*sent)

        first, responses = asyncio.run(go())
    assert first.status_code == 200
    bad = responses.pop(2)
    assert bad.status_code == 422 and "query[1] is" in bad.json()["detail"] and "--max-tokens" in bad.json()["detail"]
    for r, w in zip(responses, want):
        assert r.status_code == 200, r.text
        check(r.json()["results"], [w])
        assert r.json()["batch_size"] == len(good)
    assert wrapped.batches[-1] == len(good)


def test_tokenizer_exception_is_the_requests_fault(clf):
    """A tokenizer that raises on some text (not an InputError) fails that request with 422; the
    server stays healthy and other requests are answered."""
    class PickyPrompt:
        def __init__(self, prompt):
            self.prompt = prompt

        def __getattr__(self, name):
            return getattr(self.prompt, name)

        def encode_many(self, values, truncate=False):
            if any("boom" in v["query"] for v in values):
                raise RuntimeError("cannot encode this")
            return self.prompt.encode_many(values, truncate)

    class Picky(Wrapped):
        @property
        def prompt(self):
            return PickyPrompt(self.clf.prompt)

    with running(create_app(Picky(clf))) as (base, _):
        bad = httpx.post(base + "/v1/classify", json={"query": ["fine", "boom"]})
        assert bad.status_code == 422 and "tokenizer could not encode" in bad.json()["detail"]
        good = httpx.post(base + "/v1/classify", json={"query": "fine"})
        assert good.status_code == 200
        check(good.json()["results"], clf.classify_batch(["fine"]))
        assert httpx.get(base + "/healthz").status_code == 200


def test_json_log_lines(capsys):
    """--log-format json: each record one JSON object (time, level, logger, process, pid, message,
    an exception's text), what log collectors read without a parser."""
    import json
    import logging

    from prefixscore.serve.logs import JsonLines

    fmt = JsonLines("worker 3")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("prefixscore.frontend", logging.ERROR, __file__, 1, "a %s line", ("bad",),
                                sys.exc_info())
    line = fmt.format(rec)
    assert "\n" not in line
    out = json.loads(line)
    assert (out["level"], out["logger"], out["process"], out["message"]) == (
        "error", "prefixscore.frontend", "worker 3", "a bad line")
    assert out["time"].endswith("Z") and "ValueError: boom" in out["exception"] and out["pid"] > 0
