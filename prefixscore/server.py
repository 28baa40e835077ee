"""HTTP service: `prefixscore serve`. One engine per process behind a micro-batcher.

A request's path: validate (event loop) -> bounded queue -> the engine thread takes everything
queued as soon as it is free (waiting at most `batch_window_ms` for more): one tokenizer call for
the batch, the result cache, one `classify_encoded` call -> answers, back to the event loop in one
call for the whole batch. One thread hop each way per request: each hop costs tens of microseconds
of wake-ups, the budget is 0.5 ms.

Every CLI command imports this module to register `serve`, and importing FastAPI costs about a
second, so FastAPI and uvicorn are imported where the app is built, not at the top.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from .errors import ConfigError, InputError, PrefixScoreError

log = logging.getLogger("prefixscore.server")
PATHS = ("/v1/classify", "/v1/score", "/healthz", "/metrics", "/docs", "/openapi.json")


# ---------------------------------------------------------------- request / response shapes

class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"query": "beige trench coat women"}, {"query": ["levis 501", "红色连衣裙"]}]})
    query: str | list[str] = Field(description="one query, or a list classified independently")


class ClassifyResult(BaseModel):
    query: str = Field(description="the query as the model saw it (cut if the server truncates)")
    label: str = Field(description="what greedy decoding constrained to the labels outputs")
    scores: dict[str, float] = Field(description="per label: log-probability (mode logprobs) or raw "
                                                 "first-token logit (mode logits)")
    cached: bool = Field(description="answered from the result cache")


class Timing(BaseModel):
    queue_ms: float = Field(description="waiting for the engine")
    tokenize_ms: float
    forward_ms: float = Field(description="the engine batch this request rode in")
    total_ms: float = Field(description="from the parsed request to the answer")


class ClassifyResponse(BaseModel):
    results: list[ClassifyResult]
    batch_size: int = Field(description="queries in the engine batch (0: all from the cache)")
    timing: Timing


class ScoreRequest(BaseModel):
    """SGLang's /v1/score request; `labels` (label texts instead of token ids) is ours. Strict
    types: "yes" is no boolean and "9891" no token id (Scorer.score_request refuses them too)."""
    query: str | list[StrictInt] | None = None
    items: str | list[str] | list[list[StrictInt]] | None = None
    label_token_ids: list[StrictInt] | None = None
    labels: list[str] | None = None
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: str | None = Field(None, description="accepted for compatibility; never loads a model")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ScoreResponse(BaseModel):
    scores: list[list[float]] = Field(description="per item, one score per label, in label order")
    labels: list[str] = Field(description="the label order (ours; not in SGLang's response)")
    model: str
    usage: Usage | None = None
    object: Literal["scoring"] = "scoring"


class Error(BaseModel):
    detail: str


# ---------------------------------------------------------------- metrics, cache

class Metrics:
    """Prometheus metrics on a registry of their own, so several apps can live in one process."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("prefixscore_http_requests", "HTTP responses by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge("prefixscore_queue_depth",
                                 "queries admitted and not yet in an engine batch", registry=r)
        self.batch_size = Histogram("prefixscore_batch_size", "queries per engine batch", registry=r,
                                    buckets=[2 ** i for i in range(13)])
        # Per request, so the stages of one request add up to its total.
        self.latency = Histogram("prefixscore_latency_seconds",
                                 "per request: queue, tokenize, forward (its batch), total",
                                 ["stage"], registry=r,
                                 buckets=[1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                                          0.1, 0.25, 0.5, 1, 2.5, 5, 10])
        self.stage = {s: self.latency.labels(s) for s in ("queue", "tokenize", "forward", "total")}
        self.cache_hits = Counter("prefixscore_cache_hits", "result cache hits", registry=r)
        self.cache_misses = Counter("prefixscore_cache_misses", "result cache misses", registry=r)
        self.cache_ratio = Gauge("prefixscore_cache_hit_ratio", "hits / lookups since start", registry=r)
        self.cache_ratio.set_function(lambda: self.hits / max(1, self.hits + self.misses))
        self.hits = self.misses = 0
        self.engine_faults = Counter("prefixscore_engine_faults", "engine batches that raised", registry=r)

    def cache_lookups(self, hits: int, misses: int) -> None:
        self.hits, self.misses = self.hits + hits, self.misses + misses
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)


class ResultCache:
    """LRU of (label, scores) keyed by the prompt's token ids: the normalized form of a query that
    provably gets the same answer, so results are identical with and without the cache."""

    def __init__(self, size: int, ttl: float):
        self.size, self.ttl = size, ttl
        self.items: OrderedDict[tuple, tuple] = OrderedDict()

    def get(self, key):
        hit = self.items.get(key)
        if hit is None:
            return None
        if self.ttl and hit[0] < time.monotonic():
            del self.items[key]
            return None
        self.items.move_to_end(key)
        return hit[1]

    def put(self, key, value) -> None:
        self.items[key] = (time.monotonic() + self.ttl, value)
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)


# ---------------------------------------------------------------- micro-batcher

class Overloaded(Exception):
    pass


class EngineFault(Exception):
    pass


@dataclass
class Job:
    queries: list[str]
    future: asyncio.Future  # -> Answer, or an InputError for this request alone
    queued_at: float


@dataclass
class Answer:
    results: list[tuple[str, str, dict, bool]]  # per query: (query as seen, label, scores, cached)
    start: float  # when its batch began (perf_counter)
    tokenize: float  # seconds: the batch's tokenization
    forward: float  # seconds: the batch's engine call (0 when every query hit the cache)
    size: int  # queries in the engine call


@dataclass
class Call:
    """Other engine work (multi-item scoring), run alone after the batch it was queued with."""
    fn: object
    args: tuple
    future: asyncio.Future  # -> fn's result or exception


STOP = object()  # tells the engine thread to end
MAX_WINDOW_MS = 10_000.0  # a longer batch window would outlast any client's timeout
_SPIN_CHUNK = bytes(16384)  # hashing it: ~10 us of CPU with the GIL released (see Batcher._next)


class Batcher:
    """At most one batch in flight. The engine thread owns the batching loop: it takes everything
    queued while it was busy as the next batch, tokenizes it (one tokenizer call for the whole
    batch, parallel and off the GIL) and classifies it in one `classify_encoded` call.

    Per request that is one wake-up each way and no asyncio task of the batcher's own: the event
    loop puts the job on a SimpleQueue (a C lock: the engine thread wakes without the loop doing
    more), and the engine thread answers a whole batch with one call_soon_threadsafe that sets
    every request's future."""

    def __init__(self, clf, metrics: Metrics, max_queue: int, window: float, max_tokens: int,
                 cache: ResultCache | None, engine_cpu: int | None = None, spin: float = 0.0):
        self.clf, self.metrics, self.max_queue, self.window = clf, metrics, max_queue, window
        self.max_tokens, self.cache, self.engine_cpu, self.spin = max_tokens, cache, engine_cpu, spin
        self.queue: SimpleQueue = SimpleQueue()  # Job, Call or STOP: event loop -> engine thread
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None  # the engine thread, from start() on
        # Queue depth = admitted - taken, each counter written by one thread only (no lock):
        self.admitted = 0  # event loop: queries (or items) admitted, less finished /v1/score items
        self.taken = 0  # engine thread: queries taken into a batch
        self.ready = False  # prefix built and one batch run (graphs captured, if the engine has any)
        self.error: str | None = None  # set by an engine fault; unhealthy from then on
        metrics.queue_depth.set_function(lambda: self.depth)

    @property
    def depth(self) -> int:
        """Queries admitted and not yet in an engine batch."""
        return self.admitted - self.taken

    def admit(self, n: int) -> None:
        if self.error:
            raise EngineFault(self.error)
        if self.depth + n > self.max_queue:
            raise Overloaded(f"queue full ({self.depth} queries waiting, limit {self.max_queue}); "
                             f"retry later")
        self.admitted += n

    def submit(self, queries: list[str]) -> asyncio.Future:
        """Queue an admitted request's queries as one job (never split across batches)."""
        fut = self.loop.create_future()
        self.queue.put(Job(queries, fut, time.perf_counter()))
        return fut

    def run_on_engine(self, fn, *args) -> asyncio.Future:
        """Other engine work (multi-item scoring) runs on the same thread, between batches."""
        fut = self.loop.create_future()
        self.queue.put(Call(fn, args, fut))
        return fut

    def start(self) -> None:
        """From the event loop (the app's lifespan): start the engine thread."""
        self.loop = asyncio.get_running_loop()
        self.thread = threading.Thread(target=self._main, name="prefixscore-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(STOP)

    def _main(self) -> None:
        """Engine thread: warm up, then one batch per pass of the loop."""
        try:
            self._warmup()
            self.ready = True
        except Exception as e:
            self.fail(e)
        while True:
            items: list = []
            try:
                self._take(items)
                self._serve(items)
            except Exception as e:  # a bug here, not in a request: no request may wait forever
                self.fail(e)
                waiting = [i for i in items if isinstance(i, (Job, Call))]
                self._answer(waiting, [EngineFault(self.error)] * len(waiting))
            if any(i is STOP for i in items):
                return

    def _take(self, items: list) -> None:
        """Engine thread: the next batch into `items`: the next queued item, then everything queued
        meanwhile (after the batch window, if one is set)."""
        items.append(self._next())
        if self.window and isinstance(items[0], Job):  # the oldest job waits for company
            time.sleep(max(0.0, items[0].queued_at + self.window - time.perf_counter()))
        while True:
            try:
                items.append(self.queue.get_nowait())
            except Empty:
                return

    def _serve(self, items: list) -> None:
        """Engine thread: the batch's jobs in one engine call, then the other engine work."""
        jobs = [j for j in items if isinstance(j, Job)]
        if jobs:
            self.taken += sum(len(j.queries) for j in jobs)
            jobs = [j for j in jobs if not j.future.done()]  # skip cancelled requests
            self._answer(jobs, self._run_jobs(jobs))
        for c in items:
            if isinstance(c, Call):
                try:
                    out = c.fn(*c.args)
                except Exception as e:
                    out = e
                self._answer([c], [out])

    def _next(self):
        """Engine thread: the next queued item. For `spin` seconds it polls the queue, keeping its
        CPU busy without holding the GIL, before it blocks. On the H200 host (bench.http, serial,
        3 A/B runs) tokenize + engine call took 0.03-0.2 ms longer on a thread that had slept on
        the queue than on one that kept polling, and polling saves the wake-up. Each poll holds
        the GIL for a moment only, so the event loop is not held up."""
        deadline = time.perf_counter() + self.spin
        while time.perf_counter() < deadline:
            try:
                return self.queue.get_nowait()
            except Empty:
                hashlib.sha256(_SPIN_CHUNK)  # busy, GIL released (hashlib drops it over 2 KiB)
        return self.queue.get()

    def _run_jobs(self, jobs: list[Job]) -> list:
        """Engine thread: per job an Answer or the exception to raise in its request."""
        if not jobs:
            return []
        if not self.error:
            try:
                return self._batch(jobs)
            except Exception as e:
                self.fail(e)
        return [EngineFault(self.error)] * len(jobs)

    def _answer(self, jobs: list, outs: list) -> None:
        """Engine thread: hand a batch's results to the event loop, one wake-up for them all."""
        if jobs:
            try:
                self.loop.call_soon_threadsafe(_resolve, jobs, outs)
            except RuntimeError:  # the event loop is closed: nobody waits for these
                pass

    def _encode(self, queries: list[str]) -> list:
        """Engine thread: a request's queries tokenized, or the first bad one as an InputError."""
        try:
            encoded = self.clf.encode_many(queries)
        except InputError as e:
            return InputError(f"{query_name(e.index, len(queries))}: {e}")
        except Exception as e:  # the tokenizer itself raised: this request's input, not an engine fault
            return InputError(f"the tokenizer could not encode this request: {type(e).__name__}: {e}")
        return self._check_tokens(encoded, queries)

    def _batch(self, jobs: list[Job]) -> list:
        """Engine thread: tokenize every job (one call; a job with a bad query fails alone), look
        up the cache, classify the rest in one engine call."""
        t0 = time.perf_counter()
        try:
            flat = self.clf.encode_many([q for j in jobs for q in j.queries])
        except Exception:  # some job has a bad query: tokenize job by job to find it
            per_job = [self._encode(j.queries) for j in jobs]
        else:
            per_job, i = [], 0
            for j in jobs:
                per_job.append(flat[i:i + len(j.queries)])
                i += len(j.queries)
            per_job = [self._check_tokens(enc, j.queries) for enc, j in zip(per_job, jobs)]
        cache, todo = self.cache, []
        hits = []
        for enc in per_job:
            if isinstance(enc, InputError):
                hits.append(None)
                continue
            h = [cache.get(tuple(e.ids)) for e in enc] if cache else [None] * len(enc)
            if cache:
                self.metrics.cache_lookups(len(h) - h.count(None), h.count(None))
            todo += [e for e, x in zip(enc, h) if x is None]
            hits.append(h)
        t1 = time.perf_counter()
        results = iter(self.clf.classify_encoded(todo) if todo else [])
        t2 = time.perf_counter()
        if todo:
            self.metrics.batch_size.observe(len(todo))
        answers = []
        for enc, h in zip(per_job, hits):
            if isinstance(enc, InputError):
                answers.append(enc)
                continue
            out = []
            for e, hit in zip(enc, h):
                cached = hit is not None
                if not cached:
                    r = next(results)
                    hit = (r.label, r.scores)
                    if cache:
                        cache.put(tuple(e.ids), hit)
                out.append((e.values["query"], hit[0], hit[1], cached))
            answers.append(Answer(out, t0, t1 - t0, (t2 - t1) if todo else 0.0, len(todo)))
        return answers

    def _check_tokens(self, encoded: list, queries: list[str]):
        """The --max-tokens limit: an InputError, or with --truncate the query cut to fit."""
        limit = self.clf.prefix_len + self.max_tokens
        for i, e in enumerate(encoded):
            n = len(e.ids) - self.clf.prefix_len
            if n <= self.max_tokens:
                continue
            if not self.clf.truncate:
                return InputError(f"{query_name(i, len(queries))} is {n} tokens after the cached "
                                  f"prefix, over the limit of {self.max_tokens} tokens per query "
                                  f"(--max-tokens)")
            try:
                encoded[i] = self.clf.prompt.truncated(e.values, limit)
            except InputError as err:
                return InputError(f"{query_name(i, len(queries))}: {err} (--max-tokens)")
        return encoded

    def _warmup(self) -> None:
        if self.engine_cpu is not None:  # pid 0: this (engine) thread only
            os.sched_setaffinity(0, {self.engine_cpu})
        # The Classifier built the prefix and captured its graphs; one real batch proves the path.
        self.clf.classify_encoded([self.clf.encode("warm up")])

    def fail(self, e: BaseException) -> None:
        log.error("engine fault, the server is unhealthy from now on", exc_info=e)
        self.metrics.engine_faults.inc()
        self.error = f"engine fault: {type(e).__name__}: {e}"


def _resolve(jobs: list, outs: list) -> None:
    """Event loop: each waiting request gets its result or exception."""
    for j, out in zip(jobs, outs):
        if j.future.done():  # cancelled (client gone)
            continue
        if isinstance(out, BaseException):
            j.future.set_exception(out)
        else:
            j.future.set_result(out)


# ---------------------------------------------------------------- ASGI guard

class Guard:
    """Outermost ASGI layer: counts responses by endpoint and status, answers 401 on /v1/* without
    the API key (when one is set) before anything is read, and reads request bodies up to the size
    limit (413 past it, before anything is parsed), so memory per request is bounded."""

    def __init__(self, app, metrics: Metrics, max_body: int, api_key: str | None = None):
        self.app, self.metrics, self.max_body, self.api_key = app, metrics, max_body, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        endpoint = scope["path"] if scope["path"] in PATHS else "other"
        try:
            if self.api_key is not None and scope["path"].startswith("/v1/") and not authorized(
                    dict(scope["headers"]).get(b"authorization"), self.api_key):
                return await _send_json(counted, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body, error = await self._read(scope, receive)
                if error:
                    return await _send_json(counted, *error)
                receive = _replay(body, receive)
            await self.app(scope, receive, counted)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    async def _read(self, scope, receive):
        too_big = (413, f"request body over the limit of {self.max_body} bytes (--max-body-bytes)")
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                return b"", too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", (400, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")  # JSON is UTF-8 (RFC 8259); say so instead of a generic parse error
        except UnicodeDecodeError as e:
            return b"", (400, f"request body is not valid UTF-8 (byte {e.start})")
        return body, None


class FastClassify:
    """POST /v1/classify without FastAPI's routing and dependency layers (~0.1 ms less per request
    with a stub engine on a 2-core host): a JSON body that the route's own pydantic model accepts
    goes straight to the route's handler (answer). Anything else (another content type, invalid
    JSON or fields) falls through to the FastAPI route, which answers it exactly as before. Runs
    inside Guard, which has checked the API key and read the whole body, and both run in front of
    FastAPI itself (create_app's App)."""

    def __init__(self, app, answer):
        self.app, self.answer = app, answer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/classify" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        ctype = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            return await self.app(scope, receive, send)
        message = await receive()
        body = message.get("body", b"")
        try:
            req = ClassifyRequest.model_validate_json(body)
        except ValueError:  # pydantic's ValidationError: FastAPI words the 422
            return await self.app(scope, _replay(body, receive), send)
        from fastapi import HTTPException

        extra = []
        try:
            status, out = 200, await self.answer(req)
        except HTTPException as e:
            status, out = e.status_code, json.dumps({"detail": e.detail}).encode()
            extra = [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
        await _send(send, status, out, extra)


UNAUTHORIZED = "missing or wrong API key: send 'Authorization: Bearer KEY'"


def authorized(header: bytes | None, api_key: str) -> bool:
    """An Authorization header value that carries the API key as a bearer token."""
    scheme, _, token = (header or b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and key_matches(token.strip(), api_key)


def key_matches(token: str, api_key: str) -> bool:
    """Constant-time comparison of a bearer token with the API key."""
    return hmac.compare_digest(token.encode(), api_key.encode())


def check_api_key(key: str) -> None:
    """A key a client can send: an HTTP header value carries printable ASCII only."""
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ConfigError("the API key must be printable ASCII without leading or trailing spaces "
                          "(an HTTP header cannot carry anything else, so no client could send it)")


def query_name(i: int, n: int) -> str:
    """How an error names query i of a request of n queries: its JSON index, as in items[i]."""
    return f"query[{i}]" if n > 1 else "query"


def is_unicode(text: str) -> bool:
    """False for a lone surrogate: valid in JSON ("\\ud800") and in a Python str, not in UTF-8,
    and a tokenizer raises on it."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _send(send, status: int, body: bytes, headers=()) -> None:
    """A whole JSON response straight to the ASGI server."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send, status: int, detail: str, headers=()) -> None:
    """An error before the body was read whole: the connection closes after it."""
    await _send(send, status, json.dumps({"detail": detail}).encode(),
                [(b"connection", b"close"), *headers])


# ---------------------------------------------------------------- the app

ERRORS = {s: {"model": Error, "description": d} for s, d in [
    (400, "body is not UTF-8"), (401, "missing or wrong API key"),
    (413, "body or query count over the limit"), (422, "invalid request or query"),
    (429, "queue full: retry after Retry-After seconds"), (503, "engine fault or not ready")]}


def create_app(classifier, *, scorer=None, api_key: str | None = None, max_queue: int = 1024,
               batch_window_ms: float = 0.0, max_body_bytes: int = 1 << 20, max_queries: int = 256,
               max_tokens: int = 512, cache_size: int = 0, cache_ttl: float = 0.0,
               engine_cpu: int | None = None, engine_spin_ms: float = 0.0,
               model_name: str | None = None):
    """The ASGI app around one Classifier (and optionally one multi-item scorer for /v1/score).
    engine_cpu: pin the engine thread to this CPU (see engine_cpu()). engine_spin_ms: how long the
    engine thread polls for the next batch, busy, before it sleeps (see Batcher._next).
    model_name: what /healthz and /v1/score call the model (default: its file or folder name)."""
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from fastapi.security import HTTPBearer

    clf = classifier
    for name, v in [("max_queue", max_queue), ("max_body_bytes", max_body_bytes),
                    ("max_queries", max_queries), ("max_tokens", max_tokens)]:
        if v < 1:
            raise ConfigError(f"{name} must be at least 1, got {v}")
    if max_queries > max_queue:
        raise ConfigError(f"max_queries ({max_queries}) must not exceed max_queue ({max_queue})")
    if not 0 <= batch_window_ms <= MAX_WINDOW_MS:
        raise ConfigError(f"batch_window_ms must be from 0 to {MAX_WINDOW_MS:g}, got {batch_window_ms}")
    if not 0 <= cache_ttl < float("inf"):  # inf would be "no TTL", which 0 already says
        raise ConfigError(f"cache_ttl must be seconds >= 0 (0: none), got {cache_ttl}")
    if api_key is not None:
        check_api_key(api_key)
    metrics = Metrics()
    cache = ResultCache(cache_size, cache_ttl) if cache_size > 0 else None
    batcher = Batcher(clf, metrics, max_queue, batch_window_ms / 1e3, max_tokens, cache, engine_cpu,
                      engine_spin_ms / 1e3)
    if model_name is None:  # a name, not the host's path to the weights
        model_name = Path(str(getattr(getattr(clf, "loaded", None), "name", "prefixscore"))).name

    def admit(n: int) -> None:
        """Reserve queue room for n queries/items: 429 when full, 503 once the engine faulted."""
        try:
            batcher.admit(n)
        except Overloaded as e:
            raise HTTPException(429, str(e), headers={"Retry-After": "1"}) from None
        except EngineFault as e:
            raise HTTPException(503, str(e)) from None

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        # uvicorn lets accepted requests finish (up to its graceful-shutdown timeout) before this.
        batcher.stop()

    class App(FastAPI):
        """HTTP requests enter through Guard and FastClassify (app.front) before FastAPI's own
        layers: a valid /v1/classify body skips FastAPI's per-request telemetry check and
        Starlette's middleware stack; everything else continues into them (`inner`)."""

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                await self.front(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)

    app = App(title="prefixscore", version="0.1.0", lifespan=lifespan,
              description="Which of N labels does this causal LLM pick for this text.")
    inner = super(App, app).__call__
    app.state.batcher, app.state.metrics = batcher, metrics

    deps = []
    if api_key:
        bearer = HTTPBearer(auto_error=False)

        def check_key(creds=Depends(bearer)):  # Guard checked already; this documents the scheme
            if creds is None or not key_matches(creds.credentials, api_key):
                raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})

        deps = [Depends(check_key)]

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype:
            detail += f" (the body must be JSON sent with content-type: application/json, got {ctype!r})"
        return JSONResponse({"detail": detail, "errors": errors}, status_code=422)

    @app.post("/v1/classify", response_model=ClassifyResponse, responses=ERRORS, dependencies=deps)
    async def classify(req: ClassifyRequest):
        """Label and per-label scores for one query or a list of queries."""
        return Response(await answer_classify(req), media_type="application/json")

    async def answer_classify(req: ClassifyRequest) -> bytes:
        """The route's work, shared with FastClassify: the response body, or an HTTPException."""
        t0 = time.perf_counter()
        queries = [req.query] if isinstance(req.query, str) else req.query
        if not queries:
            raise HTTPException(422, "query is an empty list")
        if len(queries) > max_queries:
            raise HTTPException(413, f"{len(queries)} queries in one request, over the limit of "
                                     f"{max_queries} (--max-queries)")
        for i, q in enumerate(queries):  # a tokenizer raises on a lone surrogate: say what it is
            if not is_unicode(q):
                raise HTTPException(422, f"{query_name(i, len(queries))} is not valid Unicode text "
                                         f"(a lone surrogate)")
        admit(len(queries))
        try:
            a: Answer = await batcher.submit(queries)
        except InputError as e:
            raise HTTPException(422, str(e)) from None
        except EngineFault as e:
            raise HTTPException(503, str(e)) from None
        t2 = time.perf_counter()
        queue = max(0.0, a.start - t0)
        for stage, secs in (("queue", queue), ("tokenize", a.tokenize), ("forward", a.forward),
                            ("total", t2 - t0)):
            metrics.stage[stage].observe(secs)
        # Built as JSON here: the shape is ClassifyResponse (the schema), without FastAPI
        # validating it a second time on the way out.
        body = {"results": [{"query": q, "label": l, "scores": sc, "cached": c} for q, l, sc, c in a.results],
                "batch_size": a.size,
                "timing": {"queue_ms": 1e3 * queue, "tokenize_ms": 1e3 * a.tokenize,
                           "forward_ms": 1e3 * a.forward, "total_ms": 1e3 * (t2 - t0)}}
        return json.dumps(body, ensure_ascii=False).encode()

    # Without a scorer the route answers 501 but stays out of the schema: the schema lists what
    # this server can do.
    @app.post("/v1/score", response_model=ScoreResponse, responses=ERRORS, dependencies=deps,
              include_in_schema=scorer is not None)
    async def score(req: ScoreRequest):
        """SGLang-compatible multi-item scoring: per item, the labels' scores after query + item.
        apply_softmax=true: softmax over the labels; false: each label token's probability under the
        whole vocabulary (SGLang's default)."""
        if scorer is None:
            raise HTTPException(501, "no multi-item scorer is configured on this server: start it with "
                                     "--score-template TEMPLATE to enable /v1/score")
        items = [req.items] if isinstance(req.items, str) else req.items
        if req.query is None or not items:
            raise HTTPException(422, "query and items are required")
        if len(items) > max_queries:
            raise HTTPException(413, f"{len(items)} items in one request, over the limit of "
                                     f"{max_queries} (--max-queries)")
        texts = [req.query, *items, *(req.labels or [])]
        if not all(is_unicode(t) for t in texts if isinstance(t, str)):
            raise HTTPException(422, "query, items and labels must be valid Unicode text (a lone surrogate)")
        admit(len(items))
        try:  # the scorer tokenizes on the engine thread: one call per request, already batched;
            # only the fields the client sent: the scorer tells "item_first absent" from "false"
            out = await batcher.run_on_engine(scorer.score_request, req.model_dump(exclude_unset=True))
        except PrefixScoreError as e:
            raise HTTPException(422, str(e)) from None
        except Exception as e:
            batcher.fail(e)
            raise HTTPException(503, batcher.error) from None
        finally:
            batcher.admitted -= len(items)
        return ScoreResponse(**{**out, "model": model_name})

    @app.get("/healthz", responses={503: {"description": "starting, or unhealthy after an engine fault"}})
    @app.head("/healthz", include_in_schema=False)  # probes that send HEAD (RFC 9110: supported)
    async def healthz():
        """Ready once the prefix is cached and a first batch has run; unhealthy after an engine fault."""
        if batcher.error:
            return JSONResponse({"status": "unhealthy", "error": batcher.error}, status_code=503)
        if not batcher.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok", "model": model_name, "labels": list(clf.labels),
                "mode": getattr(clf, "mode", None), "scorer": scorer is not None,
                "queue_depth": batcher.depth}

    @app.get("/metrics", response_class=Response)
    @app.head("/metrics", include_in_schema=False)
    async def prometheus():
        """Prometheus text format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.front = Guard(FastClassify(inner, answer=answer_classify), metrics=metrics,
                      max_body=max_body_bytes, api_key=api_key)
    return app


# ---------------------------------------------------------------- command line

def add_command(subparsers, model_args) -> None:
    p = subparsers.add_parser(
        "serve", help="HTTP service: POST /v1/classify, /v1/score; GET /healthz, /metrics, /docs",
        description="Serve one classifier over HTTP with micro-batching. Options can also come from "
                    "a TOML file (--config); flags given on the command line win.")
    g = p.add_argument_group("server")
    g.add_argument("--config", default=None,
                   help="TOML file of options: keys are the long flags without '--' (port = 8000, "
                        "labels = [\"yes\", \"no\"], ...)")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PREFIXSCORE_API_KEY)")
    g.add_argument("--max-queue", type=int, default=1024,
                   help="queries waiting for the engine; beyond it requests get 429")
    g.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="how long a batch may wait for more requests (default 0: run when the engine is free)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413)")
    g.add_argument("--max-queries", type=int, default=256, help="queries (or items) per request (413)")
    g.add_argument("--max-tokens", type=int, default=512,
                   help="tokens per query after the cached prefix (422)")
    g.add_argument("--cache-size", type=int, default=0, help="result cache entries (default 0: off)")
    g.add_argument("--cache-ttl", type=float, default=0.0, help="result cache TTL in seconds (0: none)")
    g.add_argument("--score-template", default=None,
                   help="template with {query} and {item} slots: enables /v1/score")
    g.add_argument("--score-labels", default=None,
                   help="comma-separated labels of /v1/score when a request names none (default: yes,no)")
    g.add_argument("--max-connections", type=int, default=1000,
                   help="concurrent connections; beyond it uvicorn answers 503")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to finish accepted requests on SIGTERM/SIGINT")
    g.add_argument("--engine-cpu", default="none",
                   help="pin the engine thread to this CPU number (the event loop then runs on the "
                        "others); 'auto': the last CPU, on a GPU with 4+ CPUs; 'none' (default)")
    g.add_argument("--engine-spin-ms", default="auto",
                   help="after each batch the engine thread polls this long for the next one, busy on "
                        "its CPU, before it sleeps; 'auto' (default): 2 on a GPU, 0 on CPU inference "
                        "(whose threads need every CPU)")
    g.add_argument("--served-model-name", default=None,
                   help="the model's name in /healthz and /v1/score answers (default: its file or "
                        "folder name)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    model_args(p)
    p.set_defaults(func=lambda a: cmd_serve(a, p))


def apply_config(a, parser) -> None:
    """Options from a TOML file, under the command line: the file's values go through the same
    parser as flags (typed and checked the same way) and become its defaults, then the command
    line is parsed again on top, so a flag given there wins even where it equals the default."""
    import tomllib

    try:
        with open(a.config, "rb") as f:
            cfg = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {a.config}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {a.config}: {e}") from None
    actions = {act.dest: act for act in parser._actions if act.dest not in ("help", "config")}
    argv = []
    for key, value in cfg.items():
        dest = key.replace("-", "_")
        act = actions.get(dest)
        if act is None:
            raise ConfigError(f"config file {a.config}: unknown option {key!r}; known: "
                              f"{', '.join(sorted(k.replace('_', '-') for k in actions))}")
        flag = act.option_strings[0]
        if act.nargs == 0:  # a switch: --truncate, --access-log, --chat / --no-chat
            if not isinstance(value, bool):
                raise ConfigError(f"config file {a.config}: {key} is a switch: true or false")
            if value:
                argv.append(flag)
            elif len(act.option_strings) > 1:  # the "--no-" form
                argv.append(act.option_strings[1])
            continue
        if isinstance(value, bool):
            raise ConfigError(f"config file {a.config}: {key} takes a value, not {str(value).lower()}")
        if isinstance(value, list):  # labels = ["yes", "no"]: the flag's comma-separated form
            if any("," in str(v) for v in value):
                raise ConfigError(f"config file {a.config}: {key}: an element contains a comma, "
                                  f"which would split it; put such labels in a labels-file")
            value = ",".join(map(str, value))
        argv.append(f"{flag}={value}")  # one word: a value may start with '-'
    parser.exit_on_error = False  # a bad value raises, to be reported as the config file's
    try:
        from_file = parser.parse_args(argv)
        parser.set_defaults(**{k.replace("-", "_"): getattr(from_file, k.replace("-", "_")) for k in cfg})
        merged = parser.parse_args(a.argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"config file {a.config}: {e}") from None
    finally:
        parser.exit_on_error = True
    for dest in actions:
        setattr(a, dest, getattr(merged, dest))


def cmd_serve(a, parser) -> int:
    from .cli import make_classifier

    if a.config:
        apply_config(a, parser)
    # A secret read from a file often ends in a newline, which no HTTP header can carry.
    api_key = (a.api_key or os.environ.get("PREFIXSCORE_API_KEY") or "").strip() or None
    try:
        loopback = ipaddress.ip_address(a.host).is_loopback
    except ValueError:
        loopback = a.host == "localhost"
    if not loopback and not api_key:
        print(f"prefixscore: warning: listening on {a.host} without an API key: anyone who can reach "
              f"this port can use the model (set --api-key or PREFIXSCORE_API_KEY)", file=sys.stderr)
    clf = make_classifier(a)
    scorer = make_scorer(a, clf) if a.score_template else None
    cpu = engine_cpu(a.engine_cpu, clf.engine.device.type)
    if cpu is not None:  # the event loop (this thread, and threads it starts) off the engine's CPU
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {cpu})
    app = create_app(clf, scorer=scorer, api_key=api_key, max_queue=a.max_queue,
                     batch_window_ms=a.batch_window_ms, max_body_bytes=a.max_body_bytes,
                     max_queries=a.max_queries, max_tokens=a.max_tokens, cache_size=a.cache_size,
                     cache_ttl=a.cache_ttl, engine_cpu=cpu,
                     engine_spin_ms=engine_spin_ms(a.engine_spin_ms, clf.engine.device.type),
                     model_name=a.served_model_name)
    serve_app(app, host=a.host, port=a.port, log_level=a.log_level, access_log=a.access_log,
              limit_concurrency=a.max_connections, timeout_graceful_shutdown=a.shutdown_timeout)
    return 0


def serve_app(app, **uvicorn_kw) -> None:
    """Run the app under uvicorn as `prefixscore serve` does (bench/server_stub.py uses it too)."""
    import uvicorn

    # The event loop and the engine thread share the GIL. Under load the loop rarely blocks, so
    # the engine thread, back from a GPU sync, would wait up to the 5 ms default switch interval
    # for it: a forward's worth of latency per batch. 0.5 ms bounds that wait.
    sys.setswitchinterval(0.0005)
    uvicorn.run(app, **uvicorn_kw)


def engine_spin_ms(spec: str, device: str) -> float:
    """--engine-spin-ms: 'auto' polls on a GPU only; CPU inference needs every CPU for itself."""
    if spec == "auto":
        return 2.0 if device == "cuda" else 0.0
    try:
        ms = float(spec)
    except ValueError:
        ms = -1.0
    if not 0 <= ms < float("inf"):
        raise ConfigError(f"--engine-spin-ms must be milliseconds (>= 0) or 'auto', got {spec!r}")
    return ms


def engine_cpu(spec: str, device: str) -> int | None:
    """The CPU for the engine thread, or None. On the H200 host the same classify call ran 15-35%
    slower on some threads/CPUs than on others (bench/host.py), and pinning helped in one run
    (1.37 -> 1.15 ms; HTTP serial p50 2.19 -> 2.09 ms) but not in another (1.18 -> 1.36 ms): off
    by default, for hosts where it measures better. Never on CPU inference: its OpenMP workers
    would inherit the one-CPU mask."""
    if spec == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = os.sched_getaffinity(0)
    if spec == "auto":
        return max(cpus) if device == "cuda" and len(cpus) >= 4 else None
    try:
        cpu = int(spec)
    except ValueError:
        raise ConfigError(f"--engine-cpu must be a CPU number, 'auto' or 'none', got {spec!r}") from None
    if cpu not in cpus or len(cpus) < 2:
        raise ConfigError(f"--engine-cpu {cpu}: this process may run on CPUs {sorted(cpus)}, and "
                          f"needs one more for the event loop")
    return cpu


def make_scorer(a, clf):
    """The multi-item scorer of /v1/score, on the classifier's weights (loaded once)."""
    from .scorer import Scorer

    labels = None if a.score_labels is None else [l.strip() for l in a.score_labels.split(",")]
    return Scorer(model=clf.loaded, template=a.score_template, labels=labels, chat=a.chat,
                  max_batch_tokens=a.batch_tokens)
