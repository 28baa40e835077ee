"""The engine's queues and what runs next: two lanes, passes of bounded cost.

A request's `priority` picks its lane: 0 is real-time, anything higher is batch work, which runs
only when the real-time lane is empty (so a real-time request waits behind at most the one batch
pass in flight). Within a lane, classify rows and multi-item jobs take turns when both wait, and a
pass is cut to the token budget (PassBudget: about --pass-ms of work, measured as it goes):
classify rows in arrival order up to it, a multi-item request a run of its items at a time (items
are independent, so they split across passes). No request can hold the engine for longer than
one pass, and every deadline and abort is looked at between passes.

Nothing here touches the model: engine_loop.py runs the passes this hands out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

REALTIME, BATCH = 0, 1


def lane(priority: int) -> int:
    return REALTIME if priority <= 0 else BATCH


@dataclass
class Row:
    """One queued classify request (a row of a ClassifyReq)."""
    client: int
    rid: int
    ids: list[int]
    start: int  # tokens of ids the engine has cached (the prefix)
    deadline: float
    classifier: int
    reply: Callable
    tokens: int = 0  # computed: len(ids) - start

    def __post_init__(self):
        self.tokens = len(self.ids) - self.start


@dataclass
class ScoreJob:
    """One multi-item request, run a few items per pass."""
    msg: object  # protocol.ScoreReq
    reply: Callable
    full: list[list[int]]  # per item, the whole prompt
    shared: list[int]
    depth: int = -1  # items it will score; -1: not started (decided at its first pass)
    done: int = 0  # items scored so far
    scores: list = field(default_factory=list)
    labels: list | None = None
    computed: int = 0  # tokens computed so far

    @property
    def key(self) -> tuple[int, int]:
        return self.msg.client, self.msg.rid

    @property
    def started(self) -> bool:
        return self.depth >= 0

    def next_items(self, budget: int) -> int:
        """How many of the next items fit the pass's token budget (at least one): the query part
        once, then each item's own tokens."""
        shared, n, total = len(self.shared), 0, len(self.shared)
        for ids in self.full[self.done:self.depth]:
            total += len(ids) - shared
            if n and total > budget:
                break
            n += 1
        return n


class Lanes:
    def __init__(self):
        self.rows = (deque(), deque())  # per lane: Row
        self.jobs = (deque(), deque())  # per lane: ScoreJob (the one started first in front)
        self.turn = [0, 0]  # per lane: 0 classify next, 1 score next (when both wait)

    def __len__(self) -> int:
        return sum(map(len, self.rows)) + sum(map(len, self.jobs))

    def add_row(self, row: Row, priority: int) -> None:
        self.rows[lane(priority)].append(row)

    def add_job(self, job: ScoreJob) -> None:
        self.jobs[lane(job.msg.priority)].append(job)

    def oldest(self) -> float | None:
        """The earliest deadline among queued rows (None: none queued)."""
        heads = [q[0].deadline for q in self.rows if q]
        return min(heads) if heads else None

    def remove(self, keys: set) -> tuple[list[Row], list[ScoreJob]]:
        """Take out the rows and jobs whose (client, rid) is in keys (aborted), to be answered."""
        rows, jobs = [], []
        for q in self.rows:
            kept = [r for r in q if (r.client, r.rid) not in keys]
            if len(kept) != len(q):
                rows += [r for r in q if (r.client, r.rid) in keys]
                q.clear()
                q.extend(kept)
        for q in self.jobs:
            for j in [j for j in q if j.key in keys]:
                q.remove(j)
                jobs.append(j)
        return rows, jobs

    def expired(self, now: float) -> tuple[list[Row], list[ScoreJob]]:
        """Take out what may no longer run: rows past their deadline, jobs not started by their
        start-by time or past their client's deadline."""
        rows, jobs = [], []
        for q in self.rows:
            if any(r.deadline < now for r in q):
                rows += [r for r in q if r.deadline < now]
                kept = [r for r in q if r.deadline >= now]
                q.clear()
                q.extend(kept)
        for q in self.jobs:
            for j in list(q):
                m = j.msg
                if (not j.started and m.deadline < now) or (m.finish_by and m.finish_by < now):
                    q.remove(j)
                    jobs.append(j)
        return rows, jobs

    def next_pass(self, budget: int):
        """("classify", rows) or ("score", job) for the next pass, or None when nothing waits."""
        for k in (REALTIME, BATCH):
            rows, jobs = self.rows[k], self.jobs[k]
            if not rows and not jobs:
                continue
            if rows and (not jobs or self.turn[k] == 0):
                self.turn[k] = 1
                return "classify", self._take_rows(rows, budget)
            self.turn[k] = 0
            return "score", jobs[0]
        return None

    @staticmethod
    def _take_rows(q: deque, budget: int) -> list[Row]:
        out = [q.popleft()]
        total = out[0].tokens
        while q and total + q[0].tokens <= budget:
            total += q[0].tokens
            out.append(q.popleft())
        return out

    def finish(self, job: ScoreJob) -> None:
        for q in self.jobs:
            if q and q[0] is job:
                q.popleft()
                return
            if job in q:
                q.remove(job)
                return


class PassBudget:
    """Tokens per pass for about `seconds` of engine time: from each pass's measured rate, moved
    toward seconds x rate (at most doubling per pass, so one fast small pass cannot ask for a huge
    one). Passes carry a fixed cost (launches, the label head), so a small pass measures a low
    rate; the budget still converges to the size whose time is `seconds`, since time(b) = c +
    b / r grows slower than b."""

    def __init__(self, seconds: float, first: int = 256, floor: int = 16, ceiling: int = 1 << 20):
        self.seconds, self.floor, self.ceiling = seconds, floor, ceiling
        self.tokens = first

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        want = tokens / seconds * self.seconds
        if tokens < self.tokens and want > self.tokens:  # a part-filled pass says little about more
            return
        want = min(want, 2 * self.tokens)
        self.tokens = int(max(self.floor, min(self.ceiling, 0.5 * self.tokens + 0.5 * want)))
