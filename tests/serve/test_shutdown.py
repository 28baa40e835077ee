"""SIGTERM (or SIGINT, Ctrl-C) while a backlog is queued, as a user's orchestrator sends it to
`prefixscore serve` (a subprocess): the server exits 0 within --shutdown-timeout + 1 s in the one-process layout (the
engine on a thread, whose pass in flight once aborted the interpreter's exit: status 134) and the
launcher's (front-end and engine processes); every request is answered, 200 or 503 with
Retry-After; no process it started is left. Tiny random model, CPU."""
import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.serve.procs import metric_sum, serve


TIMEOUT = 2.0  # --shutdown-timeout
# Nothing refused before SIGTERM: the backlog is admitted whole and waits in the engine's queue.
ROOMY = ["--max-queue", "100000", "--max-queue-tokens", "100000000", "--max-connections", "200000",
         "--max-queue-ms", "60000", "--shutdown-timeout", str(TIMEOUT)]
# ~10 s of engine work on 2 busy CPUs (about 1000 such rows/s): it outlasts the drain on faster
# hosts too, so the backlog is still queued when the front ends give up on it.
REQUESTS, QUERIES = 300, 32


def descendants(pid: int) -> set[int]:
    """Every process under pid, from /proc (no psutil)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parent.items() if pp == p}
        todo += kids - found
        found |= kids
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.parametrize("workers,sig", [(1, signal.SIGTERM), (2, signal.SIGTERM), (2, signal.SIGINT)])
def test_sigterm_with_a_backlog(model, workers, sig):
    with serve(model, *ROOMY, workers=workers) as (base, proc):
        children = descendants(proc.pid)
        assert workers == 1 or len(children) >= 3, children  # a front end each, the engine

        async def go():
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as c:
                sent = [asyncio.create_task(c.post("/v1/classify", json={
                            "query": [f"backlog {i} {j} " * 12 for j in range(QUERIES)]}))
                        for i in range(REQUESTS)]
                while True:  # until every request is admitted: answered, in flight or queued
                    queued = metric_sum((await c.get("/metrics")).text, "prefixscore_queue_depth ")
                    if queued + QUERIES * sum(t.done() for t in sent) >= REQUESTS * QUERIES:
                        break
                    await asyncio.sleep(0.05)
                proc.send_signal(sig)
                t = time.monotonic()
                responses = await asyncio.gather(*sent)
                return t, responses

        t, responses = asyncio.run(go())
        code = proc.wait(30)
        elapsed = time.monotonic() - t
    assert code == 0, f"exit status {code} (134 or -6: aborted at exit)"
    assert elapsed <= TIMEOUT + 1.0, f"{elapsed:.2f} s after {sig.name}"
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, [r.text for r in responses if r.status_code not in (200, 503)]
    refused = [r for r in responses if r.status_code == 503]
    assert refused, "the backlog did not outlast the drain: nothing tested the 503 path"
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1 and "shutting down" in r.json()["detail"], r.text
    deadline = time.monotonic() + 1.0
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in children if alive(p)], "processes left behind"
