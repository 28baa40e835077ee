"""--max-connections the way nginx and Envoy hold it (serve/connections.py): at the limit the oldest
idle connections (keep-alive between requests, sockets that sent nothing) are closed for new ones,
never one with a request in progress; only when more than the limit are truly busy are new
requests answered 503 in the server's JSON shape with Retry-After, /healthz still served. In one
process, on the uvicorn protocol `prefixscore serve` runs. Tiny random model, CPU."""
import json
import socket
import time

import httpx

from prefixscore.serve import create_app
from prefixscore.serve.admission import tenant_of
from tests.serve.helpers import metric, running

# 8 connections; the config check wants the queue a worker admits below that
SMALL = dict(max_connections=8, max_queue=4, max_queries=4, header_timeout=30.0, body_timeout=30.0)
BODY = json.dumps({"query": "red dress"}).encode()
POST = (b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(BODY))


def connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def response(s) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response read off s (content-length framed): status, headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


def responses(s, n) -> list[tuple[int, dict, bytes]]:
    """n HTTP/1.1 responses read off s in order (pipelined: they may come in one packet)."""
    data, out = b"", []
    while len(out) < n:
        head, sep, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        size = int(dict(line.lower().split(": ", 1) for line in lines[1:]).get("content-length", 0)) if sep else 0
        if not sep or len(rest) < size:
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {len(out)} responses: {data!r}"
            data += chunk
            continue
        out.append((int(lines[0].split()[1]), dict(line.lower().split(": ", 1) for line in lines[1:]), rest[:size]))
        data = rest[size:]
    return out


def closed(s, timeout=2.0) -> bool:
    """The server closed s (EOF or reset) within timeout; False while it stays open."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def busy_count(server) -> int:
    reg = server.config.http_protocol_class.connections_registry
    return len(reg.live) - len(reg.idle)


def wait_busy(server, n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while busy_count(server) < n:
        assert time.monotonic() < deadline, f"{busy_count(server)} busy connections, not {n}"
        time.sleep(0.01)


def test_idle_connections_closed_first_at_the_limit(clf):
    """An idle flood (keep-alive connections that completed a request, then sockets that sent
    nothing) over a limit of 8: new connections still get /healthz and /v1/classify answered at
    once, the oldest idle connections were closed for them, and a connection in the middle of a
    request (half its body sent) is not closed and is answered when its body arrives."""
    with running(create_app(clf, **SMALL)) as (base, server):
        port = int(base.rsplit(":", 1)[1])
        mid = connect(port)
        mid.sendall(POST + BODY[:5])
        wait_busy(server, 1)
        kept = []
        for _ in range(12):
            s = connect(port)
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            assert response(s)[0] == 200
            kept.append(s)
        half = [connect(port) for _ in range(12)]
        try:
            t = time.perf_counter()
            assert httpx.get(base + "/healthz", timeout=5).status_code == 200
            r = httpx.post(base + "/v1/classify", json={"query": "blue jeans"}, timeout=5)
            assert r.status_code == 200, r.text
            assert time.perf_counter() - t < 3
            # oldest first: every kept-alive one, then the oldest sockets that sent nothing
            assert all(closed(s) for s in kept)
            assert all(closed(s) for s in half[:5])
            assert not any(closed(s, 0.05) for s in half[-5:])  # the newest idle ones stay
            mid.sendall(BODY[5:])
            status, _, body = response(mid)
            assert status == 200 and json.loads(body)["results"][0]["query"] == "red dress"
            reg = server.config.http_protocol_class.connections_registry
            assert reg.closed_idle >= 18
        finally:
            for s in [mid, *kept, *half]:
                s.close()


def test_busy_connections_over_the_limit(clf):
    """Past the limit with every connection in the middle of a request, a new request is answered
    503 in the server's JSON shape with Retry-After (never uvicorn's plain text), /healthz is still
    served, and the busy connections all finish normally."""
    with running(create_app(clf, **SMALL)) as (base, server):
        port = int(base.rsplit(":", 1)[1])
        busy = []
        for _ in range(8):
            s = connect(port)
            s.sendall(POST + BODY[:5])
            busy.append(s)
        try:
            wait_busy(server, 8)
            r = httpx.post(base + "/v1/classify", json={"query": "blue jeans"}, timeout=5)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "--max-connections" in r.json()["detail"]
            assert r.headers["connection"] == "close"
            assert httpx.get(base + "/healthz", timeout=5).status_code == 200
            for s in busy:
                s.sendall(BODY[5:])
                assert response(s)[0] == 200
            # below the limit again: served; the 503 was counted like every response
            r = httpx.post(base + "/v1/classify", json={"query": "blue jeans"}, timeout=5)
            assert r.status_code == 200, r.text
            text = httpx.get(base + "/metrics", timeout=5).text
            assert metric(text, 'prefixscore_http_requests_total{endpoint="/v1/classify",status="503"}') == 1
        finally:
            for s in busy:
                s.close()


def test_a_front_end_behind_its_target_sheds_at_once(clf):
    """With a latency target, a compute request read while the front end's loop runs more than
    the target behind (it sat unread that long) is answered 503 + Retry-After by the protocol, on
    a connection that stays open; probes are still served, and once caught up requests are served."""
    app = create_app(clf, shed_lag_ms=20.0, **SMALL)
    with running(app) as (base, server):
        port = int(base.rsplit(":", 1)[1])
        loop = app.state.frontend.client.loop
        s = connect(port)
        try:
            request = POST + BODY
            loop.call_soon_threadsafe(time.sleep, 0.15)  # the loop held: the request waits unread
            time.sleep(0.02)
            s.sendall(request)
            status, headers, detail = response(s)
            assert status == 503 and headers["retry-after"] == "1" and b"behind" in detail, (headers, detail)
            assert headers.get("connection") != "close"
            time.sleep(0.2)
            s.sendall(request)  # the same connection, caught up: served
            assert response(s)[0] == 200
        finally:
            s.close()
        assert httpx.get(base + "/healthz", timeout=5).status_code == 200
        text = httpx.get(base + "/metrics", timeout=5).text
        assert metric(text, 'prefixscore_expired_total{reason="front_end_behind"}') == 1


def test_a_shed_answer_is_written_in_order_and_bounded(clf):
    """The shed 503 is written by the protocol itself: two requests pipelined on one connection
    are answered in order and the connection then serves; a body split across packets is read
    before the answer; a client's `connection: close` is kept; a body that never comes is
    answered and closed within --body-timeout. Each answer has the app's shape: JSON detail,
    Retry-After, Date; each is counted."""
    app = create_app(clf, shed_lag_ms=20.0, **{**SMALL, "body_timeout": 0.5})
    with running(app) as (base, server):
        port = int(base.rsplit(":", 1)[1])
        loop = app.state.frontend.client.loop
        piped, split, close, stall = (connect(port) for _ in range(4))
        try:
            loop.call_soon_threadsafe(time.sleep, 0.15)  # the loop held: every request waits unread
            time.sleep(0.02)
            piped.sendall(POST + BODY + POST + BODY)
            split.sendall(POST + BODY[:5])
            close.sendall(POST.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1) + BODY)
            stall.sendall(POST)
            for status, headers, detail in responses(piped, 2):
                assert status == 503 and headers["retry-after"] == "1" and "date" in headers, headers
                assert headers["content-type"] == "application/json"
                assert "running behind" in json.loads(detail)["detail"]
            status, headers, _ = response(close)
            assert status == 503 and headers["connection"] == "close" and closed(close)
            time.sleep(0.2)
            split.sendall(BODY[5:])
            assert response(split)[0] == 503
            t = time.monotonic()
            status, headers, _ = response(stall)
            assert status == 503 and headers["connection"] == "close" and closed(stall)
            assert time.monotonic() - t < 1.0
            piped.sendall(POST + BODY)  # caught up: the same connection is served
            assert response(piped)[0] == 200
            split.sendall(POST + BODY)
            assert response(split)[0] == 200
        finally:
            for s in (piped, split, close, stall):
                s.close()
        text = httpx.get(base + "/metrics", timeout=5).text
        assert metric(text, 'prefixscore_expired_total{reason="front_end_behind"}') == 5
        assert metric(text, 'prefixscore_http_requests_total{endpoint="/v1/classify",status="503"}') == 5


def test_a_front_end_behind_sheds_the_heavy_client_not_the_light_one(clf):
    """Running behind, the front end still reads the requests of a client holding fewer queries
    than the others (admission.Admission.light): one client's flood is shed, not another's
    request beside it."""
    app = create_app(clf, shed_lag_ms=20.0, **SMALL)
    with running(app) as (base, server):
        port = int(base.rsplit(":", 1)[1])
        fe = app.state.frontend
        flood = tenant_of("id:flood")
        fe.admission.by_tenant[0][flood] = 20  # the flood's queries held, as under overload
        loop = fe.client.loop
        heavy, light = connect(port), connect(port)
        try:
            loop.call_soon_threadsafe(time.sleep, 0.15)  # the loop held: both wait unread
            time.sleep(0.02)
            heavy.sendall(POST.replace(b"\r\n\r\n", b"\r\nX-Client-Id: flood\r\n\r\n", 1) + BODY)
            light.sendall(POST.replace(b"\r\n\r\n", b"\r\nX-Client-Id: light\r\n\r\n", 1) + BODY)
            assert response(heavy)[0] == 503
            assert response(light)[0] == 200
        finally:
            heavy.close()
            light.close()
            del fe.admission.by_tenant[0][flood]
