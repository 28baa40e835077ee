"""Prometheus metrics. With several processes (front ends and engine) each writes its values to
files under PROMETHEUS_MULTIPROC_DIR (prometheus-client's multiprocess mode, set by the launcher
before any process imports prometheus_client), and /metrics in any front end sums them all.

Labels: per-classifier series carry `classifier` where they are observed; every series carries
`model` (the served name), added when /metrics is scraped: one server serves one model, so it is
the same value on each series (prometheus-client has no constant labels; the Go client's
ConstLabels do this). Process metrics (CPU, memory, open files) are the answering front end's and
the engine process's, labelled `process` ("frontend", "engine", or "server" when one process is
both) and `pid`.

With several engines (--data-parallel N > 1) the engine-side series (batch size, forward time)
and each engine's process metrics also carry `engine` (its index, 0..N-1): the sum over engines
is the server's, one engine's share says how the front ends spread the load. With one engine
there is no `engine` label, as before.
"""
from __future__ import annotations

import asyncio
import bisect
import os

LATENCY_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1,
                   2.5, 5, 10]


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class Metrics:
    """The series every process may write; a registry of its own, so several servers can live in
    one process (the tests)."""

    def __init__(self, engines: int = 1, engine: int | None = None):
        """engines: how many engine processes serve (> 1: the `engine` label on their series);
        engine: this process's index among them (None: a front end, which only reads them)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        mp = multiprocess()
        self.requests = Counter("prefixscore_http_requests", "responses by endpoint and status "
                                "(499: the client left before its answer)", ["endpoint", "status"],
                                registry=r)
        self.request_seconds = Histogram(
            "prefixscore_http_request_duration_seconds", "per request, by endpoint (route): from "
            "the server passing it on to the end of its answer", ["endpoint"], registry=r,
            buckets=LATENCY_BUCKETS)
        self.queue_depth = Gauge("prefixscore_queue_depth", "queries admitted and not yet answered",
                                 registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram(
            "prefixscore_queue_wait_seconds", "per admitted real-time classify request: the wait "
            "admission expected (source=estimate) and the one it got, admission to answer "
            "(source=measured)", ["source"], registry=r, buckets=LATENCY_BUCKETS)
        # Every process declares them with the same labels, so the sums over processes' files
        # (multiprocess mode) never mix a labelled and an unlabelled sample of one series.
        self.engines = engines
        by_engine = ["engine"] if engines > 1 else []
        self.batch_size = Histogram("prefixscore_batch_size", "queries per engine batch", by_engine,
                                    registry=r, buckets=[2 ** i for i in range(14)])
        self.forward = Histogram("prefixscore_engine_forward_seconds", "engine call per batch",
                                 by_engine, registry=r, buckets=LATENCY_BUCKETS)
        self._batch, self._forward = self.batch_size, self.forward
        if by_engine and engine is not None:
            self._batch = self.batch_size.labels(str(engine))
            self._forward = self.forward.labels(str(engine))
        # Per request, so the stages of one request add up to its total.
        self.latency = Histogram("prefixscore_latency_seconds",
                                 "per classify request: queue, tokenize, forward (its batch), total",
                                 ["classifier", "stage"], registry=r, buckets=LATENCY_BUCKETS)
        self.tokens = Counter("prefixscore_tokens", "tokens in of classify requests, computed "
                              "(after the cached prefix)", ["classifier"], registry=r)
        self.score_tokens = Counter("prefixscore_score_tokens", "tokens in of multi-item scoring "
                                    "and rerank requests (query + items)", registry=r)
        # The pair cache (serve/cache.py): lookups per route (the classify series keep their
        # names from the classify-only result cache before it), and what it holds, summed over
        # front ends (each has its own).
        self.cache_hits = Counter("prefixscore_cache_hits", "pair cache hits of classify queries "
                                  "(one per query and classifier)", registry=r)
        self.cache_misses = Counter("prefixscore_cache_misses", "pair cache misses of classify "
                                    "queries", registry=r)
        self.score_cache_hits = Counter("prefixscore_score_cache_hits", "pair cache hits of "
                                        "multi-item scoring items (/v1/score, rerank)", registry=r)
        self.score_cache_misses = Counter("prefixscore_score_cache_misses", "pair cache misses of "
                                          "multi-item scoring items", registry=r)
        self.cache_entries = Gauge("prefixscore_cache_entries", "pair cache entries (all front "
                                   "ends)", registry=r, multiprocess_mode="livesum")
        self.cache_bytes = Gauge("prefixscore_cache_bytes", "pair cache bytes, approximate (all "
                                 "front ends)", registry=r, multiprocess_mode="livesum")
        self._cache_routes = {"classify": (self.cache_hits, self.cache_misses),
                              "score": (self.score_cache_hits, self.score_cache_misses)}
        self.engine_faults = Counter("prefixscore_engine_faults", "engine deaths seen by a front end",
                                     registry=r)
        self.expired = Counter("prefixscore_expired", "requests not answered 200 for time: not "
                               "started within --max-queue-ms (queue_time), past their own "
                               "deadline (deadline: 504), or their client left (client_left)",
                               ["reason"], registry=r)
        # Depth control (--target-p99-ms): the engine's last word as each front end saw it.
        self.score_depth = Gauge("prefixscore_score_depth", "items a real-time /v1/score request "
                                 "gets scored now (depth control)", registry=r,
                                 multiprocess_mode="livemostrecent")
        self.score_p99 = Gauge("prefixscore_score_p99_ms", "depth control's measured p99 of "
                               "real-time score requests", registry=r,
                               multiprocess_mode="livemostrecent")
        self.score_running = Gauge("prefixscore_score_running", "score requests the engine has "
                                   "begun and not answered (long ones run a pass at a time)",
                                   registry=r, multiprocess_mode="livesum")
        self.score_running_passes = Gauge("prefixscore_score_running_passes", "passes run of the "
                                          "score requests in progress (of about "
                                          "prefixscore_score_running_passes_total)", registry=r,
                                          multiprocess_mode="livesum")
        self.score_running_total = Gauge("prefixscore_score_running_passes_total", "passes the "
                                         "score requests in progress take, as last estimated",
                                         registry=r, multiprocess_mode="livesum")
        if not mp:
            self.cache_ratio = Gauge("prefixscore_cache_hit_ratio", "pair cache hits / lookups "
                                     "since start, every route", registry=r)
            self.cache_ratio.set_function(lambda: self.hits / max(1, self.hits + self.misses))
        self.hits = self.misses = 0
        self.model, self.engine_pid = "", None  # known once the engine is ready (served())
        self.engine_pids: dict[int, int] = {}  # --data-parallel: engine index -> its pid, once ready
        self._stages, self._tokens, self._routes = {}, {}, {}
        self._scrape = None
        self.tallies: list[Tally] = []  # with observations not yet written (flush())
        self.flushing = None  # the pending flush's timer handle

    def flush(self) -> None:
        """Write what the tallies hold to their histograms (before a scrape; FLUSH_AFTER after a
        tally's first observation)."""
        tallies, self.tallies, self.flushing = self.tallies, [], None
        for t in tallies:
            t.write()

    def _dirty(self, tally: "Tally") -> None:
        self.tallies.append(tally)
        if self.flushing is None:
            try:
                self.flushing = asyncio.get_running_loop().call_later(FLUSH_AFTER, self.flush)
            except RuntimeError:  # no event loop here: written now
                self.flush()

    # -- children bound once (a labels() call per observation costs a lock and a dict)
    def stages(self, classifier: str) -> dict:
        """The latency children of one classifier, by stage."""
        st = self._stages.get(classifier)
        if st is None:
            st = self._stages[classifier] = {s: Tally(self, self.latency.labels(classifier, s))
                                             for s in ("queue", "tokenize", "forward", "total")}
        return st

    def classifier_tokens(self, classifier: str):
        c = self._tokens.get(classifier)
        if c is None:
            c = self._tokens[classifier] = self.tokens.labels(classifier)
        return c

    def route(self, endpoint: str):
        h = self._routes.get(endpoint)
        if h is None:
            h = self._routes[endpoint] = Tally(self, self.request_seconds.labels(endpoint))
        return h

    def served(self, model: str, engine_pid: int | None) -> None:
        """The engine is ready: its served model name (the `model` label) and its process."""
        self.model, self.engine_pid = model, engine_pid

    def cache_lookups(self, hits: int, misses: int, route: str = "classify") -> None:
        self.hits, self.misses = self.hits + hits, self.misses + misses
        h, m = self._cache_routes[route]
        if hits:
            h.inc(hits)
        if misses:
            m.inc(misses)

    def cache_held(self, cache) -> None:
        """What the pair cache holds now (after a request's lookups and stores)."""
        self.cache_entries.set(len(cache))
        self.cache_bytes.set(cache.bytes)

    def running(self, progress) -> None:
        """The score requests in progress (their last ProgressOut each)."""
        self.score_running.set(len(progress))
        self.score_running_passes.set(sum(p.passes for p in progress))
        self.score_running_total.set(sum(p.total for p in progress))

    def engine_batch(self, size: int, seconds: float) -> None:
        self._batch.observe(size)
        self._forward.observe(seconds)

    def exposition(self) -> bytes:
        """The text format: this registry (or every process's files in multiprocess mode), the
        process metrics, a `model` label on every series."""
        from prometheus_client import generate_latest

        self.flush()
        if self._scrape is None:
            self._scrape = self._scrape_registry()
        return generate_latest(self._scrape)

    def _scrape_registry(self):
        from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

        if multiprocess():
            from prometheus_client import multiprocess as mpc

            series = mpc.MultiProcessCollector(None)
        else:
            series = self.registry
        own = os.getpid()

        def engine_pid():
            pid = self.engine_pid
            return pid if pid is not None and pid != own else "none"  # "none": no /proc entry

        def own_labels():
            return {"process": "frontend" if self.engine_pid not in (None, own) else "server",
                    "pid": str(own)}

        def model():
            return {"model": self.model} if self.model else {}

        reg = CollectorRegistry(auto_describe=False)
        reg.register(Labelled(series, model))
        reg.register(Labelled(PlatformCollector(registry=None), model))
        reg.register(Labelled(ProcessCollector(registry=None),
                              lambda: {**own_labels(), **model()}))
        if self.engines > 1:  # their pids come from dp_client as each engine is ready
            reg.register(EngineProcesses(self.engine_pids, model))
        else:
            reg.register(Labelled(ProcessCollector(pid=engine_pid, registry=None),
                                  lambda: {"process": "engine", "pid": str(self.engine_pid), **model()}))
        return reg


FLUSH_AFTER = 0.05  # seconds a tally's observations may wait to be written


class Tally:
    """A histogram child's observations (per request: its route's duration, its stages), counted
    here by bucket and written to it in one go by Metrics.flush: in prometheus-client's
    multiprocess mode each observe() writes two values to a memory-mapped file, and 10 of them a
    classify request were a fifth of a front end's own Python (~27 of ~120 us, CI host). Other
    processes' scrapes see them within FLUSH_AFTER; this process's own at once (exposition()
    flushes first). Written through prometheus-client's own per-bucket values (`_buckets`,
    `_sum`, `_upper_bounds`: tests/serve/test_metrics_tally.py checks the result equals
    observe()'s)."""

    __slots__ = ("metrics", "child", "bounds", "counts", "sum", "dirty")

    def __init__(self, metrics: Metrics, child):
        self.metrics, self.child = metrics, child
        self.bounds = list(child._upper_bounds)
        self.counts, self.sum, self.dirty = [0] * len(self.bounds), 0.0, False

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket >= value
        self.sum += value
        if not self.dirty:
            self.dirty = True
            self.metrics._dirty(self)

    def write(self) -> None:
        counts, total = self.counts, self.sum
        self.counts, self.sum, self.dirty = [0] * len(self.bounds), 0.0, False
        child = self.child
        child._sum.inc(total)
        for i, n in enumerate(counts):
            if n:
                child._buckets[i].inc(n)


class EngineProcesses:
    """The process metrics of every engine process, one family per metric (as the text format
    requires), a sample per engine labelled process="engine", engine and pid. An engine that died
    has no /proc entry and no samples until its restart's pid is known."""

    def __init__(self, pids: dict, labels):
        self.pids, self.labels = pids, labels

    def describe(self):
        return []

    def collect(self):
        from prometheus_client import ProcessCollector

        families = {}
        for i, pid in sorted(self.pids.items()):
            extra = {"process": "engine", "engine": str(i), "pid": str(pid), **self.labels()}
            collector = Labelled(ProcessCollector(pid=lambda pid=pid: pid, registry=None),
                                 lambda extra=extra: extra)
            for family in collector.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


class Labelled:
    """A collector: what `source` collects, with labels() added to each sample that lacks them."""

    def __init__(self, source, labels):
        self.source, self.labels = source, labels

    def describe(self):
        return []

    def collect(self):
        extra = self.labels()
        for family in self.source.collect():
            if extra:
                family.samples = [s._replace(labels={**s.labels, **{k: v for k, v in extra.items()
                                                                    if k not in s.labels}})
                                  for s in family.samples]
            yield family
