"""A front end's admission: what it lets into the engine's queue, and what it refuses at once.

A request is admitted or refused when it arrives, never left to wait for a verdict:
- its lane (real-time, batch) holds at most --max-queue queries and --max-queue-tokens tokens
  from this front end; past that a client under its fair share (the lane's limit over the clients
  holding queries) is still admitted and the others get 429 + Retry-After, so one client's flood
  cannot take every place;
- a real-time request with a deadline is refused (429) when the work ahead of it, as the engine's
  turns will take it (a row from each client in turn: scheduler.Turns), needs longer than the time
  it has left at the engine's measured rate: under overload the engine's time goes to requests
  that can still make it, and the client hears so at once instead of at its deadline.
Each admitted request's estimate is kept beside the wait it got (/metrics:
prefixscore_queue_wait_seconds{source="estimate"|"measured"}), so the estimate can be checked.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

from .api_error import ApiError

MAX_CLIENT_ID = 256  # characters of an X-Client-Id
SEEN_S = 60.0  # a client deadline counts as known (/healthz's busy) for this long after it came
NO_DEADLINE_S = 1.0  # /healthz's busy when no deadline is known: new work waits over a second


def tenant_of(name: str) -> int:
    """A client's name (its X-Client-Id, else its address) as the engine's tenant: the same number
    in every front end of a host (a hash, not a table), never 0 (0: a request of no client)."""
    return zlib.crc32(name.encode("utf-8", "surrogateescape")) or 1


def request_tenant(headers: list, client) -> tuple[int, str | None]:
    """The client an HTTP request counts for (fair shares here, the engine's turns): its
    X-Client-Id (one header, at most MAX_CLIENT_ID characters), else its address; 0 for none.
    headers: ASGI's (lower-case name, value) byte pairs; client: (host, port) or None."""
    values = [value for name, value in headers if name == b"x-client-id"]
    if len(values) > 1:
        return 0, f"{len(values)} X-Client-Id headers; send one"
    if values:
        name = values[0].decode("latin-1").strip()
        if not name or len(name) > MAX_CLIENT_ID:
            return 0, f"X-Client-Id must be 1 to {MAX_CLIENT_ID} characters, got {len(name)}"
        return tenant_of("id:" + name), None
    return (tenant_of("addr:" + str(client[0])), None) if client else (0, None)


@dataclass
class Ticket:
    """One admitted request: what it holds until released."""
    n: int
    tokens: int
    batch: bool
    tenant: int
    t0: float
    estimate: float | None  # seconds the queue ahead was expected to take; None: no rate yet
    score: bool = False  # a /v1/score request: its tokens count in Admission.scoring


class Admission:
    def __init__(self, cfg, client, metrics, lag=lambda: 0.0):
        """cfg: FrontendConfig (max_queue, max_queue_tokens); client: the engine client (its
        wait_s: the engine's backlog at its measured rate); lag: seconds this front end's event
        loop runs behind (its requests' time unread)."""
        self.cfg, self.client, self.metrics, self.lag = cfg, client, metrics, lag
        self.inflight = 0  # queries admitted and not yet answered (this front end)
        self.held = ([0, 0], [0, 0])  # per lane (real-time, batch): those queries, their tokens
        self.by_tenant = ({}, {})  # per lane: tenant -> its queries held
        self.scoring = [0, 0]  # per lane: the tokens of the /v1/score requests held
        self.seen = (float("inf"), 0.0)  # the shortest client deadline lately: (seconds, when)

    def refuse(self, n: int, tokens: int, batch: bool = False, deadline: float | None = None,
               tenant: int = 0, score: bool = False) -> float | None:
        """The checks alone (429 + Retry-After; 504 for a deadline already past), nothing counted:
        called before tokenizing with tokens=0 too, so that under overload a refusal costs the
        front end as little as it can. score: a /v1/score request of `tokens` (its wait is its
        own run too). Returns the wait estimate (seconds), None without a rate."""
        cfg, held = self.cfg, self.held[batch]
        mine = self.by_tenant[batch].get(tenant, 0)
        if (held[0] + n > cfg.max_queue or (held[1] + tokens > cfg.max_queue_tokens and held[0] > 0)) \
                and not self._under_share(mine + n, batch, tenant):
            lane = "batch" if batch else "real-time"
            raise ApiError(429, f"queue full ({held[0]} {lane} queries, {held[1]} tokens waiting; "
                                f"limits {cfg.max_queue} and {cfg.max_queue_tokens}); retry later",
                           self.client.wait_s(n))
        wait = self.score_wait_s(tokens, batch) if score else \
            self.wait_s(n, batch, tenant) if self.client.rate else None
        if deadline is not None and not batch:
            now = time.monotonic()
            left = deadline - now
            if left < self.seen[0] or now - self.seen[1] > SEEN_S:
                self.seen = (left, now)
            if left <= 0:  # spent before it could be queued (unread in a busy front end: LoopLag)
                self.metrics.expired.labels("deadline").inc(n)
                raise ApiError(504, f"this request's deadline passed before it could be queued (this "
                                    f"front end runs {1e3 * self.lag():.0f} ms behind); it was not "
                                    f"computed")
            if wait is not None and wait > left:
                raise ApiError(429, f"the queue ahead needs about {1e3 * wait:.0f} ms, past this "
                                    f"request's deadline; retry later", wait)
        return wait

    def admit(self, n: int, tokens: int, batch: bool = False, deadline: float | None = None,
              tenant: int = 0, score: bool = False) -> Ticket:
        """refuse()'s checks, then n queries (or items) and their tokens held until release()."""
        wait = self.refuse(n, tokens, batch, deadline, tenant, score)
        if score:
            self.scoring[batch] += tokens
        held, mine = self.held[batch], self.by_tenant[batch]
        held[0] += n
        held[1] += tokens
        mine[tenant] = mine.get(tenant, 0) + n
        self.inflight += n
        self.metrics.queue_depth.inc(n)
        return Ticket(n, tokens, batch, tenant, time.monotonic(), wait, score)

    def release(self, t: Ticket, answered: bool = False) -> None:
        """answered: the engine answered it (its wait is measured beside its estimate)."""
        held, mine = self.held[t.batch], self.by_tenant[t.batch]
        held[0] -= t.n
        held[1] -= t.tokens
        if t.score:
            self.scoring[t.batch] -= t.tokens
        left = mine[t.tenant] - t.n
        if left:
            mine[t.tenant] = left
        else:
            del mine[t.tenant]
        self.inflight -= t.n
        self.metrics.queue_depth.dec(t.n)
        if answered and t.estimate is not None and not t.batch and not t.score:
            self.metrics.queue_wait.labels("estimate").observe(t.estimate)
            self.metrics.queue_wait.labels("measured").observe(time.monotonic() - t.t0)

    def light(self, tenant: int) -> bool:
        """Whether this client holds fewer real-time queries than the clients holding any do on
        average: a front end shedding because it runs behind (--shed-lag-ms) still reads its
        requests, so one client's flood is not shed onto another's."""
        mine = self.by_tenant[0]
        return mine.get(tenant, 0) * len(mine) < sum(mine.values())

    def shortest_deadline(self) -> float:
        """Seconds: the shortest deadline this front end knows (a client's within the last
        SEEN_S, --request-timeout, --max-queue-ms), else NO_DEADLINE_S."""
        cfg, (seen, when) = self.cfg, self.seen
        known = [seen] if time.monotonic() - when <= SEEN_S else []
        known += [cfg.request_timeout] if cfg.request_timeout else []
        known += [cfg.max_queue_ms / 1e3] if cfg.max_queue_ms else []
        return min(known, default=NO_DEADLINE_S)

    @property
    def tokens(self) -> int:
        return self.held[0][1] + self.held[1][1]

    def wait_s(self, n: int, batch: bool, tenant: int) -> float:
        """Seconds until n more queries of `tenant` are answered: the engine's backlog at its rate
        and a pass (client.wait_s), of which, as clients take turns, this front end's queries
        ahead are each client's up to this one's own count plus n."""
        total = self.client.wait_s(n)
        mine = self.by_tenant[batch]
        if len(mine) < 2 and tenant in mine or not mine:
            return total  # one client: the whole backlog is ahead
        own = mine.get(tenant, 0) + n
        held = sum(mine.values())
        ahead = sum(min(h, own) for t, h in mine.items() if t != tenant) + own
        one_pass = self.client.pass_s
        return (total - one_pass) * ahead / (held + n) + one_pass

    def score_wait_s(self, tokens: int, batch: bool) -> float | None:
        """Seconds until a /v1/score request of `tokens` is answered: the classify backlog, then
        the score requests held ahead of it and its own run at the tokens per second a request's
        run has lately taken (ScoreOut.run_s: other work's passes between included); None
        before one has been answered."""
        rate = self.client.score_rate
        if not rate:
            return None
        ahead = self.client.wait_s(0) if self.client.rate else 0.0
        return ahead + (self.scoring[batch] + tokens) / rate

    def _under_share(self, count: int, batch: bool, tenant: int) -> bool:
        """Whether a client holding `count` queries (with this request) is within its share of the
        lane: the lane's limit over the clients holding queries, this one among them."""
        mine = self.by_tenant[batch]
        clients = len(mine) + (tenant not in mine)
        return clients > 1 and count <= self.cfg.max_queue / clients
