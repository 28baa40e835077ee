"""Depth control: how many of a multi-item request's candidates are scored, held to a p99 target.

Under load a ranking server scores only the first `depth` items of each real-time request (the rest
come back unscored), and a PID controller sets `depth` from the p99 latency of the requests that
finished in the last window_s, every interval_s, within [min_depth, max_depth]. An idle server
scores everything.

How the loop is built, and why:
- Error: the p99's distance from the target in doublings, e = log2(target / p99), clamped to [-1, 1]
  (no request in the window: +1). Latency grows about in proportion to depth, so in logs the loop
  is linear and a gain means the same at depth 50 and at 250. Past twice the target the p99 says
  only "far too slow" (an overloaded queue's p99 grows with time, not with the overload).
- Output: the PID's output u is depth's relative rate of change, d(ln depth)/dt = u per second. A
  position mapping (depth = f(u)) fails with these gains: P alone leaves the p99 15-25% over the
  target after a 1.5x step, and an integral at Ki = 0.2/s takes several seconds to remove that. As
  a rate, Kp is the loop's integral action (no steady-state error; a 1.5x step, e = -0.58, is cut in
  about a second), Ki speeds up a long one-sided correction and Kd answers a sudden jump at once.
- Dead time: the window's p99 shows the slow requests for up to window_s after a cut has worked.
  So depth moves only the way the requests finished since the last update agree with (their p99
  over the target: it may fall; under: it may rise), and the integral starts only once the error
  has kept its sign for a whole window. It is zeroed at every crossing: the integral of a rate left
  alone would make every overload be paid back with as much underload.
- Anti-windup: conditional integration. Each update's output limits are the room left (to min_depth
  and max_depth, and 0 in a direction the newest requests forbid), and the integral is frozen while
  the output is clamped on the side the error pushes. Back-calculation would need a tracking time
  constant, and would track limits that move every update; freezing is exact and has no knob.
On the simulated servers of tests/test_depth.py: a step to 150% of capacity is back within 10% of
the target in 1.6-2.1 s, and depth is back at max_depth 1.4-2.3 s after the load drops.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from .errors import ConfigError

MAX_SAMPLES = 4096  # latencies kept: past 4096 requests per window_s, the window is the newest 4096


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class DepthOptions:
    target_p99_ms: float  # the p99 latency to hold, in milliseconds
    min_depth: int = 50  # never fewer items scored, however slow (1 <= min_depth <= max_depth)
    max_depth: int = 250  # items scored by an idle server
    kp: float = 0.8
    ki: float = 0.2
    kd: float = 0.05
    window_s: float = 1.0  # the p99 is over the requests that finished in this many recent seconds
    interval_s: float = 0.1  # the controller updates at most this often (<= window_s)

    def __post_init__(self):
        rules = ((("target_p99_ms", "window_s"), "a positive number",
                  lambda v: _number(v) and 0 < v < math.inf),
                 (("min_depth", "max_depth"), "an integer >= 1",
                  lambda v: _number(v) and isinstance(v, int) and v >= 1),
                 (("kp", "ki", "kd"), "a finite number >= 0",
                  lambda v: _number(v) and 0 <= v < math.inf),
                 (("interval_s",), f"positive and at most window_s ({self.window_s})",
                  lambda v: _number(v) and 0 < v <= self.window_s))
        for names, why, ok in rules:  # (in order: interval_s is checked against a valid window_s)
            for name in names:
                if not ok(v := getattr(self, name)):
                    raise ConfigError(f"depth control: {name} must be {why}, got {v!r}")
        if self.min_depth > self.max_depth:
            raise ConfigError(f"depth control: min_depth must be at most max_depth, got "
                              f"{self.min_depth} > {self.max_depth}")


def percentile(values, q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of all at or below it; None if none."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


class PID:
    """Textbook PID in position form, u = kp*e + ki*integral(e dt) + kd*de/dt, clamped to [lo, hi].

    Anti-windup by conditional integration: an update whose output is clamped and whose error pushes
    further into the clamp leaves the integral as it was, so after a long saturation the output
    leaves the limit as soon as the error changes sign (anti_windup=False: the plain integral, for
    A/B). An update may bring its own limits (lo, hi) and skip integrating (integrate=False).
    """

    def __init__(self, kp: float, ki: float, kd: float, lo: float = -math.inf, hi: float = math.inf,
                 anti_windup: bool = True):
        self.kp, self.ki, self.kd, self.lo, self.hi = kp, ki, kd, lo, hi
        self.anti_windup = anti_windup
        self.reset()

    def reset(self):
        self.integral = 0.0
        self.output = 0.0
        self.saturated = False
        self._last_error = None  # no derivative on the first update: no kick from a made-up past

    def update(self, error: float, dt: float, lo: float | None = None, hi: float | None = None,
               integrate: bool = True) -> float:
        lo = self.lo if lo is None else lo
        hi = self.hi if hi is None else hi
        slope = 0.0 if self._last_error is None or dt <= 0 else (error - self._last_error) / dt
        integral = self.integral + error * dt if integrate else self.integral
        u = self.kp * error + self.ki * integral + self.kd * slope
        self.output = min(max(u, lo), hi)
        self.saturated = self.output != u
        if not (self.anti_windup and ((u > hi and error > 0) or (u < lo and error < 0))):
            self.integral = integral
        self._last_error = error
        return self.output


class DepthControl:
    """The depth to score now, from the latencies observe()d. Updates run inside the calls (at most
    every interval_s, dt the real time since the last), so no thread of its own; one lock makes
    state() safe from a metrics thread while the engine thread calls observe() and depth()."""

    def __init__(self, options: DepthOptions, clock=time.monotonic):
        self.options = options
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (finished, latency)
        self._pid = PID(options.kp, options.ki, options.kd)
        self._ln_depth = math.log(options.max_depth)
        self._last = clock()
        self._side_since = self._last  # when the error last changed sign
        self._p99: float | None = None  # seconds, as of the last update
        self._error = 1.0

    def depth(self) -> int:
        with self._lock:
            self._update()
            return self._depth()

    def observe(self, latency_s: float) -> None:
        """One finished request's latency (seconds)."""
        if not latency_s >= 0:  # NaN or a clock mismatch: reading it as fast would raise depth
            return
        with self._lock:
            self._samples.append((self._clock(), float(latency_s)))
            self._update()

    def p99_ms(self) -> float | None:
        """The window's p99 as of the last update (at most interval_s old); None: no request."""
        with self._lock:
            self._update()
            return None if self._p99 is None else self._p99 * 1e3

    def state(self) -> dict:
        """For /metrics. error: in doublings of the target (+1: no request in the window); integral:
        of the error, in doubling-seconds; output: d(ln depth)/dt per second; saturated: the output
        was clamped (depth at a bound, or held by the newest requests)."""
        with self._lock:
            self._update()
            return {"depth": self._depth(), "target_p99_ms": self.options.target_p99_ms,
                    "p99_ms": None if self._p99 is None else self._p99 * 1e3,
                    "error": self._error, "integral": self._pid.integral,
                    "output": self._pid.output, "saturated": self._pid.saturated}

    def _depth(self) -> int:
        o = self.options
        return min(max(round(math.exp(self._ln_depth)), o.min_depth), o.max_depth)

    def _update(self):
        o, now = self.options, self._clock()
        dt = now - self._last
        if dt < o.interval_s:
            return
        while self._samples and self._samples[0][0] < now - o.window_s:
            self._samples.popleft()
        target = o.target_p99_ms / 1e3
        self._p99 = percentile([lat for _, lat in self._samples], 0.99)
        error = 1.0 if not self._p99 else min(max(math.log2(target / self._p99), -1.0), 1.0)
        if error * self._error < 0:
            self._side_since, self._pid.integral = now, 0.0
        # The room left, as rates over this dt, and no move the newest requests contradict.
        lo_ln, hi_ln = math.log(o.min_depth), math.log(o.max_depth)
        lo, hi = (lo_ln - self._ln_depth) / dt, (hi_ln - self._ln_depth) / dt
        newest = percentile([lat for t, lat in self._samples if t > self._last], 0.99)
        if newest is not None:
            lo, hi = (0.0 if newest <= target else lo), (0.0 if newest >= target else hi)
        u = self._pid.update(error, dt, lo, hi, integrate=now - self._side_since >= o.window_s)
        self._ln_depth = min(max(self._ln_depth + u * dt, lo_ln), hi_ln)  # (float rounding)
        self._error, self._last = error, now


def within_depth(depth, items: list, score) -> list:
    """score(items[:n]) for n = depth, an int or a DepthControl's depth() (which is then told how
    long the call took): a caller scores only what its latency target allows."""
    control = depth if callable(getattr(depth, "depth", None)) else None
    n = depth if control is None else control.depth()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"depth must be a positive integer or a DepthControl, got {depth!r}")
    t0 = time.monotonic()
    out = score(items[:n])
    if control is not None:
        control.observe(time.monotonic() - t0)
    return out
