"""serve/wire.py: frames out of a stream cut anywhere, and the engine's socket and a front end's
client talking: Hello -> Ready, a request and its answer, a lost engine failing what waits."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from prefixscore.serve import protocol as P
from prefixscore.serve.client import EngineDead
from prefixscore.serve.wire import EngineSocket, Frames, SocketClient, frame


def test_frames_from_any_cut():
    rng = random.Random(0)
    msgs = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))) for _ in range(50)]
    stream = b"".join(frame(m) for m in msgs)
    for _ in range(20):
        f, got, at = Frames(), [], 0
        while at < len(stream):
            n = rng.randrange(1, 40)
            got += f.feed(stream[at:at + n])
            at += n
        assert got == msgs and not f.buf


def test_a_broken_length_is_refused():
    with pytest.raises(P.ProtocolError, match="broken"):
        Frames().feed(b"\xff\xff\xff\xff" + b"x")


def ready() -> P.ReadyOut:
    return P.ReadyOut(model="m", tokenizer_path="", classifiers=[], max_batch_tokens=64, scorer=None,
                      device="cpu", pid=1)


def test_client_and_engine_socket(tmp_path):
    """The engine answers a Hello with its Ready and each classify request on its sender's
    connection; when the engine goes away, what waits fails with EngineDead at once."""
    path = str(tmp_path / "engine.sock")
    src = EngineSocket(path)
    src.bind(ready())
    served, stop = [], threading.Event()

    def engine():  # echo each request's rids back OK, as the engine loop's answers
        while not stop.is_set():
            if not src.pending():
                continue
            for msg, reply in src.take(0.0):
                served.append(msg)
                n = len(msg.rids)
                reply(P.ClassifyOut(msg.rids, [P.OK] * n, [1] * n, bytes(4 * 2 * n), {}, 0.001, n, 0))

    t = threading.Thread(target=engine, daemon=True)
    t.start()

    async def go():
        c = SocketClient(path, 3)
        c.start(asyncio.get_running_loop())
        for _ in range(100):
            if c.ready:
                break
            await asyncio.sleep(0.02)
        assert c.ready and c.info.model == "m"
        job = await c.classify([[1, 2, 3], [4, 5]], [0, 0], deadline=1e12)
        assert job.status == [P.OK, P.OK] and job.best == [1, 1]
        stop.set()
        t.join()
        hangs = c.classify([[7]], [0], deadline=1e12)  # nobody answers it
        await asyncio.sleep(0.05)
        src.close()  # the engine goes away: the request in flight fails now, not at a timeout
        with pytest.raises(EngineDead):
            await asyncio.wait_for(hangs, 5)
        assert not c.ready
        c.stop()

    asyncio.run(go())
    assert served[0].client == 3 and P.unpack_ids(served[0].ids, served[0].offsets) == [[1, 2, 3], [4, 5]]
