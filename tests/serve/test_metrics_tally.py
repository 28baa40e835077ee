"""metrics.Tally: observations counted by bucket and written in one go give the histogram that
observe() one by one gives (bucket edges included), in multiprocess mode too."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from prefixscore.serve.metrics import Metrics

CHECK = r"""
import asyncio, random
from prefixscore.serve.metrics import LATENCY_BUCKETS, Metrics
from prometheus_client import generate_latest

def lines(m, name, label):  # one series' samples (stage "total"), its label value taken out
    return sorted(l.replace(label, "X") for l in generate_latest(m.registry).decode().splitlines()
                  if l.startswith(name) and label in l and "_created" not in l
                  and ("stage=" not in l or 'stage="total"' in l))

rng = random.Random(0)
values = [rng.choice(LATENCY_BUCKETS) for _ in range(200)] + [rng.uniform(0, 12) for _ in range(500)]
m = Metrics()
for v in values:
    m.latency.labels("direct", "total").observe(v)
    m.request_seconds.labels("/direct").observe(v)

async def go():
    st, route = m.stages("tallied")["total"], m.route("/tallied")
    for v in values:
        st.observe(v)
        route.observe(v)
    assert m.tallies  # not written yet
    await asyncio.sleep(0.2)  # FLUSH_AFTER passed: written by the timer
    assert not m.tallies

asyncio.run(go())
for name, a, b in (("prefixscore_latency_seconds", '"direct"', '"tallied"'),
                   ("prefixscore_http_request_duration_seconds", '"/direct"', '"/tallied"')):
    want, got = lines(m, name, a), lines(m, name, b)
    assert want == got and len(want) == len(LATENCY_BUCKETS) + 3, (want, got)
print("ok")
"""

def test_tally_writes_what_observe_writes():
    exec(compile(CHECK.replace('print("ok")', ""), "check", "exec"), {})


def test_tally_in_multiprocess_mode(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_scrape_writes_what_waits():
    m = Metrics()
    m.route("/v1/score").observe(0.003)  # no event loop: written at once
    assert not m.tallies
    async def go():
        m.route("/v1/score").observe(0.004)
        assert m.tallies
        assert b'prefixscore_http_request_duration_seconds_count{endpoint="/v1/score"} 2.0' in m.exposition()
    asyncio.run(go())
