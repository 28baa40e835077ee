"""Frontend's multi-item route (/v1/score, /rerank and their gRPC twin): a mixin, as fanout.py's
ClassifyMany is, over Frontend's admission, deadlines, pair cache and engine client.

With the pair cache on (--cache-size), each item is looked up by its key (cache.py: the scorer,
the label set as named, apply_softmax, the item's whole prompt's ids); only the misses go to the
engine, in request order, and the answer merges both. Depth control then applies to the misses
alone: a cached item is free. So the scored items need not be the first ones: `scored` says which
are, and `depth` keeps its meaning, the first `depth` items are scored (the leading run)."""
from __future__ import annotations


from ..errors import PrefixScoreError
from . import protocol as P
from .answers import is_unicode
from .api_error import ApiError, check_priority
from .cache import SCORE_IDS, TEXT_AT, lookup, score_keys, store, text_keys
from .client import EngineDead


class ScoreRoute:
    # -- multi-item scoring
    async def score(self, req: dict, field: str = "items", model: str | None = None) -> dict:
        """SGLang's /v1/score request (only the fields the client sent) -> its response: this
        server's limits, then the scorer's own checks and tokenization (ScoreInput, the library's
        code, over the engine's template: errors word for word the Scorer's), and the engine scores
        the token ids. field: the request's name for its items, as errors name them ("documents"
        in a rerank request); model: a name to check (404). Ours beside SGLang's fields:
        `priority` (0 real-time, higher batch work) and `prior` (per item, what an item past the
        depth control's depth is answered with instead of null); the response adds `scored` (per
        item), `depth` (how many leading items are scored) and `cached` (items answered from the
        pair cache, --cache-size: no engine time; usage counts only the tokens computed). The
        limits (--max-queries, --max-score-tokens) are the whole request's, cached or not."""
        cfg = self.cfg
        deadline = self.deadline()
        req = dict(req)
        priority, prior = req.pop("priority", 0) or 0, req.pop("prior", None)
        check_priority(priority)
        await self._check_ready()
        if model is not None:
            self.resolve(model)
        if self.scoring is None:
            raise ApiError(501, "no multi-item scorer is configured on this server: start it with "
                                "--score-template TEMPLATE to enable /v1/score")
        items = req.get("items")
        items = [items] if isinstance(items, str) else items
        self._check_limits(req, items, field, prior)
        # Text items are keyed by their text, so the cache answers before any tokenizer call (a
        # whole repeat is never tokenized); token ids and embedding items by their ids.
        cache, hits, keys = self.cache, None, None
        if cache is not None:
            keys = text_keys(self.scorer_id, req, items)
            hits = None if keys is None else lookup(cache, self.metrics, keys, "score")
            if hits is not None and None not in hits:
                return self._score_answer([list(h[1]) for h in hits], hits[0][0], hits, prior, 0)
        # The one tokenization of the request; the context limit is checked after this server's
        # own limit, which a request far too long for either breaks first.
        scoring = self.scoring
        call = self._score_input(scoring.parse, req, fits=False)
        n = scoring.new_tokens(call.prep, self.info.scorer.prefix_ids)
        if n > cfg.max_score_tokens:
            raise ApiError(413, f"query and {field} are {n} tokens to compute (after the cached "
                                f"prefix), over the limit of {cfg.max_score_tokens} per request "
                                f"(--max-score-tokens)")
        self._score_input(scoring.checked, call.prep)
        if cache is not None and keys is None:
            keys = score_keys(self.scorer_id, call)
            hits = lookup(cache, self.metrics, keys, "score")
        rows, labels, computed = await self._engine_rows(call, hits, keys, n, priority, deadline)
        if hits is not None:
            for i, h in enumerate(hits):
                if h is not None:
                    labels, rows[i] = h[0], list(h[1])
            self.metrics.cache_held(cache)
        return self._score_answer(rows, labels, hits, prior, computed)

    def _check_limits(self, req: dict, items, field: str, prior) -> None:
        """This server's limits and a request's shape, before any tokenizer call (ApiError)."""
        cfg = self.cfg
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
        if prior is not None and (not isinstance(prior, list) or len(prior) != len(items)):
            raise ApiError(422, f"prior must be a list of one score (or one list of scores per "
                                f"label) per item: {len(items)}", param="prior")

    def _score_answer(self, rows, labels, hits, prior, computed: int) -> dict:
        """The response: per item its scores (from the engine or the cache), past the depth the
        caller's prior, else null. Scored: from the engine now or from the cache; depth: the
        leading run of scored items (the first `depth` are scored, as without a cache); cached
        items past it are scored too."""
        scored = [r is not None for r in rows]
        depth = scored.index(False) if False in scored else len(rows)
        L = len(labels)
        scores = [r if r is not None else None if prior is None else
                  (list(prior[i]) if isinstance(prior[i], list) else [prior[i]] * L)
                  for i, r in enumerate(rows)]
        return {"scores": scores, "labels": list(labels), "model": self.info.model,
                "object": "scoring", "depth": depth, "scored": scored,
                "cached": 0 if hits is None else len(hits) - hits.count(None),
                "usage": {"prompt_tokens": computed, "total_tokens": computed,
                          "completion_tokens": 0}}

    async def _engine_rows(self, call, hits, keys, n: int, priority: int, deadline):
        """The engine's scores of the items the cache missed (hits None: every item), stored in
        the cache: -> (per item its row or None, the label names, prompt tokens computed). Only
        those items go to the engine, in order (none: no engine call), admitted at their cost;
        depth control applies to them alone (cached items are free)."""
        full = call.prep.full
        todo = list(range(len(full))) if hits is None else [i for i, h in enumerate(hits) if h is None]
        rows = [None] * len(full)
        if not todo:
            return rows, None, 0
        prep = call.prep if len(todo) == len(full) else call.prep.subset(todo)
        if prep is not call.prep:
            n = self.scoring.new_tokens(prep, self.info.scorer.prefix_ids)
        cfg = self.cfg
        ticket, out = self._admit(len(todo), n, priority > 0, deadline, score=True), None
        try:
            out = await self._wait(self.client.score(
                prep.full, prep.shared, cfg.start_by(deadline), call.labels,
                call.label_token_ids, call.apply_softmax, deadline or 0.0, priority,
                prep.soft, ticket.tenant), deadline)
        except EngineDead as e:
            raise ApiError(503, str(e), 1) from None
        finally:
            self.admission.release(ticket)
        if out.status == P.BAD_INPUT:  # the request's label set (the engine tokenizes it)
            raise ApiError(422, out.error)
        if out.status == P.EXPIRED:
            self._expired(1, deadline, out.error)
        if out.status != P.OK:
            raise ApiError(503, out.error or "engine fault", 1)
        self.metrics.score_tokens.inc(out.prompt_tokens)
        if out.controlled:
            self.metrics.score_depth.set(out.depth)
            self.metrics.score_p99.set(out.p99_ms)
        labels, done = tuple(out.labels), todo[:out.depth]  # scored: the first `depth` sent
        for j, i in enumerate(done):
            rows[i] = out.scores[j]
        if self.cache is not None:
            store(self.cache, [keys[i] for i in done],
                  [(labels, tuple(out.scores[j])) for j in range(len(done))],
                  SCORE_IDS if keys[0][0] == "score" else TEXT_AT)
        return rows, labels, out.prompt_tokens

    @staticmethod
    def _score_input(step, *args, **kw):
        """A ScoreInput step; its errors (the Scorer's text) answered 422."""
        try:
            return step(*args, **kw)
        except PrefixScoreError as e:
            raise ApiError(422, str(e)) from None
        except Exception as e:  # the tokenizer itself raised: this request's input
            raise ApiError(422, f"the tokenizer could not encode this request: "
                                f"{type(e).__name__}: {e}") from None
