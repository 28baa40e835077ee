"""LoRA adapter files at run time (as gpt-fast's convert_for_runtime): read one, check it was
trained for this model, template and labels, and merge W += (alpha / r) B @ A into the loaded
weights once, so the fast path runs the base model's kernels unchanged. Writing them lives in
prefixscore/train; the base model's identity (base_hash) in loading.py."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, ModelLoadError
from ..values import ADAPTER_OBJECTIVES  # noqa: F401 (weights.adapter.ADAPTER_OBJECTIVES)
from .tagged import read_tagged
from .loading import LoadedModel

ADAPTER_FORMAT = "prefixscore-adapter"
# The adapter shipped for the bundled model and the seed labels (prefixscore/adapters/README.md
# says how it was made); `adapter="seed"` / `--adapter seed` name it.
SEED_ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "seed.safetensors"
ADAPTER_VERSION = "1"
# HF projection name -> (module, the fused runtime weight it lives in, its row block in that weight)
_PROJ = {"q_proj": ("self_attn", "wqkv", 0), "k_proj": ("self_attn", "wqkv", 1),
         "v_proj": ("self_attn", "wqkv", 2), "o_proj": ("self_attn", "o_proj", 0),
         "gate_proj": ("mlp", "wgu", 0), "up_proj": ("mlp", "wgu", 1), "down_proj": ("mlp", "down_proj", 0)}


@dataclass
class Adapter:
    """An adapter file as written (CPU, fp32). lora: {"layers.{i}.{proj}": (A [r, in], B [out, r])};
    head: {"weight" [N, H], "bias" [N]} for objective "head", else None; meta: parsed metadata
    (base_hash, base_model, template, chat, labels, objective, rank, alpha, training)."""
    meta: dict
    lora: dict
    head: dict | None = None

    @property
    def scale(self) -> float:
        return self.meta["alpha"] / self.meta["rank"]

    def __repr__(self) -> str:  # one line, not the tensors
        m, t = self.meta, self.meta.get("training") or {}
        acc = f", val_acc {t['val_acc']:.3f}" if isinstance(t.get("val_acc"), float) else ""
        return (f"Adapter({m.get('objective')!r}, rank {m.get('rank')}, {len(self.lora)} matrices, "
                f"{len(m.get('labels') or [])} labels, base {m.get('base_model')!r}{acc})")

    def head_weights(self):
        """The trained head as heads.HeadWeights (linear; objective "head" only)."""
        from .heads import HeadWeights

        if self.head is None:
            raise ConfigError(f"this adapter's objective is {self.meta['objective']!r}: it has no head")
        m = self.meta
        return HeadWeights("linear", list(m["labels"]), self.head["weight"], self.head["bias"],
                           meta={"template": m["template"], "chat": m["chat"], "model": m["base_model"]})


def read_adapter(path) -> Adapter:
    """The adapter file (CPU, fp32; "seed": the shipped one), metadata parsed; ModelLoadError for
    anything unreadable."""
    import json

    if str(path) == "seed":
        if not SEED_ADAPTER.is_file():
            raise ModelLoadError(f"the shipped seed adapter is missing from this install ({SEED_ADAPTER}): "
                                 f"reinstall prefixscore, or pass --no-adapter for the raw model")
        path = SEED_ADAPTER
    meta, tensors = read_tagged(path, "adapter", ADAPTER_FORMAT, ADAPTER_VERSION, "fine-tune again")
    tensors = {k: v.float() for k, v in tensors.items()}
    try:
        parsed = {"base_hash": meta["base_hash"], "base_model": meta["base_model"],
                  "template": meta["template"], "chat": json.loads(meta["chat"]),
                  "labels": json.loads(meta["labels"]), "objective": meta["objective"],
                  "rank": int(meta["rank"]), "alpha": float(meta["alpha"]),
                  "training": json.loads(meta.get("training", "{}"))}
        lora = {}
        for k in sorted(tensors):
            if k.endswith(".lora_A"):
                key = k.removesuffix(".lora_A")
                lora[key] = (tensors[k], tensors[key + ".lora_B"])
        head = ({"weight": tensors["head.weight"], "bias": tensors["head.bias"]}
                if parsed["objective"] == "head" else None)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: damaged adapter file ({type(e).__name__}: {e})") from None
    r, N = parsed["rank"], len(parsed["labels"])
    bad = [k for k, (A, B) in lora.items() if A.ndim != 2 or B.ndim != 2 or A.shape[0] != r
           or B.shape[1] != r or k.split(".")[-1] not in _PROJ or k.split(".")[0] != "layers"]
    if parsed["objective"] not in ADAPTER_OBJECTIVES or bad or r < 1 or (
            head is not None and (head["weight"].ndim != 2 or head["weight"].shape[0] != N
                                  or head["bias"].shape != (N,))):
        raise ModelLoadError(f"{path}: damaged adapter file (objective {parsed['objective']!r}, rank "
                             f"{r}, bad tensors {bad[:3]})")
    return Adapter(parsed, lora, head)


def check_adapter_base(adapter: Adapter, base: str, path="adapter") -> None:
    """Refuse an adapter trained on other base weights (base: base_hash of the unmerged model)."""
    m = adapter.meta
    if m["base_hash"] != base:
        raise ConfigError(f"{path} was trained on another base model ({m['base_model']}, weights hash "
                          f"{m['base_hash'][:12]}); this model's weights hash to {base[:12]}: load "
                          f"the model it was trained on, or fine-tune for this one")


def check_adapter(adapter: Adapter, base: str, template: str, labels, chat: bool, path="adapter") -> None:
    """Refuse an adapter trained on other base weights (base: base_hash of the unmerged model), or
    for another template, chat flag or label list (ConfigError): its weights only mean its labels."""
    check_adapter_base(adapter, base, path)
    m = adapter.meta
    if m["template"] != template or m["chat"] != chat:
        raise ConfigError(f"{path} was trained with template {m['template']!r} (chat={m['chat']}); "
                          f"this classifier uses {template!r} (chat={chat}): pass the same template "
                          f"and chat flag, or fine-tune for this one")
    if list(m["labels"]) != list(labels):
        raise ConfigError(f"{path} was trained for the labels {m['labels']}; this classifier has "
                          f"{list(labels)} (same labels in the same order are needed)")


def open_adapter(path, model) -> Adapter:
    """The adapter at `path` for a model about to load (Classifier's and Scorer's one door):
    read before any model loads (ModelLoadError if unreadable), refused over a loaded model,
    whose weights others may share (ConfigError)."""
    adapter = read_adapter(path)
    if isinstance(model, LoadedModel):
        raise ConfigError("an adapter is merged into the weights it loads with: pass the model's "
                          "path, not a loaded model (whose weights others share)")
    return adapter


def apply_adapter(loaded: LoadedModel, adapter: Adapter, path, prompt=None) -> dict:
    """Check `adapter` against the unmerged weights and merge it; -> its metadata. prompt:
    (template, labels, chat) it must have been trained for (a Classifier's); None: the base model
    only (a Scorer's prompt is its own, so its scores are the adapted model's reading of it)."""
    from .loading import base_hash

    base = base_hash(loaded)
    if prompt is None:
        check_adapter_base(adapter, base, str(path))
    else:
        check_adapter(adapter, base, *prompt, str(path))
    merge_adapter(loaded, adapter)
    return adapter.meta


@torch.no_grad()
def merge_adapter(loaded: LoadedModel, adapter: Adapter) -> LoadedModel:
    """Merge W += (alpha / r) B @ A into `loaded`'s weights, in place, once (a second merge is
    refused). Call it before building a Classifier on `loaded` (its prefix cache and graphs are
    computed from the weights), and check_adapter first (base_hash needs the unmerged weights).

    Q/K/V and gate/up are stored fused with their RMSNorm weight folded into the columns
    (model.fold: W' = W diag(n)), so their delta is folded the same way: W' + dW diag(n), the sum
    taken in fp32 and rounded once to the weights' dtype. O and down are plain weights."""
    m = loaded.model
    if getattr(m, "merged_adapter", None) is not None:
        raise ConfigError("an adapter is already merged into this model: load the model again")
    if loaded.fp8 is True:
        raise ConfigError("an adapter merges into the bf16 weights before they become fp8: pass "
                          "adapter= to the Classifier or Scorer that loads the model")
    c = m.config
    s = adapter.scale
    D = c.head_dim
    blocks = {"wqkv": [c.num_heads * D, c.num_kv_heads * D, c.num_kv_heads * D],
              "wgu": [c.intermediate_size, c.intermediate_size]}
    updates = []  # validate everything before touching a weight
    for key, (A, B) in adapter.lora.items():
        _, i, proj = key.split(".")
        i = int(i)
        if i >= c.num_layers:
            raise ConfigError(f"the adapter has weights for layer {i}; the model has {c.num_layers}")
        layer = m.layers[i]
        module, attr, block = _PROJ[proj]
        mod = getattr(layer, module)
        if attr in blocks:
            W = getattr(mod, attr)
            lo = sum(blocks[attr][:block])
            hi = lo + blocks[attr][block]
            norm = layer.input_layernorm if module == "self_attn" else layer.post_attention_layernorm
        else:
            W = getattr(mod, attr).weight
            lo, hi, norm = 0, W.shape[0], None
        if (B.shape[0], A.shape[1]) != (hi - lo, W.shape[1]):
            raise ConfigError(f"adapter {key}: delta {[B.shape[0], A.shape[1]]} does not fit the "
                              f"model's {[hi - lo, W.shape[1]]}")
        updates.append((W, lo, hi, A, B, norm))
    for W, lo, hi, A, B, norm in updates:
        delta = s * (B.to(W.device, torch.float32) @ A.to(W.device, torch.float32))
        if norm is not None:
            delta = delta * norm.weight.to(W.device, torch.float32)[None, :]
        W[lo:hi] = (W[lo:hi].float() + delta).to(W.dtype)
    m.merged_adapter = adapter.meta
    return loaded
