"""Engine: owns the model, the pinned prefix KV and the label-head weights, and runs batch plans.

The prefix KV is computed once per (model, template) and every batch attends to the same tensors
(no per-request copies). CPU runs each plan eagerly with the torch reference kernels.
"""
from __future__ import annotations

import torch

from .batch import Plan
from .kernels import label_head
from .loading import LoadedModel
from .model import Context


class Engine:
    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.lm_head = loaded.lm_head
        self.config = c = self.model.config
        self.device = self.lm_head.device
        self.dtype = self.lm_head.dtype
        empty = torch.empty(0, c.num_kv_heads, c.head_dim, device=self.device, dtype=self.dtype)
        self.no_prefix = [(empty, empty)] * c.num_layers

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
    def hidden(self, plan: Plan, prefix_kv) -> torch.Tensor:
        plan = plan.to(self.device)
        ctx = Context(prefix_kv, plan.base_start, plan.base_end, plan.own_start, plan.seg_offsets)
        return self.model(plan.tokens, plan.positions, ctx), plan

    @torch.inference_mode()
    def run(self, plan: Plan, prefix_kv, weight: torch.Tensor, logprobs: bool = True):
        """-> (scores [R, N] fp32, best [R]) for the plan's read-out rows."""
        h, plan = self.hidden(plan, prefix_kv)
        m = self.model
        return label_head(h, plan.rows, m.norm.weight, m.norm.eps, weight, plan.allowed, logprobs)
