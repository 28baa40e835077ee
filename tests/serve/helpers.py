"""What the serving tests share: the in-process server `prefixscore serve --workers 1` runs (uvicorn
in a thread on a free loopback port), its limits, a classifier whose engine can be slowed, gated or
failed, and checks of answers and metrics. Servers in subprocesses: procs.py; fixtures: conftest.py."""
import asyncio
import re
import socket
import threading
import time
from contextlib import contextmanager

import httpx

LIMITS = dict(max_queries=8, max_tokens=48, max_body_bytes=4096, max_queue=64)
JSON = {"content-type": "application/json"}
SCORE_TEMPLATE = "Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\nAnswer:"


@contextmanager
def running(app, wait_ready=True):
    """The server `prefixscore serve` runs (uvicorn with its bounded protocol and draining
    shutdown) in a thread on a free loopback port; stopped (gracefully) on exit."""
    from prefixscore.serve.launch import uvicorn_server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    fe = app.state.frontend
    server = uvicorn_server(app, fe.cfg, fe)
    server.config.log_level = "warning"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        if wait_ready:
            ready(base)
        yield base, server
    finally:
        server.should_exit = True
        thread.join(40)
        sock.close()
        assert not thread.is_alive(), "server thread still running"


def ready(base, timeout=30):
    deadline = time.monotonic() + timeout
    while httpx.get(base + "/healthz").status_code != 200:
        assert time.monotonic() < deadline, "server never became ready"
        time.sleep(0.02)


async def hold_engine(wrapped, client, query="holder"):
    """POST a classify request and return its task once the gated engine (Wrapped with a gate)
    holds it in a pass."""
    task = asyncio.create_task(client.post("/v1/classify", json={"query": query}))
    while wrapped.held == 0:
        await asyncio.sleep(0.01)
    return task


class Wrapped:
    """The real classifier with a slower, gated or failing engine (tests of timing and faults)."""

    def __init__(self, clf, delay=0.0, gate=None):
        self.clf, self.delay, self.gate = clf, delay, gate
        self.fail, self.fail_once, self.batches, self.held = False, False, [], 0

    def __getattr__(self, name):
        return getattr(self.clf, name)

    def decide_encoded(self, encoded):  # what the engine loop calls
        if self.gate is not None:
            self.held = len(encoded)
            self.gate.wait(30)
            self.held = 0
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("device lost")
        if self.fail_once:
            self.fail_once = False
            raise RuntimeError("device lost once")
        self.batches.append(len(encoded))
        return self.clf.decide_encoded(encoded)


def check(results, reference):
    assert [r["query"] for r in results] == [r.query for r in reference]
    for got, want in zip(results, reference):
        assert got["label"] == want.label
        assert got["scores"].keys() == want.scores.keys()
        for label, s in want.scores.items():
            assert abs(got["scores"][label] - s) < 1e-4


def metric(text, name):
    """Value of one sample line of the Prometheus text format (0 when absent). The `model` label of
    every series, and `classifier`, count only where `name` gives them."""
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if unlabelled(sample, name) == name:
            return float(value)
    return 0.0


def unlabelled(sample, name=""):
    """The sample line's name and labels without `model` / `classifier` (those `name` lacks)."""
    for label in ("model", "classifier"):
        if f'{label}="' not in name:
            sample = re.sub(rf',?{label}="[^"]*"', "", sample)
    return sample.replace("{,", "{").replace("{}", "")


def post_all(base, bodies):
    """POST every body to /v1/classify at once, each on its own connection."""
    async def go():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/classify", json=b) for b in bodies))

    return asyncio.run(go())
