"""CUDA graphs of an engine's passes: static buffers and one graph per token bucket (engine.py).

A GraphRunner serves one (prefix K/V, label weight, mode) of an Engine: a call writes the plan
into a pinned host buffer and replays its bucket's graph. The graphs of the small buckets hold
their H2D and D2H copies too, as kernels reading and writing the pinned buffers in place (one
launch per call); the large ones copy only the rows used, around the replay. Two slots of host
buffers let a pass be launched while the one before it runs (launch(), collect() later).
"""
from __future__ import annotations

import gc

import numpy as np
import torch

from .batch import Plan
from .model import Context
from .overlap import collector_paused

# Short requests get their own small buckets: the graph of a bucket does its padding tokens' work
# too, so a request replays the smallest bucket that holds it (BENCHMARKS.md, the latency buckets).
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# Past 8192 tokens a batch keeps the GPU busy for milliseconds, so launches hide behind it and a
# graph would only add padding (W3's passes padded to the next bucket: BENCHMARKS.md): run eagerly.
GRAPH_MAX_TOKENS = BUCKETS[-1]
# Buckets whose input + output bytes are at most this copy them inside their graph (the whole
# buffers, used rows or not); larger ones copy around the replay, only what the call uses.
GRAPH_COPY_MAX_BYTES = 1 << 20  # (KernelOptions.graph_copies False: every bucket copies around)
# GraphRunner.run keeps the filled input of one-request plans up to this many tokens, one per
# layout (suffix length x first position: at most a few hundred, each <= 64 * (24 + N) bytes).
IMAGE_MAX_TOKENS, MAX_IMAGES = 64, 1024
# The int32 rows every GraphRunner input starts with (GraphRunner.row names them all).
ROWS = ["tokens", "positions", "base_start", "base_end", "own_start", "rows"]
# Host buffer slots of a GraphRunner: one pass filled while the one before it runs (launch()).
SLOTS = 2
# A vocabulary graph (GraphRunner vocab=N) computes the whole vocabulary's logits for this many
# read-out rows of a bucket at most (a row a multi-item pass's item): [rows, vocab] fp32 in the pool.
VOCAB_ROWS = 256


class GraphRunner:
    """Static buffers + one CUDA graph per token bucket for one (prefix, label weight, mode).

    A call's inputs are one byte buffer, laid out per bucket Tb as int32 rows [rows_in, Tb]
    (ROWS: tokens, positions, base_start, base_end, own_start, read-out rows; the optional rows
    after them), then allowed [Tb, N] (bool), then with label tokens as an input those tokens [N]
    (int64), so they travel in one contiguous H2D copy; the label head writes best [Tb] (int64)
    and scores [Tb, N] (fp32) into one output byte buffer, read back with one D2H copy. Each
    bucket's graph is captured on its own views of the two buffers. Padding tokens see only
    themselves and the prefix; padding rows read token 0 with every label allowed; their outputs
    are never read. Embedding items (soft) bring their vectors in a table of their own, copied
    around the replay, as many rows as the pass has.
    """

    def __init__(self, engine, prefix_kv, weight, logprobs, max_tokens, ranges: bool = False,
                 vocab: int = 0, write_kv: int | None = None, labels: int = 0, soft: bool = False):
        """vocab: instead of a label head (weight None), each read-out row's probabilities of up
        to `vocab` tokens under the whole vocabulary (Engine.vocab_head: SGLang's /v1/score
        default), the tokens an input of the call (any label set of that many single tokens), for
        the first VOCAB_ROWS read-out rows of a bucket at most. labels (weight None): a label head
        over any `labels` tokens, an input of the call, their rows of the output head gathered in
        the graph (a score request's own label set). write_kv (with ranges, prefix_kv an
        engine.KVBank's): no head; each layer's K/V of the pass's tokens written to the bank rows
        of the plan's kv_dst, a padding token's to row write_kv (a chunk of Engine.extend).
        soft: plans may carry embedding items (Plan.soft)."""
        self.engine, self.prefix_kv, self.weight, self.logprobs = engine, prefix_kv, weight, logprobs
        self.ranges, self.vocab, self.write_kv, self.labels, self.soft = ranges, vocab, write_kv, labels, soft
        assert write_kv is None or ranges
        names = ROWS + ["prefix_start", "prefix_end"] * ranges + ["kv_dst"] * (write_kv is not None)
        self.row = {n: i for i, n in enumerate(names + ["soft_src"] * soft)}
        self.rows_in = len(self.row)
        # the rows a plan gives token by token, under the same names (_fill)
        self.plan_rows = [(self.row[n], n) for n in names if n != "rows"]
        self.buckets = [b for b in BUCKETS if b < max_tokens] + [next(b for b in BUCKETS if b >= max_tokens)]
        self.max_tokens = Tmax = self.buckets[-1]
        self.N = vocab or labels or (1 if weight is None else weight.shape[0])
        dev = engine.device
        # Two slots of pinned host buffers, used in turn, so a pass can be launched while the one
        # before it runs (launch(); its collect() later): the host fills one slot while the GPU
        # reads the other. The device buffers are one set: replays run in stream order.
        self.slots = [(torch.zeros(self._in_bytes(Tmax), dtype=torch.uint8).pin_memory(),
                       torch.zeros(self._out_bytes(Tmax), dtype=torch.uint8).pin_memory())
                      for _ in range(SLOTS)]
        self.dev_in = torch.zeros_like(self.slots[0][0], device=dev)
        self.dev_out = torch.zeros_like(self.slots[0][1], device=dev)
        if soft:  # per slot a host table of the pass's vectors, and the one the graphs read
            H, dt = engine.config.hidden_size, engine.dtype
            self.soft_tables = [torch.zeros(Tmax, H, dtype=dt).pin_memory() for _ in range(SLOTS)]
            self.dev_soft = torch.zeros(Tmax, H, dtype=dt, device=dev)
        if labels:  # the label tokens' rows of the output head, gathered by each replay
            self.dev_weight = torch.zeros(labels, engine.config.hidden_size, dtype=engine.dtype, device=dev)
        self.pad = np.arange(Tmax, dtype=np.int32)
        self.bucket_of = [next(b for b in self.buckets if b >= T) for T in range(Tmax + 1)]
        self.idle = {T: self._idle(T) for T in self.buckets}  # each bucket's padding input
        self.images: dict[tuple, np.ndarray] = {}  # one-request layout -> its filled input (run)
        # per slot: bucket -> numpy views of its pinned buffers (ints, allowed, columns, best, scores)
        self.views = [{} for _ in range(SLOTS)]
        for s, (hin, hout) in enumerate(self.slots):
            for T in self.buckets:
                self.views[s][T] = (*self._split_in(hin.numpy(), T), *self._split_out(hout.numpy(), T))
        self.turn = 0  # the slot the next launch uses
        self.inflight: list = [None] * SLOTS  # per slot: the collect() of its pass not yet collected
        self.graphs = {}  # bucket -> slot 0's graph (benches replay it)
        self.slot_graphs: dict[int, list] = {}  # bucket -> per slot its graph (one, shared, when
        # the graph copies around: only a graph whose copies are inside it reads a slot's buffers)
        # copies in the graph: the bucket's whole input and output buffers
        opts = engine.options
        copies = opts.graph_copies and opts.use_triton  # (the plain-torch baseline copies around)
        self.inline = {T: copies and self._in_bytes(T) + self._out_bytes(T) <= GRAPH_COPY_MAX_BYTES
                       for T in self.buckets}
        self._capture(engine)

    def _capture(self, engine):
        # No garbage collection while capturing: a dead runner's graphs freed by the collector
        # mid-capture (CUDAGraph reset) invalidate the capture under way, the whole process's
        # in CUDA's global capture mode. Collect before, as SGLang's capture does.
        gc.collect()
        with collector_paused():
            self._capture_buckets(engine)

    def _capture_buckets(self, engine):
        pool = engine.pool
        # Warm up on the stream that captures: what a kernel caches per stream (the skinny GEMMs'
        # split-K counters) then exists before the capture, which would otherwise record its
        # zero-fill into every replay (a torch kernel between two PDL launches).
        # One capture stream per engine: the allocator reuses a freed block only on the stream
        # that freed it, so runners captured on streams of their own each grew the shared pool by
        # a whole bucket set (a second classifier's graphs then cost most of the weights again).
        if engine.capture_stream is None:
            engine.capture_stream = torch.cuda.Stream(engine.device)
        stream = engine.capture_stream
        stream.wait_stream(torch.cuda.current_stream(engine.device))
        all_allowed = not self.vocab  # (vocab: token 0 in every column)
        for T in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            ints, allowed, cols = self._split_in(self.dev_in, T)
            ints.copy_(torch.from_numpy(self.idle[T]))  # valid visibility everywhere, all allowed
            if allowed is not None:
                allowed.fill_(all_allowed)
            if cols is not None:
                cols.zero_()
            for views in self.views:  # the same in the host buffers, which an inline copy reads
                h, a, c = views[T][:3]
                h[:] = self.idle[T]
                if a is not None:
                    a[:] = all_allowed
                if c is not None:
                    c[:] = 0
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                    self._body(T, 0)
            torch.cuda.synchronize()
            self.slot_graphs[T] = []
            for slot in range(SLOTS if self.inline[T] else 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self._body(T, slot)
                pool = engine.pool = g.pool()
                self.slot_graphs[T].append(g)
            self.graphs[T] = self.slot_graphs[T][0]

    def rows_of(self, T: int) -> int:
        """Read-out rows a pass of bucket T may have."""
        return min(T, VOCAB_ROWS) if self.vocab else T

    def _in_parts(self, T):
        """Byte offsets of the input's parts: ints, allowed (none with vocab), columns (vocab or
        labels: 8-byte aligned), and the end."""
        a = 4 * self.rows_in * T
        c = a + (0 if self.vocab else T * self.N)
        c += -c % 8
        return a, c, c + (8 * self.N if self.vocab or self.labels else 0)

    def _in_bytes(self, T):
        return self._in_parts(T)[2]

    def _out_bytes(self, T):
        return 8 * T + 4 * T * self.N

    def _split_in(self, buf, T):
        """(ints [rows_in, T] int32, allowed [T, N] bool or None, columns [N] int64 or None)
        views of a byte buffer (torch or numpy)."""
        numpy = isinstance(buf, np.ndarray)
        i32, b8, i64 = (np.int32, np.bool_, np.int64) if numpy else (torch.int32, torch.bool, torch.int64)
        a, c, end = self._in_parts(T)
        return (buf[:a].view(i32).reshape(self.rows_in, T),
                None if self.vocab else buf[a:a + T * self.N].view(b8).reshape(T, self.N),
                buf[c:end].view(i64) if end > c else None)

    def _split_out(self, buf, T):
        """(best [T] int64, scores [T, N] fp32) views of a byte buffer (torch or numpy)."""
        i64, f32 = (np.int64, np.float32) if isinstance(buf, np.ndarray) else (torch.int64, torch.float32)
        return buf[:8 * T].view(i64), buf[8 * T:self._out_bytes(T)].view(f32).reshape(T, self.N)

    def _idle(self, T):
        ints = np.zeros((self.rows_in, T), dtype=np.int32)  # (a padding token's prefix range: empty)
        ints[self.row["own_start"]] = self.pad[:T]
        if self.write_kv is not None:
            ints[self.row["kv_dst"]] = self.write_kv
        if self.soft:
            ints[self.row["soft_src"]] = -1
        return ints

    def _fill(self, plan: Plan, h, a, c, tokens, T: int, Tb: int, R: int) -> None:
        """A plan into a slot's numpy views of bucket Tb: ints h, allowed a, label columns c."""
        row = self.row
        for i, name in self.plan_rows:
            h[i, :T] = getattr(plan, name).numpy()
        h[:, T:Tb] = self.idle[Tb][:, T:]  # padding tokens (_idle)
        h[row["rows"], :R] = plan.rows.numpy()
        h[row["rows"], R:T] = 0  # padding rows read token 0 (stale indices could point past this bucket)
        if self.soft:
            h[row["soft_src"], :T] = -1
            if plan.soft is not None:
                h[row["soft_src"], plan.soft_rows.numpy()] = np.arange(plan.soft.shape[0])
        if c is not None:
            c[:len(tokens)] = tokens
            c[len(tokens):] = 0
        if a is not None:
            n = plan.allowed.shape[1]
            a[:R, :n] = plan.allowed.numpy()
            a[:R, n:] = False
            a[R:Tb] = True

    @property
    def host_in(self) -> torch.Tensor:
        """The pinned input of the pass launched last."""
        return self.slots[self.turn - 1][0]

    def _body(self, T, slot):
        copies = self.inline[T]
        host_in, host_out = self.slots[slot]
        if copies:  # a kernel reads the pinned input in place
            from .kernels.fused_triton import copy_bytes  # (CUDA only: triton is imported lazily)

            copy_bytes(host_in, self.dev_in, self._in_bytes(T), options=self.engine.options)
        ints, allowed, cols = self._split_in(self.dev_in, T)
        r = lambda name: ints[self.row[name]]  # noqa: E731
        tokens, pos, rows = r("tokens"), r("positions"), r("rows")
        best, scores = self._split_out(self.dev_out, T)
        kv_out = [] if self.write_kv is not None else None
        ctx = Context(self.prefix_kv, r("base_start"), r("base_end"), r("own_start"),
                      prefix_range=(r("prefix_start"), r("prefix_end")) if self.ranges else None,
                      kv_out=kv_out, options=self.engine.options)
        soft = (r("soft_src"), self.dev_soft) if self.soft else None
        engine = self.engine
        if kv_out is not None:
            engine.model(tokens, pos, ctx)
            dst = r("kv_dst").long()
            for (k, v), (bk, bv) in zip(kv_out, self.prefix_kv):
                bk.index_copy_(0, dst, k)
                bv.index_copy_(0, dst, v)
        elif self.vocab:
            R = self.rows_of(T)
            engine.forward_vocab(tokens, pos, ctx, rows[:R], cols, out=scores[:R], soft=soft)
        else:
            weight = self.weight
            if self.labels:
                weight = torch.index_select(engine.lm_head, 0, cols, out=self.dev_weight)
            engine.forward_scores(tokens, pos, ctx, rows, allowed, weight, self.logprobs,
                                  out=(scores, best), soft=soft)
        if copies:
            copy_bytes(self.dev_out, host_out, self._out_bytes(T), options=self.engine.options)

    def run(self, plan: Plan, tokens=None):
        return self.launch(plan, tokens)()

    def fits(self, plan: Plan, tokens=None) -> bool:
        """Whether a plan (and its label tokens) can replay one of these graphs."""
        if plan.num_tokens > self.max_tokens or (plan.soft is not None and not self.soft):
            return False
        if self.vocab:
            return plan.rows.shape[0] <= self.rows_of(self.bucket_of[plan.num_tokens]) and len(tokens) <= self.N
        return not self.labels or len(tokens) <= self.N

    def launch(self, plan: Plan, tokens: list[int] | None = None):
        """Fill the next slot's input with the plan and replay its bucket's graph, without waiting
        for it; returns collect() -> (scores [R, N], best [R]) on the CPU, which waits for it. A
        slot's pass is collected (by its caller or here) before the slot is filled again, so at
        most SLOTS passes are in flight. tokens (vocab, labels): the label tokens, at most N (the
        plan's allowed columns); their columns of scores are the answer, the rest are not."""
        s = self.turn
        self.turn = (s + 1) % SLOTS
        if self.inflight[s] is not None:  # its buffers are about to be refilled
            self.inflight[s]()
        T, R, N = plan.num_tokens, plan.rows.shape[0], self.N
        Tb = self.bucket_of[T]
        h, a, c, best, scores = self.views[s][Tb]
        host_in, host_out = self.slots[s]
        host_in_np = host_in.numpy()
        n_in = self._in_bytes(Tb)
        # A one-request plan's input differs from the last one of its layout in the tokens only:
        # copy that image and write the tokens (2 numpy calls instead of ~15 on the latency path).
        key = (None if plan.layout is None or Tb > IMAGE_MAX_TOKENS or c is not None or self.soft
               else (Tb, plan.layout, plan.allowed.numpy().tobytes()))
        image = self.images.get(key)
        if image is not None:
            host_in_np[:n_in] = image
            h[0, :T] = plan.tokens.numpy()
        else:
            self._fill(plan, h, a, c, tokens, T, Tb, R)
            if key is not None and len(self.images) < MAX_IMAGES:
                self.images[key] = host_in_np[:n_in].copy()
        if plan.soft is not None:  # (the table is copied around the replay, its used rows only)
            E = plan.soft.shape[0]
            self.soft_tables[s][:E].copy_(plan.soft)
            self.dev_soft[:E].copy_(self.soft_tables[s][:E], non_blocking=True)
        graphs = self.slot_graphs[Tb]
        if self.inline[Tb]:  # the graph copies the input in and the output out
            graphs[s].replay()
        else:
            self.dev_in[:n_in].copy_(host_in[:n_in], non_blocking=True)
            graphs[0].replay()
            n_out = 8 * Tb + 4 * R * N  # best (all Tb) and the first R rows of scores
            host_out[:n_out].copy_(self.dev_out[:n_out], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        out = []

        def collect():
            if not out:
                done.synchronize()  # the one host sync of the pass
                out.append((torch.from_numpy(scores[:R].copy()), torch.from_numpy(best[:R].copy())))
                if self.inflight[s] is collect:
                    self.inflight[s] = None
            return out[0]

        self.inflight[s] = collect
        return collect
