"""How late a front end's event loop runs (LoopLag): what its deadlines take off, and what
--shed-lag-ms sheds on (Frontend.deadline, connections.py)."""
from __future__ import annotations

import asyncio


class LoopLag:
    """How late this event loop runs what is due: a tick every 5 ms notes how late it fired, and
    `lag` is the recent worst (decaying to half in about ten ticks). A request's bytes wait about
    that long in its socket before a busy loop reads them, time the server's clock for its
    deadline (started when the request is read) cannot see: under overload clients got 200s
    far past their deadlines (BENCHMARKS.md, SLO). So a deadline is taken to have
    started that much earlier (Frontend.deadline)."""

    EVERY = 0.005

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.timer = loop, None
        self.restart()

    def restart(self) -> None:
        """Forget what was seen: after a stall that was not a backlog of requests (start-up's
        tokenizer build), which would otherwise read as one and shed for as long."""
        if self.timer is not None:
            self.timer.cancel()
        self.lag, self.last, self.ran = 0.0, 0.0, self.loop.time()
        self.due = self.ran + self.EVERY
        self.timer = self.loop.call_at(self.due, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        self.last, self.ran = now - self.due, now
        self.lag = max(self.last, 0.93 * self.lag)
        self.due = now + self.EVERY
        self.timer = self.loop.call_at(self.due, self._tick)

    def behind(self) -> float:
        """How far behind the loop runs now (seconds): its pending tick's lateness, or what the
        last tick found less the time since (a backlog the loop has been working through). Not
        the decayed `lag`, which would go on shedding for a while after one stall."""
        now = self.loop.time()
        return max(now - self.due, self.last - (now - self.ran))
