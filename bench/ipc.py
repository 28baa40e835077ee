"""The front end <-> engine transport alone: one message and its answer, round trip, as a front
end's event loop (uvloop) and a spinning engine process make them (serve/wire.py's choice).

    python -m bench.ipc [--n 3000]

  socket   serve/wire.py: EngineSocket echoing a ClassifyReq (decoded and encoded again, as the
           engine does) over a Unix stream socket; the front end's loop reads it on readiness
  zmq      ZeroMQ DEALER/ROUTER over ipc://, the transport it replaced (skipped without pyzmq)
Each with the engine spinning (as on a GPU, --engine-spin-ms) and blocking in its poll (CPU).
400 bytes of ids a message (ZeroMQ: the raw bytes, neither decoded nor encoded). p50/p99 after 300 warm-up round trips; writes
$OUT/ipc.json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT") or "bench/results")
MSG = b"x" * 400
WARM = 300


def engine_socket(path: str, spin: bool) -> None:
    """wire.EngineSocket as the engine loop uses it, echoing every message to its sender (run()
    kills it at the end)."""
    from prefixscore.serve.wire import EngineSocket

    src = EngineSocket(path)
    src.bind(None)
    while True:
        for msg, reply in src.take(1.0 if spin else 0.0):
            reply(msg)


async def client_socket(path: str, n: int) -> list[float]:
    from prefixscore.serve import protocol as P
    from prefixscore.serve.wire import Frames, frame

    for _ in range(100):
        try:
            r, w = await asyncio.open_unix_connection(path)
            break
        except OSError:
            await asyncio.sleep(0.05)
    frames, ts = Frames(), []
    msg = P.encoder.encode(P.ClassifyReq(0, [1], MSG, [0, len(MSG) // 4], [0], [0.0]))
    for _ in range(n):
        t = time.perf_counter()
        w.write(frame(msg))
        got = []
        while not got:
            got = frames.feed(await r.read(1 << 20))
        ts.append(time.perf_counter() - t)
    w.close()
    return ts


def engine_zmq(address: str, spin: bool) -> None:
    import zmq

    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(address)
    while True:
        if not s.poll(0 if spin else 100):
            continue
        ident, msg = s.recv_multipart()
        if msg == b"stop":
            return
        s.send_multipart([ident, msg])


async def client_zmq(address: str, n: int) -> list[float]:
    import zmq

    s = zmq.Context().socket(zmq.DEALER)
    s.connect(address)
    loop, fut = asyncio.get_running_loop(), None

    def readable():  # as the old ZmqClient: the FD is edge-triggered, drain on every wake
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            m = s.recv(zmq.NOBLOCK)
            if fut is not None and not fut.done():
                fut.set_result(m)

    loop.add_reader(s.getsockopt(zmq.FD), readable)
    ts = []
    for _ in range(n):
        fut = loop.create_future()
        t = time.perf_counter()
        s.send(MSG, zmq.NOBLOCK)
        readable()
        await fut
        ts.append(time.perf_counter() - t)
    s.send(b"stop")
    return ts


def run(kind: str, spin: bool, n: int) -> dict:
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    d = tempfile.mkdtemp(prefix="ipc")
    addr = f"{d}/engine.sock" if kind == "socket" else f"ipc://{d}/engine"
    p = mp.get_context("spawn").Process(target=engine_socket if kind == "socket" else engine_zmq,
                                        args=(addr, spin), daemon=True)
    p.start()
    time.sleep(0.5)
    ts = runner((client_socket if kind == "socket" else client_zmq)(addr, WARM + n))
    p.join(2)
    if p.is_alive():
        p.kill()
    us = sorted(1e6 * t for t in ts[WARM:])
    return {"transport": kind, "engine": "spinning" if spin else "blocking",
            "p50_us": statistics.median(us), "p99_us": us[int(0.99 * (len(us) - 1))]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000)
    a = ap.parse_args()
    kinds = ["socket"]
    try:
        import zmq  # noqa: F401
        kinds.append("zmq")
    except ImportError:
        print("pyzmq is not installed: ZeroMQ skipped")
    rows = [run(k, spin, a.n) for k in kinds for spin in (True, False)]
    print(f"{'transport':>10} {'engine':>10} {'p50 us':>8} {'p99 us':>8}")
    for r in rows:
        print(f"{r['transport']:>10} {r['engine']:>10} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ipc.json").write_text(json.dumps({"cpus": os.cpu_count(), "n": a.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
