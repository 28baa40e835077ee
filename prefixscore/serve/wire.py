"""The transport between front-end processes and an engine process: a Unix stream socket per front
end, each message one frame (4-byte little-endian length, then the msgspec bytes of protocol.py).

Why not ZeroMQ, which this replaced: a ZeroMQ message crosses two I/O threads (the sender's and
the receiver's) on its way, each a thread wake-up, and a front end's event loop then wakes on
ZeroMQ's own notification descriptor. A request and its answer made four such hand-offs: on the
2-core CI host a round trip of ZeroMQ DEALER/ROUTER over ipc:// took several times a Unix
socket's read by the same event loop and the same spinning engine (bench/ipc.py), and on a GPU
host the front-end processes' layout cost a request much more than the engine on a thread. Here a frame is one send() and one recv() on each side: the engine polls its sockets
itself between passes (it spins anyway), a front end's event loop reads its socket directly.

- EngineSocket (the engine process): listens on the path, accepts every front end, takes what
  they sent between passes, and answers each on its own connection. Its sends block (bounded by
  SEND_TIMEOUT): a front end reads whenever its loop runs, so a full buffer only means a front
  end stalled, and one stalled that long is dropped, not waited on for ever.
- SocketClient (a front end): connects, says Hello until the engine's Ready comes, and reconnects
  while the engine is down (a restarted engine listens on the same path); a lost connection fails
  everything in flight at once (BaseClient._fail_all), as the engine process's death does.
"""
from __future__ import annotations

import asyncio
import logging
import os
import select
import selectors
import socket
import struct
import time

from . import protocol as P
from .client import BaseClient
from .engine_loop import STOP

log = logging.getLogger("prefixscore.client")

HEADER = struct.Struct("<I")
SEND_TIMEOUT = 10.0  # seconds an engine's answer may wait for a front end to read its socket
MAX_FRAME = 1 << 31  # a longer length is a broken stream, not a message
MAX_BUFFERED = 256 << 20  # a front end's unsent bytes beyond which its requests fail (503)


def frame(data: bytes) -> bytes:
    """One message on the stream: its length, then its bytes."""
    return HEADER.pack(len(data)) + data


class Frames:
    """Frames out of a byte stream read in arbitrary pieces."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self.buf
        buf += data
        out, at = [], 0
        while len(buf) - at >= 4:
            (n,) = HEADER.unpack_from(buf, at)
            if n >= MAX_FRAME:
                raise P.ProtocolError(f"a frame of {n} bytes: the stream is broken")
            if len(buf) - at - 4 < n:
                break
            out.append(bytes(buf[at + 4:at + 4 + n]))
            at += 4 + n
        del buf[:at]
        return out


# ---------------------------------------------------------------- the engine's end

class EngineSocket:
    """The engine loop's source of messages (EngineLoop.source): (message, reply-to-its-sender).

    While the loop spins (between passes on a GPU, --engine-spin-ms) it reads each front end's
    socket directly, a non-blocking recv() each: spinning on epoll_wait(0) instead added ~25 us
    to a round trip on the CI host (bench/ipc.py). Past the spin it waits in select()."""

    ACCEPT_EVERY = 0.01  # seconds between looks for a new front end while spinning

    def __init__(self, path: str):
        self.path = path
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.conns: list[tuple] = []  # (socket, Frames, reply), one per front end
        self.ready: P.ReadyOut | None = None
        self.stop = False
        self.early: list = []  # read by pending(), handed out by the next take()
        self.accepted = 0.0  # when the spin last looked for new front ends (perf_counter)

    def bind(self, ready: P.ReadyOut) -> None:
        """Listen once the engine is ready: a front end that connects is answered at once."""
        self.ready = ready
        if os.path.exists(self.path):  # a previous engine's, which is gone
            os.unlink(self.path)
        ls = self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(self.path)
        ls.listen(256)
        ls.setblocking(False)
        self.sel.register(ls, selectors.EVENT_READ, None)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            entry = (conn, Frames(), self._reply(conn))
            self.conns.append(entry)
            self.sel.register(conn, selectors.EVENT_READ, entry)

    def _reply(self, conn: socket.socket):
        enc = P.encoder.encode

        def reply(out) -> None:
            if conn.fileno() < 0:  # dropped: its front end is gone
                return
            data = enc(out)
            try:
                _send_all(conn, frame(data))
            except OSError as e:  # gone, or stalled past SEND_TIMEOUT: not worth the engine's time
                log.warning("dropping a front end's connection: %s", e)
                self._drop(conn)

        return reply

    def _drop(self, conn: socket.socket) -> None:
        self.conns = [c for c in self.conns if c[0] is not conn]
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _read(self, entry: tuple, items: list) -> None:
        conn, frames, reply = entry
        try:
            data = conn.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the front end closed (exited); what it had queued was answered or not
            self._drop(conn)
            return
        for f in frames.feed(data):
            msg = P.req_decoder.decode(f)
            if isinstance(msg, P.HelloReq):
                reply(self.ready)
            else:
                items.append((msg, reply))

    def _poll(self, timeout: float, items: list) -> None:
        if timeout > 0 or self.listener is None:
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data, items)
            return
        for entry in self.conns:
            self._read(entry, items)
        now = time.perf_counter()
        if now - self.accepted > self.ACCEPT_EVERY:
            self.accepted = now
            self._accept()

    def take(self, spin: float) -> list:
        """What the front ends sent, at least one message: polls for `spin` seconds, then waits in
        select() (100 ms at a time, to see a stop)."""
        items, self.early = self.early, []
        deadline = time.perf_counter() + spin
        while not items:
            if self.stop:
                return [(STOP, None)]
            self._poll(0 if time.perf_counter() < deadline else 0.1, items)
        return items

    def pending(self) -> int:
        """Messages waiting now (read, a Hello answered, a connection accepted, without waiting)."""
        self._poll(0, self.early)
        return len(self.early)

    def put(self, msg, reply) -> None:  # only STOP, from the signal handler
        self.stop = True

    def close(self, linger: int = 0) -> None:
        """Answers already sent stay readable by the front ends after close (a Unix socket's
        buffered bytes outlive the sender's end), so a fault's last answers arrive."""
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
        if self.listener is not None and os.path.exists(self.path):
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _send_all(conn: socket.socket, data: bytes) -> None:
    """All of data on a non-blocking socket, waiting for room up to SEND_TIMEOUT in all."""
    view, deadline = memoryview(data), None
    while view:
        try:
            view = view[conn.send(view):]
        except BlockingIOError:
            deadline = deadline or time.monotonic() + SEND_TIMEOUT
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [conn], [], left)[1]:
                raise TimeoutError(f"a front end read nothing for {SEND_TIMEOUT:g} s") from None


# ---------------------------------------------------------------- a front end's end

class _Stream(asyncio.Protocol):
    def __init__(self, client: "SocketClient"):
        self.client, self.frames, self.transport = client, Frames(), None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        on_out, decode = self.client._on_out, P.out_decoder.decode
        for f in self.frames.feed(data):
            on_out(decode(f))

    def connection_lost(self, exc) -> None:
        self.client._lost(self)


class SocketClient(BaseClient):
    """An engine process behind its Unix socket."""

    RETRY = 0.05  # seconds between connection attempts while the engine is not listening

    def __init__(self, address: str, client_id: int):
        super().__init__(client_id)
        self.address = address
        self.stream: _Stream | None = None
        self.task: asyncio.Task | None = None
        self.stopped = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.task = loop.create_task(self._keep_connected())

    def stop(self) -> None:
        self.stopped = True
        if self.task is not None:
            self.task.cancel()
        if self.stream is not None and self.stream.transport is not None:
            self.stream.transport.close()

    async def _keep_connected(self) -> None:
        """Connect (again after a loss), then say Hello every 0.2 s until the Ready comes."""
        while not self.stopped:
            if self.stream is None:
                try:
                    _, self.stream = await self.loop.create_unix_connection(
                        lambda: _Stream(self), self.address)
                except OSError:  # not listening yet (starting, restarting)
                    await asyncio.sleep(self.RETRY)
                    continue
                self._send(P.HelloReq(self.id))
            elif self.error is not None:
                self._send(P.HelloReq(self.id))
            await asyncio.sleep(0.2)

    def _lost(self, stream: _Stream) -> None:
        if stream is not self.stream:
            return
        self.stream = None
        if not self.stopped:
            self._fail_all("engine process went away; the server is unhealthy until it is back")

    def _send(self, msg) -> None:
        s = self.stream
        if s is None or s.transport is None or s.transport.is_closing():
            return self._fail_rids(_rids(msg), "the engine is not connected; retry later")
        if s.transport.get_write_buffer_size() > MAX_BUFFERED:  # the engine stopped reading
            return self._fail_rids(_rids(msg), "the engine's input queue is full; retry later")
        s.transport.write(frame(P.encoder.encode(msg)))


def _rids(msg) -> list:
    return list(getattr(msg, "rids", None) or [r for r in [getattr(msg, "rid", None)] if r is not None])
