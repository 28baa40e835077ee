"""`prefixscore serve --data-parallel N`: N engine processes behind the front ends, each pass's
message to the least-loaded engine. On CPU every engine runs on cpu (a process each), which is how
CI runs several; tiny random model."""
import asyncio
import os
import re
import signal
import time

import httpx
import numpy as np
import pytest

from tests.helpers import random_queries
from tests.serve.procs import check, one_error, post_all, serve, serve_cmd
from prefixscore.serve import protocol as P
from prefixscore.serve.client import BaseClient, EngineDead
from prefixscore.serve.dp_client import DataParallelClient, least_loaded



# ---------------------------------------------------------------- the choice (no processes)

def test_least_loaded_choice():
    assert least_loaded([3, 1, 2], 0) == 1
    assert least_loaded([None, 5, 2], 0) == 2  # None: not ready, never chosen
    assert least_loaded([None, None], 3) is None
    # ties go round robin from the turn, so an idle server uses every engine
    assert [least_loaded([0, 0, 0], t) for t in range(4)] == [0, 1, 2, 0]
    assert least_loaded([1, 0, 0], 0) == 1 and least_loaded([1, 0, 0], 2) == 2


class FakeEngine(BaseClient):
    """An engine's client without a socket: records what was sent to it."""

    def __init__(self, client_id):
        super().__init__(client_id)
        self.sent = []

    def start(self, loop):
        self.loop = loop

    def _send(self, msg):
        self.sent.append(msg)


def ready(pid, prefix=(1, 2, 3)):
    c = P.ClassifierInfo(name="m", template="{query}", chat=False, special_tokens=False,
                         labels=["a", "b"], mode="logprobs", truncate=False,
                         prefix_ids=list(prefix), context_limit=100, memory={})
    return P.ReadyOut(model="m", tokenizer_path=f"/tmp/t-{pid}", classifiers=[c],
                      max_batch_tokens=64, scorer=None, device="cpu", pid=pid)


def answer(msg):
    n = len(msg.rids)
    return P.ClassifyOut(msg.rids, [P.OK] * n, [0] * n, np.zeros((n, 2), np.float32).tobytes(),
                         {}, 0.001, n, 0)


def test_router_sends_each_pass_to_the_least_loaded_engine():
    """One message per event-loop pass, whole, to the engine with the fewest rows in flight from
    this front end; a dead engine's requests fail (503) and new ones go to the live one; an
    engine whose Ready disagrees is never used and stops the front end."""
    async def go():
        loop = asyncio.get_running_loop()
        client = DataParallelClient(["a", "b", "c"], 7, connect=FakeEngine)
        mismatches = []
        client.on_mismatch = mismatches.append
        client.start(loop)
        a, b, c = client.engines
        assert client.error == "starting"
        a._on_out(ready(10))
        b._on_out(ready(11))
        assert client.error is None and client.info.pid == 10
        c._on_out(ready(12, prefix=(9,)))  # another prompt: refused
        assert mismatches and "engine 2" in mismatches[0] and "prefix_ids" in mismatches[0]
        assert client.loads() == [0, 0, None]

        first = [client.classify([[1, 2, 3, 4]] * 3, [3] * 3, time.monotonic() + 9) for _ in range(2)]
        await asyncio.sleep(0)  # the pass ends: both requests leave in one message, to one engine
        assert len(a.sent) + len(b.sent) == 1
        busy, idle = (a, b) if a.sent else (b, a)
        assert len(busy.sent[0].rids) == 6 and client.loads().count(6) == 1
        second = client.classify([[1, 2, 3, 5]], [3], time.monotonic() + 9)
        await asyncio.sleep(0)
        assert len(idle.sent) == 1  # the least loaded, not the next in turn
        idle._on_out(answer(idle.sent[0]))
        assert (await second).n_done == 1

        b._fail_all("engine process went away")  # b died: its requests fail, a takes the rest
        if busy is b:
            for f in first:
                with pytest.raises(EngineDead):
                    await f
        assert client.error is None and client.loads() == [len(a.jobs), None, None]
        n = len(a.sent)
        later = client.classify([[1, 2, 3, 6]], [3], time.monotonic() + 9)
        await asyncio.sleep(0)
        assert len(a.sent) == n + 1 and not b.sent[1:]
        a._on_out(answer(a.sent[-1]))
        assert (await later).n_done == 1
        health = client.health()["engines"]
        assert [e["ready"] for e in health] == [True, False, False]
        assert "went away" in health[1]["error"] and "does not serve" in health[2]["error"]

        a._fail_all("engine process went away")
        assert client.error.startswith("engine 0: engine process went away")
        with pytest.raises(EngineDead):
            client.classify([[1]], [0], time.monotonic() + 9)

    asyncio.run(go())


def test_abort_reaches_the_engine_holding_the_request():
    """A request aborted (its client left, its deadline passed) after its pass went to an engine is
    dropped there: the abort names its rows and only its rows, on that engine's client, and an
    answered request leaves nothing behind to abort."""
    async def go():
        loop = asyncio.get_running_loop()
        client = DataParallelClient(["a", "b"], 7, connect=FakeEngine)
        client.start(loop)
        for i, e in enumerate(client.engines):
            e._on_out(ready(10 + i))
        keep = client.classify([[1, 2, 3, 4]] * 2, [3] * 2, time.monotonic() + 9)
        drop = client.classify([[1, 2, 3, 5]] * 3, [3] * 3, time.monotonic() + 9)
        await asyncio.sleep(0)
        e = next(e for e in client.engines if e.sent)
        rids = e.sent[0].rids
        client.abort([drop])
        await asyncio.sleep(0)
        aborts = [m for x in client.engines for m in x.sent if isinstance(m, P.AbortReq)]
        assert len(aborts) == 1 and aborts[0].rids == rids[2:] and aborts in ([e.sent[-1]],)
        e._on_out(answer(P.ClassifyReq(7, rids[:2], b"", [0], [], [], [], [])))
        assert (await keep).n_done == 2 and not e.rids_of.get(keep)
        client.abort([keep])  # already answered: no message
        await asyncio.sleep(0)
        assert sum(isinstance(m, P.AbortReq) for x in client.engines for m in x.sent) == 1

    asyncio.run(go())


# ---------------------------------------------------------------- the server (processes)



def all_engines_ready(base, timeout=90):
    """/healthz once every engine is ready (the server is healthy from the first one on)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(base + "/healthz").json()
        if all(e["ready"] for e in h.get("engines", [])) and h["status"] == "ok":
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


def engines_served(text):
    """Requests per engine, from the engine-labelled batch-size histogram."""
    out = {}
    for line in text.splitlines():
        m = re.match(r'prefixscore_batch_size_sum\{.*engine="(\d+)"', line)
        if m:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + float(line.split()[-1])
    return out


def test_data_parallel_answers_like_one_engine(model, clf):
    """Two front ends, two CPU engine processes: answers equal the in-process classifier's, both
    engines serve, /metrics says which served what; one engine killed, the other serves on and
    /healthz (still 200) says which is gone."""
    queries = random_queries(160, seed=23)
    want = clf.classify_batch(queries)
    with serve(model, "--data-parallel", "2", workers=2) as (base, proc):
        h = all_engines_ready(base)
        engines = h["engines"]
        assert len(engines) == 2, h
        assert len({e["pid"] for e in engines}) == 2 and h["engine"]["pid"] == engines[0]["pid"]

        responses = post_all(base, [{"query": q} for q in queries[:150]] + [{"query": queries[150:]}])
        for r, w in zip(responses[:150], want):
            assert r.status_code == 200, r.text
            check(r.json()["results"], [w])
        check(responses[150].json()["results"], want[150:])
        text = httpx.get(base + "/metrics").text
        served = engines_served(text)
        assert sum(served.values()) == 160 and served.get(0, 0) > 0 and served.get(1, 0) > 0, served
        for i, e in enumerate(engines):  # each engine's process metrics, labelled
            assert re.search(rf'process_cpu_seconds_total{{engine="{i}",[^}}]*pid="{e["pid"]}",'
                             rf'process="engine"}}', text), text

        victim = engines[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # every front end sees the socket close within milliseconds
            h = httpx.get(base + "/healthz")
            if h.status_code == 200 and not h.json()["engines"][1]["ready"]:
                break
            assert time.monotonic() < deadline, h.text
            time.sleep(0.05)
        time.sleep(0.3)
        responses = post_all(base, [{"query": q} for q in queries[:40]])
        ok = [r for r in responses if r.status_code == 200]
        assert len(ok) >= 36, [r.text for r in responses if r.status_code != 200]  # 503: in flight
        for r, w in zip(responses, want):
            if r.status_code == 200:
                check(r.json()["results"], [w])
            else:
                assert r.status_code == 503, r.text
        for _ in range(4):  # both front ends, whichever answers
            body = httpx.get(base + "/healthz").json()
            assert body["status"] == "ok" and body["engines"][1]["ready"] is False, body
            assert body["engines"][1]["pid"] == victim and body["engine"]["pid"] == engines[0]["pid"]
        assert proc.poll() is None


@pytest.mark.parametrize("flags, text", [
    (["--data-parallel", "0"], "--data-parallel must be at least 1"),
    (["--data-parallel", "2", "--engine-cpu", "0"], "--engine-cpu pins one engine"),
    (["--data-parallel", "2", "--device", "cuda:1"], "cuda"),
])
def test_data_parallel_flags_before_the_model(unreadable_model, flags, text):
    p = serve_cmd("--model", unreadable_model, "--port", "0", "--workers", "2", *flags)
    one_error(p, text)


def test_one_worker_two_engines_restart(model, clf):
    """--workers 1 with two engines is the launcher's layout (one front-end process), not the
    single process; with --restart-engine a killed engine (here the one whose Ready the front end
    took first) comes back with a new pid and serves again, the other serving meanwhile."""
    with serve(model, "--data-parallel", "2", "--restart-engine", workers=1) as (base, proc):
        h = all_engines_ready(base)
        pids = [e["pid"] for e in h["engines"]]
        assert proc.pid not in pids and len(set(pids)) == 2
        os.kill(pids[0], signal.SIGKILL)
        r = httpx.post(base + "/v1/classify", json={"query": "red dress"})
        assert r.status_code in (200, 503), r.text  # 503 only if it was routed to the dead one
        deadline = time.monotonic() + 90
        while True:
            body = httpx.get(base + "/healthz").json()
            e0 = body["engines"][0]
            if e0["ready"] and e0["pid"] != pids[0]:
                break
            assert body["status"] == "ok", body  # engine 1 serves meanwhile
            assert time.monotonic() < deadline, body
            time.sleep(0.1)
        queries = random_queries(20, seed=3)
        responses = post_all(base, [{"query": q} for q in queries])
        for r, w in zip(responses, clf.classify_batch(queries)):
            assert r.status_code == 200, r.text
            check(r.json()["results"], [w])
        text = httpx.get(base + "/metrics").text
        assert f'pid="{e0["pid"]}",process="engine"' in text and f'pid="{pids[0]}"' not in text
