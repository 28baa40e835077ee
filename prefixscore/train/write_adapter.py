"""Writing an adapter file (the offline side; prefixscore.weights.loading reads, checks and merges it).

The file is safetensors, no pickle:
    layers.{i}.{proj}.lora_A  [r, in]    proj: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    layers.{i}.{proj}.lora_B  [out, r]   (Hugging Face module names; W += (alpha / r) B @ A)
    head.weight [N, H], head.bias [N]    objective "head" only: a linear head on the final-normed
                                         hidden state of the prompt's last token
metadata (strings): format "prefixscore-adapter", version, base_hash (loading.base_hash of the
unmerged base weights), base_model (a name, for messages), template, chat (json), labels (json),
objective, rank, alpha, training (json: options and validation numbers).
"""
from __future__ import annotations

import json

import torch

from ..weights.adapter import ADAPTER_FORMAT, ADAPTER_VERSION, Adapter


def adapter_tensors(adapter: Adapter, dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for key, (A, B) in adapter.lora.items():
        out[f"{key}.lora_A"] = A.detach().to(dtype).cpu().contiguous()
        out[f"{key}.lora_B"] = B.detach().to(dtype).cpu().contiguous()
    if adapter.head is not None:  # the head stays fp32: it is small and its logits are the scores
        out |= {f"head.{k}": v.detach().float().cpu().contiguous() for k, v in adapter.head.items()}
    return out


def save_adapter(path, adapter: Adapter, dtype=torch.float32) -> None:
    """Write `adapter` to `path`. dtype bfloat16 halves the file (the shipped seed adapter); the
    reader computes the merge in fp32 either way."""
    from safetensors.torch import save

    from ..errors import cannot_write

    m = adapter.meta
    meta = {"format": ADAPTER_FORMAT, "version": ADAPTER_VERSION, "base_hash": m["base_hash"],
            "base_model": str(m["base_model"]), "template": m["template"], "chat": json.dumps(m["chat"]),
            "labels": json.dumps(list(m["labels"]), ensure_ascii=False), "objective": m["objective"],
            "rank": str(m["rank"]), "alpha": repr(float(m["alpha"])),
            "training": json.dumps(m.get("training", {}), ensure_ascii=False)}
    data = save(adapter_tensors(adapter, dtype), metadata=meta)  # in memory: I/O errors stay OSErrors
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise cannot_write(path, e) from None


def from_peft(peft_model, meta: dict, head: dict | None = None) -> Adapter:
    """The LoRA A/B weights of a peft model, under the runtime's names (layers.{i}.{proj})."""
    lora = {}
    for name, mod in peft_model.named_modules():
        if not hasattr(mod, "lora_A") or "default" not in getattr(mod, "lora_A", {}):
            continue
        tail = name.split(".layers.", 1)[1].split(".")  # [i, self_attn|mlp, proj]
        key = f"layers.{tail[0]}.{tail[-1]}"
        lora[key] = (mod.lora_A["default"].weight.detach().float().cpu().clone(),
                     mod.lora_B["default"].weight.detach().float().cpu().clone())
    return Adapter(dict(meta), lora, head)
