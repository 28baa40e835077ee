"""The HTTP side of a front-end process: the uvicorn server, whose shutdown drains through the
Frontend (and the gRPC server beside it), and its connections: uvicorn's httptools protocol,
bounded. A request's headers must arrive whole within --header-timeout and be at most
--max-header-bytes, and a process holds at most --max-connections connections the way nginx and
Envoy hold theirs: at the limit, a new connection closes the oldest idle ones (keep-alive
connections between requests, sockets that have sent nothing yet), never one with a request in
progress. So a flood of idle sockets costs the server nothing that a new request needs, /healthz
included (uvicorn's limit_concurrency, used before, answered every request 503 once idle sockets
filled the limit). Only when more than --max-connections connections are truly busy are new
requests refused: 503 in the server's JSON shape with Retry-After, /healthz still answered (a busy
server is alive).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections import OrderedDict

from .admission import request_tenant

log = logging.getLogger("prefixscore.serve")
# Shutdown timing, in seconds around --shutdown-timeout T after the stop signal. At T - FAIL a
# front end answers what still waits 503 (before uvicorn would cancel it: a 500); by T +
# EXIT_GRACE every process of the server is gone (launch.py), the exit taking the rest of a second.
FAIL, EXIT_GRACE = 0.5, 0.6
BUSY = "over --max-connections ({}) connections with a request in progress; retry later"


class Connections:
    """One server's live connections and, oldest first, the idle ones among them: those without a
    request in progress (idle since they connected, or since their last response). A connection
    is busy from the first byte of a request to the end of its response."""

    def __init__(self, limit: int):
        self.limit = limit
        self.live: set = set()
        self.idle: OrderedDict = OrderedDict()  # connection -> None, least recently active first
        self.closed_idle = 0  # closed to make room
        self.said = {"idle": 0.0, "busy": 0.0}  # when each was last logged: a line per burst

    def make_room(self) -> None:
        """Before a new connection is counted: close the oldest idle ones until it fits."""
        while len(self.live) >= self.limit and self.idle:
            conn, _ = self.idle.popitem(last=False)
            self.live.discard(conn)
            self.closed_idle += 1
            conn.transport.close()  # connection_lost follows; HTTP lets a server close idle ones
            self.say("idle", logging.INFO, f"at --max-connections ({self.limit}): closing the "
                                           f"oldest idle connections for new ones")

    def say(self, what: str, level: int, line: str) -> None:
        now = time.monotonic()
        if now - self.said[what] > 10:
            self.said[what] = now
            log.log(level, line)

    def add(self, conn) -> None:
        self.make_room()
        self.live.add(conn)
        self.idle[conn] = None

    def busy(self, conn) -> None:
        self.idle.pop(conn, None)

    def rest(self, conn) -> None:
        if conn in self.live:
            self.idle[conn] = None
            self.idle.move_to_end(conn)  # the newest idle: closed last

    def remove(self, conn) -> None:
        self.live.discard(conn)
        self.idle.pop(conn, None)

    def too_busy(self) -> bool:
        """More connections with a request in progress than the limit (the caller's included)."""
        return len(self.live) - len(self.idle) > self.limit


def protocol_class(cfg, frontend=None):
    """uvicorn's httptools protocol, bounded: a request's headers must arrive whole within
    --header-timeout (a socket that sends nothing is closed then: idle sockets cannot starve the
    server) and be at most --max-header-bytes (431); at --max-connections the oldest idle
    connections are closed for new ones (Connections). uvicorn's own keep-alive timeout still
    closes idle keep-alive connections."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    limit, timeout = cfg.max_header_bytes, cfg.header_timeout
    conns = Connections(cfg.max_connections)
    metrics = frontend.metrics if frontend is not None else None
    busy_app = _busy_app(cfg.max_connections, metrics)
    shed_s = cfg.shed_lag_ms / 1e3 if cfg.shed_lag_ms and frontend is not None else None
    shed_app = _shed_app(cfg, metrics) if shed_s else None
    shed = Shed(metrics)

    class BoundedProtocol(HttpToolsProtocol):
        connections_registry = conns

        def connection_made(self, transport):
            super().connection_made(transport)
            self._header_bytes, self._rejected, self._open, self._shedding = 0, False, 0, False
            self._header_timer = self.loop.call_later(timeout, self._headers_late)
            conns.add(self)

        def on_message_begin(self):
            super().on_message_begin()
            self._header_bytes = 0
            self._open += 1  # requests begun and not yet answered
            conns.busy(self)
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._headers_late)

        def on_url(self, url):
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name, value):
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self):
            self._cancel_timer()
            if shed_s is not None and self.parser.get_method() == b"POST" and not _probe(self.url):
                lag = frontend.loop_lag
                if lag is not None and lag.behind() > shed_s and not self._light():
                    # it sat unread that long, or more: answered without an ASGI cycle where
                    # nothing is in progress before it on this connection (the answers keep order)
                    if (self.cycle is None or self.cycle.response_complete) and not self.pipeline:
                        self._shedding = True  # answered once its body is read
                        self._header_timer = self.loop.call_later(cfg.body_timeout, self._body_late)
                        return
                    return self._answer_with(shed_app)
            if not conns.too_busy() or _probe(self.url):
                return super().on_headers_complete()
            conns.say("busy", logging.WARNING, f"more than --max-connections ({conns.limit}) "
                                               f"connections have a request in progress: new "
                                               f"requests are answered 503")
            self._answer_with(busy_app)

        def on_body(self, body):
            if not self._shedding:
                super().on_body(body)

        def on_message_complete(self):
            if not self._shedding:
                return super().on_message_complete()
            self._cancel_timer()
            self._answer_shed(self.parser.should_keep_alive())

        def _answer_shed(self, keep: bool):
            self._shedding = False
            self.transport.write(shed.answer(self.url, keep, self.server_state.default_headers))
            if not keep:
                self.transport.close()
            self.on_response_complete()

        def _body_late(self):
            """A shed request's body not read within --body-timeout: answered, and closed."""
            self._header_timer = None
            if self._shedding:
                self._answer_shed(False)

        def _light(self) -> bool:
            """A request of a client holding less than the others (Admission.light): read, not
            shed. A bad X-Client-Id is shed as any other (the app would answer it 400)."""
            tenant, error = request_tenant(self.headers, self.client)
            return error is None and frontend.admission.light(tenant)

        def _answer_with(self, other):
            app, self.app = self.app, other  # read by super() for this request only
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def on_response_complete(self):
            super().on_response_complete()
            self._open -= 1
            if self._open <= 0 and not self.transport.is_closing():
                conns.rest(self)

        def connection_lost(self, exc):
            self._cancel_timer()
            conns.remove(self)
            super().connection_lost(exc)

        def _unsupported_upgrade_warning(self):
            pass  # served as plain HTTP; uvicorn's two warning lines per request flood the log

        def send_400_response(self, msg):
            if not self._rejected:  # after our own 431/408 the parser's error is moot
                super().send_400_response(msg)

        def _cancel_timer(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _count(self, n):
            self._header_bytes += n
            if self._header_bytes > limit and not self._rejected:
                self._reject(431, f"request headers over the limit of {limit} bytes (--max-header-bytes)")
                raise ValueError("headers too large")  # stops the parser (caught by data_received)

        def _headers_late(self):
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self._reject(408, f"request headers not received within {timeout:g} s (--header-timeout)")

        def _reject(self, status, detail):
            self._rejected = True
            body = json.dumps({"detail": detail}).encode()
            reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (status, reason, len(body), body))
            self.transport.close()

    return BoundedProtocol


def _probe(url: bytes) -> bool:
    """/healthz, exempt from the busy ceiling."""
    return url == b"/healthz" or url.startswith(b"/healthz?")


def _busy_app(limit: int, metrics=None):
    """The ASGI app that answers a request over the busy ceiling: 503 + Retry-After in the
    server's error shape (the peer's on a compatible route), and the connection closes (its body,
    if any, is not read). Counted with the other responses (Guard, which it bypasses, counts
    those)."""
    async def busy(scope, receive, send):
        from .http import send_json

        await send_json(send, 503, BUSY.format(limit), [(b"retry-after", b"1")], close=True,
                        path=scope["path"])
        _count_503(metrics, scope["path"])

    return busy


def _count_503(metrics, path: str, expired: str | None = None) -> None:
    """A 503 the protocol answered, which Guard (which counts the rest) did not see."""
    if metrics is not None:
        from .http import endpoint

        metrics.requests.labels(endpoint(path), "503").inc()
        if expired:
            metrics.expired.labels(expired).inc()


SHED = "this front end is running behind (over --shed-lag-ms): requests wait unread; retry later"


class Shed:
    """The 503 of a front end running behind, written straight to the connection: through an ASGI
    cycle (a task, the app's send calls) a refusal cost a good part of an answer, so a saturated
    front end fell further behind shedding. Its bytes are what _shed_app sends (the route's error
    shape, Retry-After), made once per route; counted as _shed_app counts."""

    def __init__(self, metrics=None):
        self.metrics = metrics
        self.made: dict[bytes, tuple[bytes, bytes, str]] = {}  # url -> (head, body, path)

    def answer(self, url: bytes, keep_alive: bool, default_headers) -> bytes:
        head, body, path = self.made.get(url) or self._make(url)
        _count_503(self.metrics, path, "front_end_behind")
        extra = b"".join(b"%s: %s\r\n" % kv for kv in default_headers)
        return b"%s%s%s\r\n%s" % (head, extra, b"" if keep_alive else b"connection: close\r\n", body)

    def _make(self, url: bytes) -> tuple[bytes, bytes, str]:
        from http import HTTPStatus

        from . import compat
        from .http import endpoint

        path = url.split(b"?", 1)[0].decode("latin-1")
        status, body = compat.error_body(path, 503, SHED) or (503, json.dumps({"detail": SHED}).encode())
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"retry-after: 1\r\n" % (status, HTTPStatus(status).phrase.encode(), len(body)))
        made = head, body, path
        if endpoint(path) != "other" and b"?" not in url:  # routes only: made-up URLs grow nothing
            self.made[url] = made
        return made


def _shed_app(cfg, metrics=None):
    """The ASGI app that answers a compute request while the front end runs more than
    --shed-lag-ms behind: 503 + Retry-After without the app's work (Guard, parsing, admission:
    a refusal through them costs about half an accepted request, so a front end near its limit
    fell further behind under overload, its 429s hundreds of ms late). The body is read (within
    --body-timeout) so the connection stays open for the client's next request."""
    async def shed(scope, receive, send):
        from .http import send_json

        close = False
        try:
            async with asyncio.timeout(cfg.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body"):
                        close = message["type"] != "http.request"
                        break
        except TimeoutError:
            close = True
        await send_json(send, 503, SHED, [(b"retry-after", b"1")],
                        close=close, path=scope["path"])
        _count_503(metrics, scope["path"], "front_end_behind")

    return shed


def uvicorn_server(app, fcfg, frontend):
    """A uvicorn Server whose shutdown drains through the Frontend first, within
    --shutdown-timeout for HTTP and gRPC together."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn + the gRPC front end on the same event loop and Frontend (--grpc-port)."""
        grpc = None
        exit_by: float | None = None  # time.monotonic() by which this process must be gone

        async def startup(self, sockets=None):
            await super().startup(sockets)  # lifespan first: the engine client starts
            if fcfg.grpc_port is not None and not self.should_exit:
                from .grpc_server import start_grpc

                self.grpc = await start_grpc(frontend, fcfg.host, fcfg.grpc_port)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, without raising the caught signal again at exit: a drained server exits
            0 (as the launcher does), not by SIGTERM."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None):
            timeout = fcfg.shutdown_timeout
            end = time.monotonic() + timeout
            self.exit_by = end + EXIT_GRACE
            frontend.begin_drain()
            # Answer what is still waiting 503 just before uvicorn would cancel it (a 500).
            loop = asyncio.get_running_loop()
            loop.call_later(max(0.0, timeout - FAIL), frontend.fail_pending)
            if self.grpc is not None:  # before super(): its lifespan shutdown stops the client
                from .grpc_server import stop_grpc

                await stop_grpc(self.grpc, timeout)
            # HTTP gets what is left of the one drain time, not a second one after gRPC's.
            self.config.timeout_graceful_shutdown = max(0.1, end - time.monotonic())
            await super().shutdown(sockets)

    # No limit_concurrency: the protocol holds --max-connections (Connections). No WebSocket
    # (nothing here serves one): an upgraded connection would leave the protocol's registry
    # uncounted, busy forever.
    # JSON lines: uvicorn's loggers keep no handlers of their own, so theirs reach the root's (logs.py)
    log_config = None if fcfg.log_format == "json" else uvicorn.config.LOGGING_CONFIG
    config = uvicorn.Config(app, http=protocol_class(fcfg, frontend), ws="none", log_config=log_config,
                            log_level=fcfg.log_level, access_log=fcfg.access_log, timeout_keep_alive=5,
                            timeout_graceful_shutdown=fcfg.shutdown_timeout)
    return DrainingServer(config)
