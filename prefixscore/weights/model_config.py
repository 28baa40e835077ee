"""Model configuration: the handful of numbers the forward pass needs, read from a transformers config
(which itself comes from config.json or from GGUF metadata)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ModelLoadError

# model_type -> our family. All four share the Llama block; the differences are flags below.
SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# RoPE variants, computed by transformers' ROPE_INIT_FUNCTIONS (model.rope_inv_freq). "dynamic" only
# rescales past max_position_embeddings, which is our context limit anyway; "longrope" is capped
# below (context_limit).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters(hf) -> dict:
    rp = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (and Llama, Qwen3 with attention_bias)
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    mlp_bias: bool = False
    o_bias: bool = False  # Llama, Qwen3 with attention_bias (Qwen2: q/k/v bias only)
    sliding_window: int | None = None
    hf_config: object = field(default=None, repr=False)  # kept for transformers' RoPE variants

    @classmethod
    def from_hf(cls, cfg) -> "ModelConfig":
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED:
            raise ModelLoadError(
                f"unsupported architecture {mt!r}: prefixscore supports {', '.join(sorted(SUPPORTED))}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            v = getattr(cfg, key, None)
            if not isinstance(v, int) or v <= 0:
                raise ModelLoadError(f"config: {key} must be a positive integer, got {v!r}")
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # the MLP is silu(gate) * up, nothing else
            raise ModelLoadError(f"config: hidden_act {act!r} is not supported (only silu/swish)")
        rope_type = rope_parameters(cfg)["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"config: rope_type {rope_type!r} is not supported "
                                 f"(supported: {', '.join(ROPE_TYPES)})")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        sw = getattr(cfg, "sliding_window", None)
        if mt == "qwen2" and not getattr(cfg, "use_sliding_window", False):
            sw = None
        # Biases as transformers builds them: Llama and Qwen3 put attention_bias on q/k/v and o,
        # Qwen2 always has q/k/v bias and no o bias, Mistral none; only Llama has mlp_bias.
        attn_bias = mt in ("llama", "qwen3") and bool(getattr(cfg, "attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position=getattr(cfg, "max_position_embeddings", None) or 2048,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attn_bias,
            qk_norm=mt == "qwen3",
            mlp_bias=mt == "llama" and bool(getattr(cfg, "mlp_bias", False)),
            o_bias=attn_bias,
            sliding_window=sw,
            hf_config=cfg,
        )

    @property
    def context_limit(self) -> int:
        """Longest prompt (in tokens) the model can attend over exactly."""
        limit = self.max_position
        if self.sliding_window:
            limit = min(limit, self.sliding_window)
        rp = rope_parameters(self.hf_config)
        if rp["rope_type"] == "longrope":
            # transformers switches every position, the cached prefix's too, from short_factor to
            # long_factor once a sequence passes original_max_position_embeddings: stop there
            # (short_factor, exact) rather than compute something no HF forward computes.
            limit = min(limit, rp.get("original_max_position_embeddings") or limit)
        return limit
