"""One request to several classifiers of the server (`--classifier`), as /v1/classify takes it:

    {"query": ["levis 501", "红色连衣裙"], "classifiers": ["category", "gender"]}
    -> {"results": [{"query": "levis 501",
                     "classifiers": {"category": {"query", "label", "scores", "probs", "cached"},
                                     "gender": {...}}},
                    ...],
        "classifiers": ["category", "gender"], "batch_size": 12, "timing": {...}}

Each classifier's entry is exactly the result a request naming that classifier alone gets (the
same fields and numbers); the top-level `query` is the query as sent (a classifier's own `query`
is as it saw it, cut by --truncate). The front end tokenizes the queries once per classifier and
sends every row in one engine message, so the engine takes them in one pass of its loop
(EngineLoop.decide). Queries x classifiers count against --max-queries and admission. `model` may
be left out or name the served model; `classifier` and `classifiers` are exclusive.
"""
from __future__ import annotations

import json
import time

from .answers import Answer, label_probs, merge_rows
from .api_error import ApiError
from .cache import CLASSIFY_IDS, lookup, store
from .client import EngineDead


class ClassifyMany:
    """Frontend's classify_many (a mixin: Frontend's helpers do the rest, as for one classifier)."""

    async def classify_many(self, queries: list[str], classifiers: list[str],
                            model: str | None = None, field: str = "query",
                            priority: int = 0) -> list[Answer]:
        """The same queries by several classifiers (their names): an Answer per classifier, in
        their order, sharing one engine request and its timing."""
        t0 = time.perf_counter()
        cache = self.cache
        self._check_queries(queries, max(1, len(classifiers)), field)
        await self._check_ready()
        ks = self.catalog.resolve_many(model, classifiers)
        encs = [self._encode(queries, k, field) for k in ks]
        t1 = time.perf_counter()
        todo, rows, looked = [], [], []
        for k, encoded in zip(ks, encs):
            hits, keys = [None] * len(encoded), None
            if cache is not None:  # keyed as Frontend.classify keys it
                keys = self._classify_keys(k, encoded)
                hits = lookup(cache, self.metrics, keys, "classify")
            missed = [e for e, h in zip(encoded, hits) if h is None]
            todo += missed
            rows += [k] * len(missed)
            looked.append((hits, keys, missed, sum(len(e.ids) - e.start for e in missed)))
        job = None
        if todo:
            job = await self._engine(todo, sum(x[3] for x in looked), rows if any(rows) else None,
                                     priority)
            for k, (_, _, _, cost) in zip(ks, looked):
                if cost:
                    self.metrics.classifier_tokens(self.classifiers[k].name).inc(cost)
        r, answers = 0, []
        for k, encoded, (hits, keys, missed, _) in zip(ks, encs, looked):
            info = self.classifiers[k]
            results, fresh = merge_rows(encoded, hits, job, info.labels, r)
            r += len(fresh)
            if cache is not None:
                store(cache, [keys[i] for i in fresh], list(fresh.values()), CLASSIFY_IDS)
            answers.append(self._classified(results, info, encoded, missed, job, t0, t1))
        if cache is not None:
            self.metrics.cache_held(cache)
        return answers

    async def _engine(self, todo: list, cost: int, classifiers: list[int] | None,
                      priority: int = 0):
        """The engine's answers (a ClassifyJob) to todo's rows, admitted by cost; classifiers: each
        row's classifier (None: the default's). Frontend.classify does the same inline."""
        deadline = self.deadline()
        ticket, job = self._admit(len(todo), cost, priority > 0, deadline), None
        try:
            fut = self.client.classify([e.ids for e in todo], [e.start for e in todo],
                                       self.cfg.start_by(deadline),
                                       classifiers, priority, deadline or 0.0, ticket.tenant)
            job = await self._wait(fut, deadline)
        except EngineDead as e:
            raise ApiError(503, str(e), 1) from None
        finally:
            self.admission.release(ticket, job is not None)
        self._check_status(job, deadline)
        return job


async def answer(fe, req) -> bytes:
    """The ClassifyManyResponse JSON of a /v1/classify request with `classifiers` (fe: the
    Frontend; req: the ClassifyRequest)."""
    if req.classifier is not None:
        raise ApiError(422, "give classifier (one) or classifiers (several), not both",
                       param="classifier")
    queries = [req.query] if isinstance(req.query, str) else req.query
    answers = await fe.classify_many(queries, req.classifiers, req.model, priority=req.priority)
    results = []
    for i, q in enumerate(queries):
        per = {}
        for a in answers:
            seen, label, scores, cached = a.results[i]
            per[a.classifier] = {"query": seen, "label": label, "scores": dict(zip(a.labels, scores)),
                                 "probs": dict(zip(a.labels, label_probs(scores)[0])),
                                 "cached": cached}
        results.append({"query": q, "classifiers": per})
    first = answers[0]  # one engine request: the same batch and timing for each classifier
    body = {"results": results, "classifiers": [a.classifier for a in answers],
            "batch_size": first.batch_size,
            "timing": {"queue_ms": 1e3 * first.queue_s, "tokenize_ms": 1e3 * first.tokenize_s,
                       "forward_ms": 1e3 * first.forward_s, "total_ms": 1e3 * first.total_s}}
    return json.dumps(body, ensure_ascii=False).encode()
