"""A front end's admission alone (serve/admission.py): fair shares of a full queue, the wait
estimate as clients take turns, refusals by deadline; no engine (the server: test_slo.py)."""
import time

import pytest

from prefixscore.serve.admission import Admission, tenant_of
from prefixscore.serve.api_error import ApiError
from prefixscore.serve.config import FrontendConfig
from prefixscore.serve.metrics import Metrics


class Engine:
    """The engine client's side admission reads: a backlog and a rate (rows/s)."""

    def __init__(self, rate=None, pass_s=0.0, score_rate=None):
        self.rate, self.backlog, self.pass_s, self.score_rate = rate, 0, pass_s, score_rate

    def wait_s(self, n):
        return (self.backlog + n) / self.rate + self.pass_s if self.rate else 1.0


def admission(rate=None, score_rate=None, **kw):
    kw.setdefault("max_queries", min(kw.get("max_queue", 1024), 256))
    kw.setdefault("max_connections", 4096)
    return Admission(FrontendConfig(**kw), Engine(rate, score_rate=score_rate), Metrics())


def test_a_full_queue_still_admits_a_client_under_its_share():
    a = admission(max_queue=10)
    flood = [a.admit(1, 4, tenant=7) for _ in range(10)]
    with pytest.raises(ApiError) as e:
        a.admit(1, 4, tenant=7)
    assert e.value.status == 429 and "queue full" in e.value.detail
    light = a.admit(1, 4, tenant=9)  # 1 of 10 over two clients: within its share
    assert a.inflight == 11
    for _ in range(4):
        a.admit(1, 4, tenant=9)
    with pytest.raises(ApiError):  # 6 > 10 / 2
        a.admit(1, 4, tenant=9)
    for t in flood + [light]:
        a.release(t)
    assert a.by_tenant[0] == {9: 4} and a.held[0] == [4, 16]


def test_one_client_alone_gets_the_whole_queue_and_no_more():
    a = admission(max_queue=4)
    for _ in range(4):
        a.admit(1, 1, tenant=3)
    with pytest.raises(ApiError):
        a.admit(1, 1, tenant=3)


def test_wait_estimate_counts_the_queue_ahead_in_turns():
    """The engine's backlog is 100 rows of a flooding client (10 rows/s): a client with nothing
    queued waits about a turn, the flooder's next row the whole backlog."""
    a = admission(rate=10.0, max_queue=1000)
    for _ in range(100):
        a.admit(1, 1, tenant=7)
    a.client.backlog = 100
    assert a.wait_s(1, False, 7) == pytest.approx(10.1)
    assert a.wait_s(1, False, 9) == pytest.approx(10.1 * 2 / 101)
    deadline = time.monotonic() + 1.0
    ticket = a.admit(1, 1, deadline=deadline, tenant=9)  # 0.2 s ahead of it: admitted
    assert ticket.estimate == pytest.approx(0.2, rel=0.01)
    with pytest.raises(ApiError) as e:
        a.admit(1, 1, deadline=deadline, tenant=7)
    assert e.value.status == 429 and "past this request's deadline" in e.value.detail
    assert int(e.value.headers["Retry-After"]) >= 10
    a.client.pass_s = 0.5  # answers come a pass at a time: a pass more, not scaled by the turns
    assert a.wait_s(1, False, 9) == pytest.approx(10.1 * 4 / 102 + 0.5)  # its 2 and 2 of the flood


def test_measured_wait_beside_the_estimate_in_metrics():
    a = admission(rate=100.0)
    t = a.admit(2, 8, tenant=1)
    a.release(t, answered=True)
    a.release(a.admit(1, 1, batch=True), answered=True)  # batch work: no estimate kept
    m = a.metrics.queue_wait
    counts = {s: m.labels(s)._sum.get() for s in ("estimate", "measured")}
    assert counts["estimate"] == pytest.approx(0.02) and 0 <= counts["measured"] < 1


def test_tenants_are_stable_and_never_zero():
    assert tenant_of("id:a") == tenant_of("id:a") != tenant_of("id:b")
    assert all(tenant_of(str(i)) != 0 for i in range(1000))


def test_health_state_against_the_shortest_deadline_known():
    from prefixscore.serve.frontend import Frontend
    engine = Engine(rate=10.0)
    fe = Frontend(FrontendConfig(request_timeout=2.0), engine, Metrics(), lambda info: [])
    assert fe._state(oldest_ms=500, silent_ms=100) == "ok"
    assert fe._state(oldest_ms=2500, silent_ms=100) == "busy"  # waiting past --request-timeout
    assert fe._state(oldest_ms=2500, silent_ms=2100) == "degraded"  # and the engine silent
    engine.backlog = 30  # 3 s of work ahead of a new request
    assert fe._state(0, 0) == "busy"
    engine.backlog = 0
    with pytest.raises(ApiError):  # a 50 ms client deadline, refused: it is known all the same
        fe.admission.refuse(1, 0, deadline=time.monotonic() + 0.05)
    assert fe.admission.shortest_deadline() <= 0.05
    assert fe._state(oldest_ms=80, silent_ms=0) == "busy"


def test_client_id_from_http_headers_and_grpc_metadata():
    """X-Client-Id names the client (one header, 1 to 256 characters), else its address; gRPC
    reads x-client-id metadata and the peer the same way."""
    from types import SimpleNamespace

    from prefixscore.serve.grpc_server import call_tenant
    from prefixscore.serve.admission import request_tenant
    named = request_tenant([(b"x-client-id", b"shop-7")], ("10.0.0.1", 5))
    assert named == (tenant_of("id:shop-7"), None)
    assert request_tenant([], ("10.0.0.1", 5)) == (tenant_of("addr:10.0.0.1"), None)
    assert request_tenant([], None) == (0, None)
    assert "2 X-Client-Id headers" in request_tenant([(b"x-client-id", b"a")] * 2, None)[1]
    assert "1 to 256" in request_tenant([(b"x-client-id", b"x" * 300)], None)[1]

    def context(metadata, peer="ipv4:10.0.0.1:5123"):
        return SimpleNamespace(invocation_metadata=lambda: metadata, peer=lambda: peer)
    assert call_tenant(context([("x-client-id", "shop-7")])) == named[0]
    assert call_tenant(context([])) == tenant_of("addr:ipv4:10.0.0.1")
    with pytest.raises(ApiError) as e:
        call_tenant(context([("x-client-id", "a"), ("x-client-id", "b")]))
    assert e.value.status == 400


def test_a_score_request_is_admitted_by_its_own_run_and_the_scores_ahead():
    """A /v1/score request's wait: the classify backlog, the score tokens held ahead and its own
    tokens at the measured tokens per second of a request's run; refused at once (429) when that
    is past its deadline, and counted out on release."""
    a = admission(rate=100.0, score_rate=10_000.0)
    a.client.backlog = 10  # 0.1 s of classify rows
    first = a.admit(10, 4_000, deadline=time.monotonic() + 5, score=True)
    assert first.estimate == pytest.approx(0.1 + 0.4) and a.scoring == [4_000, 0]
    with pytest.raises(ApiError) as e:  # 0.1 + (4,000 + 8,000) / 10,000 = 1.3 s > 1 s
        a.admit(10, 8_000, deadline=time.monotonic() + 1.0, score=True)
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
    a.release(first, answered=True)
    assert a.scoring == [0, 0] and a.admit(10, 8_000, deadline=time.monotonic() + 1.0, score=True)
    assert a.metrics.queue_wait.labels("estimate")._sum.get() == 0  # classify's figure only
