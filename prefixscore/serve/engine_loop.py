"""The engine loop: one per engine (GPU), ignorant of sockets.

It takes everything its front ends queued since the last pass (HTTP, gRPC, any number of worker
processes), drops what expired or was aborted, runs every classify request in one
`classify_encoded` call (flat batches, CUDA graphs), answers each front end with one message, then
runs queued multi-item scoring requests (token ids: the front end checked and tokenized them,
Scorer.score_call runs them; only a request's label set is tokenized here, once per set). The same loop runs on a thread of the server process
(`--workers 1`, client.InprocClient) or as the main loop of an engine process (engine_proc.py); a
`source` gives it messages and a reply function per message. It calls `Classifier.decide_encoded`
(label indices and score rows, no Result objects): the tests' seam for a slow or failing engine.

Several classifiers over one model (`--classifier`, Classifier.many): each request names one by
its index in ReadyOut.classifiers; a batch's requests are grouped by classifier and the groups go
through `EngineLoop.decide`, the one seam between the loop and the device for them: small batches
of several classifiers run as one flat forward pass over a bank of every classifier's prefix and
label rows (many.decide_many: one weight read instead of one per classifier), larger ones one
classifier's flat batches after another's (there the pass is compute-bound and fusing gains little).
"""
from __future__ import annotations

import logging
import os
import time
from queue import Empty, SimpleQueue

import numpy as np

from ..errors import PrefixScoreError
from ..many import GRAPH_TOKENS, decide_many, fusable, fused_tokens
from ..prompt import Encoded
from ..score_input import Prepared, ScoreCall
from . import protocol as P

log = logging.getLogger("prefixscore.engine")
STOP = object()


class EngineFault(Exception):
    """The engine failed on a batch (not the requests' fault): it stops, and is restarted if the
    server was started with --restart-engine."""


class QueueSource:
    """Messages from threads of this process (the in-process client): a SimpleQueue of
    (message, reply) pairs, STOP to end."""

    def __init__(self):
        self.queue: SimpleQueue = SimpleQueue()

    def put(self, msg, reply) -> None:
        self.queue.put((msg, reply))

    def take(self, spin: float) -> list:
        """The next message (polling `spin` seconds before sleeping), then everything queued."""
        deadline = time.perf_counter() + spin
        while True:
            try:
                items = [self.queue.get_nowait()]
                break
            except Empty:
                if time.perf_counter() >= deadline:
                    items = [self.queue.get()]
                    break
                time.sleep(0)  # yield the GIL to the event loop between polls
        while True:
            try:
                items.append(self.queue.get_nowait())
            except Empty:
                return items

    def pending(self) -> int:
        return self.queue.qsize()


class EngineLoop:
    def __init__(self, clf, scorer=None, source=None, window: float = 0.0, spin: float = 0.0,
                 metrics=None):
        """clf: a Classifier (served under the model's name), or {name: Classifier} over one
        loaded model (Classifier.many), the default first."""
        self.names, self.clfs = (list(clf), list(clf.values())) if isinstance(clf, dict) else (None, [clf])
        self.clf, self.scorer, self.window, self.spin = self.clfs[0], scorer, window, spin
        self.source = source or QueueSource()
        self.metrics = metrics
        self.N = max(len(c.labels) for c in self.clfs)  # score columns of an answer row
        self.aborted: set[tuple[int, int]] = set()
        # a bank of every classifier: one set of graphs whichever classifiers a batch asks for
        self.fuse = len(self.clfs) > 1 and fusable(self.clfs)

    def ready(self, tokenizer_path: str = "", model: str = "") -> P.ReadyOut:
        """model: the served name; with one classifier (no names given) also the classifier's."""
        clf = self.clf
        return P.ReadyOut(
            model=model, tokenizer_path=tokenizer_path,
            classifiers=[classifier_info(name, c) for name, c in zip(self.names or [model], self.clfs)],
            max_batch_tokens=clf.max_batch_tokens, scorer=scorer_info(self.scorer),
            device=str(clf.engine.device), pid=os.getpid())

    def warmup(self) -> None:
        """One real batch per classifier proves the path (each built its prefix and graphs)."""
        for c in self.clfs:
            c.decide_encoded([c.encode("warm up")])
        if self.fuse:  # builds the bank and captures its graphs now, not on the first request
            decide_many(self.clfs, [[c.encode("warm up")] for c in self.clfs])

    def decide(self, groups: dict[int, list[Encoded]]) -> dict[int, tuple[list[int], list[list[float]]]]:
        """THE SEAM for several classifiers (every batch of an engine that has more than one):
        {classifier index: its requests} -> {index: (label indices, score rows)}, each in its
        group's order. Several groups whose flat tokens fit the bank's graphs share one forward
        pass (many.decide_many); otherwise each classifier runs its own flat batches in turn."""
        clfs = self.clfs
        if self.fuse and len(groups) > 1 and fused_tokens(clfs, groups) <= GRAPH_TOKENS:
            out = decide_many(clfs, [groups.get(k, []) for k in range(len(clfs))])
            return {k: out[k] for k in groups}
        return {k: clfs[k].decide_encoded(enc) for k, enc in groups.items()}

    def run(self) -> None:
        """Serve until STOP. An EngineFault (or anything else) propagates to the owner, after the
        batch it broke has been answered FAULT."""
        while True:
            items = self.source.take(self.spin)
            if self.window and all(m is not STOP for m, _ in items):  # wait for company
                time.sleep(self.window)
                items += self.source.take(0.0) if self.source.pending() else []
            stop = any(m is STOP for m, _ in items)
            self.serve([(m, r) for m, r in items if m is not STOP])
            if stop:
                return

    def serve(self, items: list) -> None:
        for m, _ in items:
            if isinstance(m, P.AbortReq):
                self.aborted.update((m.client, r) for r in m.rids)
        classify = [(m, r) for m, r in items if isinstance(m, P.ClassifyReq)]
        if classify:
            self._classify(classify)
        for m, reply in items:
            if isinstance(m, P.ScoreReq):
                out = self._score(m)
                reply(out)
                if out.status == P.FAULT:
                    raise EngineFault(out.error)
        self.aborted.clear()  # an abort names only requests queued before it

    def _classify(self, msgs: list) -> None:
        now = time.monotonic()
        todo, where, which = [], [], []  # Encoded, (message index, row), classifier index
        status, errors = [], []
        n_clf = len(self.clfs)
        multi = n_clf > 1
        for k, (m, _) in enumerate(msgs):
            ids = P.unpack_ids(m.ids, m.offsets)
            st, err = [P.OK] * len(m.rids), {}
            cl = m.classifiers  # empty: every row the default's
            for i, rid in enumerate(m.rids):
                if (m.client, rid) in self.aborted:
                    st[i] = P.ABORTED
                elif m.deadlines[i] + self.window < now:  # the batch window is not queueing
                    st[i] = P.EXPIRED
                elif cl and not 0 <= cl[i] < n_clf:  # a front end of another engine's Ready
                    st[i], err[rid] = P.BAD_INPUT, f"no classifier {cl[i]} on this engine"
                else:
                    todo.append(Encoded({"query": ""}, "", ids[i], m.starts[i]))
                    where.append((k, i))
                    if multi:
                        which.append(cl[i] if cl else 0)
            status.append(st)
            errors.append(err)
        t0 = time.perf_counter()
        try:
            if not todo:
                best_all, scores_all = [], []
            elif not multi:  # one classifier: straight through, as before there were several
                best_all, scores_all = self.clf.decide_encoded(todo)
            else:
                best_all, scores_all = self._decide(todo, which)
        except Exception as e:
            for k, (m, reply) in enumerate(msgs):
                reply(P.ClassifyOut(m.rids, [P.FAULT] * len(m.rids), [0] * len(m.rids),
                                    bytes(4 * self.N * len(m.rids)),
                                    {r: f"engine fault: {type(e).__name__}: {e}" for r in m.rids},
                                    0.0, len(todo), 0))
            raise EngineFault(f"{type(e).__name__}: {e}") from e
        forward = time.perf_counter() - t0
        if self.metrics is not None and todo:
            self.metrics.engine_batch(len(todo), forward)
        best = [np.zeros(len(m.rids), dtype=np.int64) for m, _ in msgs]
        scores = [np.zeros((len(m.rids), self.N), dtype=np.float32) for m, _ in msgs]
        for (k, i), d, sc in zip(where, best_all, scores_all):
            best[k][i] = d
            scores[k][i] = sc
        queued = self.source.pending()
        for k, (m, reply) in enumerate(msgs):
            reply(P.ClassifyOut(m.rids, status[k], best[k].tolist(), scores[k].tobytes(), errors[k],
                                forward, len(todo), queued))

    def _decide(self, todo: list[Encoded], which: list[int]):
        """Label indices and score rows of todo, in its order, on an engine of several
        classifiers; which[j]: todo[j]'s classifier. Grouped for decide(), rows padded to N."""
        groups: dict[int, list[int]] = {}
        for j, c in enumerate(which):
            groups.setdefault(c, []).append(j)
        out = self.decide({c: [todo[j] for j in js] for c, js in groups.items()})
        best, scores = [0] * len(todo), [None] * len(todo)
        for c, js in groups.items():
            b, s = out[c]
            rows = np.zeros((len(js), self.N), dtype=np.float32)
            rows[:, :len(self.clfs[c].labels)] = s
            for j, bj, row in zip(js, b, rows):
                best[j], scores[j] = bj, row
        return best, scores

    def _score(self, m: P.ScoreReq) -> P.ScoreOut:
        if (m.client, m.rid) in self.aborted:
            return _score_failed(m, P.ABORTED, None)
        if m.deadline + self.window < time.monotonic():
            return _score_failed(m, P.EXPIRED, None)
        if self.scorer is None:
            return _score_failed(m, P.BAD_INPUT, "no multi-item scorer on this server")
        try:
            full, shared = P.unpack_score(m, self.scorer.config.vocab_size)
            # query and items as given stay with the front end (its errors and limits read them):
            # the answer reads only the scores
            call = ScoreCall(None, Prepared(full, full, shared), m.labels, m.label_token_ids,
                             m.apply_softmax)
            out = self.scorer.score_call(call)
        except PrefixScoreError as e:  # a label set the scorer refuses, or a ProtocolError
            return _score_failed(m, P.BAD_INPUT, str(e))
        except Exception as e:
            log.error("engine fault in multi-item scoring", exc_info=e)
            return _score_failed(m, P.FAULT, f"engine fault: {type(e).__name__}: {e}")
        return P.ScoreOut(m.rid, P.OK, out["scores"], out["labels"], out["usage"]["prompt_tokens"],
                          None)


def _score_failed(m: P.ScoreReq, status: int, error: str | None) -> P.ScoreOut:
    return P.ScoreOut(m.rid, status, [], [], 0, error)


def classifier_info(name: str, clf) -> P.ClassifierInfo:
    """What a front end needs of one classifier (its Prompt rebuilt over the shared tokenizer)."""
    prompt = clf.prompt
    return P.ClassifierInfo(
        name=name, template=prompt.template, chat=prompt.chat,
        special_tokens=getattr(prompt, "special_tokens", False), labels=list(clf.labels),
        mode=clf.mode, truncate=clf.truncate, prefix_ids=list(prompt.prefix_ids),
        context_limit=prompt.context_limit or 0, memory=dict(getattr(clf, "memory", None) or {}))


def scorer_info(sc) -> P.ScorerInfo | None:
    """What a front end needs of the Scorer to check and tokenize score requests itself
    (score_input.ScoreInput over its Prompt rebuilt from the template)."""
    if sc is None:
        return None
    prompt, inp = sc.prompt, sc.input
    return P.ScorerInfo(
        template=None if prompt is None else prompt.template,
        chat=bool(prompt and prompt.chat), special_tokens=bool(prompt and prompt.special_tokens),
        labels=list(sc.labels), item_first=sc.item_first, prefix_ids=list(sc.prefix_ids),
        vocab_size=inp.vocab_size, context_limit=inp.context_limit, max_items=inp.max_items)
