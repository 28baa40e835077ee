"""The load generator of bench.http: P processes, each an event loop firing its share of an
open-loop (Poisson) arrival stream over its own keep-alive connections, HTTP/1.1 or gRPC.

Why processes: one Python event loop tops out at a few tens of thousands of requests/s, and a
generator that falls behind sends late and so under-reports the server's latency (or its
capacity). P processes each fire rate/P; independent Poisson streams add up to a Poisson stream
of the whole rate, so the server sees the same arrivals as from one ideal client.

Method, per process and phase:
- The arrival times are drawn before the phase starts (n uniform points over the phase, sorted:
  a Poisson process given its count), and a request's latency counts from its *scheduled* time,
  so a slow server cannot slow the load down (no coordinated omission).
- A pacer coroutine sends each request when due: it sleeps on the loop's timer until shortly
  before (timers are millisecond-coarse), then spins the loop (sleep(0), which still serves
  responses) until the exact time. Lateness (actual send - scheduled, ms) is recorded per
  request: the parent flags a phase whose generator lagged.
- HTTP: requests are pre-encoded bytes written on an idle keep-alive connection (FIFO, so every
  pre-opened connection takes its turn and the server's front ends share them), one request per
  connection at a time (no pipelining: it would queue a request behind another). With none
  idle, a new connection opens (up to the cap; its setup counts in that request's latency).
- gRPC (hook: needs the message class from prefixscore.serve.proto): requests are pre-serialized
  and sent through grpc.aio's generic unary-unary call on a few channels, each its own HTTP/2
  connection; the serializer passed to the call is the identity.
- Results go back to the parent as compact arrays (float32 latency ms, uint16 status, float32
  lateness ms) plus counters; the parent merges all processes and takes percentiles over all.

bench.slo drives the same processes with `streams` (LoadGen.streams): several streams at once,
each open loop (Poisson, its rate stepping by segment), at fixed times, or closed (k in flight);
requests may carry headers (http_post); per request also whether the answer had Retry-After and
an integer field of its body (depth). Scraper polls the server's /metrics meanwhile.

Run by bench.http and bench.slo (LoadGen); every phase is bounded in time (timeout) and count.
"""
from __future__ import annotations

import asyncio
import gc
import json
import math
import multiprocessing as mp
import os
import random
import socket
import traceback
from array import array
from collections import deque
from time import monotonic, process_time  # monotonic: one clock for every process of this machine

# Status codes in the result arrays: HTTP statuses as they are; below 100 the client's own.
LOST, TIMEOUT, CONN_ERROR, BAD_RESPONSE = 0, 1, 2, 3
GRPC_BASE = 1000  # 1000 + a grpc.StatusCode's number (0 = OK is recorded as 200)
CLIENT_STATUS = {LOST: "lost", TIMEOUT: "timeout", CONN_ERROR: "connection error",
                 BAD_RESPONSE: "bad response"}
KEEP_ALIVE_S = 4.0  # reuse no connection idle longer: the server closes them after 5 s
TICK_S = 0.05  # how often timeouts are checked

GRPC_METHOD = "/prefixscore.v1.PrefixScore/Classify"
# Where the message classes live (prefixscore/serve/proto): the only thing --proto grpc needs
# from the server's package.
GRPC_MODULES = ("prefixscore.serve.proto.prefixscore_pb2", "prefixscore.serve.proto")


def status_name(code: int) -> str:
    if code in CLIENT_STATUS:
        return CLIENT_STATUS[code]
    if code >= GRPC_BASE:
        import grpc

        names = {c.value[0]: c.name for c in grpc.StatusCode}
        return "grpc " + names.get(code - GRPC_BASE, str(code - GRPC_BASE))
    return str(code)


# ---------------------------------------------------------------- request payloads

def http_post(path: str, obj, headers: dict | None = None) -> bytes:
    body = json.dumps(obj).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{extra}content-length: {len(body)}\r\n\r\n").encode() + body


GET_HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


def grpc_message(name: str):
    """A message class of the gRPC API (ClassifyRequest, ClassifyResponse)."""
    import importlib

    for module in GRPC_MODULES:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise RuntimeError(f"--proto grpc needs the message class {name} from one of {GRPC_MODULES}")


def grpc_payloads(queries: list[str]) -> list[bytes]:
    """Each query as a serialized Classify request (serialized once, before any phase)."""
    message = grpc_message("ClassifyRequest")
    return [message(queries=[q]).SerializeToString() for q in queries]


def grpc_timing(body: bytes) -> dict:
    """The server's stage timing from a serialized ClassifyResponse."""
    t = grpc_message("ClassifyResponse").FromString(body).timing
    return {k: getattr(t, k) for k in ("queue_ms", "tokenize_ms", "forward_ms", "total_ms")}


# ---------------------------------------------------------------- per-request bookkeeping

class Recorder:
    """Latency from the scheduled time and status of request i, set once (a late answer to a
    request already timed out is ignored)."""

    def __init__(self, sched: array):
        n = len(sched)
        self.sched = sched  # monotonic seconds; the serial driver fills it at send time
        self.lat = array("f", bytes(4 * n))
        self.status = array("H", bytes(2 * n))
        self.done = 0
        self.last_done = 0.0
        self.on_done = None  # callback(i), set by the driver

    def finish(self, i: int, status: int) -> None:
        if self.status[i]:
            return
        now = monotonic()
        self.lat[i] = 1e3 * (now - self.sched[i])
        self.status[i] = status
        self.done += 1
        self.last_done = now
        if self.on_done is not None:
            self.on_done(i)


# ---------------------------------------------------------------- HTTP/1.1 client

class HttpConn(asyncio.Protocol):
    """One keep-alive connection: its requests in flight in order (one, or several pipelined);
    responses parsed just enough (status, content-length)."""

    def __init__(self, pool: "HttpPool"):
        self.pool = pool
        self.transport = None
        self.buf = b""
        self.reqs: deque[int] = deque()  # the requests in flight, oldest first
        self.used = monotonic()

    def connection_made(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport

    def send(self, i: int, payload: bytes) -> None:
        self.reqs.append(i)
        self.transport.write(payload)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while buf:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end].lower()
            k = head.find(b"\r\ncontent-length:")
            if k < 0 or not self.reqs:  # chunked or unasked-for: not what this server sends
                self.buf = b""
                self.pool.finish(self, BAD_RESPONSE, None)
                self.transport.abort()
                return
            e = head.find(b"\r\n", k + 2)
            total = end + 4 + int(head[k + 17:e if e > 0 else end])
            if len(buf) < total:
                break
            if b"\r\nconnection: close" in head:  # an error the server answers and hangs up on
                self.transport.close()
            self.pool.finish(self, int(buf[9:12]), buf[end + 4:total], head)
            buf = buf[total:]
        self.buf = buf

    def connection_lost(self, exc) -> None:
        self.pool.lost(self)


class HttpPool:
    """A process's connections to the server: dispatch(i) sends request i now on an idle
    connection; with none idle, pipelined behind fewer than `pipeline` requests on a busy one
    (pipeline > 1: an overloaded server holds connections longer than the generator can open
    new ones), else queued until one is free (opening another while under the cap)."""

    def __init__(self, port: int, payloads: list[bytes], rec: Recorder, max_conns: int,
                 offset: int = 0, keep_bodies: bool = False, payload_of=None, inspect=None,
                 pipeline: int = 1):
        self.loop = asyncio.get_running_loop()
        self.port, self.payloads, self.rec, self.max_conns = port, payloads, rec, max_conns
        self.offset, self.pipeline = offset, pipeline  # each process starts at its own query
        # request i's bytes (default: the payloads in turn); inspect(i, head, body): each answer's
        # lower-cased head and body, before it is recorded (the streams driver's)
        self.payload_of = payload_of or (lambda i: payloads[(i + offset) % len(payloads)])
        self.inspect = inspect
        self.idle: deque[HttpConn] = deque()
        self.busy: set[HttpConn] = set()
        self.pending: deque[int] = deque()
        self.conns = 0  # open or opening
        self.opened = self.conn_limited = self.conn_errors = self.pipelined = 0
        self.bodies = [] if keep_bodies else None

    async def preopen(self, k: int) -> None:
        await asyncio.gather(*(self._open() for _ in range(min(k, self.max_conns) - self.conns)))

    def dispatch(self, i: int) -> None:
        now = monotonic()
        while self.idle:
            c = self.idle.popleft()
            if now - c.used < KEEP_ALIVE_S:
                self.busy.add(c)
                c.send(i, self.payload_of(i))
                return
            c.transport.close()  # the server may be closing it: never reuse a stale one
        if self.pipeline > 1 and self.busy:
            c = min(self.busy, key=lambda c: len(c.reqs))
            if len(c.reqs) < self.pipeline and not c.transport.is_closing():
                self.pipelined += 1
                c.send(i, self.payload_of(i))
                return
        self.pending.append(i)
        if self.conns < self.max_conns:
            self.loop.create_task(self._open())
        else:
            self.conn_limited += 1

    async def _open(self) -> None:
        self.conns += 1
        try:
            _, c = await self.loop.create_connection(lambda: HttpConn(self), "127.0.0.1", self.port)
        except OSError:
            self.conns -= 1
            self.conn_errors += 1
            if self.conns == 0:  # nothing will ever serve what waits: fail it now
                while self.pending:
                    self.rec.finish(self.pending.popleft(), CONN_ERROR)
            return
        self.opened += 1
        self._free(c)  # its first job, if one waits

    def _free(self, c: HttpConn) -> None:
        c.used = monotonic()
        while self.pending:
            i = self.pending.popleft()
            if not self.rec.status[i]:  # not timed out while it waited
                self.busy.add(c)
                c.send(i, self.payload_of(i))
                return
        self.busy.discard(c)
        self.idle.append(c)

    def finish(self, c: HttpConn, status: int, body, head: bytes | None = None) -> None:
        i = c.reqs.popleft() if c.reqs else -1
        if i >= 0:
            if self.bodies is not None and body is not None:
                self.bodies.append(body)
            if self.inspect is not None and not self.rec.status[i]:
                self.inspect(i, head, body)
            self.rec.finish(i, status)
        if status != BAD_RESPONSE and not c.transport.is_closing() and not c.reqs:
            self._free(c)

    def lost(self, c: HttpConn) -> None:
        self.conns -= 1
        self.busy.discard(c)
        try:
            self.idle.remove(c)
        except ValueError:
            pass
        while c.reqs:
            self.rec.finish(c.reqs.popleft(), CONN_ERROR)
        if self.pending and self.conns < self.max_conns:
            self.loop.create_task(self._open())

    def expire(self, timeout: float) -> None:
        """Requests older than `timeout` (from their scheduled time): timed out. A connection
        with one request in flight is aborted (the answer may still come, on a connection nobody
        reads); a pipelined one is kept for the requests behind, the late answer ignored."""
        limit = monotonic() - timeout
        sched, status = self.rec.sched, self.rec.status
        while self.pending and sched[self.pending[0]] < limit:
            self.rec.finish(self.pending.popleft(), TIMEOUT)
        for c in [c for c in self.busy if c.reqs and sched[c.reqs[0]] < limit]:
            for i in c.reqs:
                if sched[i] < limit and not status[i]:
                    self.rec.finish(i, TIMEOUT)
            if self.pipeline == 1:
                c.reqs.clear()
                c.transport.abort()

    async def close(self) -> None:
        for c in list(self.idle) + list(self.busy):
            c.transport.close()
        await asyncio.sleep(0)


# ---------------------------------------------------------------- gRPC client (hook)

class GrpcPool:
    """The same interface over grpc.aio: a generic unary-unary call per channel, the request
    pre-serialized (the serializer is the identity), one task per request."""

    def __init__(self, port: int, payloads: list[bytes], rec: Recorder, channels: int,
                 timeout: float, offset: int = 0, keep_bodies: bool = False):
        import grpc

        self.grpc, self.rec, self.payloads, self.timeout, self.offset = grpc, rec, payloads, timeout, offset
        # A local subchannel pool each: separate TCP connections, not one shared behind them all.
        self.channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                   options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range(max(1, channels))]
        self.calls = [ch.unary_unary(GRPC_METHOD, request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b) for ch in self.channels]
        self.opened, self.conn_limited, self.conn_errors = len(self.channels), 0, 0
        self.bodies = [] if keep_bodies else None
        self.loop = asyncio.get_running_loop()
        self.k = 0

    async def preopen(self, k: int) -> None:
        await asyncio.gather(*(ch.channel_ready() for ch in self.channels))

    def dispatch(self, i: int) -> None:
        self.k += 1
        call = self.calls[self.k % len(self.calls)]
        self.loop.create_task(self._one(i, call(self.payloads[(i + self.offset) % len(self.payloads)],
                                                timeout=self.timeout)))

    async def _one(self, i, call) -> None:
        try:
            body = await call
            status = 200
            if self.bodies is not None:
                self.bodies.append(body)
        except self.grpc.aio.AioRpcError as e:
            status = GRPC_BASE + e.code().value[0]
        except Exception:
            status = CONN_ERROR
        self.rec.finish(i, status)

    def expire(self, timeout: float) -> None:
        pass  # the call's deadline does it (DEADLINE_EXCEEDED)

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels))


def make_pool(spec: dict, payloads, rec, max_conns, offset=0, keep_bodies=False):
    if spec["proto"] == "grpc":
        return GrpcPool(spec["port"], payloads, rec, max_conns, spec["timeout"], offset, keep_bodies)
    return HttpPool(spec["port"], payloads, rec, max_conns, offset, keep_bodies, pipeline=spec.get("pipeline", 1))


def ticker(pool, timeout: float):
    """Check timeouts every TICK_S; returns a function that stops it."""
    loop = asyncio.get_running_loop()
    handle = None

    def tick():
        nonlocal handle
        pool.expire(timeout)
        handle = loop.call_later(TICK_S, tick)

    tick()
    return lambda: handle.cancel()


# ---------------------------------------------------------------- drivers (run in a load process)

async def serial(payloads, spec) -> dict:
    """Closed loop: one request at a time on one connection; latency from the send."""
    n = spec["n"]
    sched = array("d", bytes(8 * n))
    rec = Recorder(sched)
    loop = asyncio.get_running_loop()
    pool = make_pool(spec, payloads, rec, 1, spec.get("offset", 0), keep_bodies=spec.get("bodies", False))
    await pool.preopen(1)
    stop = ticker(pool, spec["timeout"])
    for i in range(n):
        fut = loop.create_future()
        rec.on_done = lambda i, fut=fut: fut.set_result(None)
        sched[i] = monotonic()
        pool.dispatch(i)
        await fut
    stop()
    await pool.close()
    out = {"lat": rec.lat, "status": rec.status}
    if pool.bodies:  # the server's own stage timing, parsed now, outside the measured loop
        if spec["proto"] == "grpc":
            out["timing"] = [grpc_timing(b) for b in pool.bodies]
        else:
            out["timing"] = [json.loads(b)["timing"] for b in pool.bodies if b.startswith(b'{"results"')]
    return out


async def open_loop(payloads, spec) -> dict:
    """Open loop: spec["n"] requests at Poisson times over spec["duration"] s from spec["start"]."""
    n, duration, start, spin = spec["n"], spec["duration"], spec["start"], spec["spin_ms"] / 1e3
    rng = random.Random(spec["seed"])
    sched = array("d", sorted(start + rng.random() * duration for _ in range(n)))
    late = array("f", bytes(4 * n))
    rec = Recorder(sched)
    loop = asyncio.get_running_loop()
    all_done = loop.create_future()
    rec.on_done = lambda i: rec.done == n and not all_done.done() and all_done.set_result(None)
    pool = make_pool(spec, payloads, rec, spec["max_conns"], spec["offset"])
    await pool.preopen(spec["preopen"])
    stop = ticker(pool, spec["timeout"])
    cpu0 = process_time()
    i = 0
    while i < n:
        now = monotonic()
        while i < n and sched[i] <= now:  # everything due, at once
            late[i] = 1e3 * (now - sched[i])
            pool.dispatch(i)
            i += 1
            now = monotonic()
        if i == n:
            break
        wait = sched[i] - now
        # The loop's timer wakes up to ~1 ms late: sleep on it only until `spin` before the send,
        # then spin (sleep(0) still runs the loop: responses are read meanwhile).
        await asyncio.sleep(wait - spin if wait > spin else 0)
    last_send = monotonic()
    try:
        await asyncio.wait_for(all_done, max(0.0, sched[-1] - monotonic()) + spec["timeout"] + 2 * TICK_S + 1)
    except asyncio.TimeoutError:
        pass  # what is still unanswered stays LOST
    stop()
    cpu = process_time() - cpu0  # includes the spinning: near 100% of the phase by design
    await pool.close()
    return {"lat": rec.lat, "status": rec.status, "late": late, "n": n, "start": start, "cpu_s": cpu,
            "duration": duration, "last_send": last_send, "last_done": rec.last_done,
            "opened": pool.opened, "conn_limited": pool.conn_limited, "conn_errors": pool.conn_errors}


async def streams(spec) -> dict:
    """Several streams at once over one pool (bench.slo). A stream is its pre-encoded requests
    ("payloads", taken in turn from "offset") and when to send them: "segments" [(t0, t1, n)], n
    Poisson arrivals over [t0, t1) s of the phase (one segment per step of a rate that steps);
    "at" [t, ...], one send at each; "closed" k: k requests kept in flight from "from" to "until" s
    (the next one sent as one is answered, 10 ms later after an error; at most "cap"), latency
    from the send. Per request: its stream, scheduled time, when it was written (a send waits for a
    free connection), latency, status, whether the answer had Retry-After, and the integer after
    the stream's "field" (b'"depth":') in its body, or -1."""
    start, spin, all_streams = spec["start"], spec["spin_ms"] / 1e3, spec["streams"]
    rng = random.Random(spec["seed"])
    plan = []  # (scheduled time, stream), the open-loop sends
    for s, st in enumerate(all_streams):
        plan += [(start + t, s) for t in st.get("at", ())]
        for t0, t1, n in st.get("segments", ()):
            plan += [(start + t0 + rng.random() * (t1 - t0), s) for _ in range(n)]
    plan.sort()
    n_open = len(plan)
    closed = [s for s, st in enumerate(all_streams) if st.get("closed")]
    base, used = {}, {s: 0 for s in closed}  # a block of slots per closed stream, after the open ones
    n = n_open
    for s in closed:
        base[s], n = n, n + all_streams[s]["cap"]
    sched = array("d", [t for t, _ in plan]) + array("d", bytes(8 * (n - n_open)))
    sid = array("B", [s for _, s in plan])
    for s in closed:
        sid += array("B", [s]) * all_streams[s]["cap"]
    body, seq = [None] * n, [st.get("offset", 0) for st in all_streams]
    for i, (_, s) in enumerate(plan):
        pl = all_streams[s]["payloads"]
        body[i], seq[s] = pl[seq[s] % len(pl)], seq[s] + 1
    late, retry, value = array("f", bytes(4 * n)), array("B", bytes(n)), array("i", [-1]) * n
    wrote = array("f", [-1.0]) * n  # ms after its scheduled time that it was written; -1: never
    fields = [st.get("field") for st in all_streams]

    def inspect(i, head, data):
        if head is not None and b"\r\nretry-after:" in head:
            retry[i] = 1
        key = fields[sid[i]]
        if key and data:
            k = data.find(key)
            if k >= 0:
                digits = data[k + len(key):k + len(key) + 24].lstrip().split(b",")[0].rstrip(b"}] ")
                value[i] = int(digits) if digits.lstrip(b"-").isdigit() else -1

    rec = Recorder(sched)
    loop = asyncio.get_running_loop()

    def payload_of(i):  # called as request i is written (on a free connection)
        wrote[i] = 1e3 * (monotonic() - sched[i])
        return body[i]

    pool = make_pool(spec, None, rec, spec["max_conns"])
    pool.payload_of, pool.inspect = payload_of, inspect
    sending = [True]
    all_done = loop.create_future()

    def send_closed(s):
        st = all_streams[s]
        if used[s] >= st["cap"] or monotonic() >= start + st["until"]:
            return
        i = base[s] + used[s]
        used[s] += 1
        pl = all_streams[s]["payloads"]
        body[i], seq[s] = pl[seq[s] % len(pl)], seq[s] + 1
        sched[i] = monotonic()
        pool.dispatch(i)

    def on_done(i):
        s = sid[i]
        if i >= n_open:  # after this answer's connection is free again
            loop.call_later(0.0 if rec.status[i] == 200 else 0.01, send_closed, s)
        if not sending[0] and rec.done == n_open + sum(used.values()) and not all_done.done():
            all_done.set_result(None)

    rec.on_done = on_done
    await pool.preopen(spec["preopen"])
    stop = ticker(pool, spec["timeout"])
    for s in closed:
        for _ in range(all_streams[s]["closed"]):
            loop.call_later(max(0.0, start + all_streams[s].get("from", 0.0) - monotonic()), send_closed, s)
    cpu0 = process_time()
    i = 0
    while i < n_open:  # the pacer of open_loop
        now = monotonic()
        while i < n_open and sched[i] <= now:
            late[i] = 1e3 * (now - sched[i])
            pool.dispatch(i)
            i += 1
            now = monotonic()
        if i < n_open:
            wait = sched[i] - now
            await asyncio.sleep(wait - spin if wait > spin else 0)
    last_send = monotonic()
    until = max((start + all_streams[s]["until"] for s in closed), default=0.0)
    if until > monotonic():
        await asyncio.sleep(until - monotonic())
    sending[0] = False
    if rec.done < n_open + sum(used.values()):
        try:
            await asyncio.wait_for(all_done, max(0.0, sched[n_open - 1] - monotonic() if n_open else 0.0)
                                   + spec["timeout"] + 2 * TICK_S + 1)
        except asyncio.TimeoutError:
            pass  # what is still unanswered stays LOST
    stop()
    cpu = process_time() - cpu0
    await pool.close()

    def keep(a):  # the open sends, then the used slots of each closed block
        out = a[:n_open]
        for s in closed:
            out += a[base[s]:base[s] + used[s]]
        return out

    return {**{k: keep(a) for k, a in (("sched", sched), ("lat", rec.lat), ("status", rec.status),
                                       ("late", late), ("wrote", wrote), ("stream", sid),
                                       ("retry", retry), ("value", value))},
            "n_open": n_open, "cpu_s": cpu, "last_send": last_send, "opened": pool.opened,
            "conn_limited": pool.conn_limited, "conn_errors": pool.conn_errors, "pipelined": pool.pipelined}


# ---------------------------------------------------------------- the load processes

def worker_main(index: int, conn, proto: str, queries: list[str], cpus) -> None:
    """A load process: pinned, its payloads encoded once, then commands from the parent until
    'stop'. The collector is off during a phase (a gen-2 pass would stall the pacer) and the
    start-up objects are frozen out of its way."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:  # overload phases hold many connections
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
    payloads = {"healthz": [GET_HEALTHZ],
                "classify": [http_post("/v1/classify", {"query": q}) for q in queries],
                # a deadline already past: the server's refusal path (504 before tokenizing)
                "refused": [http_post("/v1/classify", {"query": q}, {"X-Request-Timeout": "0.000001"})
                            for q in queries[:256]]}
    if proto == "grpc":
        payloads["classify"] = grpc_payloads(queries)
    else:
        try:
            import uvloop  # the client's own cost, kept small

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:
            pass
    gc.collect()
    gc.freeze()
    drivers = {"serial": serial, "open": open_loop, "streams": streams}
    while True:
        try:
            cmd, spec = conn.recv()
        except EOFError:
            return
        if cmd == "stop":
            return
        kind = spec.get("payload", "classify")
        spec = {**spec, "proto": "http" if kind == "healthz" or cmd == "streams" else proto}
        if spec["proto"] == "grpc":
            spec["port"] = spec["grpc_port"]
        gc.disable()
        try:
            out = asyncio.run(drivers[cmd](spec) if cmd == "streams" else drivers[cmd](payloads[kind], spec))
        except Exception:
            out = {"error": f"load process {index}: {traceback.format_exc()}"}
        finally:
            gc.enable()
        conn.send(out)


class LoadGen:
    """The parent's handle on P load processes (spawned: the parent may hold threads)."""

    def __init__(self, procs: int, proto: str, queries: list[str], cpus=None):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for k in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(k, child, proto, queries, cpus), daemon=True,
                            name=f"loadgen-{k}")
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        self.n_queries = len(queries)

    def _ask(self, conns, cmd, specs) -> list[dict]:
        for c, s in zip(conns, specs):
            c.send((cmd, s))
        outs = [c.recv() for c in conns]
        for o in outs:
            if "error" in o:
                raise RuntimeError(o["error"])
        return outs

    def serial(self, port: int, n: int, timeout: float, payload="classify", grpc_port=None,
               bodies=False) -> dict:
        """Closed loop on load process 0."""
        spec = {"port": port, "grpc_port": grpc_port, "n": n, "timeout": timeout, "payload": payload,
                "bodies": bodies}
        return self._ask(self.conns[:1], "serial", [spec])[0]

    def open_loop(self, port: int, rate: float, duration: float, max_requests: int, timeout: float,
                  max_conns: int, conns: int, seed: int, spin_ms: float, grpc_port=None) -> tuple[list[dict], float]:
        """`rate` req/s split over the processes, for `duration` s or max_requests requests,
        whichever is fewer (then the phase is shorter, the rate the same). -> per-process results
        and the phase's duration."""
        total = max(1, min(max_requests, round(rate * duration)))
        duration = total / rate
        P = len(self.conns)
        counts = [total // P + (k < total % P) for k in range(P)]
        share = rate / P
        # Enough connections pre-opened for the concurrency the rate needs, and at least --conns
        # in all so every front end gets some; not more than ~2 s of requests (each one is reused
        # within the keep-alive limit).
        preopen = min(max_conns // P, max(math.ceil(conns / P), math.ceil(share * 0.005) + 1))
        preopen = max(1, min(preopen, math.ceil(share * 2)))
        start = monotonic() + 0.3 + 0.002 * preopen  # every process connected and ready by then
        specs = [{"port": port, "grpc_port": grpc_port, "n": counts[k], "duration": duration,
                  "start": start, "timeout": timeout, "max_conns": max(1, max_conns // P),
                  "preopen": preopen, "seed": seed * 1000 + k, "spin_ms": spin_ms,
                  "offset": k * self.n_queries // P} for k in range(P) if counts[k]]
        return self._ask(self.conns[:len(specs)], "open", specs), duration

    def streams(self, port: int, streams: list[dict], timeout: float, max_conns: int, conns: int,
                seed: int, spin_ms: float, lag_ms: float, hold_s: float = 0.005, pipeline: int = 1) -> dict:
        """Streams at once (the `streams` driver), each split over the processes: a segment's
        arrivals and a closed stream's concurrency shared out, "at" sends dealt round. A stream:
        {"payloads": [bytes], "segments": [(t0, t1, rate)], "at": [t], "closed": k, "from": t,
        "until": t, "cap": n, "field": bytes}. -> every request of all processes as numpy arrays:
        t (scheduled, s from the phase start), lat (ms from t), status, late (ms), stream, retry,
        wrote (ms from t to its write on a connection, -1 never: no connection came free in time),
        value, done (answered, s); "start" (monotonic) and "gen", the generator's figures.
        hold_s: how long a request is expected to hold its connection (an overloaded server's
        answers come up to the deadline late): connections for that concurrency are opened before
        the first send, so no send waits for one to open mid-phase. pipeline: with no connection
        idle, a send goes out behind up to pipeline - 1 others on a busy one (HttpPool)."""
        import numpy as np

        P = len(self.conns)

        def share(n, k):
            return n // P + (k < n % P)

        specs = [[{"payloads": st["payloads"], "offset": k * len(st["payloads"]) // P, "field": st.get("field"),
                   "at": st.get("at", [])[k::P], "closed": share(st.get("closed", 0), k), "from": st.get("from", 0.0),
                   "segments": [(t0, t1, share(round(r * (t1 - t0)), k)) for t0, t1, r in st.get("segments", ())],
                   "until": st.get("until", 0.0), "cap": share(st.get("cap", 0), k)} for st in streams]
                 for k in range(P)]
        most = max(sum(n for st in mine for _, _, n in st["segments"]) for mine in specs)
        # connections for the peak concurrency at hold_s per request, --conns at least
        peak = sum(max((r for _, _, r in st.get("segments", ())), default=0) for st in streams) / P
        closed = sum(st.get("closed", 0) for st in streams) / P
        preopen = max(1, min(max_conns // P, max(math.ceil(conns / P), math.ceil(peak * hold_s + closed) + 1)))
        # time to draw and sort the arrivals and to connect, before the first send
        start = monotonic() + 0.3 + 4e-6 * most + 0.002 * preopen
        outs = self._ask(self.conns, "streams", [
            {"port": port, "grpc_port": None, "start": start, "timeout": timeout, "seed": seed * 1000 + k,
             "max_conns": max(1, max_conns // P), "preopen": preopen, "spin_ms": spin_ms, "streams": specs[k],
             "pipeline": pipeline}
            for k in range(P)])
        kinds = (("sched", np.float64), ("lat", np.float32), ("status", np.uint16), ("late", np.float32),
                 ("wrote", np.float32), ("stream", np.uint8), ("retry", np.uint8), ("value", np.int32))
        R = {k: np.concatenate([np.frombuffer(o[k], d) for o in outs]) for k, d in kinds}
        R["t"], R["start"] = R.pop("sched") - start, start
        for k in ("lat", "late", "wrote"):
            R[k] = R[k].astype(np.float64)
        R["done"] = R["t"] + R["lat"] / 1e3
        late = [sorted(o["late"][:o["n_open"]]) for o in outs]
        p99 = max((x[int(0.99 * (len(x) - 1))] for x in late if x), default=0.0)
        R["gen"] = {"late_p99_ms": p99, "late_max_ms": max((x[-1] for x in late if x), default=0.0),
                    "lagged": p99 > lag_ms, "sent": int((R["wrote"] >= 0).sum()), "not_sent": int((R["wrote"] < 0).sum()),
                    "cpu_s": [o["cpu_s"] for o in outs],
                    **{k: sum(o[k] for o in outs) for k in ("opened", "conn_limited", "conn_errors", "pipelined")}}
        return R

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------- the server's /metrics (bench.slo)

def parse_metrics(text: str, prefixes: tuple[str, ...] = ("prefixscore_",)) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for the samples whose name starts with one of
    `prefixes` (names may change: callers match by prefix, never by a whole name)."""
    out = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(prefixes):
            continue
        key, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        key = key + "}" if "{" in key else key
        try:
            out[key.strip()] = float(rest.split()[0])
        except (IndexError, ValueError):
            pass
    return out


def scrape(port: int, timeout: float = 2.0) -> dict[str, float] | None:
    """One GET /metrics, parsed; None when it does not answer 200."""
    import http.client

    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", "/metrics")
        r = c.getresponse()
        text = r.read().decode("utf-8", "replace")
        c.close()
        return parse_metrics(text) if r.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None


def post(port, path, obj, headers=None, timeout=120.0):
    """One POST (outside any measured phase) -> (status, lower-cased headers, JSON body or None);
    status None without an answer."""
    import http.client

    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", path, json.dumps(obj), {"content-type": "application/json", **(headers or {})})
        r = c.getresponse()
        data, st, hdrs = r.read(), r.status, {k.lower(): v for k, v in r.getheaders()}
        c.close()
    except (OSError, http.client.HTTPException):
        return None, {}, None
    try:
        return st, hdrs, json.loads(data)
    except ValueError:
        return st, hdrs, None


class Scraper:
    """GET /metrics every `every` s on a thread of the parent (between its waits on the load
    processes): samples [(monotonic time, {name: value})] of the names starting with `prefixes`."""

    def __init__(self, port: int, every: float = 0.1, prefixes: tuple[str, ...] = ("prefixscore_",)):
        import threading

        self.port, self.every, self.prefixes = port, every, prefixes
        self.samples: list[tuple[float, dict]] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="metrics-scraper")
        self._thread.start()

    def _run(self) -> None:
        import http.client

        conn, due = None, monotonic()
        while not self._stop.wait(max(0.0, due - monotonic())):
            due += self.every
            t = monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
                conn.request("GET", "/metrics")
                r = conn.getresponse()
                text = r.read().decode("utf-8", "replace")
                if r.status == 200:
                    self.samples.append((t, parse_metrics(text, self.prefixes)))
                    continue
            except (OSError, http.client.HTTPException):
                conn = None
            self.failed += 1

    def stop(self) -> list[tuple[float, dict]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples
