"""`prefixscore serve --workers N`: a launcher, N front-end processes sharing the port and one engine
process over ZeroMQ, as a user starts it (a subprocess), with a real HTTP client. Tiny random model,
CPU. Each test starts its own server (a few seconds)."""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import random_queries
from tests.serve.procs import check, free_port, metric_sum, post_all, serve, wait_healthy



def test_workers_answer_like_in_process(model, clf):
    """Three front ends, many concurrent clients: every answer equals the in-process call's, and
    /metrics (from whichever front end answers it) sums the requests of all of them."""
    queries = random_queries(120, seed=11)
    want = clf.classify_batch(queries)
    with serve(model, workers=3) as (base, _):
        bodies = [{"query": q} for q in queries[:100]] + [{"query": queries[100:]}]
        responses = post_all(base, bodies)
        for r, w in zip(responses[:100], want):
            assert r.status_code == 200, r.text
            check(r.json()["results"], [w])
        check(responses[100].json()["results"], want[100:])
        text = httpx.get(base + "/metrics").text
        n = metric_sum(text, 'prefixscore_http_requests_total{endpoint="/v1/classify",status="200"}')
        assert n == 101
        assert metric_sum(text, "prefixscore_batch_size_count") >= 1  # the engine process's series
        assert metric_sum(text, 'process_cpu_seconds_total{pid=') > 0  # and its CPU, and ours
        assert text.count("process_cpu_seconds_total{") == 2 and 'process="engine"' in text


def test_workers_score_like_in_process(model, clf):
    """/v1/score through front-end processes: each tokenizes with the score template rebuilt over
    the engine's saved tokenizer files and sends ids; answers and errors are the in-process
    Scorer's."""
    from prefixscore import InputError
    from prefixscore.scorer import Scorer

    template = "Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\nAnswer:"
    scorer = Scorer(clf.loaded, template, ["yes", "no"], chat=False)
    requests = [
        {"query": "wool coat", "items": [" a long camel coat", " flip flops"], "apply_softmax": True},
        {"query": "wool coat", "items": ["parka"], "label_token_ids": [5, 9]},
        {"query": [11, 12, 13], "items": [[20, 21], [30]], "item_first": True},
        {"query": "wool coat", "items": ["parka"], "item_first": True},  # errors: the template's order
        {"query": "q", "items": ["a"], "labels": ["Trench Coat", "Dress"]},  # not single tokens
    ]
    with serve(model, "--score-template", template, "--score-labels", "yes,no", "--no-chat") as (base, _):
        for req in requests:
            r = httpx.post(base + "/v1/score", json=req, timeout=60)
            try:
                want = scorer.score_request(req)
            except InputError as e:
                assert r.status_code == 422 and r.json()["detail"] == str(e), r.text
                continue
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["labels"] == want["labels"] and got["usage"] == want["usage"]
            for a, b in zip(got["scores"], want["scores"], strict=True):
                assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_engine_killed_then_restarted(model, clf):
    """Killing the engine process: requests in flight and after get 503 within a second (none
    hangs), /healthz is unhealthy; with --restart-engine a new engine serves again."""
    with serve(model, "--restart-engine", "--batch-window-ms", "3000") as (base, proc):
        pid = httpx.get(base + "/healthz").json()["engine"]["pid"]

        async def go():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                sent = [asyncio.create_task(c.post("/v1/classify", json={"query": [f"q{i}", "x"]}))
                        for i in range(2)]
                while metric_sum((await c.get("/metrics")).text, "prefixscore_queue_depth ") < 4:
                    await asyncio.sleep(0.02)  # accepted, waiting in the engine's batch window
                t = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                out = await asyncio.gather(*sent)
                return out, time.perf_counter() - t

        responses, took = asyncio.run(go())
        assert [r.status_code for r in responses] == [503] * 2, [r.text for r in responses]
        assert took < 1.0 and "engine" in responses[0].json()["detail"]
        h = httpx.get(base + "/healthz")
        assert h.status_code == 503
        after = wait_healthy(base, proc, timeout=90)
        assert after["engine"]["pid"] != pid
        r = httpx.post(base + "/v1/classify", json={"query": "red dress"})
        assert r.status_code == 200
        check(r.json()["results"], clf.classify_batch(["red dress"]))


def test_sigterm_under_load_loses_nothing(model, clf):
    """SIGTERM while requests are queued: every accepted request is answered correctly, one sent
    after the drain began is refused 503 + Retry-After or never connects, the server exits 0, and
    the port is closed."""
    queries = random_queries(40, seed=5)
    want = clf.classify_batch(queries)
    # A long window keeps the accepted requests queued until SIGTERM has landed (a fixed sleep
    # raced the host's load: CI once saw only 19 of 40 accepted after 0.15 s).
    with serve(model, "--batch-window-ms", "3000") as (base, proc):
        async def go():
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as c:
                sent = [asyncio.create_task(c.post("/v1/classify", json={"query": q})) for q in queries]
                while metric_sum((await c.get("/metrics")).text, "prefixscore_queue_depth ") < len(queries):
                    await asyncio.sleep(0.02)  # all accepted, waiting in the engine's batch window
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                try:
                    late = await c.post("/v1/classify", json={"query": "late"})
                except httpx.TransportError as e:
                    late = e
                return await asyncio.gather(*sent), late

        responses, late = asyncio.run(go())
        assert proc.wait(60) == 0
    assert [r.status_code for r in responses] == [200] * len(queries), [r.text for r in responses]
    for r, w in zip(responses, want):
        check(r.json()["results"], [w])
    if isinstance(late, httpx.Response):  # reached a draining front end on a kept-alive connection
        assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
        assert "shutting down" in late.json()["detail"]
    with pytest.raises(httpx.ConnectError):
        httpx.post(base + "/v1/classify", json={"query": "late"})


def test_busy_port_fails_before_loading(model):
    """A busy port is one clear error line and exit status 2, before any model loads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "prefixscore.cli", "serve", "--model", "/nonexistent",
                              "--port", str(port), "--workers", "2"], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert time.perf_counter() - t < 30


def test_engine_that_cannot_start_ends_the_server(tmp_path):
    """An engine that fails before it is ready (here: a model folder whose files pass the
    launcher's checks, config.json and a *.safetensors file, but do not load) ends the server
    with status 2 instead of restarting forever."""
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    out = subprocess.run([sys.executable, "-m", "prefixscore.cli", "serve", "--model", str(bad),
                          "--port", str(free_port()), "--workers", "2", "--restart-engine",
                          "--log-level", "error"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "before it was ready" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_item_table_without_its_model_record_is_one_line(model, clf, tmp_path, workers):
    """A table that does not record the base model it was made for is refused at start-up, in
    either layout, with one line naming what is missing (with --workers 2 the engine process
    printed a traceback)."""
    import torch

    from prefixscore.item_table import write_table
    from tests.serve.conftest import SCORE_TEMPLATE

    table = tmp_path / "items.parquet"
    write_table(table, ["a"], torch.zeros(1, clf.loaded.model.config.hidden_size))
    out = subprocess.run([sys.executable, "-m", "prefixscore.cli", "serve", "--model", str(model),
                          "--device", "cpu", "--port", str(free_port()), "--workers", workers,
                          "--score-template", SCORE_TEMPLATE, "--score-labels", "yes,no",
                          "--item-table", str(table)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "does not record the base model" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
