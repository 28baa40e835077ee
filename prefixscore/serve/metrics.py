"""Prometheus metrics. With several processes (front ends and engine) each writes its values to
files under PROMETHEUS_MULTIPROC_DIR (prometheus-client's multiprocess mode, set by the launcher
before any process imports prometheus_client), and /metrics in any front end sums them all."""
from __future__ import annotations

import os

LATENCY_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1,
                   2.5, 5, 10]


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class Metrics:
    """The series every process may write; a registry of its own, so several servers can live in
    one process (the tests)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        mp = multiprocess()
        self.requests = Counter("prefixscore_http_requests", "responses by endpoint and status "
                                "(499: the client left before its answer)", ["endpoint", "status"],
                                registry=r)
        self.queue_depth = Gauge("prefixscore_queue_depth", "queries admitted and not yet answered",
                                 registry=r, multiprocess_mode="livesum")
        self.batch_size = Histogram("prefixscore_batch_size", "queries per engine batch", registry=r,
                                    buckets=[2 ** i for i in range(14)])
        self.forward = Histogram("prefixscore_engine_forward_seconds", "engine call per batch",
                                 registry=r, buckets=LATENCY_BUCKETS)
        # Per request, so the stages of one request add up to its total.
        self.latency = Histogram("prefixscore_latency_seconds",
                                 "per request: queue, tokenize, forward (its batch), total",
                                 ["stage"], registry=r, buckets=LATENCY_BUCKETS)
        self.stage = {s: self.latency.labels(s) for s in ("queue", "tokenize", "forward", "total")}
        self.tokens = Counter("prefixscore_tokens", "tokens computed (after the cached prefix)",
                              registry=r)
        self.cache_hits = Counter("prefixscore_cache_hits", "result cache hits", registry=r)
        self.cache_misses = Counter("prefixscore_cache_misses", "result cache misses", registry=r)
        self.engine_faults = Counter("prefixscore_engine_faults", "engine deaths seen by a front end",
                                     registry=r)
        self.expired = Counter("prefixscore_expired", "queries dropped unrun: over --max-queue-ms, "
                               "or their client left", ["reason"], registry=r)
        if not mp:
            self.cache_ratio = Gauge("prefixscore_cache_hit_ratio", "hits / lookups since start",
                                     registry=r)
            self.cache_ratio.set_function(lambda: self.hits / max(1, self.hits + self.misses))
        self.hits = self.misses = 0

    def cache_lookups(self, hits: int, misses: int) -> None:
        self.hits, self.misses = self.hits + hits, self.misses + misses
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)

    def engine_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.forward.observe(seconds)

    def exposition(self) -> bytes:
        """The text format: this registry, or every process's files in multiprocess mode."""
        from prometheus_client import CollectorRegistry, generate_latest

        if multiprocess():
            from prometheus_client import multiprocess as mpc

            reg = CollectorRegistry()
            mpc.MultiProcessCollector(reg)
            return generate_latest(reg)
        return generate_latest(self.registry)
