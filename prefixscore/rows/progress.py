"""Progress of long work on stderr, as a user reads it where it runs: a tqdm bar on a terminal,
else a line every few seconds (a log file, a CI job, `2> log`: tqdm's bar there is one growing
line of carriage returns, written only as the bar sees fit). For `score`, `eval` and fine-tuning;
`classify` has its own (rows/stream.py: its share is the bytes of the rows done); both take
their ETA from Pace."""
from __future__ import annotations

import collections
import sys
import time

EVERY = 5.0  # seconds between lines when stderr is not a terminal


def duration(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


WINDOW = 60.0  # seconds of progress an ETA's pace is taken over


class Pace:
    """Seconds left at the pace of the last WINDOW seconds. The pace since the start lagged: a
    classify job's first chunks are small (32, 64 rows... make small passes), and on a 20,000-row
    log its ETA at a quarter done was 46% over (bench/eta.py); within 7% this way."""

    def __init__(self, t0: float, f0: float = 0.0):
        self.t0, self.f0 = t0, f0  # the start, and the share done then (a resume's)
        self.seen = collections.deque([(t0, f0)])  # (time, share) of the lines printed

    def eta(self, now: float, f: float) -> float:
        """At share f (> f0) now."""
        seen = self.seen
        seen.append((now, f))
        while len(seen) > 2 and now - seen[1][0] >= WINDOW:  # keep one sample at least WINDOW old
            seen.popleft()
        t, g = seen[0]
        if f <= g:  # nothing done in the window (one long pass): the pace since the start
            t, g = self.t0, self.f0
        return (1 - f) * (now - t) / (f - g)


class Bar:
    """update(n) as tqdm's. On a terminal a tqdm bar (shown once the work outlasts a second); else
    a line every `every` seconds: done of total, the rate, the share and an ETA. disable: neither."""

    def __init__(self, total: int | None, unit: str, desc: str, disable: bool = False, stream=None,
                 every: float = EVERY, clock=time.monotonic):
        self.total, self.unit, self.desc, self.every, self.clock = total, unit, desc, every, clock
        self.stream = sys.stderr if stream is None else stream
        self.n, self.bar, self.disable, self.postfix = 0, None, disable, {}
        self.t0 = self.last = clock()
        self.pace = Pace(self.t0)
        if not disable and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, desc=desc, file=self.stream, delay=1.0,
                            dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if self.disable or now - self.last < self.every:
            return
        self.last, secs = now, now - self.t0
        rate = self.n / secs if secs > 0 else 0.0
        line = f"{self.desc}: {self.n}" + (f"/{self.total}" if self.total else "") + \
            f" {self.unit}s, {rate:.1f} {self.unit}s/s"
        if self.total and 0 < self.n <= self.total:
            line += f", {100 * self.n / self.total:.0f}%, ETA {duration(self.pace.eta(now, self.n / self.total))}"
        print(line + "".join(f", {k} {v}" for k, v in self.postfix.items()), file=self.stream, flush=True)

    def set_postfix(self, refresh: bool = True, **values) -> None:
        """tqdm's (fine-tuning's loss): on the bar, or on the next line."""
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(refresh=refresh, **values)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
