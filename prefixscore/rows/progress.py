"""Progress of long work on stderr, as a user reads it where it runs, drawn by a timer thread (the
work's own loop can sit minutes in one engine pass or one training step): a tqdm bar on a terminal
of known width, else a line every few seconds (a log file, a CI job, `2> log`, a pseudo-terminal
of 0 columns: tqdm's bar there is one growing line of carriage returns, or a lone one). Bar is the
form for `score`, `eval` and fine-tuning; `classify` has its own line (rows/stream.py: its share
is the bytes of the rows done). Both take their rate and ETA from Pace."""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
import weakref

EVERY = 5.0  # seconds between lines when stderr is not a terminal
REFRESH = 1.0  # seconds between redraws of a terminal's bar (and before its first)
# The share of the time so far that a rate leaves out: start-up (model warm-up, the first small
# chunks) and, as the run grows, a longer past, so one slow minute moves the rate little.
SKIP = 0.2


def duration(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Pace:
    """Rates per second over the run so far less its first SKIP of time, from the counts sampled
    at each progress line. The pace of the last minute swung with one slow or fast minute (0.81x
    and 2.07x of the truth at a quarter and three quarters of a 20,000-row log), and the pace since
    the start lagged behind a slow start (46% over at a quarter): BENCHMARKS.md has what this
    gives (bench/eta.py)."""

    def __init__(self, t0: float, *counts: float):
        """t0: the start; counts: where they stood then (a resume's rows done before)."""
        self.t0 = t0
        self.seen = collections.deque([(t0, counts)])  # (time, counts), from the window's start on

    def rates(self, now: float, *counts: float) -> list[float]:
        """Each count's rate between the last sample at or before SKIP of the time so far and now
        (0.0 where no time has passed)."""
        seen = self.seen
        seen.append((now, counts))
        cut = self.t0 + SKIP * (now - self.t0)
        while len(seen) > 2 and seen[1][0] <= cut:
            seen.popleft()
        t, old = seen[0]
        return [(c - o) / (now - t) if now > t else 0.0 for c, o in zip(counts, old)]


def eta(share: float | None, share_rate: float) -> float | None:
    """Seconds left at share done and that rate of it; None where it cannot be told."""
    return (1 - share) / share_rate if share is not None and share_rate > 0 else None


def terminal_columns(stream) -> int:
    """The width of the terminal `stream` writes to; 0 where it is not one or its width is unknown
    (then progress comes as lines)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (AttributeError, OSError, ValueError):
        return 0


class Ticker:
    """fn() every `every` seconds on a daemon thread, on a fixed schedule, until close(). Holds fn's
    object weakly: a display left unclosed (an exception in the loop that updates it) stops once
    dropped. A closed stream (a pipe's reader gone) stops it quietly."""

    def __init__(self, method, every: float):
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(weakref.WeakMethod(method), every),
                                       name="prefixscore-progress", daemon=True)
        self.thread.start()

    def _run(self, ref, every: float) -> None:
        start, k = time.monotonic(), 1
        while not self.stopped.wait(max(0.0, start + k * every - time.monotonic())):
            fn = ref()
            if fn is None:
                return
            try:
                fn()
            except (OSError, ValueError):
                return
            del fn
            k = max(k + 1, int((time.monotonic() - start) / every) + 1)  # fell behind: the next slot

    def close(self) -> None:
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join()


def _paced_tqdm():
    """tqdm (imported when a bar is drawn: `--help` stays light) whose rate, and so its remaining
    time, is Pace's: tqdm's own follows the last few updates."""
    from tqdm import tqdm

    class PacedTqdm(tqdm):
        pace_rate = 0.0

        @property
        def format_dict(self):
            d = super().format_dict
            if self.pace_rate > 0:
                d["rate"] = self.pace_rate
            return d

    return PacedTqdm


class Shown:
    """What Bar and classify's Progress share. The work's thread moves the counts; a Ticker reads
    them: every REFRESH seconds into a tqdm bar on a terminal of known width, else every `every`
    seconds into a line (line()). every None: no timer, tick() by hand (tests)."""

    def __init__(self, desc: str, unit: str, total: int | None = None, start: int = 0,
                 f0: float = 0.0, disable: bool = False, stream=None, every: float | None = EVERY,
                 clock=time.monotonic):
        self.desc, self.unit, self.total, self.clock = desc, unit, total, clock
        self.stream = sys.stderr if stream is None else stream
        self.pace = Pace(clock(), start, f0)
        self.bar = self.ticker = None
        if disable:
            return
        if terminal_columns(self.stream):
            self.bar = _paced_tqdm()(total=total, initial=start, unit=unit, desc=desc,
                                     file=self.stream, dynamic_ncols=True, delay=REFRESH)
            every = REFRESH if every is not None else None
        if every is not None:
            self.ticker = Ticker(self.tick, every)

    def state(self) -> tuple[int, float | None]:
        """(work done, its share of the whole or None); read once per tick."""
        raise NotImplementedError

    def line(self, n: int, share: float | None, rate: float, left: float | None) -> str:
        raise NotImplementedError

    def tick(self) -> None:
        n, share = self.state()
        rate, share_rate = self.pace.rates(self.clock(), n, share or 0.0)
        if self.bar is None:
            print(self.line(n, share, rate, eta(share, share_rate)), file=self.stream, flush=True)
            return
        self._set_bar(n, share, rate)
        self.bar.refresh()

    def _set_bar(self, n: int, share: float | None, rate: float | None = None) -> None:
        if share and self.total is None:  # an estimate where the share is a file's bytes
            self.bar.total = max(n, round(n / share))
        self.bar.n = n
        if rate is not None:
            self.bar.pace_rate = rate

    def close(self) -> None:
        if self.ticker is not None:
            self.ticker.close()
            self.ticker = None
        if self.bar is not None:
            self._set_bar(*self.state())  # tqdm draws its last state if it was ever shown
            self.bar.close()
            self.bar = None


class Bar(Shown):
    """update(n) as tqdm's, for `score`, `eval` and fine-tuning: a tqdm bar on a terminal, else a
    line every `every` seconds: done of total, the rate, the share and an ETA. disable: neither."""

    def __init__(self, total: int | None, unit: str, desc: str, disable: bool = False, stream=None,
                 every: float | None = EVERY, clock=time.monotonic):
        self.n, self.postfix = 0, {}
        super().__init__(desc, unit, total, disable=disable, stream=stream, every=every, clock=clock)

    def update(self, n: int = 1) -> None:
        self.n += n  # the ticker shows it

    def set_postfix(self, refresh: bool = True, **values) -> None:
        """tqdm's (fine-tuning's loss): on the bar, or on the next line."""
        self.postfix = values

    def state(self) -> tuple[int, float | None]:
        n = self.n
        return n, (min(n, self.total) / self.total if self.total else None)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=False)
        super().tick()

    def line(self, n: int, share: float | None, rate: float, left: float | None) -> str:
        line = f"{self.desc}: {n}" + (f"/{self.total}" if self.total else "") + \
            f" {self.unit}s, {rate:.1f} {self.unit}s/s"
        if share is not None:
            line += f", {100 * share:.0f}%" + (f", ETA {duration(left)}" if left is not None else "")
        return line + "".join(f", {k} {v}" for k, v in self.postfix.items())

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
