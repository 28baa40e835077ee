"""Model configuration: the handful of numbers the forward pass needs, read from a transformers config
(which itself comes from config.json or from GGUF metadata)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ModelLoadError

# model_type -> our family. All four share the Llama block; the differences are flags below.
SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


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
    qkv_bias: bool  # Qwen2 (and Llama with attention_bias)
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    mlp_bias: bool = False
    sliding_window: int | None = None
    hf_config: object = field(default=None, repr=False)  # kept for transformers' RoPE variants

    @classmethod
    def from_hf(cls, cfg) -> "ModelConfig":
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED:
            raise ModelLoadError(
                f"unsupported architecture {mt!r}: prefixscore supports {', '.join(sorted(SUPPORTED))}"
            )
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        sw = getattr(cfg, "sliding_window", None)
        if mt == "qwen2" and not getattr(cfg, "use_sliding_window", False):
            sw = None
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
            max_position=getattr(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=mt == "qwen3",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            sliding_window=sw,
            hf_config=cfg,
        )

    @property
    def context_limit(self) -> int:
        """Longest prompt (in tokens) the model can attend over exactly."""
        if self.sliding_window:
            return min(self.max_position, self.sliding_window)
        return self.max_position
