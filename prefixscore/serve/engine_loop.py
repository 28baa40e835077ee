"""The engine loop: one per engine (GPU), ignorant of sockets.

It takes everything its front ends queued since the last pass (HTTP, gRPC, any number of worker
processes), drops what expired or was aborted, runs every classify request in one
`classify_encoded` call (flat batches, CUDA graphs), answers each front end with one message, then
runs queued multi-item scoring requests. The same loop runs on a thread of the server process
(`--workers 1`, client.InprocClient) or as the main loop of an engine process (engine_proc.py); a
`source` gives it messages and a reply function per message. It calls `Classifier.decide_encoded`
(label indices and score rows, no Result objects): the tests' seam for a slow or failing engine.
"""
from __future__ import annotations

import logging
import os
import time
from queue import Empty, SimpleQueue

import numpy as np

from ..errors import PrefixScoreError
from ..prompt import Encoded
from . import protocol as P

log = logging.getLogger("prefixscore.engine")
STOP = object()


class EngineFault(Exception):
    """The engine failed on a batch (not the requests' fault): it stops, and is restarted if the
    server was started with --restart-engine."""


class QueueSource:
    """Messages from threads of this process (the in-process client): a SimpleQueue of
    (message, reply) pairs, STOP to end."""

    def __init__(self):
        self.queue: SimpleQueue = SimpleQueue()

    def put(self, msg, reply) -> None:
        self.queue.put((msg, reply))

    def take(self, spin: float) -> list:
        """The next message (polling `spin` seconds before sleeping), then everything queued."""
        deadline = time.perf_counter() + spin
        while True:
            try:
                items = [self.queue.get_nowait()]
                break
            except Empty:
                if time.perf_counter() >= deadline:
                    items = [self.queue.get()]
                    break
                time.sleep(0)  # yield the GIL to the event loop between polls
        while True:
            try:
                items.append(self.queue.get_nowait())
            except Empty:
                return items

    def pending(self) -> int:
        return self.queue.qsize()


class EngineLoop:
    def __init__(self, clf, scorer=None, source=None, window: float = 0.0, spin: float = 0.0,
                 metrics=None):
        self.clf, self.scorer, self.window, self.spin = clf, scorer, window, spin
        self.source = source or QueueSource()
        self.metrics = metrics
        self.N = len(clf.labels)
        self.aborted: set[tuple[int, int]] = set()

    def ready(self, tokenizer_path: str = "", model: str = "") -> P.ReadyOut:
        clf = self.clf
        return P.ReadyOut(
            model=model, tokenizer_path=tokenizer_path, template=clf.prompt.template,
            chat=clf.prompt.chat, special_tokens=getattr(clf.prompt, "special_tokens", False),
            labels=list(clf.labels), mode=clf.mode, truncate=clf.truncate,
            prefix_ids=list(clf.prompt.prefix_ids), context_limit=clf.prompt.context_limit or 0,
            max_batch_tokens=clf.max_batch_tokens, scorer=self.scorer is not None,
            device=str(clf.engine.device), pid=os.getpid())

    def warmup(self) -> None:
        """One real batch proves the path (the Classifier built the prefix and captured graphs)."""
        self.clf.decide_encoded([self.clf.encode("warm up")])

    def run(self) -> None:
        """Serve until STOP. An EngineFault (or anything else) propagates to the owner, after the
        batch it broke has been answered FAULT."""
        while True:
            items = self.source.take(self.spin)
            if self.window and all(m is not STOP for m, _ in items):  # wait for company
                time.sleep(self.window)
                items += self.source.take(0.0) if self.source.pending() else []
            stop = any(m is STOP for m, _ in items)
            self.serve([(m, r) for m, r in items if m is not STOP])
            if stop:
                return

    def serve(self, items: list) -> None:
        for m, _ in items:
            if isinstance(m, P.AbortReq):
                self.aborted.update((m.client, r) for r in m.rids)
        classify = [(m, r) for m, r in items if isinstance(m, P.ClassifyReq)]
        if classify:
            self._classify(classify)
        for m, reply in items:
            if isinstance(m, P.ScoreReq):
                out = self._score(m)
                reply(out)
                if out.status == P.FAULT:
                    raise EngineFault(out.error)
        self.aborted.clear()  # an abort names only requests queued before it

    def _classify(self, msgs: list) -> None:
        now = time.monotonic()
        todo, where = [], []  # Encoded, (message index, row)
        status = []
        for k, (m, _) in enumerate(msgs):
            ids = P.unpack_ids(m.ids, m.offsets)
            st = [P.OK] * len(m.rids)
            for i, rid in enumerate(m.rids):
                if (m.client, rid) in self.aborted:
                    st[i] = P.ABORTED
                elif m.deadlines[i] + self.window < now:  # the batch window is not queueing
                    st[i] = P.EXPIRED
                else:
                    todo.append(Encoded({"query": ""}, "", ids[i], m.starts[i]))
                    where.append((k, i))
            status.append(st)
        t0 = time.perf_counter()
        try:
            best_all, scores_all = self.clf.decide_encoded(todo) if todo else ([], [])
        except Exception as e:
            for k, (m, reply) in enumerate(msgs):
                reply(P.ClassifyOut(m.rids, [P.FAULT] * len(m.rids), [0] * len(m.rids),
                                    bytes(4 * self.N * len(m.rids)),
                                    {r: f"engine fault: {type(e).__name__}: {e}" for r in m.rids},
                                    0.0, len(todo), 0))
            raise EngineFault(f"{type(e).__name__}: {e}") from e
        forward = time.perf_counter() - t0
        if self.metrics is not None and todo:
            self.metrics.engine_batch(len(todo), forward)
        best = [np.zeros(len(m.rids), dtype=np.int64) for m, _ in msgs]
        scores = [np.zeros((len(m.rids), self.N), dtype=np.float32) for m, _ in msgs]
        for (k, i), d, sc in zip(where, best_all, scores_all):
            best[k][i] = d
            scores[k][i] = sc
        queued = self.source.pending()
        for k, (m, reply) in enumerate(msgs):
            reply(P.ClassifyOut(m.rids, status[k], best[k].tolist(), scores[k].tobytes(), {},
                                forward, len(todo), queued))

    def _score(self, m: P.ScoreReq) -> P.ScoreOut:
        if (m.client, m.rid) in self.aborted:
            return P.ScoreOut(m.rid, P.ABORTED, None, None)
        if m.deadline + self.window < time.monotonic():
            return P.ScoreOut(m.rid, P.EXPIRED, None, None)
        if self.scorer is None:
            return P.ScoreOut(m.rid, P.BAD_INPUT, None, "no multi-item scorer on this server")
        try:
            out = self.scorer.score_request(m.request)
        except PrefixScoreError as e:
            return P.ScoreOut(m.rid, P.BAD_INPUT, None, str(e))
        except Exception as e:
            log.error("engine fault in multi-item scoring", exc_info=e)
            return P.ScoreOut(m.rid, P.FAULT, None, f"engine fault: {type(e).__name__}: {e}")
        return P.ScoreOut(m.rid, P.OK, out, None)
