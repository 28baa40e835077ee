"""Engine: owns the model, the pinned prefix KV and the label-head weights, and runs batch plans.

The prefix KV is computed once per (model, template) and every batch attends to the same tensors
(no per-request copies). CPU runs each plan eagerly with the torch reference kernels. On CUDA,
`capture()` records one CUDA graph per token-count bucket over static buffers; a call then writes
the plan into one pinned host buffer, replays, and waits once. The graphs of the small buckets
hold their H2D and D2H copies too, as kernels reading and writing the pinned buffers in place (one
launch per call); the large ones copy only the rows used, around the replay.

An engine fixes its KernelOptions (kernels/options.py) when it is made and hands them to every
forward in the model's Context, so its CUDA graphs hold the kernels of those options; another
setting is another engine (bench/ builds one per A/B arm).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from .batch import Plan
from .errors import ConfigError
from .kernels import label_head
from .kernels.label_head import rms_norm
from .kernels.options import KernelOptions
from .weights.loading import LoadedModel
from .model import Context

# Short requests get their own small buckets: the graph of a bucket does its padding tokens' work
# too, and on the H200 one Qwen2.5-0.5B-shape request took 0.564 / 0.570 / 0.579 / 0.585 / 0.597 ms
# in buckets of 1 / 2 / 4 / 8 / 16 tokens.
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# Past 8192 tokens a batch keeps the GPU busy for milliseconds, so launches hide behind it and a
# graph would only add padding (W3: 15,050 tokens padded to 16,384 was 9% waste): run eagerly.
GRAPH_MAX_TOKENS = BUCKETS[-1]
# Buckets whose input + output bytes are at most this copy them inside their graph (the whole
# buffers, used rows or not); larger ones copy around the replay, only what the call uses.
GRAPH_COPY_MAX_BYTES = 1 << 20  # (KernelOptions.graph_copies False: every bucket copies around)
# GraphRunner.run keeps the filled input of one-request plans up to this many tokens, one per
# layout (suffix length x first position: at most a few hundred, each <= 64 * (24 + N) bytes).
IMAGE_MAX_TOKENS, MAX_IMAGES = 64, 1024


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
        P = len(ids)
        zeros = torch.zeros(P, dtype=torch.int32, device=self.device)
        kv: list = []
        ctx = Context(self.no_prefix, zeros, zeros, zeros, torch.tensor([0, P]), kv_out=kv,
                      options=self.options)
        self.model(torch.tensor(ids, device=self.device), torch.arange(P, device=self.device), ctx)
        return [(k.contiguous(), v.contiguous()) for k, v in kv]

    @torch.inference_mode()
    def query_kv(self, base, capacity: int) -> "QueryKV":
        """A request's own K/V buffer of `capacity` rows: `base` (the pinned prefix's K/V, or the
        engine's empty one) first, the rest filled a chunk at a time by extend()."""
        return QueryKV(base, capacity, self.config, self.device, self.dtype)

    @torch.inference_mode()
    def extend(self, kv: "QueryKV", ids: list[int]) -> None:
        """Compute `ids` as the next tokens after kv's filled rows (positions continue there; each
        attends to every filled row and causally to the chunk) and write their K/V into kv: one
        bounded pass of a prompt longer than a pass (a score request's query part). Chunk by chunk
        this is the causal prefill of the whole prompt, its sums taken over other splits (the
        prefix part, then the chunk's own, merged by log-sum-exp), so equal to one pass within
        rounding, not bitwise. Queued without a host sync on CUDA."""
        n, c = kv.filled, len(ids)
        if n + c > kv.capacity:
            raise ValueError(f"{c} tokens past the {kv.capacity - n} left in this K/V")
        zeros = torch.zeros(c, dtype=torch.int32, device=self.device)
        out: list = []
        ctx = Context(kv.view(n), zeros, zeros, zeros, torch.tensor([0, c]), kv_out=out,
                      options=self.options)
        tokens = torch.tensor(ids, device=self.device)
        self.model(tokens, torch.arange(n, n + c, device=self.device), ctx)
        for (k, v), (bk, bv) in zip(out, kv.bufs):
            bk[n:n + c].copy_(k)
            bv[n:n + c].copy_(v)
        kv.filled = n + c

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

    def run(self, plan: Plan, prefix_kv, weight: torch.Tensor, logprobs: bool = True):
        """-> (scores [R, N] fp32, best [R]) on the CPU for the plan's read-out rows."""
        g = self._graph(plan, prefix_kv, weight, logprobs)
        return g.run(plan) if g is not None else self.launch(plan, prefix_kv, weight, logprobs)()

    @property
    def queues(self) -> bool:
        """Whether launch() can return before its pass has run (an eager CUDA pass), so a caller
        gains by launching the next pass before collecting this one. On a CPU it computes."""
        return self.device.type == "cuda"

    def _graph(self, plan: Plan, prefix_kv, weight, logprobs) -> "GraphRunner | None":
        if plan.soft is not None:  # embedding overrides run eagerly: the graphs stay as they are
            return None
        g = self.graphs.get((id(prefix_kv), id(weight), logprobs))
        return g if g is not None and plan.num_tokens <= g.max_tokens else None

    @torch.inference_mode()
    def launch(self, plan: Plan, prefix_kv, weight: torch.Tensor, logprobs: bool = True):
        """Queue the plan's forward and return `collect()`, which waits for it and returns what
        run() returns. On CUDA an eager (past the graphs) forward is queued without a host sync,
        so the host can prepare the next plan while the GPU works. Graph replays share static
        buffers: they finish before launch returns."""
        g = self._graph(plan, prefix_kv, weight, logprobs)
        if g is not None:
            out = g.run(plan)
            return lambda: out
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

    def capture(self, prefix_kv, weight, logprobs: bool, max_tokens: int, ranges: bool = False) -> dict:
        """CUDA graphs for every bucket up to max_tokens; returns capture time and memory.
        ranges: plans carry per-token prefix ranges (a bank of several prefixes, many.py)."""
        if self.device.type != "cuda":
            return {}
        torch.cuda.synchronize()
        # torch.cuda.graph() empties the allocator's cache on entry, which read as negative graph
        # memory (-1.7 GB after the prefill's temporaries): empty it before the baseline too.
        torch.cuda.empty_cache()
        mem0, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        runner = GraphRunner(self, prefix_kv, weight, logprobs, min(max_tokens, GRAPH_MAX_TOKENS), ranges)
        self.graphs[(id(prefix_kv), id(weight), logprobs)] = runner
        torch.cuda.synchronize()
        return {"capture_s": time.perf_counter() - t0, "buckets": runner.buckets,
                "graph_mem_mb": (torch.cuda.memory_reserved() - mem0) / 2**20}  # pools + buffers

    def vocab_probs(self, plan: Plan, kv, tokens: list[int]) -> torch.Tensor:
        """Each label token's probability under the whole vocabulary: the full output head, but
        only at the read-out rows (one row per item): the Scorer's mode vocab_probs."""
        h, plan = self.hidden(plan, kv, read=True)
        norm = self.model.norm
        x = rms_norm(h, norm.weight, norm.eps)
        cols = torch.tensor(tokens, device=x.device)
        out = []
        for c in range(0, x.shape[0], 1024):  # bounds the [rows, vocab] fp32 block
            logits = (x[c:c + 1024] @ self.lm_head.t()).float()
            out.append((logits[:, cols] - logits.logsumexp(-1, keepdim=True)).exp())
        return torch.cat(out).cpu()


class QueryKV:
    """One request's K/V past what every request shares: per layer (k, v) [capacity, Hkv, D],
    its first rows the base (pinned prefix) K/V, then the tokens Engine.extend computed. view(n)
    is the first n rows as the per-layer list a Context takes, one list object per n, so spans
    over the same rows share a pass (spans.SpanLayout.passes groups by it)."""

    def __init__(self, base, capacity: int, config, device, dtype):
        P = base[0][0].shape[0]
        shape = (capacity, config.num_kv_heads, config.head_dim)
        self.bufs = []
        for bk, bv in base:
            k, v = torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)
            k[:P].copy_(bk)
            v[:P].copy_(bv)
            self.bufs.append((k, v))
        self.capacity, self.filled = capacity, P
        self._views: dict[int, list] = {}

    def view(self, n: int) -> list:
        if n > self.filled:
            raise ValueError(f"{n} rows asked of a K/V with {self.filled} filled")
        if n not in self._views:
            self._views[n] = [(k[:n], v[:n]) for k, v in self.bufs]
        return self._views[n]


def _soft(plan: Plan):
    return None if plan.soft is None else (plan.soft_rows, plan.soft)


class GraphRunner:
    """Static buffers + one CUDA graph per token bucket for one (prefix, label weight, mode).

    A call's inputs are one byte buffer, laid out per bucket Tb as the int32 rows [6, Tb] (tokens,
    positions, base_start, base_end, own_start, read-out rows; with `ranges` 8 rows, then
    prefix_start and prefix_end) and then allowed [Tb, N] (bool), so
    they travel in one contiguous H2D copy; the label head writes best [Tb] (int64) and scores
    [Tb, N] (fp32) into one output byte buffer, read back with one D2H copy. Each bucket's graph
    is captured on its own views of the two buffers. Padding tokens see only themselves and the
    prefix; padding rows read token 0 with every label allowed; their outputs are never read.
    """

    def __init__(self, engine: Engine, prefix_kv, weight, logprobs, max_tokens, ranges: bool = False):
        self.engine, self.prefix_kv, self.weight, self.logprobs = engine, prefix_kv, weight, logprobs
        self.ranges = ranges
        self.rows_in = 8 if ranges else 6  # int32 rows of the input
        self.buckets = [b for b in BUCKETS if b < max_tokens] + [next(b for b in BUCKETS if b >= max_tokens)]
        self.max_tokens = Tmax = self.buckets[-1]
        self.N = weight.shape[0]
        dev = engine.device
        self.host_in = torch.zeros(self._in_bytes(Tmax), dtype=torch.uint8).pin_memory()
        self.host_out = torch.zeros(self._out_bytes(Tmax), dtype=torch.uint8).pin_memory()
        self.dev_in = torch.zeros_like(self.host_in, device=dev)
        self.dev_out = torch.zeros_like(self.host_out, device=dev)
        self.pad = np.arange(Tmax, dtype=np.int32)
        self.bucket_of = [next(b for b in self.buckets if b >= T) for T in range(Tmax + 1)]
        self.images: dict[tuple, np.ndarray] = {}  # one-request layout -> its filled input (run)
        hin, hout = self.host_in.numpy(), self.host_out.numpy()
        self.host_in_np = hin
        self.views = {}  # bucket -> numpy views of the pinned buffers (ints, allowed, best, scores)
        for T in self.buckets:
            ints, allowed = self._split_in(hin, T)
            best, scores = self._split_out(hout, T)
            self.views[T] = (ints, allowed, best, scores)
        self.graphs = {}
        # copies in the graph: the bucket's whole input and output buffers
        opts = engine.options
        copies = opts.graph_copies and opts.use_triton  # (the plain-torch baseline copies around)
        self.inline = {T: copies and self._in_bytes(T) + self._out_bytes(T) <= GRAPH_COPY_MAX_BYTES
                       for T in self.buckets}
        pool = engine.pool
        # Warm up on the stream that captures: what a kernel caches per stream (the skinny GEMMs'
        # split-K counters) then exists before the capture, which would otherwise record its
        # zero-fill into every replay (a torch kernel between two PDL launches).
        # One capture stream per engine: the allocator reuses a freed block only on the stream
        # that freed it, so runners captured on streams of their own each grew the shared pool by
        # a whole bucket set (H200, 0.5B: +346 MiB for a second classifier, 86% of the weights).
        if engine.capture_stream is None:
            engine.capture_stream = torch.cuda.Stream(dev)
        stream = engine.capture_stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        for T in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            ints, allowed = self._split_in(self.dev_in, T)
            ints.copy_(torch.from_numpy(self._idle(T)))  # valid visibility everywhere, all allowed
            allowed.fill_(True)
            h, a = self.views[T][:2]  # the same in the host buffer, which an inline copy reads
            h[:] = self._idle(T)
            a[:] = True
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                    self._body(T)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                self._body(T)
            pool = engine.pool = g.pool()
            self.graphs[T] = g

    def _in_bytes(self, T):
        return 4 * self.rows_in * T + T * self.N

    def _out_bytes(self, T):
        return 8 * T + 4 * T * self.N

    def _split_in(self, buf, T):
        """(ints [rows_in, T] int32, allowed [T, N] bool) views of a byte buffer (torch or numpy)."""
        i32, b8 = (np.int32, np.bool_) if isinstance(buf, np.ndarray) else (torch.int32, torch.bool)
        n = 4 * self.rows_in * T
        return (buf[:n].view(i32).reshape(self.rows_in, T),
                buf[n:self._in_bytes(T)].view(b8).reshape(T, self.N))

    def _split_out(self, buf, T):
        """(best [T] int64, scores [T, N] fp32) views of a byte buffer (torch or numpy)."""
        i64, f32 = (np.int64, np.float32) if isinstance(buf, np.ndarray) else (torch.int64, torch.float32)
        return buf[:8 * T].view(i64), buf[8 * T:self._out_bytes(T)].view(f32).reshape(T, self.N)

    def _idle(self, T):
        ints = np.zeros((self.rows_in, T), dtype=np.int32)  # (a padding token's prefix range: empty)
        ints[4] = self.pad[:T]
        return ints

    def _body(self, T):
        copies = self.inline[T]
        if copies:  # a kernel reads the pinned input in place
            from .kernels.fused_triton import copy_bytes  # (CUDA only: triton is imported lazily)

            copy_bytes(self.host_in, self.dev_in, self._in_bytes(T), options=self.engine.options)
        ints, allowed = self._split_in(self.dev_in, T)
        tokens, pos, bs, be, own, rows = ints[:6]
        best, scores = self._split_out(self.dev_out, T)
        ctx = Context(self.prefix_kv, bs, be, own, prefix_range=(ints[6], ints[7]) if self.ranges else None,
                      options=self.engine.options)
        self.engine.forward_scores(tokens, pos, ctx, rows, allowed, self.weight, self.logprobs,
                                   out=(scores, best))
        if copies:
            copy_bytes(self.dev_out, self.host_out, self._out_bytes(T), options=self.engine.options)

    def run(self, plan: Plan):
        T, R, N = plan.num_tokens, plan.rows.shape[0], self.N
        Tb = self.bucket_of[T]
        h, a, best, scores = self.views[Tb]
        n_in = self._in_bytes(Tb)
        # A one-request plan's input differs from the last one of its layout in the tokens only:
        # copy that image and write the tokens (2 numpy calls instead of ~15 on the latency path).
        key = (None if plan.layout is None or Tb > IMAGE_MAX_TOKENS else
               (Tb, plan.layout, plan.allowed.numpy().tobytes()))
        image = self.images.get(key)
        if image is not None:
            self.host_in_np[:n_in] = image
            h[0, :T] = plan.tokens.numpy()
        else:
            for i, x in enumerate((plan.tokens, plan.positions, plan.base_start, plan.base_end,
                                   plan.own_start)):
                h[i, :T] = x.numpy()
            if self.ranges:
                h[6, :T] = plan.prefix_start.numpy()
                h[7, :T] = plan.prefix_end.numpy()
            h[:, T:Tb] = 0
            h[4, T:Tb] = self.pad[T:Tb]
            h[5, :R] = plan.rows.numpy()
            h[5, R:Tb] = 0  # padding rows read token 0 (stale indices could point past this bucket)
            a[:R] = plan.allowed.numpy()
            a[R:Tb] = True
            if key is not None and len(self.images) < MAX_IMAGES:
                self.images[key] = self.host_in_np[:n_in].copy()
        if self.inline[Tb]:  # the graph copies the input in and the output out
            self.graphs[Tb].replay()
        else:
            self.dev_in[:n_in].copy_(self.host_in[:n_in], non_blocking=True)
            self.graphs[Tb].replay()
            n_out = 8 * Tb + 4 * R * N  # best (all Tb) and the first R rows of scores
            self.host_out[:n_out].copy_(self.dev_out[:n_out], non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the one host sync of the call
        return torch.from_numpy(scores[:R].copy()), torch.from_numpy(best[:R].copy())
