"""The engine's queues and what runs next: two lanes, passes of bounded cost.

A request's `priority` picks its lane: 0 is real-time, anything higher is batch work, which runs
in the engine's idle capacity: its rows ride along in real-time passes that leave room (a few
percent of a pass's cost) and run alone, in small passes, when the real-time lane is empty (so a
real-time request waits behind at most one small batch pass). Within a lane, classify rows and
multi-item jobs share the engine by time when both wait (after a score pass, classify passes for
as long), and a pass is cut to the token budget (PassBudget:
about --pass-ms of work, but never under a few times a pass's fixed cost, measured as it goes):
classify rows up to it, a multi-item request a chunk of its long query part or a run of its items at
a time (score_run.py). No request can hold the engine for longer than one pass, and every deadline
and abort is looked at between passes.

Within a lane, clients take turns (Turns): a row from each client that has rows waiting, in
turn, each client's rows in arrival order, and the next multi-item request started is the one of
the client whose request started least recently. A client is its `tenant` (X-Client-Id, else its
address: frontend.py), so one client's flood delays another's requests by a row per turn, not by
the flood's length.

Nothing here touches the model: engine_loop.py runs the passes this hands out.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
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
    dead: bool = False  # aborted: skipped when it reaches the head
    gone: bool = False  # out of the queue (taken, aborted, expired): skipped where it still is
    finish_by: float = 0.0  # its client's deadline (0: none): ends it, started or not
    # shared by the rows of one client request (a list of queries): [True] once any has started,
    # after which `deadline` (the start-by time) no longer ends them; None: a request of one row
    request: list | None = None
    tenant: int = 0  # the client that sent it (fair turns)

    def __post_init__(self):
        self.tokens = len(self.ids) - self.start

    @property
    def work(self) -> tuple:
        """What its answer depends on: rows of equal work are computed once."""
        return self.classifier, self.start, tuple(self.ids)

    def late(self, now: float) -> bool:
        """Past its start-by time while its request has not started, or past its client's
        deadline."""
        started = self.request is not None and self.request[0]
        return (self.deadline < now and not started) or 0 < self.finish_by < now


@dataclass
class ScoreJob:
    """One multi-item request, run a pass at a time (score_run.ScoreRun: its long query part in
    chunks, then runs of its items)."""
    msg: object  # protocol.ScoreReq
    reply: Callable
    full: list[list[int]]  # per item, the whole prompt
    shared: list[int]
    soft: list | None = None  # per item its soft token's vector or None (protocol.unpack_score)
    run: object = None  # its ScoreRun from its first pass on; None: not started
    total: int = 0  # the passes it takes, as last estimated (a progress figure)
    t_start: float = 0.0  # when its first pass began (time.perf_counter())

    @property
    def key(self) -> tuple[int, int]:
        return self.msg.client, self.msg.rid

    @property
    def tenant(self) -> int:
        return self.msg.tenant

    @property
    def started(self) -> bool:
        return self.run is not None


@dataclass
class RowJob:
    """A classify row longer than a pass, taken out of the rows to run a pass at a time as a job
    (score_run.PromptRun), in its lane's turn for multi-item work. Once started, its start-by
    time no longer applies; its client's deadline ends it through the front end's abort."""
    row: Row
    priority: int
    run: object = None  # its PromptRun from its first pass on
    total: int = 0

    @property
    def msg(self) -> "RowJob":  # what expiry reads of a job: priority, deadline, finish_by
        return self

    @property
    def key(self) -> tuple[int, int]:
        return self.row.client, self.row.rid

    @property
    def started(self) -> bool:
        return self.run is not None

    @property
    def deadline(self) -> float:
        return self.row.deadline

    @property
    def tenant(self) -> int:
        return self.row.tenant

    finish_by = 0.0


class Turns:
    """One lane's queued rows, each client's (tenant's) in arrival order, taken a row per client
    in turn. `order` holds every row in arrival order too, for expiry: the start-by times expire
    in arrival order, so its head is all expiry looks at, however many clients wait. A row taken
    or expired stays in the other deque until it reaches that head (skipped there: `gone`)."""

    def __init__(self):
        self.by: dict[int, deque] = {}  # tenant -> its rows
        self.turn: deque = deque()  # tenants with rows, the next to take first
        self.order: deque = deque()  # every row, arrival order

    def __bool__(self) -> bool:
        self.prune()
        return bool(self.turn)

    def append(self, row: Row) -> None:
        q = self.by.get(row.tenant)
        if q is None:
            q = self.by[row.tenant] = deque()
            self.turn.append(row.tenant)
        q.append(row)
        self.order.append(row)

    def prune(self) -> None:
        """Drop gone rows at the next tenant's head (and tenants left without rows)."""
        while self.turn:
            q = self.by[self.turn[0]]
            while q and q[0].gone:
                q.popleft()
            if q:
                return
            del self.by[self.turn.popleft()]

    def head(self) -> Row | None:
        """The row to take next (prune first), None when none waits."""
        self.prune()
        return self.by[self.turn[0]][0] if self.turn else None

    def pop(self) -> Row:
        """Take head(): its tenant's turn passes to the next."""
        t = self.turn[0]
        row = self.by[t].popleft()
        row.gone = True
        self.turn.rotate(-1)
        return row

    def clear(self) -> None:
        self.by.clear()
        self.turn.clear()
        self.order.clear()


class Lanes:
    """Rows and jobs per lane. Every step is O(1) per row, whatever the queue's length (under
    overload it holds thousands): an aborted row is marked dead through an index and skipped when
    it reaches the head, and expiry looks at the heads only. That is exact for the start-by times
    (--max-queue-ms from arrival: a lane's rows expire in arrival order), which end a request only
    before any of its rows has started (a list of 256 queries on a CPU is not cut off after its
    first passes); a row whose client deadline is earlier than the rows ahead of it is answered at
    that deadline by the front end's timer, whose abort marks it dead here."""

    def __init__(self):
        self.rows = (Turns(), Turns())  # per lane: Row
        self.jobs = (deque(), deque())  # per lane: ScoreJob (the one started first in front)
        self.live: dict[tuple[int, int], Row] = {}  # queued rows by (client, rid)
        # Classify and score passes of a lane share the engine by time when both wait: after a
        # score pass, classify passes until they have had as long (at least one). Turn by turn,
        # an 8k-token multi-item request's long passes each let one short classify pass in, and
        # classify at half of capacity fell behind into 504s.
        self.since = [0.0, 0.0]  # per lane: classify seconds since its last score pass
        self.score_s = [0.0, 0.0]  # per lane: that score pass's seconds
        self.ran = [False, False]  # per lane: a classify pass since that score pass
        self.last: tuple[str, int] | None = None  # the pass handed out last: (kind, lane)
        self.starts = [0, 0]  # per lane: multi-item jobs started
        self.started_at = ({}, {})  # per lane: tenant -> the count when its last job started

    def __len__(self) -> int:
        return len(self.live) + sum(map(len, self.jobs))

    def add_row(self, row: Row, priority: int) -> None:
        self.rows[lane(priority)].append(row)
        self.live[(row.client, row.rid)] = row

    def add_job(self, job: ScoreJob, first: bool = False) -> None:
        """first: ahead of the jobs waiting (a row that was at the head of the rows)."""
        q = self.jobs[lane(job.msg.priority)]
        q.appendleft(job) if first else q.append(job)

    def remove(self, keys: set) -> tuple[list[Row], list[ScoreJob]]:
        """Take out the rows and jobs whose (client, rid) is in keys (aborted), to be answered."""
        rows = [r for r in (self.live.pop(k, None) for k in keys) if r is not None]
        for r in rows:
            r.dead = r.gone = True
        jobs = []
        for q in self.jobs:
            for j in [j for j in q if j.key in keys]:
                q.remove(j)
                jobs.append(j)
        return rows, jobs

    def expired(self, now: float) -> tuple[list[Row], list[ScoreJob]]:
        """Take out what may no longer run: rows at a lane's head past their deadline, jobs not
        started by their start-by time or past their client's deadline."""
        rows, jobs = [], []
        for turns in self.rows:
            q = turns.order
            while q and (q[0].gone or q[0].late(now)):
                r = q.popleft()
                if not r.gone:
                    r.gone = True
                    del self.live[(r.client, r.rid)]
                    rows.append(r)
        for q in self.jobs:
            for j in list(q):
                m = j.msg
                if (not j.started and m.deadline < now) or (m.finish_by and m.finish_by < now):
                    q.remove(j)
                    jobs.append(j)
        return rows, jobs

    def next_pass(self, budget: int, spare: int = 0, small: int | None = None):
        """("classify", rows, cut) or ("score", job, None) for the next pass, or None when nothing
        waits; cut: rows were left for lack of budget. A real-time classify pass that leaves room
        takes batch rows along, up to `spare` tokens (a pass's cost grows little with its tokens,
        so that is the engine's idle capacity at a few percent on the real-time rows' latency); a
        pass of batch rows alone holds at most `small` tokens, so that a real-time request never
        waits long behind one."""
        for k in (REALTIME, BATCH):
            rows, jobs = self.rows[k], self.jobs[k]
            if not rows and not jobs:
                continue
            if rows and (not jobs or not self.ran[k] or self.since[k] < self.score_s[k]):
                self.ran[k], self.last = True, ("classify", k)
                cap = budget if k == REALTIME else min(budget, small or budget)
                out, total, cut = self._take_rows(rows, cap)
                room = min(spare, budget - total)
                if k == REALTIME and not cut and room > 0 and self.rows[BATCH]:
                    more, _, _ = self._take_rows(self.rows[BATCH], room, at_least_one=False)
                    out += more
                return "classify", out, cut
            self.ran[k], self.since[k], self.score_s[k], self.last = False, 0.0, 0.0, ("score", k)
            return "score", self._next_job(k), None
        return None

    def _next_job(self, k: int):
        """The lane's running job, else the one to start: the first of the client whose last
        job started least recently (never: first of all), moved to the front."""
        q, seen = self.jobs[k], self.started_at[k]
        if not q[0].started and len(q) > 1:
            i = min(range(len(q)), key=lambda i: (seen.get(q[i].tenant, -1), i))
            job = q[i]
            del q[i]
            q.appendleft(job)
        if not q[0].started:
            if len(seen) > 4096:  # clients come and go: forget them all now and then
                seen.clear()
            seen[q[0].tenant] = self.starts[k]
            self.starts[k] += 1
        return q[0]

    def as_job(self, row: Row) -> RowJob:
        """The row next_pass handed out alone (a classify pass), too long for a pass: a job of
        its lane, first among its jobs, and the pass handed out counted as that job's."""
        k = self.last[1]
        job = RowJob(row, k)
        self.add_job(job, first=True)
        self.ran[k], self.since[k], self.score_s[k], self.last = False, 0.0, 0.0, ("score", k)
        return job

    def took(self, seconds: float, last: tuple[str, int] | None = None) -> None:
        """The pass next_pass handed out last (or `last`, a (kind, lane) it handed out before:
        a staged pass's wait) took `seconds` (the time share between kinds)."""
        last = last or self.last
        if last is not None:
            kind, k = last
            if kind == "score":
                self.score_s[k] = seconds
            else:
                self.since[k] += seconds

    def _take_rows(self, q: Turns, budget: int, at_least_one: bool = True) -> tuple[list[Row], int, bool]:
        """Rows in turn (Turns) up to `budget` tokens; a row whose work an earlier one of the pass does
        (the same query to the same classifier: a burst of clients sending one query) costs
        nothing, as the engine computes it once (EngineLoop._classify)."""
        out, total, seen = [], 0, set()
        while (r := q.head()) is not None:
            work = r.work
            cost = 0 if work in seen else r.tokens
            if (out or not at_least_one) and total + cost > budget:
                return out, total, True
            q.pop()
            del self.live[(r.client, r.rid)]
            out.append(r)
            seen.add(work)
            total += cost
            if r.request is not None:
                r.request[0] = True
        return out, total, False

    def finish(self, job: ScoreJob) -> None:
        for q in self.jobs:
            if job in q:
                q.remove(job)
                return


class PassBudget:
    """Tokens per pass for about `seconds` of engine time. A pass costs a fixed part (launches, the
    label head, the host's work around them) plus a cost per token: the per-token cost is timed at
    warm-up (calibrate: a pass of one row against one of many), the fixed part re-estimated after
    every pass from what it took, because it moves with the load (about twice as large under
    load as idle). The goal is `seconds`, but never under `times` the fixed part: below it every
    pass shrinks to a row or two and throughput to a row per fixed cost (a tenth of the capacity
    a goal from the idle engine's fixed part held).
    The budget is what a pass of the goal holds: (goal - fixed) / per-token cost. Uncalibrated
    (no warm-up: tests) it stays at `first`.

    The per-token cost is taken as calibrated, so a pass slower than the model says raises the
    fixed part, the goal (times it) and so the next pass's tokens: with a per-token cost under
    the truth that feeds on itself (multi-item passes calibrated on classify's cost, 4x too low,
    grew several times over their goal while classify p99 rose with them). Each kind of pass is calibrated on
    its own, and the fixed part is held under `most` times its calibrated value."""

    def __init__(self, seconds: float, first: int = 256, floor: int = 32, ceiling: int = 1 << 20,
                 times: float = 3.0, most: float = 4.0):
        self.seconds = self.goal = seconds
        self.floor, self.ceiling, self.times, self.most = floor, ceiling, times, most
        self.tokens = first
        self.fixed, self.per_token, self.limit = 0.0, None, float("inf")

    def calibrate(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, max(per_token, 1e-9)
        self.limit = self.most * fixed
        self._set()

    def observe(self, seconds: float, tokens: int) -> None:
        """A pass of `tokens` took `seconds`: its fixed part moves the estimate by a tenth (a
        single slow pass, a GC pause, at most doubles its share of it)."""
        if self.per_token is None or seconds <= 0:
            return
        part = min(max(0.0, seconds - self.per_token * tokens), 2 * self.fixed + 1e-4)
        self.fixed = min(self.limit, self.fixed + 0.1 * (part - self.fixed))
        self._set()

    @property
    def spare(self) -> int:
        """Tokens that cost a tenth of the fixed part (batch rows riding along); 0 uncalibrated."""
        return 0 if self.per_token is None else int(0.1 * self.fixed / self.per_token)

    @property
    def small(self) -> int:
        """A small pass: tokens that cost half the fixed part (batch rows alone)."""
        if self.per_token is None:
            return self.tokens
        return max(self.floor, int(0.5 * self.fixed / self.per_token))

    def _set(self) -> None:
        self.goal = max(self.seconds, self.times * self.fixed)
        self.tokens = int(max(self.floor, min(self.ceiling, (self.goal - self.fixed) / self.per_token)))
