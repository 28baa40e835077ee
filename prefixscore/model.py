"""The transformer math, over a flat batch of tokens [T, hidden] with no padding.

Llama / Mistral / Qwen2 / Qwen3 share this block: RMSNorm -> QKV (+bias for Qwen2) -> (per-head
RMSNorm for Qwen3) -> RoPE -> attention (pinned prefix + in-batch ranges) -> O -> residual ->
RMSNorm -> SiLU(gate) * up -> down -> residual. Module names follow Hugging Face so a HF state dict
loads as is. The vocabulary head is not here: only its label-token rows are used (kernels/label_head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kernels import attention
from .kernels.label_head import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        D = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * D, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * D, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * D, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * D, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(D, c.rms_norm_eps)
            self.k_norm = RMSNorm(D, c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: "Context", layer: int):
        T, c = x.shape[0], self.c
        q = self.q_proj(x).view(T, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(T, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.kv_out is not None:  # building the prefix cache: keep post-RoPE K/V
            ctx.kv_out.append((k, v))
        pk, pv = ctx.prefix_kv[layer]
        o = attention(q, k, v, pk, pv, ctx.base_start, ctx.base_end, ctx.own_start,
                      c.head_dim ** -0.5, ctx.seg_offsets)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x, cos, sin):
    """x [T, H, D]; cos/sin [T, D] (HF's non-interleaved layout)."""
    return (x * cos[:, None] + rotate_half(x) * sin[:, None]).to(x.dtype)


def rope_inv_freq(c: ModelConfig):
    """Inverse frequencies and attention scaling, via transformers for the scaled RoPE variants."""
    hf = c.hf_config
    rp = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        return inv_freq.float(), float(scaling)
    theta = rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    D = c.head_dim
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)), 1.0


@dataclass
class Context:
    """What the attention of every layer needs besides the hidden states (built once per batch)."""
    prefix_kv: list  # per layer (k [P, Hkv, D], v [P, Hkv, D])
    base_start: torch.Tensor
    base_end: torch.Tensor
    own_start: torch.Tensor
    seg_offsets: torch.Tensor | None = None  # CPU hint for the torch reference only
    kv_out: list | None = None


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inv_freq, self.rope_scaling = rope_inv_freq(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions, dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    def forward(self, tokens, positions, ctx: Context):
        """tokens, positions [T] -> hidden states [T, hidden] before the final norm."""
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx, i)
        return x
