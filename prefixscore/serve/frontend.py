"""A front end's request handling, shared by HTTP and gRPC: validate, tokenize, the result cache,
admission, the engine call, and the answer's fields. Errors are ApiError(status, detail), in HTTP
status codes (gRPC maps them); nothing here knows a wire format.

Admission: a front end admits at most --max-queue queries in flight (its own, exact count) and
answers 429 with Retry-After from the engine's measured rate beyond that; a query not started by
the engine within --max-queue-ms is dropped unrun and answered 503; a request whose client left is
aborted (dropped if still queued), and counted as 499, not 200.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import InputError
from . import protocol as P
from .client import EngineDead
from .config import FrontendConfig


DEFAULT_MODEL = "default/not-specified"  # what Infinity's client sends when no model is named


class ApiError(Exception):
    """param: the request field at fault, for error shapes that name it (vLLM's)."""

    def __init__(self, status: int, detail: str, retry_after: float | None = None,
                 param: str | None = None):
        super().__init__(detail)
        self.status, self.detail, self.param = status, detail, param
        self.headers = {} if retry_after is None else {"Retry-After": str(max(1, math.ceil(retry_after)))}


@dataclass
class Answer:
    results: list[tuple[str, str, list[float], bool]]  # per query: (query as seen, label, scores, cached)
    labels: list[str]
    classifier: str  # the served classifier that answered
    prompt_tokens: int  # every query's whole prompt, the cached prefix included
    cached_tokens: int  # of them, not computed: the cached prefix, and whole prompts the cache answered
    batch_size: int
    queue_s: float
    tokenize_s: float
    forward_s: float
    total_s: float


class ResultCache:
    """LRU of (label index, scores) keyed by the prompt's token ids: the normalized form of a query
    that provably gets the same answer, so results are identical with and without the cache."""

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


class Frontend:
    def __init__(self, cfg: FrontendConfig, client, metrics, prompt_factory):
        """prompt_factory(ready) -> the Prompt to tokenize with (the classifier's own in-process;
        one built from the engine's tokenizer files in a worker process)."""
        self.cfg, self.client, self.metrics = cfg, client, metrics
        self.prompt_factory = prompt_factory
        self.prompt = None
        self.info: P.ReadyOut | None = None
        self.created = 0  # when this front end first saw the engine ready (Unix seconds)
        self.cache = ResultCache(cfg.cache_size, cfg.cache_ttl) if cfg.cache_size > 0 else None
        self.inflight = 0  # queries admitted and not yet answered (this front end)
        self.inflight_tokens = 0  # their tokens after the cached prefix
        self.draining = False
        client.metrics = metrics
        # The prompt is built when the engine's Ready arrives (at start-up), not by the first
        # request this process takes: that built the tokenizer inside a request and, in a worker
        # that had not imported transformers yet, held its event loop for seconds (H200, 8
        # workers: healthz max 8.6 s, open-loop max 9.5 s while p99 was 4.8 ms).
        client.on_ready = self.sync

    # -- state
    def sync(self) -> None:
        """After the engine's Ready: the prompt, checked against the engine's own prefix."""
        info = self.client.info
        if info is not None and info is not self.info:
            prompt = self.prompt_factory(info)
            if list(prompt.prefix_ids) != list(info.prefix_ids):
                raise RuntimeError("this front end's tokenizer splits the prompt differently from "
                                   "the engine's")
            prompt.context_limit = info.context_limit
            self.prompt, self.info = prompt, info
            self.created = self.created or int(time.time())
            self.metrics.served(info.model, info.pid)

    def classifier_names(self) -> list[str]:
        """The classifiers this server serves, the default first: today one, named like the served
        model (--served-model-name, else the model's file or folder name)."""
        return [self.info.model]

    def resolve(self, model: str | None = None, classifier: str | None = None) -> str:
        """The classifier a request names (`model` and/or `classifier`, as vLLM's `model` names a
        served model or adapter; none: the default), or 404 naming the unknown one."""
        info = self.info
        if model is not None and model != info.model and model != DEFAULT_MODEL:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{info.model}`).", param="model")
        names = self.classifier_names()
        if classifier is None:
            return names[0]
        if classifier not in names:
            raise ApiError(404, f"The classifier `{classifier}` does not exist (this server serves "
                                f"{', '.join(f'`{n}`' for n in names)}).", param="classifier")
        return classifier

    def health(self) -> tuple[int, dict]:
        c = self.client
        if self.draining:
            return 503, {"status": "shutting down"}
        if c.error is not None and c.error != "starting":
            return 503, {"status": "unhealthy", "error": c.error}
        if c.error is not None:
            return 503, {"status": "starting"}
        self.sync()
        i = self.info
        return 200, {"status": "ok", "model": i.model, "labels": i.labels, "mode": i.mode,
                     "scorer": i.scorer, "queue_depth": self.inflight + c.queued,
                     "engine": {"pid": i.pid, "device": i.device}}

    async def wait_ready(self) -> None:
        """Until the engine is ready (within --max-queue-ms), else 503."""
        await self._check_ready()

    async def _check_ready(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another instance", 1)
        await self.client.wait_ready(self.cfg.max_queue_ms / 1e3)
        if self.client.error is not None:
            raise ApiError(503, "the engine is not ready: " + self.client.error, 1)
        self.sync()

    def _admit(self, n: int, tokens: int) -> None:
        """Admission by cost: n queries (or items) and their tokens after the cached prefix, each
        within this front end's share (--max-queue, --max-queue-tokens), else 429 + Retry-After."""
        cfg = self.cfg
        if self.inflight + n > cfg.max_queue or (self.inflight_tokens + tokens > cfg.max_queue_tokens
                                                 and self.inflight > 0):
            raise ApiError(429, f"queue full ({self.inflight} queries, {self.inflight_tokens} tokens "
                                f"waiting; limits {cfg.max_queue} and {cfg.max_queue_tokens}); retry "
                                f"later", self.client.wait_s(n))
        self.inflight += n
        self.inflight_tokens += tokens
        self.metrics.queue_depth.inc(n)

    def _release(self, n: int, tokens: int) -> None:
        self.inflight -= n
        self.inflight_tokens -= tokens
        self.metrics.queue_depth.dec(n)

    # -- classify
    async def classify(self, queries: list[str], model: str | None = None,
                       classifier: str | None = None, field: str = "query") -> Answer:
        """model / classifier: what the request names (Frontend.resolve); field: the request's
        name for its queries, as errors name them ("input" in vLLM's shape)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        if not queries:
            raise ApiError(422, f"{field} is an empty list", param=field)
        if len(queries) > cfg.max_queries:
            raise ApiError(413, f"{len(queries)} queries in one request, over the limit of "
                                f"{cfg.max_queries} (--max-queries)", param=field)
        for i, q in enumerate(queries):  # a tokenizer raises on a lone surrogate: say what it is
            if not isinstance(q, str):
                raise ApiError(422, f"{query_name(i, len(queries), field)} must be a string",
                               param=field)
            if not is_unicode(q):
                raise ApiError(422, f"{query_name(i, len(queries), field)} is not valid Unicode text "
                                    f"(a lone surrogate)", param=field)
        await self._check_ready()
        name = self.resolve(model, classifier)
        encoded = self._encode(queries, field)
        t1 = time.perf_counter()
        cache, hits = self.cache, [None] * len(encoded)
        if cache is not None:
            hits = [cache.get(tuple(e.ids)) for e in encoded]
            self.metrics.cache_lookups(len(hits) - hits.count(None), hits.count(None))
        todo = [e for e, h in zip(encoded, hits) if h is None]
        job = None
        if todo:
            cost = sum(len(e.ids) - e.start for e in todo)
            self._admit(len(todo), cost)
            try:
                fut = self.client.classify([e.ids for e in todo], [e.start for e in todo],
                                           time.monotonic() + cfg.max_queue_ms / 1e3)
                job = await self._wait(fut)
            except EngineDead as e:
                raise ApiError(503, str(e), 1) from None
            finally:
                self._release(len(todo), cost)
            self.metrics.classifier_tokens(name).inc(cost)
            self._check_status(job)
        labels = self.info.labels
        rows = iter(range(len(todo)))
        results = []
        for e, h in zip(encoded, hits):
            if h is None:
                r = next(rows)
                h = (job.best[r], job.scores[r].tolist())
                if cache is not None:
                    cache.put(tuple(e.ids), h)
                results.append((e.values["query"], labels[h[0]], h[1], False))
            else:
                results.append((e.values["query"], labels[h[0]], h[1], True))
        t2 = time.perf_counter()
        forward = job.forward_s if job else 0.0
        prompt_tokens = sum(len(e.ids) for e in encoded)
        computed = sum(len(e.ids) - e.start for e in todo)
        ans = Answer(results, labels, name, prompt_tokens, prompt_tokens - computed,
                     job.batch_size if job else 0, max(0.0, t2 - t1 - forward) if job else 0.0,
                     t1 - t0, forward, t2 - t0)
        st = self.metrics.stages(name)
        st["queue"].observe(ans.queue_s)
        st["tokenize"].observe(ans.tokenize_s)
        st["forward"].observe(ans.forward_s)
        st["total"].observe(ans.total_s)
        return ans

    def _encode(self, queries: list[str], field: str = "query"):
        """Tokenized (Prompt.encode_many: one tokenizer call), within --max-tokens (cut with
        --truncate), or a 422 naming the query."""
        prompt, info, cfg = self.prompt, self.info, self.cfg
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

    async def _wait(self, fut):
        """The engine's answer; if this request is cancelled (its client left), the engine is
        told to drop it unrun."""
        try:
            return await fut
        except asyncio.CancelledError:
            self.client.abort([fut])
            self.metrics.expired.labels("client_left").inc()
            raise

    def _check_status(self, job) -> None:
        bad = [s for s in job.status if s != P.OK]
        if not bad:
            return
        if P.FAULT in bad:
            raise ApiError(503, next(iter(job.errors.values()), "engine fault"), 1)
        if P.EXPIRED in bad:
            self.metrics.expired.labels("queue_time").inc(bad.count(P.EXPIRED))
            raise ApiError(503, f"not started within --max-queue-ms ({self.cfg.max_queue_ms:g} ms): "
                                f"the server is overloaded; retry later", self.client.wait_s(0))
        raise ApiError(503, "request aborted", 1)

    # -- multi-item scoring
    async def score(self, req: dict, field: str = "items", model: str | None = None) -> dict:
        """SGLang's /v1/score request (only the fields the client sent), limits checked here,
        tokenization and scoring by the engine's Scorer. field: the request's name for its items,
        as errors name them ("documents" in a rerank request); model: a name to check (404)."""
        cfg = self.cfg
        await self._check_ready()
        if model is not None:
            self.resolve(model)
        if not self.info.scorer:
            raise ApiError(501, "no multi-item scorer is configured on this server: start it with "
                                "--score-template TEMPLATE to enable /v1/score")
        items = req.get("items")
        items = [items] if isinstance(items, str) else items
        if req.get("query") is None or not items:
            raise ApiError(422, f"query and {field} are required", param=field)
        if len(items) > cfg.max_queries:
            raise ApiError(413, f"{len(items)} {field} in one request, over the limit of "
                                f"{cfg.max_queries} (--max-queries)", param=field)
        labels = req.get("label_token_ids") or req.get("labels") or []
        if len(labels) > cfg.max_label_ids:
            raise ApiError(413, f"{len(labels)} labels in one request, over the limit of "
                                f"{cfg.max_label_ids} (--max-label-ids)")
        texts = [req["query"], *items, *(req.get("labels") or [])]
        if not all(is_unicode(t) for t in texts if isinstance(t, str)):
            raise ApiError(422, f"query, {field} and labels must be valid Unicode text (a lone "
                                f"surrogate)")
        n = self._count_tokens(req["query"], items)
        if n > cfg.max_score_tokens:
            raise ApiError(413, f"query and {field} are {n} tokens, over the limit of "
                                f"{cfg.max_score_tokens} per request (--max-score-tokens)")
        self._admit(len(items), n)
        try:
            out = await self._wait(self.client.score(req, time.monotonic() + cfg.max_queue_ms / 1e3))
        except EngineDead as e:
            raise ApiError(503, str(e), 1) from None
        finally:
            self._release(len(items), n)
        if out.status == P.OK:
            self.metrics.score_tokens.inc(n)
            return out.result
        if out.status == P.BAD_INPUT:
            raise ApiError(422, out.error)
        if out.status == P.EXPIRED:
            raise ApiError(503, f"not started within --max-queue-ms ({cfg.max_queue_ms:g} ms): the "
                                f"server is overloaded; retry later", self.client.wait_s(0))
        raise ApiError(503, out.error or "engine fault", 1)

    def _count_tokens(self, query, items) -> int:
        """Tokens of query + items (ids as given, text through the tokenizer: exact to a few
        tokens at the joins, which is what a limit needs)."""
        texts = [t for t in [query, *items] if isinstance(t, str)]
        n = sum(len(t) for t in [query, *items] if isinstance(t, list))
        if texts:
            backend = getattr(self.prompt.tokenizer, "_tokenizer", None)
            if backend is not None and hasattr(backend, "encode_batch_fast"):
                n += sum(len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False))
            else:
                n += sum(len(ids) for ids in self.prompt.tokenizer(texts, add_special_tokens=False)["input_ids"])
        return n

    def begin_drain(self) -> None:
        """SIGTERM: new requests get 503 + Retry-After from now on; accepted ones still run."""
        self.draining = True

    def fail_pending(self) -> None:
        """At the end of the drain time: what is still waiting is answered 503 + Retry-After."""
        self.client._fail_all("the server is shutting down and this request did not finish within "
                              "--shutdown-timeout; retry on another instance", fault=False)


def label_probs(scores: list[float]) -> tuple[list[float], list[float]]:
    """Softmax and log-softmax of one row of label scores. Either mode's scores give the labels'
    probabilities: log-probabilities are already normalized (softmax returns their exp), and mode
    logits needs labels with distinct first tokens, whose first-token softmax is the label's."""
    m = max(scores)
    ex = [math.exp(x - m) for x in scores]
    total = sum(ex)
    log_total = math.log(total)
    return [e / total for e in ex], [x - m - log_total for x in scores]


def query_name(i: int, n: int, field: str = "query") -> str:
    """How an error names query i of a request of n queries: its JSON index, as in items[i]."""
    return f"{field}[{i}]" if n > 1 else field


def is_unicode(text: str) -> bool:
    """False for a lone surrogate: valid in JSON ("\\ud800") and in a Python str, not in UTF-8,
    and a tokenizer raises on it."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
