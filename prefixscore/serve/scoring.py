"""Frontend's multi-item route (/v1/score, /rerank and their gRPC twin): a mixin, as fanout.py's
ClassifyMany is, over Frontend's admission, deadlines and engine client."""
from __future__ import annotations

import time

from ..errors import PrefixScoreError
from . import protocol as P
from .answers import is_unicode
from .api_error import ApiError, check_priority
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
        depth control's depth is answered with instead of null); the response adds `depth` (items
        scored, the first ones) and `scored` (per item)."""
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
        if prior is not None and (not isinstance(prior, list) or len(prior) != len(items)):
            raise ApiError(422, f"prior must be a list of one score (or one list of scores per "
                                f"label) per item: {len(items)}", param="prior")
        self._admit(len(items), n, priority > 0)
        try:
            start_by = time.monotonic() + cfg.max_queue_ms / 1e3
            out = await self._wait(self.client.score(
                call.prep.full, call.prep.shared,
                start_by if deadline is None else min(start_by, deadline), call.labels,
                call.label_token_ids, call.apply_softmax, deadline or 0.0, priority), deadline)
        except EngineDead as e:
            raise ApiError(503, str(e), 1) from None
        finally:
            self._release(len(items), n, priority > 0)
        if out.status == P.OK:
            self.metrics.score_tokens.inc(out.prompt_tokens)
            if out.controlled:
                self.metrics.score_depth.set(out.depth)
                self.metrics.score_p99.set(out.p99_ms)
            t, L = out.prompt_tokens, len(out.labels)
            scores = out.scores
            if out.depth < len(scores):  # past the depth: the caller's prior, else null
                scores = scores[:out.depth] + [
                    None if prior is None else
                    (list(prior[i]) if isinstance(prior[i], list) else [prior[i]] * L)
                    for i in range(out.depth, len(scores))]
            return {"scores": scores, "labels": out.labels, "model": self.info.model,
                    "object": "scoring", "depth": out.depth,
                    "scored": [i < out.depth for i in range(len(scores))],
                    "usage": {"prompt_tokens": t, "total_tokens": t, "completion_tokens": 0}}
        if out.status == P.BAD_INPUT:  # the request's label set (the engine tokenizes it)
            raise ApiError(422, out.error)
        if out.status == P.EXPIRED:
            self._expired(1, deadline)
        raise ApiError(503, out.error or "engine fault", 1)

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
