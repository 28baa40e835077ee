"""Engine: owns the model, the pinned prefix KV and the label-head weights, and runs batch plans.

The prefix KV is computed once per (model, template) and every batch attends to the same tensors
(no per-request copies). CPU runs each plan eagerly with the torch reference kernels. On CUDA,
`capture()` and `capture_vocab()` record CUDA graphs per token-count bucket (graphs.py), which a
plan that fits replays. A request longer than a pass has a K/V of its own (QueryKV), filled a
chunk at a time by `extend()` (score_run.py).

An engine fixes its KernelOptions (kernels/options.py) when it is made and hands them to every
forward in the model's Context, so its CUDA graphs hold the kernels of those options; another
setting is another engine (bench/ builds one per A/B arm).
"""
from __future__ import annotations

import dataclasses
import gc
import time
import weakref

import torch

from .batch import Plan
from .errors import ConfigError
from .kernels import label_head
from .kernels.label_head import rms_norm
from .kernels.options import KernelOptions
from .weights.loading import LoadedModel
from .model import Context
from .graphs import GRAPH_MAX_TOKENS, GraphRunner

# Label tokens a vocabulary graph takes (Engine.capture_vocab): a /v1/score request's label set
# (the server's --max-label-ids is 64 by default; a larger set runs eagerly).
VOCAB_LABELS = 64
# Rows of an engine's K/V bank (KVBank): two requests of the server's longest query part (its
# --max-score-tokens, 8,192 by default) at once; a request that finds no room runs eagerly.
BANK_ROWS = 2 * (8192 + 512)

class Engine:
    def __init__(self, loaded: LoadedModel, options: KernelOptions | None = None):
        """options: the kernels this engine runs, fixed for its life (None: the defaults with the
        environment's settings, KernelOptions.from_env)."""
        self.options = KernelOptions.from_env() if options is None else options
        self.model = loaded.model
        self.lm_head = loaded.lm_head
        self.config = c = self.model.config
        self.device = self.lm_head.device
        self.dtype = self.lm_head.dtype
        empty = torch.empty(0, c.num_kv_heads, c.head_dim, device=self.device, dtype=self.dtype)
        self.no_prefix = [(empty, empty)] * c.num_layers
        self.graphs: dict[tuple, GraphRunner] = {}
        # One CUDA graph memory pool for every runner of this engine: replays are serial (one
        # stream, each call waits for its own), and a graph's outputs leave through buffers outside
        # the pool, so the classifiers of one model need the activation memory of one bucket set,
        # not one each (a second classifier costs its prefix KV, label rows and static buffers).
        self.pool = None
        self.capture_stream = None
        self.bank: KVBank | None = None  # (make_bank: the K/V of long requests, in graphs' reach)

    @classmethod
    def shared(cls, loaded: LoadedModel, **options) -> "Engine":
        """The one engine of a loaded model: classifiers and scorers over the same weights share
        its graph memory pool (kept on the LoadedModel, which lives as long as they do), and so its
        KernelOptions. options: fields the caller asks for (batch_invariant=True; None: no wish);
        the first caller's make the engine (over KernelOptions.from_env()), and a later caller
        asking for another value is refused: one engine runs one set of kernels."""
        want = {k: v for k, v in options.items() if v is not None}
        engine = loaded.__dict__.get("engine")
        if engine is None:
            engine = loaded.__dict__["engine"] = cls(loaded, KernelOptions.from_env(**want))
        asked = dataclasses.replace(engine.options, **want)  # (as the options keep them: tune)
        clash = [k for k in want if getattr(asked, k) != getattr(engine.options, k)]
        if clash:
            k, v = clash[0], getattr(asked, clash[0])
            raise ConfigError(
                f"{k}={v}: this model's engine runs its kernels with {k}={getattr(engine.options, k)}, "
                f"fixed by the first classifier or scorer made over it (those of one loaded model, "
                f"Classifier.many's too, share one engine); give them all the same {k}, or load the "
                f"model again for the other setting")
        return engine

    def weight_bytes(self) -> int:
        """The model's weight bytes, output head included (what classifiers over this engine
        share)."""
        return self.model.weight_bytes(self.lm_head)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of the prefix tokens for every layer, [P, Hkv, D] each: a causal pass with no cache."""
        if not ids:
            return self.no_prefix
        kv = self.query_kv(self.no_prefix, len(ids))
        self.extend(kv, ids)  # (one chunk: the whole prefix)
        return kv.view(len(ids))

    def make_bank(self, rows: int = BANK_ROWS) -> "KVBank":
        """The engine's K/V bank (made once): where requests longer than a pass keep their own
        K/V (query_kv(banked=True)), so the passes over it replay graphs (capture(..., ranges=True)
        over bank.kv, capture_extend)."""
        if self.bank is None:
            self.bank = KVBank(rows, self.config, self.device, self.dtype)
        return self.bank

    @torch.inference_mode()
    def query_kv(self, base, capacity: int, banked: bool = False) -> "QueryKV":
        """A request's own K/V buffer of `capacity` rows: `base` (the pinned prefix's K/V, or the
        engine's empty one) first, the rest filled a chunk at a time by extend(). banked: in the
        engine's bank if it has one with room (else a buffer of its own, whose passes run eagerly)."""
        bank = self.bank if banked else None
        lo = bank.alloc(capacity) if bank is not None else None
        return QueryKV(base, capacity, self.config, self.device, self.dtype,
                       None if lo is None else (bank, lo))

    @torch.inference_mode()
    def extend(self, kv: "QueryKV", ids: list[int]):
        """Compute `ids` as the next tokens after kv's filled rows (positions continue there; each
        attends to every filled row and causally to the chunk) and write their K/V into kv: one
        bounded pass of a prompt longer than a pass (a score request's query part). Chunk by chunk
        this is the causal prefill of the whole prompt, its sums taken over other splits (the
        prefix part, then the chunk's own, merged by log-sum-exp), so equal to one pass within
        rounding, not bitwise. Queued without a host sync on CUDA (a graph replay where the K/V is
        in the bank and a chunk graph was captured); returns wait(), which waits for it."""
        n, c = kv.filled, len(ids)
        if n + c > kv.capacity:
            raise ValueError(f"{c} tokens past the {kv.capacity - n} left in this K/V")
        g = self.graphs.get((id(kv.bufs), "extend")) if kv.bank is not None else None
        kv.filled = n + c
        if g is not None and c <= g.max_tokens:
            return g.launch(extend_plan(ids, kv.lo, n))
        zeros = torch.zeros(c, dtype=torch.int32, device=self.device)
        out: list = []
        ctx = Context(kv.view(n), zeros, zeros, zeros, torch.tensor([0, c]), kv_out=out,
                      options=self.options)
        tokens = torch.tensor(ids, device=self.device)
        self.model(tokens, torch.arange(n, n + c, device=self.device), ctx)
        lo = kv.lo
        for (k, v), (bk, bv) in zip(out, kv.bufs):
            bk[lo + n:lo + n + c].copy_(k)
            bv[lo + n:lo + n + c].copy_(v)
        return _waiter(self.device)

    def label_weight(self, columns: list[int]) -> torch.Tensor:
        """The output head's rows for the label tokens only: an N-row projection, never the vocab."""
        return self.lm_head[torch.tensor(columns, device=self.device)].contiguous()

    @torch.inference_mode()
    def hidden(self, plan: Plan, prefix_kv, read: bool = False):
        """-> (hidden states before the final norm, the plan on the device): of every row, or with
        read=True of the plan's read-out rows only ([R, hidden], in plan.rows order; the last
        layer then runs for those rows alone: model.Transformer.forward)."""
        plan = plan.to(self.device)
        ctx = Context(prefix_kv, plan.base_start, plan.base_end, plan.own_start, plan.seg_offsets,
                      prefix_range=plan.prefix_range, options=self.options)
        rows = plan.rows.long() if read and self.prune else None
        h = self.model(plan.tokens, plan.positions, ctx, _soft(plan), rows)
        return (h[plan.rows] if read and rows is None else h), plan

    @property
    def prune(self) -> bool:
        """Whether an eager pass runs its last layer for the read-out rows only. Not in batch-
        invariant mode on CUDA, where a graph bucket runs every row and the two agreeing bitwise is
        not yet tested on the GPU (on the CPU both modes are torch's, and both prune)."""
        o = self.options
        return o.prune_last_layer and not (o.batch_invariant and self.device.type == "cuda")

    @torch.inference_mode()
    def forward_scores(self, tokens, positions, ctx, rows, allowed, weight, logprobs, out=None,
                       soft=None, prune: bool = False):
        """prune (eager passes): the last layer runs for `rows` only (a graph's passes keep every
        row: its static buffers hold a bucket's worth of rows, read or padding)."""
        m = self.model
        if prune and self.prune:
            h = m(tokens, positions, ctx, soft, rows.long())
            rows = torch.arange(h.shape[0], device=h.device)
        else:
            h = m(tokens, positions, ctx, soft)
        return label_head(h, rows, m.norm.weight, m.norm.eps, weight, allowed, logprobs, out,
                          options=self.options)

    @torch.inference_mode()
    def forward_vocab(self, tokens, positions, ctx, rows, cols, out=None, soft=None):
        """The whole model's probabilities of tokens `cols` at `rows` (vocab_head), every row of
        the forward computed (a graph's)."""
        h = self.model(tokens, positions, ctx, soft)
        return self.vocab_head(h[rows.long()], cols, out)

    def vocab_head(self, h, cols, out=None):
        """Each of `cols`' probability under the whole vocabulary at each row of h (hidden states
        before the final norm): the full output head, for these rows only, logits in the model's
        dtype, their log-sum-exp in fp32."""
        norm = self.model.norm
        x = rms_norm(h, norm.weight, norm.eps)
        res = []
        for c in range(0, x.shape[0], 1024):  # bounds the [rows, vocab] fp32 block
            logits = (x[c:c + 1024] @ self.lm_head.t()).float()
            res.append((logits[:, cols] - logits.logsumexp(-1, keepdim=True)).exp())
        p = res[0] if len(res) == 1 else torch.cat(res)
        return p if out is None else out.copy_(p)

    def run(self, plan: Plan, prefix_kv, weight: torch.Tensor, logprobs: bool = True):
        """-> (scores [R, N] fp32, best [R]) on the CPU for the plan's read-out rows."""
        return self.launch(plan, prefix_kv, weight, logprobs)()

    @property
    def bare(self) -> tuple:
        """(K/V, kv_range) of a pass that sees no pinned prefix: an empty range of the bank, whose
        graphs then serve it, where the engine has one; else the empty K/V."""
        return (self.no_prefix, None) if self.bank is None else (self.bank.kv, (0, 0))

    @property
    def captures(self) -> bool:
        """Whether this engine's passes replay CUDA graphs (captured on CUDA only)."""
        return self.device.type == "cuda"

    @property
    def queues(self) -> bool:
        """Whether launch() can return before its pass has run (an eager CUDA pass), so a caller
        gains by launching the next pass before collecting this one. On a CPU it computes."""
        return self.device.type == "cuda"

    def _graph(self, plan: Plan, prefix_kv, weight, logprobs, columns) -> tuple:
        """(the runner whose graphs the plan replays, its label tokens) or (None, None): the
        runner of this weight, else (columns given) the one taking any label set over prefix_kv."""
        g = self.graphs.get((id(prefix_kv), id(weight), logprobs))
        if g is not None and g.fits(plan):
            return g, None
        g = self.graphs.get((id(prefix_kv), "labels", logprobs)) if columns is not None else None
        return (g, columns) if g is not None and g.fits(plan, columns) else (None, None)

    @torch.inference_mode()
    def launch(self, plan: Plan, prefix_kv, weight: torch.Tensor, logprobs: bool = True,
               columns: list[int] | None = None):
        """Queue the plan's forward and return `collect()`, which waits for it and returns what
        run() returns. On CUDA neither an eager (past the graphs) forward nor a graph replay waits
        for the GPU, so the host can prepare the next plan while the GPU works (a graph runner
        has SLOTS input slots: the launch after those collects the oldest first). columns: the
        vocabulary ids of weight's rows (a label set's), so a graph taking any set may replay."""
        g, tokens = self._graph(plan, prefix_kv, weight, logprobs, columns)
        if g is not None:
            if tokens is None:
                return g.launch(plan)
            pending, n = g.launch(plan, tokens), len(tokens)
            return lambda: (lambda s, b: (s[:, :n], b))(*pending())
        cuda = self.device.type == "cuda"
        p = plan.pinned().to(self.device) if cuda else plan  # pinned: the copies do not block
        ctx = Context(prefix_kv, p.base_start, p.base_end, p.own_start, p.seg_offsets,
                      prefix_range=p.prefix_range, options=self.options)
        scores, best = self.forward_scores(p.tokens, p.positions, ctx, p.rows, p.allowed, weight,
                                           logprobs, soft=_soft(p), prune=True)
        if not cuda:
            return lambda: (scores, best)
        host = (torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True),
                torch.empty(best.shape, dtype=best.dtype, pin_memory=True))
        host[0].copy_(scores, non_blocking=True)
        host[1].copy_(best, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def collect():
            done.synchronize()
            return host

        return collect

    def capture(self, prefix_kv, weight, logprobs: bool, max_tokens: int, ranges: bool = False,
                soft: bool = False) -> dict:
        """CUDA graphs for every bucket up to max_tokens; returns capture time and memory.
        ranges: plans carry per-token prefix ranges (a bank of several prefixes, many.py); soft:
        they may carry embedding items. weight None: any label set of up to VOCAB_LABELS tokens,
        an input of each call (launch's columns)."""
        if not self.captures:
            return {}
        torch.cuda.synchronize()
        # torch.cuda.graph() empties the allocator's cache on entry, which read as negative graph
        # memory (-1.7 GB after the prefill's temporaries): empty it before the baseline too, and
        # collect first, as the capture does (a dead runner's graph pools freed then read as
        # negative memory too).
        gc.collect()
        torch.cuda.empty_cache()
        mem0, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        runner = GraphRunner(self, prefix_kv, weight, logprobs, min(max_tokens, GRAPH_MAX_TOKENS), ranges,
                             labels=VOCAB_LABELS if weight is None else 0, soft=soft)
        self.graphs[(id(prefix_kv), "labels" if weight is None else id(weight), logprobs)] = runner
        torch.cuda.synchronize()
        return {"capture_s": time.perf_counter() - t0, "buckets": runner.buckets,
                "graph_mem_mb": (torch.cuda.memory_reserved() - mem0) / 2**20}  # pools + buffers

    def capture_vocab(self, prefix_kv, max_tokens: int, labels: int = VOCAB_LABELS,
                      ranges: bool = False, soft: bool = False) -> dict:
        """CUDA graphs of vocab_probs passes over prefix_kv, for any set of up to `labels` label
        tokens (GraphRunner vocab): SGLang's default /v1/score mode replays a graph too."""
        if not self.captures:
            return {}
        t0 = time.perf_counter()
        runner = GraphRunner(self, prefix_kv, None, False, min(max_tokens, GRAPH_MAX_TOKENS),
                             ranges, vocab=labels, soft=soft)
        self.graphs[(id(prefix_kv), "vocab")] = runner
        torch.cuda.synchronize()
        return {"capture_s": time.perf_counter() - t0, "buckets": runner.buckets}

    def capture_scorer(self, prefix_kv, weight, logprobs: bool, max_tokens: int) -> dict:
        """A Scorer's graphs, over its pinned prefix and over the engine's K/V bank (made here):
        its own labels' (weight; None: none, mode vocab_probs), any label set's under softmax,
        SGLang's default mode's, each taking embedding items; and the bank's chunks (extend).
        What another scorer of this engine captured already is shared."""
        if not self.captures:
            return {}
        bank = self.make_bank()
        info = {}
        for kv, ranges in ((prefix_kv, False), (bank.kv, True)):
            part = info.setdefault("bank" if ranges else "prefix", {})
            if weight is not None and (id(kv), id(weight), logprobs) not in self.graphs:
                part["own"] = self.capture(kv, weight, logprobs, max_tokens, ranges, soft=True)
            if (id(kv), "labels", True) not in self.graphs:
                part["labels"] = self.capture(kv, None, True, max_tokens, ranges, soft=True)
            if (id(kv), "vocab") not in self.graphs:
                part["vocab"] = self.capture_vocab(kv, max_tokens, ranges=ranges, soft=True)
        if (id(bank.kv), "extend") not in self.graphs:
            t0 = time.perf_counter()
            self.graphs[(id(bank.kv), "extend")] = GraphRunner(
                self, bank.kv, None, False, min(max_tokens, GRAPH_MAX_TOKENS), True, write_kv=bank.trash)
            info["bank"]["extend"] = {"capture_s": time.perf_counter() - t0}
        return info

    def vocab_probs(self, plan: Plan, kv, tokens: list[int]) -> torch.Tensor:
        """Each label token's probability under the whole vocabulary: the full output head, but
        only at the read-out rows (one row per item): the Scorer's mode vocab_probs. A graph
        replay where one was captured for kv (capture_vocab) and the plan fits it."""
        g = self.graphs.get((id(kv), "vocab"))
        if g is not None and g.fits(plan, tokens):
            return g.run(plan, tokens)[0][:, :len(tokens)]
        h, plan = self.hidden(plan, kv, read=True)
        return self.vocab_head(h, torch.tensor(tokens, device=h.device)).cpu()


class KVBank:
    """The K/V of requests longer than a pass, as regions of one buffer per layer: the passes over
    them name their rows by index (a token's prefix range, a chunk's destination rows), never by a
    tensor of their own, so one set of CUDA graphs serves every request. Row `trash` (the last)
    takes the writes of a graph's padding tokens."""

    def __init__(self, rows: int, config, device, dtype):
        shape = (rows + 1, config.num_kv_heads, config.head_dim)
        # zeros: an eager CPU pass masks the rows past a token's range, and 0 x NaN would not vanish
        self.kv = [(torch.zeros(shape, device=device, dtype=dtype),
                    torch.zeros(shape, device=device, dtype=dtype)) for _ in range(config.num_layers)]
        self.rows = self.trash = rows
        self.used: dict[int, int] = {}  # first row -> end, of each region in use

    def alloc(self, n: int) -> int | None:
        """The first row of a free region of n rows (first fit), or None if none is left."""
        at = 0
        for lo, hi in sorted(self.used.items()):
            if lo - at >= n:
                break
            at = max(at, hi)
        if at + n > self.rows:
            return None
        self.used[at] = at + n
        return at

    def free(self, lo: int) -> None:
        self.used.pop(lo, None)


class QueryKV:
    """One request's K/V past what every request shares: per layer (k, v), rows [lo, lo +
    capacity) of `bufs` (a region of the engine's KVBank, freed with this object, or a buffer of
    its own: lo 0), its first rows the base (pinned prefix) K/V, then the tokens Engine.extend
    computed (`filled` rows in all); close() gives the region back. view(n) is the first n rows
    as the per-layer list a Context takes, one list object per n, so spans over the same rows
    share a pass; range(n) the same rows as bank indices (spans.cached_spans: a bank's passes
    replay graphs)."""

    def __init__(self, base, capacity: int, config, device, dtype, region=None):
        """region: (bank, first row) of a region allocated for it; None: a buffer of its own."""
        P = base[0][0].shape[0]
        self.bank, self.lo = region if region is not None else (None, 0)
        self.close = lambda: None  # (a region goes back to the bank: now or when this is freed)
        if self.bank is not None:
            self.bufs = self.bank.kv
            self.close = weakref.finalize(self, self.bank.free, self.lo)
        else:
            shape = (capacity, config.num_kv_heads, config.head_dim)
            self.bufs = [(torch.zeros(shape, device=device, dtype=dtype),
                          torch.zeros(shape, device=device, dtype=dtype)) for _ in base]
        for (k, v), (bk, bv) in zip(self.bufs, base):
            k[self.lo:self.lo + P].copy_(bk)
            v[self.lo:self.lo + P].copy_(bv)
        self.capacity, self.filled = capacity, P
        self._views: dict[int, list] = {}

    def view(self, n: int) -> list:
        if n not in self._views:
            lo, hi = self.range(n)
            self._views[n] = [(k[lo:hi], v[lo:hi]) for k, v in self.bufs]
        return self._views[n]

    def range(self, n: int) -> tuple[int, int]:
        if n > self.filled:
            raise ValueError(f"{n} rows asked of a K/V with {self.filled} filled")
        return self.lo, self.lo + n


def extend_plan(ids: list[int], lo: int, n: int) -> Plan:
    """The Plan of a chunk after n filled rows of a bank region at row lo (Engine.extend's graph):
    one causal span that sees rows [lo, lo + n) and writes its K/V to the rows after them."""
    c = len(ids)
    z = torch.zeros(c, dtype=torch.int32)
    return Plan(tokens=torch.tensor(ids, dtype=torch.int64),
                positions=torch.arange(n, n + c, dtype=torch.int64), base_start=z, base_end=z,
                own_start=z, seg_offsets=torch.tensor([0, c]), rows=torch.zeros(0, dtype=torch.int64),
                allowed=torch.zeros(0, 1, dtype=torch.bool), batch=0,
                prefix_start=torch.full((c,), lo, dtype=torch.int32),
                prefix_end=torch.full((c,), lo + n, dtype=torch.int32),
                kv_dst=torch.arange(lo + n, lo + n + c, dtype=torch.int32))


def _waiter(device):
    """wait() for the work queued so far on the device (nothing to wait for on a CPU)."""
    if device.type != "cuda":
        return lambda: None
    done = torch.cuda.Event()
    done.record()
    return done.synchronize


def _soft(plan: Plan):
    """The model's soft input of a plan's embedding items: (src [T], table [E, hidden])."""
    if plan.soft is None:
        return None
    rows = plan.soft_rows.long()
    src = torch.full((plan.num_tokens,), -1, dtype=torch.int64, device=rows.device)
    return src.index_copy_(0, rows, torch.arange(rows.shape[0], device=rows.device)), plan.soft
