"""`prefixscore serve` in a subprocess, as a user starts it: a free port, waiting for /healthz, POSTs
at once, and the run-to-exit form whose start-up errors the tests read."""
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base, proc, timeout=90):
    deadline = time.monotonic() + timeout
    last = None
    while True:
        assert proc.poll() is None, f"server exited {proc.returncode}"
        assert time.monotonic() < deadline, f"server never became ready: {last}"
        try:
            r = httpx.get(base + "/healthz")
            if r.status_code == 200:
                return r.json()
            last = r.text
        except httpx.TransportError as e:
            last = repr(e)
        time.sleep(0.1)


@contextmanager
def serve(model, *flags, workers=2):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PREFIXSCORE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "serve", "--model", str(model),
                             "--device", "cpu", "--port", str(port), "--workers", str(workers),
                             "--log-level", "info", *flags], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def post_all(base, bodies, timeout=60):
    async def go():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as c:
            return await asyncio.gather(*(c.post("/v1/classify", json=b) for b in bodies),
                                        return_exceptions=True)

    return asyncio.run(go())


def check(got, want):
    assert [r["label"] for r in got] == [w.label for w in want]
    for g, w in zip(got, want):
        assert max(abs(g["scores"][k] - v) for k, v in w.scores.items()) < 1e-4


def metric_sum(text, prefix):
    """Sum of the samples whose line starts with prefix, their `model` label aside."""
    lines = (re.sub(r',?model="[^"]*"', "", l).replace("{,", "{").replace("{}", "")
             for l in text.splitlines())
    return sum(float(l.split()[-1]) for l in lines if l.startswith(prefix))


def serve_cmd(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "prefixscore.cli", "serve", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=(env or os.environ) | {"OMP_NUM_THREADS": "1"})


def one_error(p, text):
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and text in lines[0], p.stderr[-2000:]
