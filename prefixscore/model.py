"""The transformer math, over a flat batch of tokens [T, hidden] with no padding.

Llama / Mistral / Qwen2 / Qwen3 share this block, x being the residual stream:
    q, k, v = split(RMSNorm(x) @ Wqkv (+ bias, Qwen2))   (Q, K, V fused into one GEMM)
    q, k = RoPE(RMSNorm_head(q), RMSNorm_head(k))        (per-head norm for Qwen3 only)
    x = x + attention(q, k, v | pinned prefix K/V, in-batch visibility ranges) @ Wo (+ bias)
    h = RMSNorm(x)
    x = x + (silu(h @ Wgate) * (h @ Wup)) @ Wdown        (gate/up fused into one GEMM)
Each RMSNorm's weight is folded into the columns of the linear after it at load (fuse(): W' = W
diag(w), one rounding of W' in bf16), so the norm left to compute is a per-row scale 1/rms(x) that
commutes with the GEMM. For small T on CUDA (kernels/gemm) RoPE and SiLU*mul are GEMM epilogues,
each residual add is the epilogue of the GEMM before it (O, down), which also leaves the row sums
of squares, each 1/rms scale the epilogue of the GEMM after it (QKV, gate/up; Normed), and the
attention runs inside the O GEMM (kernels/attention_o_triton.py): four kernels per layer.
Module names follow Hugging Face so a HF state dict loads as is; `fuse()` then concatenates the
weights. The vocabulary head is not here: only its label-token rows are used (kernels/label_head).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .weights.model_config import ModelConfig, rope_parameters
from .errors import ModelLoadError
from .kernels.attention import attention, attention_o
from .kernels.attention_cpu import group_layout
from .kernels.fp8 import Fp8Weight, fp16_input_scale
from .kernels.fused import embed_rope
from .kernels.gemm import Normed, gate_up_silu, linear_residual, qkv_rope
from .kernels.options import KernelOptions


def fold(w, norm_weight):
    """W diag(norm_weight): RMSNorm(x) @ W^T == (x / rms(x)) @ fold(W, norm_weight)^T."""
    return (w.float() * norm_weight.float()[None, :]).to(w.dtype).contiguous()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        D = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * D, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * D, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * D, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * D, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(D, c.rms_norm_eps)
            self.k_norm = RMSNorm(D, c.rms_norm_eps)

    def fuse(self, norm_weight):
        p = (self.q_proj, self.k_proj, self.v_proj)
        self.wqkv = fold(torch.cat([m.weight for m in p]), norm_weight)
        self.bqkv = torch.cat([m.bias for m in p]).contiguous() if self.c.qkv_bias else None
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, h: Normed, residual, cos, sin, ctx: "Context", layer: int, rows=None):
        """rows: the query rows to compute past the K/V (Transformer.forward's last layer)."""
        c = self.c
        qn = (self.q_norm.weight, self.k_norm.weight) if c.qk_norm else (None, None)
        q, k, v = qkv_rope(h, self.wqkv, self.bqkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim,
                           *qn, c.rms_norm_eps, options=ctx.options)
        if ctx.kv_out is not None:  # building the prefix cache: keep post-RoPE K/V
            ctx.kv_out.append((k, v))
        pk, pv = ctx.prefix_kv[layer]
        if rows is not None:  # every row's K/V, then only the read rows' attention and O
            o = attention(q, k, v, pk, pv, ctx.base_start, ctx.base_end, ctx.own_start,
                          c.head_dim ** -0.5, prefix_range=ctx.prefix_range, options=ctx.options,
                          rows=rows)
            return linear_residual(o.reshape(o.shape[0], -1), self.o_proj.weight, self.o_proj.bias,
                                   residual[rows], options=ctx.options, inplace=True)
        if ctx.layout is None and not q.is_cuda:  # CPU: groups of rows and masks once per forward
            ctx.layout = group_layout(ctx.base_start, ctx.base_end, ctx.own_start, pk.shape[0],
                                      ctx.prefix_range)
        return attention_o(q, k, v, pk, pv, ctx.base_start, ctx.base_end, ctx.own_start,
                           c.head_dim ** -0.5, self.o_proj.weight, residual, ctx.seg_offsets,
                           ctx.layout, self.o_proj.bias, ctx.prefix_range, options=ctx.options,
                           inplace=True)  # (the stream is this forward's own: Block.forward)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.bias = c.mlp_bias
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def fuse(self, norm_weight):
        self.wgu = fold(torch.cat([self.gate_proj.weight, self.up_proj.weight]), norm_weight)
        self.bgu = torch.cat([self.gate_proj.bias, self.up_proj.bias]) if self.bias else None
        del self.gate_proj, self.up_proj

    def forward(self, h: Normed, residual, options: KernelOptions):
        gu = gate_up_silu(h, self.wgu, self.bgu, options=options)
        return linear_residual(gu, self.down_proj.weight, self.down_proj.bias, residual, options=options,
                               inplace=True)


class Fp8Linear(nn.Module):
    """An nn.Linear with its weight in e4m3 and per-row scales (kernels/fp8.py); bias unchanged."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.weight = Fp8Weight.quantize(lin.weight)  # (a plain attribute: not a tensor)
        self.bias = lin.bias


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, ssq, cos, sin, ctx, layer, rows=None):
        """x: the residual stream; ssq: its per-row sums of squares if the GEMM that wrote x left
        them (then the norm is a scale in the next GEMM's epilogue). -> the same for the next layer
        (rows: for those rows only). The stream belongs to this forward: past the skinny kernels
        the O and down GEMMs add into it in place (gemm.linear_residual), each after the last read
        of the value it replaces."""
        x, ssq = self.self_attn(Normed(x, ssq, self.input_layernorm.eps), x, cos, sin, ctx, layer, rows)
        return self.mlp(Normed(x, ssq, self.post_attention_layernorm.eps), x, ctx.options)

    def fuse(self):
        self.self_attn.fuse(self.input_layernorm.weight)
        self.mlp.fuse(self.post_attention_layernorm.weight)


def rope_inv_freq(c: ModelConfig):
    """fp32 inverse frequencies [D/2] and attention scaling, via transformers for the scaled RoPE
    variants; on the CPU, as the model is built on the meta device and these are not weights."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, D = c.hf_config, c.head_dim
    rp = rope_parameters(hf)
    with torch.device("cpu"):
        if rp["rope_type"] == "default":
            theta = rp.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
            return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)), 1.0
        try:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rp["rope_type"]](hf, "cpu")
        except (KeyError, ValueError, TypeError, ZeroDivisionError) as e:
            raise ModelLoadError(f"config: bad {rp['rope_type']!r} rope parameters {rp} ({e!r})") from None
    if inv_freq.shape != (D // 2,):  # e.g. partial_rotary_factor, which this block does not apply
        raise ModelLoadError(f"config: RoPE over {2 * inv_freq.numel()} of {D} head dims is not supported")
    return inv_freq.float(), float(scaling)


@dataclass
class Context:
    """What the attention of every layer needs besides the hidden states (built once per batch)."""
    prefix_kv: list  # per layer (k [P, Hkv, D], v [P, Hkv, D])
    base_start: torch.Tensor
    base_end: torch.Tensor
    own_start: torch.Tensor
    seg_offsets: torch.Tensor | None = None  # CPU hint for the torch reference only
    kv_out: list | None = None
    layout: list | None = None  # CPU attention's groups of rows and masks (kernels/attention_cpu.py)
    # (prefix_start, prefix_end) int32 [T]: the pinned keys each token sees, when prefix_kv is a
    # bank of several classifiers' prefixes (kernels/attention.py); None: all of them.
    prefix_range: tuple | None = None
    # The engine's kernel switches, passed to every kernel of the forward (kernels/options.py): a
    # keyword every Context is built with, so no forward runs with options the engine did not fix.
    options: KernelOptions = field(kw_only=True)


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # A plain fp32 attribute, not a buffer, so model.to(bf16) cannot round it (HF keeps it fp32:
        # bf16 frequencies put the angle of position 2000 off by radians).
        self.inv_freq, self.rope_scaling = rope_inv_freq(c)
        self._rope_tables: dict = {}

    def fuse(self):
        """Concatenate Q/K/V and gate/up weights, folding in the norms (after loading HF names)."""
        for layer in self.layers:
            layer.fuse()
        return self

    def quantize_fp8(self):
        """After fuse(): every block's linear weights (QKV with its norm folded in, O, gate/up
        with its norm, down) to e4m3 with one scale per output row. Embeddings, norms and biases
        stay in the model's dtype (kernels/fp8.py)."""
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            a.wqkv, m.wgu = Fp8Weight.quantize(a.wqkv), Fp8Weight.quantize(m.wgu)
            a.o_proj, m.down_proj = Fp8Linear(a.o_proj), Fp8Linear(m.down_proj)
            # down's input is bounded by gate/up's weights: it may multiply in fp16 (fp8_fp16)
            m.down_proj.weight.x_scale = fp16_input_scale(m.wgu, m.bgu)
        return self

    def weight_bytes(self, *extra: torch.Tensor) -> int:
        """Bytes of every weight the forward reads (and of `extra` tensors, e.g. the output head),
        each storage once: parameters, the fused QKV and gate/up tensors (plain attributes after
        fuse()) and FP8 weights with their scales."""
        seen = {}
        for v in [*extra, *(v for mod in self.modules()
                             for v in [*mod._parameters.values(), *vars(mod).values()])]:
            for t in ((v.q, v.scale) if isinstance(v, Fp8Weight) else (v,) if torch.is_tensor(v) else ()):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def rope(self, positions, dtype):
        """cos, sin [T, D] in dtype, computed in fp32 as HF does."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device, torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    def rope_table(self, device, dtype):
        """rope() of every position the model takes, built on first use (before any graph capture):
        a forward gathers its rows, the same values, in the kernel that gathers the embeddings."""
        key = (str(device), dtype)
        if key not in self._rope_tables:
            pos = torch.arange(self.config.context_limit, device=device)
            self._rope_tables[key] = self.rope(pos, dtype)
        return self._rope_tables[key]

    def forward(self, tokens, positions, ctx: Context, soft=None, rows=None):
        """tokens, positions [T] -> hidden states [T, hidden] before the final norm. soft: (src [T]
        int, table [E, hidden]): row t's input is table[src[t]], not its token's embedding, where
        src[t] >= 0 (as transformers' inputs_embeds; static shapes, so a graph takes it). rows
        (int [R], on the model's device): -> [R, hidden], the
        hidden states of those rows only. The last layer then computes its K/V for every row (those
        rows attend to them) and its attention, O and MLP for those rows only: a pass reads one row
        per query or item, so W3 (100 items of 150 tokens) skips ~96% of one layer in 24."""
        emb = self.embed_tokens.weight
        # x, its rows' sums of squares for layer 0's norm (fused path; else None), RoPE's cos/sin
        x, ssq, cos, sin = embed_rope(tokens, positions, emb, *self.rope_table(emb.device, emb.dtype),
                                      options=ctx.options)
        if soft is not None:
            src, table = soft
            on = src >= 0
            vec = table.index_select(0, src.clamp(min=0)).to(x.dtype)
            x = torch.where(on[:, None], vec, x)
            if ssq is not None:  # [1, T]: the overridden rows' sums of squares, as embed_rope's
                ssq = torch.where(on[None], vec.float().square().sum(-1)[None], ssq)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, ssq = layer(x, ssq, cos, sin, ctx, i, rows if i == last else None)
        return x
