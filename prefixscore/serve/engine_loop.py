"""The engine loop: one per engine (GPU), ignorant of sockets.

Each turn it takes what its front ends sent (HTTP, gRPC, any number of worker processes) into the
lanes of scheduler.py, answers what expired or was aborted, and runs one pass: classify rows
through one `classify_encoded` call (flat batches, CUDA graphs), or a run of one multi-item
request's items (token ids: the front end checked and tokenized them, Scorer.score_call runs them;
only a request's label set is tokenized here, once per set). Passes are kept to about
ScheduleOptions.pass_s of work, real-time work before batch work, so a long request cannot hold
the engine and deadlines are looked at between passes. With a latency target, depth control
(depth.py) decides how many items of a real-time score request are scored.

The same loop runs on a thread of the server process (`--workers 1`, client.InprocClient) or as
the main loop of an engine process (engine_proc.py); a `source` gives it messages and a reply
function per message. It calls `Classifier.decide_encoded` (label indices and score rows, no
Result objects): the tests' seam for a slow or failing engine.

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
from ..score_run import CHUNK_MIN, PromptRun
from . import protocol as P
from .config import ScheduleOptions
from .scheduler import Lanes, PassBudget, Row, RowJob, ScoreJob, lane

log = logging.getLogger("prefixscore.engine")
STOP = object()


class Stopped(BaseException):
    """The stop at shutdown: raised in an engine process's main thread by its stop signal, in the
    engine thread by engine_proc.end_engine_thread, wherever the engine is (a BaseException: the
    loop's `except Exception` fault handling does not take it for a fault)."""


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
                 metrics=None, schedule: ScheduleOptions | None = None):
        """clf: a Classifier (served under the model's name), or {name: Classifier} over one
        loaded model (Classifier.many), the default first."""
        self.names, self.clfs = (list(clf), list(clf.values())) if isinstance(clf, dict) else (None, [clf])
        self.clf, self.scorer, self.window, self.spin = self.clfs[0], scorer, window, spin
        self.source = source or QueueSource()
        self.metrics = metrics
        self.N = max(len(c.labels) for c in self.clfs)  # score columns of an answer row
        self.prefixes = [list(c.prompt.prefix_ids) for c in self.clfs]  # a ClassifyReq's starts
        # a bank of every classifier: one set of graphs whichever classifiers a batch asks for
        self.fuse = len(self.clfs) > 1 and fusable(self.clfs)
        self.schedule = schedule = schedule or ScheduleOptions()
        self.lanes = Lanes()
        # On a GPU a classify pass is launched while the one before it runs, and collected (its
        # answers sent) after: the host's planning, copies and answers overlap the GPU's work
        # (engine.GraphRunner's two input slots). One classifier's passes only (several go
        # through decide()); on a CPU a launch computes, so passes run one at a time.
        self.staged = len(self.clfs) == 1 and bool(getattr(self.clf.engine, "queues", False))
        self.inflight = None  # the classify pass launched and not collected: (rows, finish, t0, lane)
        self.classify_budget = PassBudget(schedule.pass_s, times=schedule.pass_times)
        # Calibrated on multi-item passes (_warm_scorer), one budget per mode: apply_softmax and
        # SGLang's default (the label tokens' share of the whole vocabulary) run different heads,
        # both eagerly today (mostly host work: BENCHMARKS.md, the engine loop). Never fewer tokens
        # than the floor, or a long request would crawl through passes of one item.
        self.score_budgets = {softmax: PassBudget(schedule.pass_s, floor=256, times=2.0)
                              for softmax in (False, True)}
        # A query-part chunk's extra cost per K/V row it attends to, in tokens per chunk token:
        # learnt from the chunks run (_learn_kv_weight), so long queries' chunks shrink as their
        # K/V fills and keep to the pass budget.
        self.kv_weight = 0.0
        # Classify rows answered per second of wall time while rows kept waiting (every pass, the
        # host's work, score passes between): what admission's wait estimates divide by
        # (ClassifyOut.drain_rps). A pass's own seconds leave out all but the pass, and on a CPU
        # whose front end shares the cores, estimates from them let in requests that missed.
        self.drain, self.drain_from = 0.0, None
        self.depth = None
        if schedule.target_p99_ms:
            from ..depth import DepthControl, DepthOptions

            kp, ki, kd = schedule.depth_gains
            self.depth = DepthControl(DepthOptions(schedule.target_p99_ms, schedule.depth_min,
                                                   schedule.depth_max, kp, ki, kd))

    def ready(self, tokenizer_path: str = "", model: str = "") -> P.ReadyOut:
        """model: the served name; with one classifier (no names given) also the classifier's."""
        clf = self.clf
        return P.ReadyOut(
            model=model, tokenizer_path=tokenizer_path,
            classifiers=[P.classifier_info(name, c) for name, c in zip(self.names or [model], self.clfs)],
            max_batch_tokens=clf.max_batch_tokens, scorer=P.scorer_info(self.scorer, clf),
            device=str(clf.engine.device), pid=os.getpid(),
            dtype=str(clf.engine.dtype).removeprefix("torch."))

    def warmup(self) -> None:
        """One real batch per classifier proves the path (each built its prefix and graphs); then
        a pass of one row and one of many are timed: the pass budgets' fixed part and cost per
        token (scheduler.PassBudget)."""
        for c in self.clfs:
            c.decide_encoded([c.encode("warm up")])
        if self.fuse:  # builds the bank and captures its graphs now, not on the first request
            decide_many(self.clfs, [[c.encode("warm up")] for c in self.clfs])
        gpu = str(self.clf.engine.device).startswith("cuda")
        one = [self.clf.encode("warm up")]
        # enough tokens that the GPU's time grows with them (a few thousand); few on a CPU (a
        # median of three: one timing of 4 rows on a busy CI host gave budgets of two rows)
        many = one * (512 if gpu else 8)
        t_one, t_many = _timed(self.clf.decide_encoded, one, 3), _timed(self.clf.decide_encoded, many, 3)
        n_one = len(one[0].ids) - one[0].start
        per_token = max(0.0, t_many - t_one) / (n_one * (len(many) - 1))
        self.classify_budget.calibrate(t_one, per_token)
        log.info("engine pass: %.2f ms fixed + %.2f us a token; pass goal %.2f ms (%d tokens)",
                 1e3 * t_one, 1e6 * per_token, 1e3 * self.classify_budget.goal,
                 self.classify_budget.tokens)
        if self.scorer is not None:
            self._warm_scorer(gpu)

    def _warm_scorer(self, gpu: bool) -> None:
        """A few multi-item passes of the sizes requests bring (short and long items, one and
        many): the first request paid for the eager kernels' tuning, ten times its later time,
        classify held meanwhile. Then the smallest and the largest are timed for the multi-item
        pass budget: its costs are its own (span planning, eager launches: a fixed cost many times
        classify's; BENCHMARKS.md, the engine loop)."""
        sc = self.scorer
        labels = {} if sc.labels else {"label_token_ids": [11, 12]}
        sizes = ((1, 8), (16, 8), (4, 64), (32, 64)) if gpu else ((1, 8), (4, 8))

        def one(n_length, softmax):  # a pass of n items of `length` tokens: its computed tokens
            n, length = n_length
            items = [[11 + (i + j) % 50 for j in range(length)] for i in range(n)]
            body = {"query": [11, 12, 13, 14], "items": items, "apply_softmax": softmax, **labels}
            return sc.score_request(body)["usage"]["prompt_tokens"]

        for softmax, budget in self.score_budgets.items():
            for size in sizes:
                one(size, softmax)
            (t_small, n_small), (t_large, n_large) = (
                (_timed(lambda s: one(s, softmax), s, 3), one(s, softmax)) for s in (sizes[0], sizes[-1]))
            # not under classify's (a noisy timing on a busy host would give passes without bound)
            per_token = max(self.classify_budget.per_token, (t_large - t_small) / max(1, n_large - n_small))
            budget.calibrate(t_small, per_token)
            log.info("multi-item pass (apply_softmax %s): %.2f ms fixed + %.2f us a token; pass goal "
                     "%.2f ms (%d tokens)", softmax, 1e3 * t_small, 1e6 * per_token, 1e3 * budget.goal,
                     budget.tokens)

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
        pass it broke has been answered FAULT."""
        while True:
            if len(self.lanes) or self.inflight:  # work waits: only look for new messages, never block
                items = self.source.take(0.0) if self.source.pending() else []
            else:
                items = self.source.take(self.spin)
                if self.window and all(m is not STOP for m, _ in items):  # wait for company
                    time.sleep(self.window)
                    items += self.source.take(0.0) if self.source.pending() else []
            if any(m is STOP for m, _ in items):
                self.serve([(m, r) for m, r in items if m is not STOP], passes=0)
                self._drop_all()
                return
            self.serve(items)

    def serve(self, items: list, passes: int = 1) -> None:
        """Take items into the lanes, answer what expired or was aborted, then run up to `passes`
        passes (the loop runs one per turn, so it looks for new messages between passes)."""
        aborted = set()
        for m, reply in items:
            if isinstance(m, P.AbortReq):
                aborted.update((m.client, r) for r in m.rids)
            elif isinstance(m, P.ClassifyReq):
                self._add_classify(m, reply)
            elif isinstance(m, P.ScoreReq):
                self._add_score(m, reply)
        if aborted:
            rows, jobs = self.lanes.remove(aborted)
            self._answer_rows(rows, P.ABORTED)
            for j in jobs:
                self._fail_job(j, P.ABORTED)
        now = time.monotonic()
        rows, jobs = self.lanes.expired(now - self.window)  # the batch window is not queueing
        self._answer_rows(rows, P.EXPIRED)
        for j in jobs:
            self._fail_job(j, P.EXPIRED)
        for _ in range(passes):
            b = self.classify_budget
            nxt = self.lanes.next_pass(b.tokens, b.spare, b.small)
            if nxt is None:
                break
            kind, what, _ = nxt
            t0 = time.perf_counter()
            if kind == "classify" and len(what) == 1 and self._too_long(what[0]):
                kind, what = "score", self.lanes.as_job(what[0])  # a pass at a time
            if kind == "classify" and self.staged:
                self._launch_classify(what)  # then collects the pass before it
                continue
            self.collect()  # the pass in flight first: its answers, and the GPU to this one
            if kind == "classify":
                self._classify(what)
            else:
                self._score_pass(what)
            self.lanes.took(time.perf_counter() - t0)
        else:
            return
        self.collect()  # nothing more to run this turn

    def _drop_all(self) -> None:
        """STOP: what is still queued is answered ABORTED (the front ends answered it already)."""
        self.collect()
        self._answer_rows(list(self.lanes.live.values()), P.ABORTED)
        self.lanes.live.clear()
        for q in self.lanes.rows:
            q.clear()
        for q in self.lanes.jobs:
            for j in q:
                self._fail_job(j, P.ABORTED)
            q.clear()

    def _fail_job(self, job, status: int) -> None:
        """A job answered without finishing (aborted, expired): a long classify row as a row, a
        score request with how far it got."""
        if isinstance(job, RowJob):
            self._answer_rows([job.row], status)
        else:
            job.reply(_score_failed(job.msg, status, _stopped(job) if status == P.EXPIRED else None))

    # -- classify
    def _add_classify(self, m: P.ClassifyReq, reply) -> None:
        ids = P.unpack_ids(m.ids, m.offsets)
        n_clf, cl, pr, fb, tn = len(self.clfs), m.classifiers, m.priorities, m.finish_bys, m.tenants
        bad = {}
        prefixes = self.prefixes
        requests = _requests(m.groups)
        for i, rid in enumerate(m.rids):
            c, start = cl[i] if cl else 0, m.starts[i]
            if not 0 <= c < n_clf:  # a front end of another engine's Ready
                bad[rid] = f"no classifier {c} on this engine"
                continue
            if not 0 <= start <= len(prefixes[c]):
                bad[rid] = f"a start of {start} past classifier {c}'s {len(prefixes[c])} prefix tokens"
                continue
            row_ids = prefixes[c][:start] + ids[i] if start else ids[i]  # the prompt, as sent
            self.lanes.add_row(Row(m.client, rid, row_ids, start, m.deadlines[i], c, reply,
                                   finish_by=fb[i] if fb else 0.0,
                                   request=requests[i] if requests else None,
                                   tenant=tn[i] if tn else 0), pr[i] if pr else 0)
        if bad:
            reply(self._out(list(bad), [P.BAD_INPUT] * len(bad), errors=bad))

    def _out(self, rids, status, best=None, scores=None, errors=None, forward=0.0, size=0):
        n = len(rids)
        return P.ClassifyOut(rids, status, best or [0] * n,
                             scores if scores is not None else bytes(4 * self.N * n), errors or {},
                             forward, size, len(self.lanes), self.drain)

    def _answer_rows(self, rows: list[Row], status: int) -> None:
        """Rows answered without running (expired, aborted): one message per front end."""
        for reply, group in _by_reply(rows):
            rids = [r.rid for _, r in group]
            reply(self._out(rids, [status] * len(rids)))

    def _classify(self, rows: list[Row]) -> None:
        once, index = _once(rows)
        todo = [Encoded({"query": ""}, "", r.ids, r.start) for r in once]
        t0 = time.perf_counter()
        try:
            if len(self.clfs) == 1:  # one classifier: straight through
                best_all, scores_all = self.clf.decide_encoded(todo)
            else:
                best_all, scores_all = self._decide(todo, [r.classifier for r in once])
        except Exception as e:
            self._fault(rows, e)
        self._answer(rows, *_spread(best_all, scores_all, index), time.perf_counter() - t0)

    def _launch_classify(self, rows: list[Row]) -> None:
        """A staged classify pass: launched now (the GPU queues it behind the pass in flight),
        then the pass in flight collected and answered; this one's answers wait for the next
        turn's launch or for collect()."""
        t0 = time.perf_counter()
        once, index = _once(rows)
        todo = [Encoded({"query": ""}, "", r.ids, r.start) for r in once]
        try:
            launched = self.clf.launch_encoded(todo)
        except Exception as e:
            self.collect()
            self._fault(rows, e)
        finish = launched if index is None else (lambda: _spread(*launched(), index))
        self.lanes.took(time.perf_counter() - t0)
        before, self.inflight = self.inflight, (rows, finish, t0, self.lanes.last)
        if before is not None:
            self._collect(before)

    def collect(self) -> None:
        """The staged classify pass in flight, if any: waited for and answered."""
        if self.inflight is not None:
            before, self.inflight = self.inflight, None
            self._collect(before)

    def _collect(self, pass_) -> None:
        rows, finish, t0, last = pass_
        t1 = time.perf_counter()
        try:
            best_all, scores_all = finish()
        except Exception as e:
            self._fault(rows, e)
        done = time.perf_counter()
        self.lanes.took(done - t1, last)  # the wait: engine time this pass took from the loop
        self._answer(rows, best_all, scores_all, done - t0)  # (launch to answer: its time in flight)

    def _fault(self, rows: list[Row], e: Exception) -> None:
        """A classify pass failed: its rows answered FAULT, and the engine stops (EngineFault)."""
        error = f"engine fault: {type(e).__name__}: {e}"
        for reply, group in _by_reply(rows):
            rids = [r.rid for _, r in group]
            reply(self._out(rids, [P.FAULT] * len(rids), errors={r: error for r in rids},
                            size=len(rows)))
        raise EngineFault(f"{type(e).__name__}: {e}") from e

    def _answer(self, rows: list[Row], best_all, scores_all, forward: float, tokens=None) -> None:
        """A classify pass's answers, one message per front end; forward: the pass's seconds,
        tokens its cost (default: its rows' tokens)."""
        self.classify_budget.observe(forward, sum(r.tokens for r in rows) if tokens is None else tokens)
        self._drained(len(rows))
        if self.metrics is not None:
            self.metrics.engine_batch(len(rows), forward)
        for reply, group in _by_reply(rows):
            rids = [r.rid for _, r in group]
            scores = np.asarray([scores_all[i] for i, _ in group], dtype=np.float32)
            reply(self._out(rids, [P.OK] * len(rids), [int(best_all[i]) for i, _ in group],
                            scores.reshape(len(rids), self.N).tobytes(), forward=forward,
                            size=len(rows)))

    def _drained(self, n: int) -> None:
        """n rows answered now: a drain-rate sample if rows waited since the last answer (the
        engine was busy throughout), smoothed as the front ends' rates are."""
        now = time.perf_counter()
        if self.drain_from is not None and now > self.drain_from:
            r = n / (now - self.drain_from)
            self.drain = r if not self.drain else 0.8 * self.drain + 0.2 * r
        self.drain_from = now if len(self.lanes) or self.inflight else None

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

    # -- multi-item scoring
    def _add_score(self, m: P.ScoreReq, reply) -> None:
        if self.scorer is None:
            return reply(_score_failed(m, P.BAD_INPUT, "no multi-item scorer on this server"))
        try:
            full, shared, soft = P.unpack_score(m, self.scorer.config.vocab_size,
                                                self.scorer.config.hidden_size)
        except PrefixScoreError as e:  # a ProtocolError
            return reply(_score_failed(m, P.BAD_INPUT, str(e)))
        self.lanes.add_job(ScoreJob(m, reply, full, shared, soft))

    def _score(self, m: P.ScoreReq) -> P.ScoreOut:
        """One whole request, every pass in turn (for tests and tools: the loop interleaves)."""
        out = []
        self._add_score(m, lambda o: out.append(o) if isinstance(o, P.ScoreOut) else None)
        while not out:
            job = self.lanes.jobs[lane(m.priority)][0]
            self._score_pass(job)
        return out[0]

    def _begin(self, job: ScoreJob) -> bool:
        """A job's first pass: its depth (depth control: real-time requests under a target) and
        its ScoreRun; False if its label set is refused (answered BAD_INPUT)."""
        m, n = job.msg, len(job.full)
        depth = n if self.depth is None or m.priority > 0 else min(n, self.depth.depth())
        call = ScoreCall(None, Prepared(job.full, job.full, job.shared, job.soft), m.labels,
                         m.label_token_ids, m.apply_softmax)
        try:
            job.run = self.scorer.begin(call, depth, self.score_budgets[bool(m.apply_softmax)].tokens)
        except PrefixScoreError as e:  # a label set the scorer refuses
            self.lanes.finish(job)
            job.reply(_score_failed(m, P.BAD_INPUT, str(e)))
            return False
        return True

    def _too_long(self, row: Row) -> bool:
        """A classify row to run a pass at a time (PromptRun): over twice a pass's tokens, of a
        classifier that scores label tokens (a trained head reads its row whole)."""
        return (row.tokens > 2 * max(CHUNK_MIN, self.classify_budget.tokens)
                and self.clfs[row.classifier].head is None)

    def _row_pass(self, job: RowJob) -> None:
        """The next pass of a long classify row: a chunk of its prompt, or its last part with the
        label head, which answers it."""
        row, budget = job.row, self.classify_budget
        if job.run is None:
            job.run = PromptRun(self.clfs[row.classifier], row.ids, row.start)
        rows = job.run.kv.filled
        t0 = time.perf_counter()
        try:
            cost = job.run.step(budget.tokens, self.kv_weight)
        except Exception as e:
            self.lanes.finish(job)
            self._fault([row], e)
        spent = time.perf_counter() - t0
        self._learn_kv_weight(budget, spent, cost, rows)
        if not job.run.finished:
            budget.observe(spent, cost)
            return
        self.lanes.finish(job)
        best, scores = job.run.answer
        padded = np.zeros(self.N, dtype=np.float32)
        padded[:len(scores)] = scores
        self._answer([row], [best], [padded], spent, cost)

    def _score_pass(self, job: ScoreJob) -> None:
        """The next pass of job (a chunk of its query part or a run of its items: score_run.py);
        it is answered after its last, told its progress after the others."""
        if isinstance(job, RowJob):
            return self._row_pass(job)
        m = job.msg
        if job.run is None:
            job.t_start = time.perf_counter()
            if not self._begin(job):
                return
        run, budget = job.run, self.score_budgets[bool(m.apply_softmax)]
        chunk, rows, done = run.filling, run.kv.filled if run.filling else 0, run.done
        t0 = time.perf_counter()
        try:
            cost = run.step(budget.tokens, self.kv_weight)
        except Exception as e:
            self.lanes.finish(job)
            log.error("engine fault in multi-item scoring", exc_info=e)
            job.reply(_score_failed(m, P.FAULT, f"engine fault: {type(e).__name__}: {e}"))
            raise EngineFault(f"{type(e).__name__}: {e}") from e
        spent = time.perf_counter() - t0
        if chunk:
            self._learn_kv_weight(budget, spent, cost, rows)
        budget.observe(spent, cost)
        if self.metrics is not None:
            self.metrics.engine_batch(run.done - done, spent)  # (items: none in a chunk)
        if not run.finished:
            job.total = run.passes + run.remaining(budget.tokens, self.kv_weight)
            job.reply(P.ProgressOut(m.rid, run.passes, job.total, run.done, run.filling))
            return
        self.lanes.finish(job)
        controlled, p99 = self.depth is not None and m.priority <= 0, 0.0
        if controlled:
            if m.sent:
                self.depth.observe(time.monotonic() - m.sent)
            p99 = self.depth.p99_ms() or 0.0
        out = run.answer()
        unscored = [[] for _ in range(len(job.full) - run.depth)]
        job.reply(P.ScoreOut(m.rid, P.OK, out["scores"] + unscored, out["labels"], run.computed,
                             None, run.depth, controlled, p99, time.perf_counter() - job.t_start))

    def _learn_kv_weight(self, budget: PassBudget, spent: float, cost: float, rows: int) -> None:
        """A query-part chunk attended to `rows` K/V rows: what it cost past its tokens' calibrated
        cost moves the cost of a row (in tokens per chunk token) by a tenth. cost: the chunk's
        tokens weighed at the old estimate, c * (1 + w * rows)."""
        if budget.per_token is None or rows <= 0:
            return
        c = cost / (1 + self.kv_weight * rows)
        seen = (max(0.0, spent - budget.fixed) / (budget.per_token * c) - 1) / rows
        self.kv_weight = max(0.0, self.kv_weight + 0.1 * (seen - self.kv_weight))


def _once(rows: list[Row]) -> tuple[list[Row], list[int] | None]:
    """The rows of distinct work (Row.work), and per row the index of its work among them (None:
    every row distinct): identical rows in a pass are computed once, every one answered."""
    first: dict[tuple, int] = {}
    once, index = [], []
    for r in rows:
        k = first.setdefault(r.work, len(once))
        if k == len(once):
            once.append(r)
        index.append(k)
    return (rows, None) if len(once) == len(rows) else (once, index)


def _spread(best, scores, index):
    """Answers of the distinct rows (_once) to every row."""
    if index is None:
        return best, scores
    return [best[i] for i in index], [scores[i] for i in index]


def _requests(groups: list[int]) -> list[list] | None:
    """Per row, the started flag it shares with the other rows of its client request
    (ClassifyReq.groups: the rid of each row's request's first row); None: no groups."""
    if not groups:
        return None
    flags: dict[int, list] = {}
    return [flags.setdefault(g, [False]) for g in groups]


def _timed(fn, arg, n: int) -> float:
    """The median time of n calls of fn(arg)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def _by_reply(rows: list[Row]):
    """(reply, [(index in rows, row), ...]) per front end: one answer message each."""
    by = {}
    for i, r in enumerate(rows):
        by.setdefault(id(r.reply), (r.reply, []))[1].append((i, r))
    return by.values()


def _score_failed(m: P.ScoreReq, status: int, error: str | None) -> P.ScoreOut:
    return P.ScoreOut(m.rid, status, [], [], 0, error)


def _stopped(job: ScoreJob) -> str | None:
    """How far an expired score request got (None: it never started)."""
    run = job.run
    if run is None:
        return None
    return (f"stopped at its deadline after {run.passes} of about {max(job.total, run.passes)} "
            f"passes ({run.done} of {run.depth} items scored)")
