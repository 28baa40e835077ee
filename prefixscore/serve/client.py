"""Front end -> engine clients, one interface over two transports (vLLM's EngineCoreClient shape).

- InprocClient: the engine loop on a thread of this process (`--workers 1`; the tests' seam).
- SocketClient (wire.py): an engine process over a Unix socket (several front-end processes).
- DataParallelClient (dp_client.py): several engine processes, a SocketClient each (--data-parallel).

Both batch: every request submitted during one event-loop pass leaves in one message, and each
engine batch comes back as one message per front end. Both watch the engine: when it dies every
request in flight fails at once with EngineDead (503), `error` is set until it is ready again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import protocol as P
from .engine_loop import STOP, EngineLoop, Stopped

log = logging.getLogger("prefixscore.client")


class EngineDead(Exception):
    pass


@dataclass
class ClassifyJob:
    """One front-end request: its queries' rows, answered together (one message each way)."""
    future: asyncio.Future
    n: int
    t0: float = 0.0  # when it was sent (time.monotonic())
    status: list = None
    best: list = None
    scores: np.ndarray = None
    errors: dict = field(default_factory=dict)
    forward_s: float = 0.0
    batch_size: int = 0
    n_done: int = 0


class BaseClient:
    # What admission reads of the engine besides `rate`, set from its answers (_on_out); class
    # defaults, so that DataParallelClient may define them over its engines instead.
    pass_s = 0.0  # a classify pass's seconds, smoothed: answers come a pass at a time
    score_rate = None  # /v1/score tokens computed per second of a request's run, smoothed

    def __init__(self, client_id: int = 0):
        self.id = client_id
        self.info: P.ReadyOut | None = None
        self.error: str | None = "starting"  # None once the engine is ready
        self.rids = itertools.count()
        self.jobs: dict[int, tuple] = {}  # rid -> (job, row) or ScoreReq future
        self.outbox: list = []  # messages built in this event-loop pass
        # score requests the engine has run some passes of: rid -> (its last ProgressOut, when)
        self.running: dict[int, tuple[P.ProgressOut, float]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queued = 0  # the engine's queue depth in its last answer
        self.last_out = 0.0  # when the engine last answered (time.monotonic())
        self.rate = None  # engine requests/s, smoothed (for Retry-After)
        self.rids_of: dict[asyncio.Future, list[int]] = {}  # until each future is done (abort)
        self.metrics = None  # set by the front end: engine deaths are counted
        self.became_ready: asyncio.Event | None = None
        # Called (event loop) when the engine's Ready arrives: the front end builds its prompt
        # then, at start-up, instead of inside the first request that reaches this process.
        self.on_ready = None

    async def wait_ready(self, timeout: float) -> None:
        """While the engine starts, a request waits for it (up to timeout), not a 503."""
        if self.error == "starting":
            if self.became_ready is None:
                self.became_ready = asyncio.Event()
            try:
                await asyncio.wait_for(self.became_ready.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    @property
    def ready(self) -> bool:
        return self.error is None

    def health(self) -> dict:
        """What /healthz adds about the engines (several: dp_client); one says nothing more."""
        return {}

    def progress(self, fut) -> P.ProgressOut | None:
        """How far the engine got with a score request's future (None: no pass run yet)."""
        rids = self.rids_of.get(fut, ())
        entry = self.running.get(rids[0]) if len(rids) == 1 else None
        return None if entry is None else entry[0]

    def _show_running(self) -> None:
        if self.metrics is not None:
            self.metrics.running([p for p, _ in self.running.values()])

    def running_cards(self) -> list[dict]:
        """/healthz: the score requests in progress, as the engine last reported them."""
        now = time.monotonic()
        return [{"passes": p.passes, "of_passes": p.total, "items_done": p.items_done,
                 "query_part": p.filling, "reported_ms_ago": round(1e3 * (now - t), 1)}
                for p, t in self.running.values()]

    def waiting(self) -> tuple[float | None, float]:
        """(when the oldest request this front end waits on was sent, when the engine last
        answered), time.monotonic(); None: nothing waits. /healthz reads the oldest request's age
        and how long the engine has been silent while requests wait (a long pass)."""
        first = next(iter(self.jobs.values()), None)  # dicts keep order: the oldest first
        if first is None:
            return None, self.last_out
        return (first[0].t0 if isinstance(first[0], ClassifyJob) else first[1]), self.last_out

    # -- submitting (event loop)
    def classify(self, ids: list[list[int]], starts: list[int], deadline: float,
                 classifiers: list[int] | None = None, priority: int = 0,
                 finish_by: float = 0.0, tenant: int = 0) -> asyncio.Future:
        """One request of len(ids) rows. classifiers[i]: the classifier (its index in
        ReadyOut.classifiers) of row i; None: the default for every row. deadline: not started by
        then, the engine drops it unrun (once one of its rows has started, the others are not
        dropped for it); finish_by: the client's deadline (0: none), which ends every row;
        tenant: the client that sent it (its turns in the engine's lane)."""
        if self.error is not None:
            raise EngineDead(self.error)
        job = ClassifyJob(self.loop.create_future(), len(ids), time.monotonic())
        rids = [next(self.rids) for _ in ids]
        for row, rid in enumerate(rids):
            self.jobs[rid] = (job, row)
        self._track(job.future, rids)
        data, offsets = P.pack_ids(ids, starts)  # the prefix's tokens are the engine's own
        n = len(ids)
        self._queue(P.ClassifyReq(self.id, rids, data, offsets, starts, [deadline] * n,
                                  classifiers or [], [priority] * n if priority else [],
                                  [rids[0]] * n if n > 1 else [], [finish_by] * n if finish_by else [],
                                  [tenant] * n if tenant else []))
        return job.future

    def score(self, full: list[list[int]], shared: list[int], deadline: float,
              labels: list[str] | None = None, label_token_ids: list[int] | None = None,
              apply_softmax: bool = False, finish_by: float = 0.0, priority: int = 0,
              soft: list | None = None, tenant: int = 0) -> asyncio.Future:
        """One tokenized score request (ScoreInput.parse's): per item its whole prompt's ids, and
        the ids before the item slot; the label set as the request named it (None: the scorer's);
        soft: Prepared.soft (per item its vector or None), None for no embedding items.
        deadline: not started by then, dropped unrun; finish_by: the client's deadline (0: none),
        its passes stop there."""
        if self.error is not None:
            raise EngineDead(self.error)
        fut = self.loop.create_future()
        rid = next(self.rids)
        now = time.monotonic()
        self.jobs[rid] = (fut, now)
        self._track(fut, [rid])
        data, offsets = P.pack_ids(full)
        vectors = [v for v in soft if v is not None] if soft else []
        self._queue(P.ScoreReq(self.id, rid, data, offsets, np.asarray(shared, np.int32).tobytes(),
                               labels, label_token_ids, apply_softmax, deadline, finish_by, priority,
                               now, b"".join(v.numpy().astype(np.float32).tobytes() for v in vectors),
                               tenant))
        return fut

    def _track(self, fut: asyncio.Future, rids: list[int]) -> None:
        """A future's rows, until it is answered, failed or aborted (each pops it: a done
        callback would run before the awaiting task's abort, which then found nothing)."""
        self.rids_of[fut] = rids

    def abort(self, futures: list) -> None:
        """Requests whose clients left or whose deadline passed: dropped by the engine if still
        queued. O(their rows), not O(requests in flight): under overload thousands of deadlines
        pass each second with thousands in flight."""
        rids = [rid for f in futures for rid in self.rids_of.pop(f, ()) if rid in self.jobs]
        if any([self.running.pop(rid, None) for rid in rids]):
            self._show_running()
        if rids:
            self._queue(P.AbortReq(self.id, rids))

    def _queue(self, msg) -> None:
        if not self.outbox:
            self.loop.call_soon(self._flush)
        self.outbox.append(msg)

    def _flush(self) -> None:
        msgs, self.outbox = self.outbox, []
        classify = [m for m in msgs if isinstance(m, P.ClassifyReq)]
        if len(classify) > 1:  # one message for every classify request of this pass
            msgs = [m for m in msgs if not isinstance(m, P.ClassifyReq)] + [_merge(classify)]
        for m in msgs:
            self._send(m)

    # -- answers (event loop)
    def _on_out(self, out) -> None:
        self.last_out = time.monotonic()
        if isinstance(out, P.ClassifyOut):
            self.queued = out.queued
            if out.forward_s > 0:
                self.pass_s = _smooth(self.pass_s, out.forward_s)
            if out.drain_rps > 0:  # the engine's own measure: every pass and what is between
                self.rate = out.drain_rps
            elif out.forward_s > 0:  # before the engine has been busy for two passes
                self.rate = _smooth(self.rate, out.batch_size / out.forward_s)
            scores = np.frombuffer(out.scores, dtype=np.float32).reshape(len(out.rids), -1)
            for i, rid in enumerate(out.rids):
                entry = self.jobs.pop(rid, None)
                if entry is None:
                    continue
                job, row = entry
                if job.status is None:
                    job.status, job.best = [0] * job.n, [0] * job.n
                    job.scores = np.zeros((job.n, scores.shape[1]), dtype=np.float32)
                job.status[row], job.best[row], job.scores[row] = out.status[i], out.best[i], scores[i]
                if rid in out.errors:
                    job.errors[row] = out.errors[rid]
                job.forward_s, job.batch_size = out.forward_s, out.batch_size
                job.n_done += 1
                if job.n_done == job.n:
                    self.rids_of.pop(job.future, None)
                    if not job.future.done():
                        job.future.set_result(job)
        elif isinstance(out, P.ProgressOut):
            if out.rid in self.jobs:
                self.running[out.rid] = (out, self.last_out)
                self._show_running()
        elif isinstance(out, P.ScoreOut):
            if out.run_s > 0 and out.prompt_tokens > 0:
                self.score_rate = _smooth(self.score_rate, out.prompt_tokens / out.run_s)
            if self.running.pop(out.rid, None) is not None:
                self._show_running()
            entry = self.jobs.pop(out.rid, None)
            if entry is not None:
                self.rids_of.pop(entry[0], None)
                if not entry[0].done():
                    entry[0].set_result(out)
        elif isinstance(out, P.ReadyOut):
            # Every Hello gets a Ready, and Hellos sent while an engine (re)starts are queued and
            # answered together: the same engine's Ready again changes nothing (struct equality).
            fresh, self.error = out != self.info, None
            if fresh:
                self.info = out
            if fresh and self.on_ready is not None:
                try:
                    self.on_ready()
                except Exception:  # the front end checks again on each request and says why
                    log.exception("building the front end's prompt from the engine's Ready")
            if self.became_ready is not None:
                self.became_ready.set()

    def _fail_all(self, error: str, fault: bool = True) -> None:
        """The engine is gone: every request in flight fails now (503), none hangs."""
        if fault and self.metrics is not None:
            self.metrics.engine_faults.inc()
        self.error = error
        jobs, self.jobs, self.rids_of, self.running = self.jobs, {}, {}, {}
        for job, _ in jobs.values():
            fut = job.future if isinstance(job, ClassifyJob) else job
            if not fut.done():
                fut.set_exception(EngineDead(error))

    def _fail_rids(self, rids, error: str) -> None:
        """These requests fail now with EngineDead (503), the engine staying as it is."""
        for rid in rids:
            job, _ = self.jobs.pop(rid, (None, None))
            self.running.pop(rid, None)
            fut = job.future if isinstance(job, ClassifyJob) else job
            self.rids_of.pop(fut, None)
            if fut is not None and not fut.done():
                fut.set_exception(EngineDead(error))

    def wait_s(self, n: int) -> float:
        """Seconds the engine needs for what is queued plus n more requests (Retry-After): this
        front end's rows in flight, or the engine's queue (every front end's) if longer, at the
        engine's rate, and a pass more: the pass running when they arrive ends before theirs
        starts, and a row is answered when its whole pass is (on a CPU, a long wait)."""
        if not self.rate:
            return 1.0
        return (max(len(self.jobs), self.queued) + n) / self.rate + self.pass_s


def _smooth(old: float | None, new: float) -> float:
    """An engine figure smoothed over its answers (a fifth of each new one); None or 0: none yet."""
    return new if not old else 0.8 * old + 0.2 * new


def _merge(msgs: list) -> P.ClassifyReq:
    rids, starts, deadlines, offsets, datas, base = [], [], [], [0], [], 0
    mixed = any(m.classifiers for m in msgs)  # else every row is the default's: nothing to send
    ranked = any(m.priorities for m in msgs)  # else every row is real-time
    grouped = any(m.groups for m in msgs)  # else every row is a request of its own
    timed = any(m.finish_bys for m in msgs)  # else no row has a client deadline
    named = any(m.tenants for m in msgs)  # else every row is of one client
    classifiers, priorities, groups, finish_bys, tenants = [], [], [], [], []
    for m in msgs:
        rids += m.rids
        starts += m.starts
        deadlines += m.deadlines
        offsets += [base + o for o in m.offsets[1:]]
        base += m.offsets[-1]
        datas.append(m.ids)
        if mixed:
            classifiers += m.classifiers or [0] * len(m.rids)
        if ranked:
            priorities += m.priorities or [0] * len(m.rids)
        if grouped:
            groups += m.groups or m.rids
        if timed:
            finish_bys += m.finish_bys or [0.0] * len(m.rids)
        if named:
            tenants += m.tenants or [0] * len(m.rids)
    return P.ClassifyReq(msgs[0].client, rids, b"".join(datas), offsets, starts, deadlines,
                         classifiers, priorities, groups, finish_bys, tenants)


class InprocClient(BaseClient):
    """The engine loop on a thread of this process: messages are passed as objects, answers come
    back to the event loop with one call_soon_threadsafe per engine batch. A thread that dies
    (any exception, a BaseException too) fails everything in flight; with restart=True a new
    thread takes over the same classifier."""

    def __init__(self, clf, scorer=None, window: float = 0.0, spin: float = 0.0, metrics=None,
                 restart: bool = False, model: str = "", engine_cpu: int | None = None,
                 schedule=None):
        super().__init__(0)
        self.clf, self.scorer, self.restart, self.model = clf, scorer, restart, model
        self.engine = EngineLoop(clf, scorer, window=window, spin=spin, metrics=metrics,
                                 schedule=schedule)
        self.engine_cpu = engine_cpu
        self.thread: threading.Thread | None = None
        self.restarts = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.Thread(target=self._main, name="prefixscore-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.engine.source.put(STOP, None)

    def _send(self, msg) -> None:
        self.engine.source.put(msg, self._reply)

    def _reply(self, out) -> None:
        try:
            self.loop.call_soon_threadsafe(self._on_out, out)
        except RuntimeError:  # the event loop is closed: nobody waits for it
            pass

    def _main(self) -> None:
        try:
            if self.engine_cpu is not None:  # pid 0: this (engine) thread only
                os.sched_setaffinity(0, {self.engine_cpu})
            self.engine.warmup()
            self._reply(self.engine.ready(model=self.model))
            self.engine.run()
        except Stopped:  # the shutdown's, once everything is answered (end_engine_thread)
            return
        except BaseException as e:  # noqa: B036 -- no request may wait on a dead thread
            log.error("engine thread died", exc_info=e)
            try:
                self.loop.call_soon_threadsafe(self._died, f"engine fault: {type(e).__name__}: {e}")
            except RuntimeError:
                pass

    def _died(self, error: str) -> None:
        self._fail_all(error)
        if self.restart:
            self.restarts += 1
            log.warning("restarting the engine thread (restart %d)", self.restarts)
            self.engine.source = type(self.engine.source)()
            self.start(self.loop)
