"""Pre-quantized FP8 (e4m3) checkpoints, dequantized at load into ordinary HF-named weights.

Two formats, both named by config.json's `quantization_config`:

- compressed-tensors (Neural Magic / RedHatAI "FP8-Dynamic" and "FP8" model cards, llm-compressor):
  `quant_method: "compressed-tensors"`, `format: "float-quantized"` (or "naive-quantized", the same
  storage: compressed_tensors/compressors/quantized_compressors/naive_quantized.py registers
  FloatQuantizationCompressor as an alias of NaiveQuantizationCompressor), every config group's
  `weights` = {num_bits: 8, type: "float", strategy: "channel" | "tensor", symmetric: true}.
  Tensors `X.weight` F8_E4M3 [N, K] and `X.weight_scale` [N, 1] (channel) or one value (tensor);
  W = weight * weight_scale. Layers on the `ignore` list are stored unquantized.
- fp8 (Qwen's "-FP8" releases, DeepSeek-V3; transformers' FineGrainedFP8Config, vLLM's Fp8Config):
  `quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [bn, bk]` (128x128 in practice).
  Tensors `X.weight` F8_E4M3 [N, K] and `X.weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)], the
  last block ragged; despite its name the scale multiplies: W[n, k] = weight[n, k] *
  scale_inv[n // bn, k // bk] (vLLM vllm/model_executor/layers/quantization/utils/fp8_utils.py:
  create_fp8_scale_parameter sizes the grid with ceil division, requant_weight_ue8m0_inplace
  dequantizes with repeat_interleave + crop; transformers integrations/finegrained_fp8.py
  Fp8Dequantize, the same index map for whole blocks, checked in tests/weights/test_fp8_checkpoints.py).
  Without weight_block_size (AutoFP8 / vLLM per-tensor checkpoints) `X.weight_scale` is one value.

Dequantization is exact in the sense of one fp32 rounding of weight.float() * scale.float(); the
caller casts to the dtype asked for (and `--dtype fp8` requantizes per output channel after the
RMSNorm weights are folded in). Activation-side scales (input_scale for static activation
quantization, k/v cache scales) are read and dropped: the forward keeps activations in the compute
dtype (fp8 computes per-token scales dynamically), which is closer to the unquantized model than
one calibrated per-tensor scale; vLLM itself already collapses a fused QKV's three input scales to
their max (compressed_tensors_w8a8_fp8.py). Anything else is refused with ModelLoadError."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..errors import ModelLoadError

FP8 = torch.float8_e4m3fn
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACT_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale")  # dropped (docstring)
_QUANT_LEAVES = ("weight_scale", "weight_scale_inv", "weight_zero_point", "weight_g_idx",
                 "weight_shape_original", "weight_packed", "weight_global_scale")
_CT_FORMATS = ("float-quantized", "naive-quantized")
SUPPORTED = ("compressed-tensors (float-quantized, fp8 e4m3 weights, channel or tensor strategy) and "
             "fp8 (e4m3, weight_block_size blocks or one scale per tensor)")


def _as_dict(qc):
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def checkpoint_format(quant_config, name: str = "config.json") -> str | None:
    """None (not quantized), "compressed-tensors-channel", "compressed-tensors-tensor",
    "fp8-block128" (128x128 blocks), "fp8-block{bn}x{bk}" or "fp8-tensor"; ModelLoadError for
    any other quantization_config."""
    try:
        return _format(_as_dict(quant_config), f"{name}: quantization_config")
    except (AttributeError, TypeError, ValueError) as e:  # a list where a dict belongs, ...
        raise ModelLoadError(f"{name}: malformed quantization_config ({type(e).__name__}: {e})") from None


def _format(qc, bad):
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        extra = [k for k in ("sparsity_config", "transform_config")
                 if qc.get(k) and (k == "transform_config" or qc[k].get("format") != "dense")]
        if extra:  # 2:4 sparse storage, or online rotations the forward would have to apply
            raise ModelLoadError(f"{bad} has a compressed-tensors {extra[0]}: prefixscore loads {SUPPORTED}")
        strategies = set()
        for gname, group in (qc.get("config_groups") or {}).items():
            fmt = group.get("format") or qc.get("format")
            w = group.get("weights")
            if w is None:  # activations or KV cache only: the weights are stored unquantized
                continue
            if fmt not in _CT_FORMATS:
                raise ModelLoadError(f"{bad} has compressed-tensors format {fmt!r}: prefixscore loads "
                                     f"{SUPPORTED}")
            spec = (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("symmetric", True))
            if spec[:2] != (8, "float") or spec[2] not in ("channel", "tensor") or spec[3] is not True:
                raise ModelLoadError(f"{bad} group {gname!r} has weights num_bits={spec[0]}, type="
                                     f"{spec[1]!r}, strategy={spec[2]!r}, symmetric={spec[3]}: prefixscore "
                                     f"loads {SUPPORTED}")
            strategies.add(spec[2])
        if not strategies:
            raise ModelLoadError(f"{bad} (compressed-tensors) quantizes no weights: prefixscore loads "
                                 f"{SUPPORTED}")
        return "compressed-tensors-channel" if "channel" in strategies else "compressed-tensors-tensor"
    if method == "fp8":
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
            raise ModelLoadError(f"{bad} has fp8 fmt {qc.get('fmt')!r}: only e4m3 is supported")
        block = qc.get("weight_block_size")
        if block is None:
            return "fp8-tensor"
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ModelLoadError(f"{bad} has weight_block_size {block!r}: expected two positive "
                                 f"integers such as [128, 128]")
        return "fp8-block128" if list(block) == [128, 128] else f"fp8-block{block[0]}x{block[1]}"
    raise ModelLoadError(f"{bad} has quant_method {method!r}: prefixscore loads unquantized "
                         f"checkpoints, GGUF files and {SUPPORTED}")


def folder_format(path: Path) -> str | None:
    """checkpoint_format of a model folder's config.json, reading nothing else (an unreadable
    config.json is left to the full load to report)."""
    try:
        qc = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return checkpoint_format(qc, f"{path}/config.json")


def _dequantize(k, w, s, fmt, block, name):
    if s.dtype not in _SCALE_DTYPES or not torch.isfinite(s).all() or w.ndim != 2:
        raise ModelLoadError(f"{name}: {k} is {list(w.shape)} with a {s.dtype} scale of shape "
                             f"{list(s.shape)}: expected a 2-D weight and finite fp32/bf16/fp16 scales")
    N, K = w.shape
    if block is not None:
        bn, bk = block
        grid = (-(-N // bn), -(-K // bk))
        if tuple(s.shape) != grid:
            raise ModelLoadError(f"{name}: {k} is [{N}, {K}] with {bn}x{bk} blocks, so its "
                                 f"weight_scale_inv should be {list(grid)}, not {list(s.shape)}")
        full = s.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:N, :K]
        return w.float() * full
    if s.numel() == 1:
        return w.float() * s.float().reshape(())
    if fmt == "compressed-tensors-channel" and tuple(s.shape) in ((N, 1), (N,)):
        return w.float() * s.float().reshape(N, 1)
    want = "[N, 1] (one per output channel) or one value" if fmt.endswith("channel") else "one value"
    raise ModelLoadError(f"{name}: {k} is [{N}, {K}] but its weight_scale has shape {list(s.shape)}: "
                         f"expected {want} for a {fmt} checkpoint")


def dequantize_checkpoint(tensors: dict, quant_config, name: str) -> dict:
    """HF-named tensors with every FP8 weight dequantized to fp32 and its scale removed (other
    tensors untouched, activation scales dropped); `tensors` as given when not quantized.
    ModelLoadError, naming the tensor, for anything not in the two formats (module docstring)."""
    fmt = checkpoint_format(quant_config, f"{name}/config.json")
    if fmt is None:
        fp8 = sorted(k for k, v in tensors.items() if v.dtype in _FP8_DTYPES)
        if fp8:
            raise ModelLoadError(f"{name}: {fp8[0]} is stored as {tensors[fp8[0]].dtype} ({len(fp8)} "
                                 f"such tensors) but config.json has no quantization_config; prefixscore "
                                 f"loads {SUPPORTED}")
        return tensors
    qc = _as_dict(quant_config)
    block = qc.get("weight_block_size") if fmt.startswith("fp8-block") else None
    scale_leaf = "weight_scale_inv" if block is not None else "weight_scale"
    out, used, dropped = {}, set(), []
    for k, v in tensors.items():
        leaf = k.rsplit(".", 1)[-1]
        if leaf in _ACT_SCALES:
            dropped.append(k)
        elif leaf in _QUANT_LEAVES:
            continue  # consumed with its weight below, or refused as stray
        elif v.dtype == FP8:
            sk, zk = k.removesuffix("weight") + scale_leaf, k.removesuffix("weight") + "weight_zero_point"
            if leaf != "weight" or sk not in tensors:
                raise ModelLoadError(f"{name}: {k} is float8_e4m3fn but has no {scale_leaf}"
                                     f"{f' ({sk})' if leaf == 'weight' else ''}: a {fmt} checkpoint "
                                     f"needs one per FP8 weight")
            if zk in tensors and bool(tensors[zk].float().ne(0).any()):
                raise ModelLoadError(f"{name}: {zk} is nonzero: asymmetric FP8 is not supported")
            out[k] = _dequantize(k, v, tensors[sk], fmt, block, name)
            used.update((sk, zk))
        elif v.dtype in _FP8_DTYPES:
            raise ModelLoadError(f"{name}: {k} is {v.dtype}: only float8_e4m3fn (F8_E4M3) weights with "
                                 f"their scales are supported ({SUPPORTED})")
        else:
            out[k] = v
    stray = sorted(k for k in tensors if k.rsplit(".", 1)[-1] in _QUANT_LEAVES and k not in used)
    if stray:
        raise ModelLoadError(f"{name}: {stray[0]} ({len(stray)} such tensors) belongs to no "
                             f"float8_e4m3fn weight of this {fmt} checkpoint; prefixscore loads {SUPPORTED}")
    log = logging.getLogger(__name__)
    log.info("%s: %s FP8 checkpoint, %d weights dequantized to fp32 at load", name, fmt,
             sum(1 for v in tensors.values() if v.dtype == FP8))
    if dropped:
        log.info("%s: %d activation scales (input_scale, k/v cache scales) not used: activations stay "
                 "in the compute dtype, or get dynamic per-token scales with --dtype fp8", name, len(dropped))
    return out
