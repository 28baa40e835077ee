"""Engine: owns the model, the pinned prefix KV and the label-head weights, and runs batch plans.

The prefix KV is computed once per (model, template) and every batch attends to the same tensors
(no per-request copies). CPU runs each plan eagerly with the torch reference kernels. On CUDA,
`capture()` records one CUDA graph per token-count bucket over static buffers; a call then writes
the plan into one pinned host buffer, copies it with one H2D copy, replays, and reads the result
back with one sync.
"""
from __future__ import annotations

import time

import torch

from .batch import Plan
from .kernels import label_head
from .loading import LoadedModel
from .model import Context

BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# Past 8192 tokens a batch keeps the GPU busy for milliseconds, so launches hide behind it and a
# graph would only add padding (W3: 15,050 tokens padded to 16,384 was 9% waste): run eagerly.
GRAPH_MAX_TOKENS = BUCKETS[-1]


class Engine:
    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.lm_head = loaded.lm_head
        self.config = c = self.model.config
        self.device = self.lm_head.device
        self.dtype = self.lm_head.dtype
        empty = torch.empty(0, c.num_kv_heads, c.head_dim, device=self.device, dtype=self.dtype)
        self.no_prefix = [(empty, empty)] * c.num_layers
        self.graphs: dict[tuple, GraphRunner] = {}

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of the prefix tokens for every layer, [P, Hkv, D] each: a causal pass with no cache."""
        if not ids:
            return self.no_prefix
        P = len(ids)
        zeros = torch.zeros(P, dtype=torch.int32, device=self.device)
        kv: list = []
        ctx = Context(self.no_prefix, zeros, zeros, zeros, torch.tensor([0, P]), kv_out=kv)
        self.model(torch.tensor(ids, device=self.device), torch.arange(P, device=self.device), ctx)
        return [(k.contiguous(), v.contiguous()) for k, v in kv]

    def label_weight(self, columns: list[int]) -> torch.Tensor:
        """The output head's rows for the label tokens only: an N-row projection, never the vocab."""
        return self.lm_head[torch.tensor(columns, device=self.device)].contiguous()

    @torch.inference_mode()
    def hidden(self, plan: Plan, prefix_kv):
        plan = plan.to(self.device)
        ctx = Context(prefix_kv, plan.base_start, plan.base_end, plan.own_start, plan.seg_offsets)
        return self.model(plan.tokens, plan.positions, ctx), plan

    @torch.inference_mode()
    def forward_scores(self, tokens, positions, ctx, rows, allowed, weight, logprobs):
        m = self.model
        h = m(tokens, positions, ctx)
        return label_head(h, rows, m.norm.weight, m.norm.eps, weight, allowed, logprobs)

    def run(self, plan: Plan, prefix_kv, weight: torch.Tensor, logprobs: bool = True):
        """-> (scores [R, N] fp32, best [R]) on the CPU for the plan's read-out rows."""
        return self.launch(plan, prefix_kv, weight, logprobs)()

    @torch.inference_mode()
    def launch(self, plan: Plan, prefix_kv, weight: torch.Tensor, logprobs: bool = True):
        """Queue the plan's forward and return `collect()`, which waits for it and returns what
        run() returns. On CUDA an eager (past the graphs) forward is queued without a host sync,
        so the host can prepare the next plan while the GPU works. Graph replays share static
        buffers: they finish before launch returns."""
        g = self.graphs.get((id(prefix_kv), id(weight), logprobs))
        if g is not None and plan.num_tokens <= g.max_tokens:
            out = g.run(plan)
            return lambda: out
        cuda = self.device.type == "cuda"
        p = plan.pinned().to(self.device) if cuda else plan  # pinned: the copies do not block
        ctx = Context(prefix_kv, p.base_start, p.base_end, p.own_start, p.seg_offsets)
        scores, best = self.forward_scores(p.tokens, p.positions, ctx, p.rows, p.allowed, weight,
                                           logprobs)
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

    def capture(self, prefix_kv, weight, logprobs: bool, max_tokens: int) -> dict:
        """CUDA graphs for every bucket up to max_tokens; returns capture time and memory."""
        if self.device.type != "cuda":
            return {}
        torch.cuda.synchronize()
        mem0, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        runner = GraphRunner(self, prefix_kv, weight, logprobs, min(max_tokens, GRAPH_MAX_TOKENS))
        self.graphs[(id(prefix_kv), id(weight), logprobs)] = runner
        torch.cuda.synchronize()
        return {"capture_s": time.perf_counter() - t0, "buckets": runner.buckets,
                "graph_mem_mb": (torch.cuda.memory_reserved() - mem0) / 2**20}  # pools + buffers


class GraphRunner:
    """Static buffers + one CUDA graph per token bucket for one (prefix, label weight, mode).

    Int inputs (tokens, positions, base_start, base_end, own_start, rows) live in one flat int32
    buffer that bucket Tb reads as [6, Tb] from its start, so a call is one contiguous H2D copy
    (torch stages a strided slice of a [6, Tmax] buffer through a temporary). Padding tokens see
    only themselves and the prefix; padding rows read token 0 with every label allowed; their
    outputs are never read.
    """

    def __init__(self, engine: Engine, prefix_kv, weight, logprobs, max_tokens):
        self.engine, self.prefix_kv, self.weight, self.logprobs = engine, prefix_kv, weight, logprobs
        self.buckets = [b for b in BUCKETS if b < max_tokens] + [next(b for b in BUCKETS if b >= max_tokens)]
        self.max_tokens = Tmax = self.buckets[-1]
        N, dev = weight.shape[0], engine.device
        self.host = torch.zeros(6 * Tmax, dtype=torch.int32).pin_memory()
        self.host_allowed = torch.ones(Tmax, N, dtype=torch.bool).pin_memory()
        self.ints = torch.zeros(6 * Tmax, dtype=torch.int32, device=dev)
        self.allowed = torch.ones(Tmax, N, dtype=torch.bool, device=dev)
        self.out_scores = torch.empty(Tmax, N).pin_memory()
        self.out_best = torch.empty(Tmax, dtype=torch.int64).pin_memory()
        self.pad = torch.arange(Tmax, dtype=torch.int32)
        self.host_np, self.host_allowed_np, self.pad_np = (
            self.host.numpy(), self.host_allowed.numpy(), self.pad.numpy())
        self.graphs, self.outputs = {}, {}
        pool = None
        for T in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self.ints[4 * T:5 * T] = self.pad[:T].to(dev)  # own_start = t: valid visibility everywhere
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self._body(T)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[T] = self._body(T)
            pool = g.pool()
            self.graphs[T] = g

    def _body(self, T):
        tokens, pos, bs, be, own, rows = self.ints[:6 * T].view(6, T)
        ctx = Context(self.prefix_kv, bs, be, own)
        return self.engine.forward_scores(tokens, pos, ctx, rows, self.allowed[:T], self.weight,
                                          self.logprobs)

    def run(self, plan: Plan):
        T, R = plan.num_tokens, plan.rows.shape[0]
        Tb = next(b for b in self.buckets if b >= T)
        h = self.host_np[:6 * Tb].reshape(6, Tb)  # numpy views of the pinned buffers: cheap writes
        a = self.host_allowed_np
        for i, x in enumerate((plan.tokens, plan.positions, plan.base_start, plan.base_end,
                               plan.own_start)):
            h[i, :T] = x.numpy()
        h[:, T:Tb] = 0
        h[4, T:Tb] = self.pad_np[T:Tb]
        h[5, :R] = plan.rows.numpy()
        h[5, R:Tb] = 0  # padding rows read token 0 (stale indices could point past this bucket)
        a[:R] = plan.allowed.numpy()
        a[R:Tb] = True
        self.ints[:6 * Tb].copy_(self.host[:6 * Tb], non_blocking=True)
        self.allowed[:Tb].copy_(self.host_allowed[:Tb], non_blocking=True)
        self.graphs[Tb].replay()
        scores, best = self.outputs[Tb]
        self.out_scores[:R].copy_(scores[:R], non_blocking=True)
        self.out_best[:R].copy_(best[:R], non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the one host sync of the call
        return self.out_scores[:R].clone(), self.out_best[:R].clone()
