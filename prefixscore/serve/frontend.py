"""A front end's request handling, shared by HTTP and gRPC: validate, tokenize, the pair cache,
admission, the engine call, and the answer's fields. Errors are ApiError(status, detail), in HTTP
status codes (gRPC maps them); nothing here knows a wire format.

Admission: a front end admits at most --max-queue queries in flight (its own, exact count) and
answers 429 with Retry-After from the engine's measured rate beyond that; a query not started by
the engine within --max-queue-ms is dropped unrun and answered 503; a request whose client left is
aborted (dropped if still queued), and counted as 499, not 200.

Deadlines: a request may carry its own (HTTP's X-Request-Timeout, gRPC's deadline; else
--request-timeout). A timer answers it then (504), whatever the engine is doing, and the engine is
told to drop it: it never runs once its deadline has passed, and a multi-item request stops at its
next pass. The start-by time (--max-queue-ms) is the engine's to enforce, between its passes (the
batch window, an engine setting, does not count as queueing).
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar

from ..errors import InputError
from . import protocol as P
from .answers import Answer, is_unicode, label_probs, merge_rows, query_name  # noqa: F401
from .admission import Admission
from .api_error import ApiError, check_priority
from .cache import CLASSIFY_IDS, classifier_ids, lookup, new_cache, scorer_id, store
from .catalog import DEFAULT_MODEL, Catalog  # noqa: F401 -- importable from here, as before
from .client import EngineDead
from .config import READY_WAIT_S, FrontendConfig
from .fanout import ClassifyMany
from .loop_lag import LoopLag  # noqa: F401 -- importable from here, as before
from .scoring import ScoreRoute

# A request's own deadline (time.monotonic()), set by its transport around the call: HTTP's
# X-Request-Timeout header (http.Guard), gRPC's deadline (grpc_server). None: --request-timeout.
DEADLINE: ContextVar[float | None] = ContextVar("prefixscore_deadline", default=None)
# The client that sent it (admission.tenant_of of its X-Client-Id, else its address), set the same
# way: clients take turns in admission and in the engine's lanes. 0: no client known.
TENANT: ContextVar[int] = ContextVar("prefixscore_tenant", default=0)


log = logging.getLogger("prefixscore.serve")


class Late(Exception):
    """Set on a request's future by its timer: no answer by its deadline or start-by time."""


class Frontend(ClassifyMany, ScoreRoute):
    def __init__(self, cfg: FrontendConfig, client, metrics, prompt_factory):
        """prompt_factory(ready) -> the Prompts to tokenize with, one per classifier of
        ready.classifiers (the classifiers' own in-process; built over the engine's tokenizer
        files in a worker process)."""
        self.cfg, self.client, self.metrics = cfg, client, metrics
        self.prompt_factory = prompt_factory
        self.catalog: Catalog | None = None  # the classifiers by name, and their prompts
        self.prompts: list = []  # per classifier, in ReadyOut.classifiers order
        self.prompt = None  # the default classifier's (its tokenizer is every classifier's)
        self.scoring = None  # the scorer's request side (score_input.ScoreInput); None: no scorer
        self.info: P.ReadyOut | None = None
        self.classifiers: list[P.ClassifierInfo] = []
        self.created = 0  # when this front end first saw the engine ready (Unix seconds)
        self.cache = new_cache(cfg)  # the pair cache (cache.py); None: off
        self.cache_ids: list[bytes] = []  # per classifier, its identity in cache keys
        self.scorer_id: bytes | None = None  # the scorer's
        self.admission = Admission(cfg, client, metrics, self._lag)
        self.draining = False
        self.loop_lag: LoopLag | None = None  # started on the event loop with the engine's Ready
        self.announced = False  # the "ready" lines said (cfg.announce)
        client.metrics = metrics
        # The prompt is built when the engine's Ready arrives (at start-up), not by the first
        # request this process takes: that built the tokenizer inside a request and, in a worker
        # that had not imported transformers yet, held its event loop for seconds (healthz and
        # open-loop maxima of seconds while the p99 was a few ms).
        client.on_ready = self.sync

    # -- state
    def sync(self) -> None:
        """After the engine's Ready: a prompt per classifier (Catalog checks each against the
        engine's own prefix)."""
        info, loop = self.client.info, self.client.loop
        if info is not None and info is not self.info:
            catalog = Catalog(info, list(self.prompt_factory(info)))
            self.catalog, self.prompts, self.prompt = catalog, catalog.prompts, catalog.prompts[0]
            self.scoring = catalog.scoring
            self.cache_ids = classifier_ids(info)
            self.scorer_id = None if self.scoring is None else scorer_id(info)
            self.classifiers, self.info = info.classifiers, info
            self.created = self.created or int(time.time())
            self.metrics.served(info.model, info.pid)
            # The tokenizer's first call is slow (BENCHMARKS.md, SLO), and a request would pay it
            # in the event loop: a worker's first requests then ran over --shed-lag-ms and were shed.
            for prompt in self.prompts:
                prompt.encode_many([{"query": "warm up"}], True)
            if self.cfg.announce and not self.announced:
                self.announced = True
                self._announce(info)
            # Building the prompts (the tokenizer) holds the loop for seconds; a tick that late
            # read as a backlog and shed every request for as long (the first requests after
            # "ready" all got 503 front_end_behind). So the clock starts after it.
            if self.loop_lag is not None:
                self.loop_lag.restart()
        if self.loop_lag is None and self.info is not None and loop is not None and loop.is_running():
            self.loop_lag = LoopLag(loop)

    def _announce(self, info) -> None:
        """One line per endpoint once the engine is ready: the URL, the model, "ready" (as vLLM's
        and TEI's start-up logs end)."""
        cfg, host = self.cfg, f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        routes = "POST /v1/classify" + (", /v1/score" if info.scorer is not None else "")
        log.info("ready: %s (%d labels) on http://%s:%d (%s; docs /docs, /metrics, /healthz)",
                 info.model, len(self.classifiers[0].labels), host, cfg.port, routes)
        if cfg.grpc_port:
            log.info("ready: %s over gRPC on %s:%d (%s)", info.model, host, cfg.grpc_port,
                     "prefixscore.v1.PrefixScore")

    def classifier_names(self) -> list[str]:
        """The classifiers this server serves, the default first: one named like the served model
        (--served-model-name, else the model's file or folder name), or those --classifier
        declared."""
        return self.catalog.names

    def resolve(self, model: str | None = None, classifier: str | None = None) -> int:
        """The index of the classifier a request names (Catalog.resolve), or 404."""
        return self.catalog.resolve(model, classifier)

    def health(self) -> tuple[int, dict]:
        c = self.client
        if self.draining:
            return 503, {"status": "shutting down"}
        if c.error is not None and c.error != "starting":
            return 503, {"status": "unhealthy", "error": c.error, **c.health()}
        if c.error is not None:
            return 503, {"status": "starting"}
        self.sync()
        i, default = self.info, self.classifiers[0]
        sent, answered = c.waiting()
        now = time.monotonic()
        # The engine's real state: a long pass shows as requests waiting while it says nothing.
        oldest = 0.0 if sent is None else 1e3 * (now - sent)
        silent = 0.0 if sent is None else 1e3 * (now - max(sent, answered))
        return 200, {"status": self._state(oldest, silent), "model": i.model, "labels": default.labels, "mode": default.mode,
                     "scorer": i.scorer is not None, "queue_depth": self.admission.inflight + c.queued,
                     "oldest_queued_ms": round(oldest, 3), "engine_busy_ms": round(silent, 3),
                     "running": c.running_cards(),
                     "engine": {"pid": i.pid, "device": i.device},
                     "classifiers": self.catalog.health_cards(), **self._score_weights(), **c.health()}

    def _score_weights(self) -> dict:
        """Which weights /v1/score runs: the classifiers' (base, no adapter merged), or a copy of
        the base weights of its own where the classifiers' carry an adapter."""
        s = self.info.scorer
        if s is None:
            return {}
        own = s.own_weight_bytes
        return {"score_weights": {"weights": "base", "own_copy": bool(own), "bytes": own}}

    def _state(self, oldest_ms: float, silent_ms: float) -> str:
        """/healthz's status: "degraded" when the engine has said nothing for longer than the
        shortest deadline this front end knows while requests wait (a pass or a stall holds it),
        "busy" when new work would wait longer than that (the oldest queued request, or the
        backlog at the engine's rate), else "ok"."""
        limit = self.admission.shortest_deadline()
        if silent_ms > 1e3 * limit:
            return "degraded"
        if oldest_ms > 1e3 * limit or (self.client.rate and self.client.wait_s(1) > limit):
            return "busy"
        return "ok"

    def _lag(self) -> float:
        return self.loop_lag.lag if self.loop_lag is not None else 0.0

    async def wait_ready(self) -> None:
        """Until the engine is ready (within --max-queue-ms), else 503."""
        await self._check_ready()

    async def _check_ready(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another instance", 1)
        ms = self.cfg.max_queue_ms
        await self.client.wait_ready(READY_WAIT_S if ms is None else ms / 1e3)
        if self.client.error is not None:
            raise ApiError(503, "the engine is not ready: " + self.client.error, 1)
        self.sync()

    def _admit(self, n: int, tokens: int, batch: bool = False, deadline: float | None = None,
               score: bool = False):
        """admission.Admission.admit for this request's client (TENANT)."""
        return self.admission.admit(n, tokens, batch, deadline, TENANT.get(), score)

    def _refuse(self, n: int, tokens: int, batch: bool = False, deadline: float | None = None) -> None:
        self.admission.refuse(n, tokens, batch, deadline, TENANT.get())

    # -- classify
    def deadline(self) -> float | None:
        """This request's deadline (time.monotonic()): its own, else --request-timeout's, less
        the loop's lag."""
        d = DEADLINE.get()
        if d is None and self.cfg.request_timeout:
            d = time.monotonic() + self.cfg.request_timeout
        if d is not None and self.loop_lag is not None:  # the time it likely sat unread
            d -= self.loop_lag.lag
        return d

    async def classify(self, queries: list[str], model: str | None = None,
                       classifier: str | None = None, field: str = "query",
                       priority: int = 0) -> Answer:
        """model / classifier: what the request names (Catalog.resolve); field: the request's
        name for its queries, as errors name them ("input" in vLLM's shape); priority: 0
        real-time, higher batch work (idle engine time only). Several classifiers at once:
        classify_many (many.py)."""
        t0 = time.perf_counter()
        deadline = self.deadline()
        check_priority(priority)
        self._check_queries(queries, 1, field)
        await self._check_ready()
        k = 0 if model is None and classifier is None else self.catalog.resolve(model, classifier)
        info = self.classifiers[k]
        if self.cache is None:  # refused before tokenizing (cached queries need no admission)
            self._refuse(len(queries), 0, priority > 0, deadline)
        encoded = self._encode(queries, k, field)
        t1 = time.perf_counter()
        cache, hits = self.cache, [None] * len(encoded)
        if cache is not None:  # keyed by classifier too: two prompts may tokenize alike
            keys = self._classify_keys(k, encoded)
            hits = lookup(cache, self.metrics, keys, "classify")
        todo = [e for e, h in zip(encoded, hits) if h is None]
        job = None
        if todo:  # inline, not many.py's _engine: the latency path pays for no extra coroutine
            cost = sum(len(e.ids) - e.start for e in todo)
            ticket = self._admit(len(todo), cost, priority > 0, deadline)
            try:
                fut = self.client.classify([e.ids for e in todo], [e.start for e in todo],
                                           self.cfg.start_by(deadline),
                                           [k] * len(todo) if k else None, priority, deadline or 0.0,
                                           ticket.tenant)
                job = await self._wait(fut, deadline)
            except EngineDead as e:
                raise ApiError(503, str(e), 1) from None
            finally:
                self.admission.release(ticket, job is not None)
            self.metrics.classifier_tokens(info.name).inc(cost)
            self._check_status(job, deadline)
        results, fresh = merge_rows(encoded, hits, job, info.labels)
        if cache is not None:
            store(cache, [keys[i] for i in fresh], list(fresh.values()), CLASSIFY_IDS)
            self.metrics.cache_held(cache)
        return self._classified(results, info, encoded, todo, job, t0, t1)

    def _classified(self, results, info, encoded, todo, job, t0: float, t1: float) -> Answer:
        """classify's Answer, its stages observed: tokenize t0 -> t1, the engine's pass after."""
        labels = info.labels
        t2 = time.perf_counter()
        forward = job.forward_s if job else 0.0
        prompt_tokens = sum(len(e.ids) for e in encoded)
        computed = sum(len(e.ids) - e.start for e in todo)
        ans = Answer(results, labels, info.name, prompt_tokens, prompt_tokens - computed,
                     job.batch_size if job else 0, max(0.0, t2 - t1 - forward) if job else 0.0,
                     t1 - t0, forward, t2 - t0)
        st = self.metrics.stages(info.name)
        st["queue"].observe(ans.queue_s)
        st["tokenize"].observe(ans.tokenize_s)
        st["forward"].observe(ans.forward_s)
        st["total"].observe(ans.total_s)
        return ans

    def _classify_keys(self, k: int, encoded) -> list[tuple]:
        """Classifier k's cache keys of its encoded queries (cache.py)."""
        ident = self.cache_ids[k]
        return [("classify", ident, tuple(e.ids)) for e in encoded]

    def _check_queries(self, queries: list[str], per: int, field: str) -> None:
        cfg = self.cfg
        if not queries:
            raise ApiError(422, f"{field} is an empty list", param=field)
        n = len(queries) * per  # what the engine runs: a row per query and classifier
        if n > cfg.max_queries:
            raise ApiError(413, f"{len(queries)} queries in one request, over the limit of "
                                f"{cfg.max_queries} (--max-queries)" if per == 1 else
                                f"{len(queries)} queries x {per} classifiers = {n} classifications "
                                f"in one request, over the limit of {cfg.max_queries} "
                                f"(--max-queries)", param=field)
        for i, q in enumerate(queries):  # a tokenizer raises on a lone surrogate: say what it is
            if not isinstance(q, str):
                raise ApiError(422, f"{query_name(i, len(queries), field)} must be a string",
                               param=field)
            if not is_unicode(q):
                raise ApiError(422, f"{query_name(i, len(queries), field)} is not valid Unicode text "
                                    f"(a lone surrogate)", param=field)

    def _encode(self, queries: list[str], k: int = 0, field: str = "query"):
        """Tokenized by classifier k's prompt (Prompt.encode_many: one tokenizer call), within
        --max-tokens (cut with --truncate), or a 422 naming the query."""
        prompt, info, cfg = self.prompts[k], self.classifiers[k], self.cfg
        try:
            encoded = prompt.encode_many([{"query": q} for q in queries], info.truncate)
        except InputError as e:
            raise ApiError(422, f"{query_name(getattr(e, 'index', 0), len(queries), field)}: {e}",
                           param=field) from None
        except Exception as e:  # the tokenizer itself raised: this request's input
            raise ApiError(422, f"the tokenizer could not encode this request: "
                                f"{type(e).__name__}: {e}", param=field) from None
        P_ = len(prompt.prefix_ids)
        limit = P_ + cfg.max_tokens
        for i, e in enumerate(encoded):
            n = len(e.ids) - P_
            if n <= cfg.max_tokens:
                continue
            if not info.truncate:
                raise ApiError(422, f"{query_name(i, len(queries), field)} is {n} tokens after the "
                                    f"cached prefix, over the limit of {cfg.max_tokens} tokens per "
                                    f"query (--max-tokens)", param=field)
            try:
                encoded[i] = prompt.truncated(e.values, limit)
            except InputError as err:
                raise ApiError(422, f"{query_name(i, len(queries), field)}: {err} (--max-tokens)",
                               param=field) from None
        return encoded

    async def _wait(self, fut, deadline: float | None = None):
        """The engine's answer by the request's deadline (else 504, by a timer, whatever the
        engine is doing); if this request is cancelled (its client left) or late, the engine is
        told to drop it unrun."""
        timer = None
        if deadline is not None:
            timer = self.client.loop.call_later(max(0.0, deadline - time.monotonic()), _set_late, fut)
        try:
            return await fut
        except asyncio.CancelledError:
            self.client.abort([fut])
            self.metrics.expired.labels("client_left").inc()
            raise
        except Late:
            done = self.client.progress(fut)
            self.client.abort([fut])
            self.metrics.expired.labels("deadline").inc()
            raise ApiError(504, _late(done)) from None
        finally:
            if timer is not None:
                timer.cancel()

    def _check_status(self, job, deadline: float | None = None) -> None:
        bad = [s for s in job.status if s != P.OK]
        if not bad:
            return
        if P.FAULT in bad:
            raise ApiError(503, next(iter(job.errors.values()), "engine fault"), 1)
        if P.BAD_INPUT in bad:  # a classifier index the engine lacks (another engine's Ready)
            raise ApiError(503, next(iter(job.errors.values()), "bad engine request"), 1)
        if P.EXPIRED in bad:
            self._expired(bad.count(P.EXPIRED), deadline)
        raise ApiError(503, "request aborted", 1)

    def _expired(self, n: int, deadline: float | None, stopped: str | None = None) -> None:
        """The engine dropped it unrun (or stopped its passes: `stopped` says how far it got):
        past the request's own deadline 504, else not started within --max-queue-ms 503 +
        Retry-After."""
        if deadline is not None and time.monotonic() >= deadline:
            self.metrics.expired.labels("deadline").inc(n)
            raise ApiError(504, f"no answer within the request's deadline ({DEADLINE_SOURCES}); "
                                f"{stopped or 'it was not computed'}")
        self.metrics.expired.labels("queue_time").inc(n)
        raise ApiError(503, f"not started within --max-queue-ms ({self.cfg.max_queue_ms:g} ms): "
                            f"the server is overloaded; retry later", self.client.wait_s(0))

    def begin_drain(self) -> None:
        """SIGTERM: new requests get 503 + Retry-After from now on; accepted ones still run."""
        self.draining = True

    def fail_pending(self) -> None:
        """At the end of the drain time: what is still waiting is answered 503 + Retry-After."""
        self.client._fail_all("the server is shutting down and this request did not finish within "
                              "--shutdown-timeout; retry on another instance", fault=False)


DEADLINE_SOURCES = "X-Request-Timeout, the gRPC deadline or --request-timeout"


def _late(progress) -> str:
    """A 504's text at the request's deadline: how far the engine got (a score request's last
    ProgressOut), or that it was not computed."""
    if progress is None:
        return f"no answer within the request's deadline ({DEADLINE_SOURCES}); it was not computed"
    return (f"no answer within the request's deadline ({DEADLINE_SOURCES}); stopped after "
            f"{progress.passes} of about {progress.total} passes ({progress.items_done} items "
            f"scored), the engine drops it at its next pass")


def _set_late(fut) -> None:
    if not fut.done():
        fut.set_exception(Late())


