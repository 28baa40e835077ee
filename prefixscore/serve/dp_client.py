"""Front end -> several engine processes, one per GPU (`--data-parallel N`, vLLM's
DPLBAsyncMPClient shape): one SocketClient (wire.py) per engine, and a router in front of them.

The front end already batches every request of one event-loop pass into one message; the router
sends each such message whole to the engine with the fewest rows in flight from this front end
(ties: round robin), so an engine still gets one message per pass, not one per request. The
count is each engine client's own `jobs` (a row per classify query, one per score request):
exact, and it falls as answers arrive, so no load report from the engines is needed. A score
request counts as one row: it is rare next to classify traffic and its items run as one call.

Each engine is watched by its own client: one that dies fails only what was routed to it (503),
new messages go to the engines still ready, and the server stays healthy while one is. Every
engine must serve the same classifiers (the same prefix ids): the first Ready is the front end's,
and a later one that disagrees stops this front end (`on_mismatch`), as no answer could be trusted.
"""
from __future__ import annotations

import functools
import itertools
import logging

from . import protocol as P
from .client import BaseClient, ClassifyJob, EngineDead

log = logging.getLogger("prefixscore.client")


def least_loaded(loads: list[int | None], turn: int) -> int | None:
    """The index of the smallest load (None: not ready), ties broken round robin from turn (so
    that an idle server spreads its passes over every engine), or None when none is ready."""
    best, n = None, len(loads)
    for k in range(n):
        i = (turn + k) % n
        if loads[i] is not None and (best is None or loads[i] < loads[best]):
            best = i
    return best


def disagreement(a: P.ReadyOut, b: P.ReadyOut) -> str | None:
    """What two engines' Ready facts differ in (those a front end builds its prompts and answers
    from), or None. pid, device and the tokenizer's copy are each engine's own."""
    for name in ("model", "max_batch_tokens"):
        if getattr(a, name) != getattr(b, name):
            return f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
    if (a.scorer is None) != (b.scorer is None):
        return f"scorer: {a.scorer is not None} != {b.scorer is not None}"
    if a.scorer != b.scorer:  # a front end tokenizes score requests by the first one's
        return "the scorer's template, labels or limits"
    if [c.name for c in a.classifiers] != [c.name for c in b.classifiers]:
        return "the classifiers' names"
    for x, y in zip(a.classifiers, b.classifiers):
        for name in ("prefix_ids", "labels", "template", "mode", "chat", "special_tokens",
                     "truncate", "context_limit"):
            if getattr(x, name) != getattr(y, name):
                return f"classifier {x.name!r}: {name}"
    return None


class DataParallelClient(BaseClient):
    """The client a front end holds for N engines. It keeps BaseClient's submitting side (request
    ids, the pass's outbox and its merge into one message); at the send it hands the message and
    its requests' jobs to the chosen engine's client, whose answers resolve them as before."""

    def __init__(self, addresses: list[str], client_id: int, connect=None):
        from .wire import SocketClient

        connect = connect or (lambda address: SocketClient(address, client_id))
        self.engines = [connect(a) for a in addresses]
        super().__init__(client_id)
        for i, e in enumerate(self.engines):
            e.on_ready = functools.partial(self._engine_ready, i)
        self.turn = itertools.count(client_id)  # front ends start their ties on different engines
        self.rejected: dict[int, str] = {}  # engines whose Ready disagreed (why): never routed to
        # Called with a message when an engine's Ready disagrees with the first one's; the worker
        # process exits then (launch.worker_main), and the launcher ends the server.
        self.on_mismatch = None

    # -- the state the front end reads, derived from the engines'
    @property
    def error(self) -> str | None:
        """None while any engine is ready; "starting" until one first is; else why none is."""
        errors = [self._error(i) for i in range(len(self.engines))]
        if None in errors:
            return None
        if all(err == "starting" for err in errors):
            return "starting"
        return "; ".join(f"engine {i}: {err}" for i, err in enumerate(errors))

    @error.setter
    def error(self, value) -> None:  # BaseClient's writes: each engine keeps its own
        pass

    def _error(self, i: int) -> str | None:
        """Engine i's state: None when ready (a rejected engine's repeated Ready clears its
        client's error, not the rejection)."""
        return self.rejected[i] if i in self.rejected else self.engines[i].error

    @property
    def queued(self) -> int:
        return sum(e.queued for i, e in enumerate(self.engines) if self._error(i) is None)

    @queued.setter
    def queued(self, value) -> None:
        pass

    @property
    def metrics(self):
        return self._metrics

    @metrics.setter
    def metrics(self, m) -> None:  # each engine's death is counted by its own client
        self._metrics = m
        for e in getattr(self, "engines", ()):
            e.metrics = m

    def loads(self) -> list[int | None]:
        """Rows in flight from this front end, per engine (None: not ready)."""
        return [len(e.jobs) if self._error(i) is None else None for i, e in enumerate(self.engines)]

    def waiting(self) -> tuple[float | None, float]:
        """The oldest request waiting on any engine, and the latest answer of any (BaseClient's)."""
        sent = [t for t, _ in (e.waiting() for e in self.engines) if t is not None]
        return (min(sent) if sent else None), max(e.last_out for e in self.engines)

    def progress(self, fut):
        return next((p for p in (e.progress(fut) for e in self.engines) if p is not None), None)

    def running_cards(self) -> list[dict]:
        return [c for e in self.engines for c in e.running_cards()]

    def health(self) -> dict:
        """/healthz: every engine, ready or not (and why not); `engine` is the first ready one."""
        engines = []
        for i, e in enumerate(self.engines):
            err = self._error(i)
            card = {"index": i, "ready": err is None, "in_flight": len(e.jobs)}
            if e.info is not None:
                card.update(pid=e.info.pid, device=e.info.device)
            if err is not None:
                card["error"] = err
            engines.append(card)
        out = {"engines": engines}
        ready = [c for c in engines if c["ready"] and "pid" in c]
        if ready:
            out["engine"] = {"pid": ready[0]["pid"], "device": ready[0]["device"]}
        return out

    def wait_s(self, n: int) -> float:
        """Retry-After: what is in flight and queued on the ready engines, at their summed rate."""
        live = [e for i, e in enumerate(self.engines) if self._error(i) is None]
        rate = sum(e.rate for e in live if e.rate)
        work = sum(max(len(e.jobs), e.queued) for e in live) + len(self.jobs) + n
        return work / rate + self.pass_s if rate else 1.0

    @property
    def score_rate(self) -> float | None:
        """One score request's tokens per second of its run, averaged over the ready engines."""
        rates = [e.score_rate for i, e in enumerate(self.engines) if self._error(i) is None and e.score_rate]
        return sum(rates) / len(rates) if rates else None

    @property
    def pass_s(self) -> float:
        """The longest recent classify pass of the ready engines (client.BaseClient.pass_s)."""
        return max((e.pass_s for i, e in enumerate(self.engines) if self._error(i) is None), default=0.0)

    # -- lifecycle
    def start(self, loop) -> None:
        self.loop = loop
        for e in self.engines:
            e.start(loop)

    def stop(self) -> None:
        for e in self.engines:
            e.stop()

    # -- routing
    def _send(self, msg) -> None:
        """A message of this pass, whole, to the least-loaded ready engine, its jobs with it."""
        if isinstance(msg, P.ClassifyReq):
            rids = msg.rids
        elif isinstance(msg, P.ScoreReq):
            rids = [msg.rid]
        else:  # aborts go straight to the engines' clients (abort below); Hello is theirs
            return
        i = least_loaded(self.loads(), next(self.turn))
        if i is None:  # every engine went away during this pass
            self._fail_rids(rids, self.error or "no engine is ready")
            return
        e = self.engines[i]
        for rid in rids:
            job = self.jobs.pop(rid, None)
            if job is not None:
                e.jobs[rid] = job
                fut = job[0].future if isinstance(job[0], ClassifyJob) else job[0]
                if fut in self.rids_of:  # its abort goes to that engine's client
                    e.rids_of[fut] = self.rids_of.pop(fut)
        e._send(msg)

    def abort(self, futures: list) -> None:
        for e in self.engines:
            e.abort(futures)

    def _fail_all(self, error: str, fault: bool = True) -> None:
        """The front end's drain deadline: everything in flight on every engine fails (503)."""
        self._fail_rids(list(self.jobs), error)
        for e in self.engines:
            e._fail_all(error, fault)

    def _engine_ready(self, i: int) -> None:
        """Engine i's (new) Ready: the first one becomes the front end's; a later one must agree."""
        info = self.engines[i].info
        self.rejected.pop(i, None)  # a restarted engine is judged again
        if self.info is None:
            self.info = info
        else:
            why = disagreement(self.info, info)
            if why is not None:
                msg = (f"engine {i} (pid {info.pid}) does not serve what the first engine does "
                       f"({why}); every engine must load the same model and classifiers")
                self.rejected[i] = msg
                log.error(msg)
                if self.on_mismatch is not None:
                    self.on_mismatch(msg)
                return
        if self.metrics is not None:
            self.metrics.engine_pids[i] = info.pid
        log.info("engine %d ready (pid %d, %s)", i, info.pid, info.device)
        if self.on_ready is not None:
            self.on_ready()
        if self.became_ready is not None:
            self.became_ready.set()


__all__ = ["DataParallelClient", "EngineDead", "least_loaded"]
