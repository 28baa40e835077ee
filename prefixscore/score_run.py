"""Requests longer than a pass, run a pass at a time: the engine loop's unit of multi-item work
(ScoreRun), and of a classify prompt longer than a pass (PromptRun).

The engine loop (serve/engine_loop.py) gives each step a token budget (about --pass-ms of work) and
looks at its queues, deadlines and aborts between steps, so no request holds the engine for longer
than a pass. A step is one of:

  * a chunk of the query part: when the tokens a request's items share (the template's text and
    the query, past the pinned prefix) would fill more than half a pass, they are prefilled first,
    a chunk a pass, into a K/V of the request's own (engine.QueryKV) that starts with the pinned
    prefix's rows; an 8k-token query is then ~30 bounded passes, not one that holds the engine
    for as long as it takes (a CPU: minutes);
  * a run of items: the next items that fit the budget, as spans (spans.py). After chunks they
    attend to the request's K/V and carry no query tokens (spans.cached_spans); otherwise each run
    carries the query part, as Scorer.score_call's passes do (spans.request_spans), and keeps the
    pinned prefix's CUDA graphs.

A chunk's cost grows with the rows it attends to: the caller's kv_weight (cost of one K/V row per
token, in tokens) shrinks chunks as the K/V fills. Items past `depth` are not run (depth control).
"""
from __future__ import annotations

import math

from .score_input import ScoreCall
from .spans import by_start, cached_spans, query_part, request_spans

CHUNK_MIN = 64  # tokens: a shorter chunk would be mostly a pass's fixed cost


class ScoreRun:
    def __init__(self, scorer, call: ScoreCall, depth: int | None = None, tokens: int | None = None):
        """scorer: a Scorer; call: a parsed request (ScoreInput.parse); depth: score only the
        first items (None: all); tokens: the pass budget it starts under (None: the scorer's
        max_batch_tokens), which decides whether its query part runs in chunks. The label set is
        checked here (InputError)."""
        self.sc = scorer
        self.head, self.mode = scorer.call_head(call)
        n = len(call.prep.full)
        self.depth = n if depth is None else min(depth, n)
        self.prep = call.prep.subset(list(range(self.depth))) if self.depth < n else call.prep
        self.branches = (self.head.trie.branch_paths() if self.mode in ("logprobs", "softmax") else [])
        self.branch = sum(len(p) for p in self.branches)
        self.scores: list = []  # per item run so far, its label scores
        self.done = 0  # items scored
        self.computed = 0  # tokens computed
        self.passes = 0  # passes run
        self.kv = None  # the request's own K/V (engine.QueryKV) once its query part is chunked
        self._plan = None  # (start, ref, L, {item: q}) of the items over self.kv
        self._decide(scorer.max_batch_tokens if tokens is None else tokens)

    @property
    def finished(self) -> bool:
        return self.done >= self.depth

    @property
    def filling(self) -> bool:
        """Whether the next step is a chunk of the query part."""
        return self.kv is not None and self.kv.filled < self._plan[0] + self._plan[2]

    def step(self, tokens: int, kv_weight: float = 0.0) -> float:
        """One pass of about `tokens` tokens' cost; returns its cost in tokens (a chunk's tokens
        weighed by the rows they attend to: c * (1 + kv_weight * rows))."""
        self.passes += 1
        if self.filling:
            return self._chunk(tokens, kv_weight)
        return self._items(tokens)

    def remaining(self, tokens: int, kv_weight: float = 0.0) -> int:
        """Passes still to run at about `tokens` a pass (an estimate: a progress figure)."""
        if self.finished:
            return 0
        chunks = 0
        if self.filling:
            start, _, L, _ = self._plan
            left, rows = start + L - self.kv.filled, self.kv.filled + (start + L - self.kv.filled) / 2
            chunks = math.ceil(left / max(CHUNK_MIN, tokens / (1 + kv_weight * rows)))
        own = sum(self._cost(i) for i in range(self.done, self.depth))
        return chunks + max(1, math.ceil(own / max(1, tokens)))

    def answer(self) -> dict:
        """score_call's response for the items run (the first `depth`)."""
        n = self.computed
        return {"scores": self.scores, "labels": self.head.labels, "model": self.sc.loaded.name,
                "object": "scoring",
                "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}

    # -- the plan
    def _decide(self, tokens: int) -> None:
        """Chunk the query part of the request's largest group of items (those
        that start past the pinned prefix, as a rule all) if it would fill over half a pass (and
        is longer than a chunk: a short one costs little in every run of items)."""
        sc, prep = self.sc, self.prep
        start, idx = max(by_start(prep, sc.prefix_ids).items(), key=lambda g: len(g[1]))
        ref, q, L = query_part(prep, start, idx)
        if L <= max(CHUNK_MIN, tokens // 2):
            return
        # computed once for the request, not once a span: as far as any item agrees with it (an
        # item that agrees less attends to fewer of its rows)
        L = max(q)
        base = sc.prefix_kv if start else sc.engine.no_prefix
        self.kv = sc.engine.query_kv(base, start + L, banked=True)
        self._plan = (start, ref, L, dict(zip(idx, q)))

    def _cost(self, i: int) -> int:
        """Item i's own tokens in a run (past the query part it shares; its label branches)."""
        prep = self.prep
        if self._plan is not None and i in self._plan[3]:
            start, _, L, q = self._plan
            return len(prep.full[i]) - start - min(q[i], L) + self.branch
        return len(prep.full[i]) - len(prep.shared) + self.branch

    # -- the passes
    def _chunk(self, tokens: int, kv_weight: float) -> float:
        start, ref, L, _ = self._plan
        rows = self.kv.filled
        c = min(start + L - rows, max(CHUNK_MIN, int(tokens / (1 + kv_weight * rows))))
        self.sc.engine.extend(self.kv, ref[rows - start:rows - start + c])()  # (its cost is timed)
        self.computed += c
        return c * (1 + kv_weight * rows)

    def _items(self, tokens: int) -> float:
        """The next items that fit `tokens` (at least one), in as few passes as their K/V allow
        (one, but for items whose tokens disagree with the query part or the pinned prefix)."""
        sc, prep = self.sc, self.prep
        total = 0 if self.kv is not None else len(prep.shared)
        k = 0
        for i in range(self.done, self.depth):
            total += self._cost(i)
            if k and total > tokens:
                break
            k += 1
        run = list(range(self.done, self.done + k))
        spans = []
        one_per_span = len(self.branches) > 1
        if self.kv is not None:
            start, _, L, q = self._plan
            mine = [i for i in run if i in q]
            spans += cached_spans(sc.spans, prep, mine, start, [q[i] for i in mine], L, self.kv,
                                  self.branch, one_per_span)
            run = [i for i in run if i not in q]
        if run:  # with the query part in the pass (slots are the subset's: back to the request's)
            for g in request_spans(sc.spans, prep.subset(run), sc.prefix_ids, sc.prefix_kv,
                                   sc.engine.bare, self.branch, one_per_span):
                g.slots = [run[s] for s in g.slots]
                spans.append(g)
        out = {}
        for batch in sc.spans.passes(spans, self.branch):
            scores, _ = sc._launch_pass(batch, self.mode, self.head, self.branches)()
            out.update(zip((i for g in batch for i in g.slots), scores))
        self.scores += [out[i] for i in range(self.done, self.done + k)]
        computed = sum(len(g.shared) + sum(map(len, g.tails)) for g in spans)
        self.computed += computed
        self.done += k
        if self.finished and self.kv is not None:
            self.kv.close()  # (a region of the engine's K/V bank goes back now)
        return computed


class PromptRun:
    """One classify prompt longer than a pass: its tokens prefilled a chunk a pass into a K/V of
    its own (the classifier's pinned prefix first, as a ScoreRun's query part), then its last
    ones with the label head and the trie's branches (Classifier.decide_after): the answer of
    decide_encoded([it]) within rounding, never holding the engine for more than a pass."""

    def __init__(self, clf, ids: list[int], start: int):
        """ids: the whole prompt; start: the tokens of it the classifier has cached (its pinned
        prefix, or 0)."""
        self.clf, self.ids = clf, ids
        self.kv = clf.engine.query_kv(clf.prefix_kv if start else clf.engine.no_prefix, len(ids),
                                      banked=True)
        self.passes = 0
        self.answer = None  # (label index, score row) after the last pass

    @property
    def finished(self) -> bool:
        return self.answer is not None

    @property
    def filling(self) -> bool:
        return not self.finished

    def step(self, tokens: int, kv_weight: float = 0.0) -> float:
        """One pass of about `tokens` tokens' cost (as ScoreRun.step): a chunk, or the last part."""
        self.passes += 1
        rows = self.kv.filled
        left = len(self.ids) - rows
        c = max(CHUNK_MIN, int(tokens / (1 + kv_weight * rows)))
        if left <= c:
            (best,), (scores,) = self.clf.decide_after(self.kv.view(rows), self.ids[rows:])
            self.answer = best, scores
            self.kv.close()
            return left * (1 + kv_weight * rows)
        self.clf.engine.extend(self.kv, self.ids[rows:rows + c])()
        return c * (1 + kv_weight * rows)
