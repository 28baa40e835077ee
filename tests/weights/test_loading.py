"""Loading: what a checkpoint or config cannot be computed exactly is refused with a ModelLoadError
that names it (never a raw traceback, never a silently dropped weight); what HF ignores loads."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixscore.weights.model_config import ModelConfig
from prefixscore.errors import ModelLoadError
from prefixscore.weights.loading import from_tensors, load


@pytest.fixture
def folder(tmp_path, tiny_model):
    """A copy of the tiny llama folder (tied embeddings), to edit."""
    def get(arch="llama"):
        d = tmp_path / arch
        shutil.copytree(tiny_model(arch), d)
        return d

    return get


def edit_config(d, **kw):
    c = json.loads((d / "config.json").read_text())
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))


def edit_weights(d, fn):
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})


def refused(path, *words):
    with pytest.raises(ModelLoadError) as e:
        load(path)
    for w in words:
        assert w in str(e.value), str(e.value)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_hidden_act_other_than_silu_refused(folder, act):
    d = folder("qwen2")
    edit_config(d, hidden_act=act)
    refused(d, "hidden_act", act)


def test_swish_is_silu(folder):
    d = folder()
    edit_config(d, hidden_act="swish")
    load(d)


@pytest.mark.parametrize("rope_type", ["proportional", "no_such_rope"])
def test_unknown_rope_type_refused(rope_type):
    from tests.helpers import tiny_hf_config

    cfg = tiny_hf_config("llama", rope_parameters=dict(rope_type=rope_type, rope_theta=1e4))
    with pytest.raises(ModelLoadError, match=f"rope_type '{rope_type}'"):
        ModelConfig.from_hf(cfg)


def test_null_field_in_config(folder):
    d = folder()
    edit_config(d, num_attention_heads=None)
    refused(d, "config.json", "num_attention_heads")


@pytest.mark.parametrize("key,value,tensor", [
    ("intermediate_size", 96, "model.layers.0.mlp.gate_proj.weight"),
    ("vocab_size", 100, "model.embed_tokens.weight"),
])
def test_config_sizes_not_matching_weights(folder, key, value, tensor):
    d = folder()
    edit_config(d, **{key: value})
    refused(d, tensor, "[128, 64]" if key == "intermediate_size" else "[49152, 64]",
            f"[{value}, 64]")


# ---------------------------------------------------------------- weights
@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_unreadable_safetensors(folder, how):
    d = folder()
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\0" * 100, "empty": b""}[how])
    refused(d, str(f), "safetensors")


def test_unused_weight_refused(folder):
    """A tensor the config does not account for (here o_proj.bias without attention_bias) is an
    error naming it, not dropped (as the o_proj bias once was)."""
    d = folder()
    edit_weights(d, lambda t: t.update({"model.layers.1.self_attn.o_proj.bias": torch.ones(64)}))
    refused(d, "model.layers.1.self_attn.o_proj.bias", "attention_bias")


def test_harmless_extras_load(folder):
    """Old checkpoints' rotary_emb.inv_freq buffers and a tied model's lm_head.weight equal to the
    embeddings are not weights we drop: they load."""
    d = folder()

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    edit_weights(d, add)
    m = load(d)
    assert torch.equal(m.lm_head, m.model.embed_tokens.weight)


def test_hf_state_dict_loads():
    """from_tensors on a HF model's state_dict (bench/): tied lm_head.weight is the embeddings."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import tiny_hf_config

    for arch in ("llama", "qwen3"):
        cfg = tiny_hf_config(arch, attention_bias=True)
        hf = AutoModelForCausalLM.from_config(cfg)
        m = from_tensors(ModelConfig.from_hf(cfg), hf.state_dict(), None, arch, "cpu", torch.float32)
        assert torch.equal(m.lm_head, hf.lm_head.weight)


def test_untied_without_lm_head_refused(folder):
    d = folder("mistral")  # untied
    edit_weights(d, lambda t: t.pop("lm_head.weight"))
    refused(d, "lm_head.weight", "tie_word_embeddings")


def test_tied_without_embeddings_uses_lm_head(folder):
    """HF ties to whichever of the two the file has."""
    d = folder()

    def swap(t):
        t["lm_head.weight"] = t.pop("model.embed_tokens.weight")
    edit_weights(d, swap)
    m = load(d)
    assert torch.equal(m.lm_head, m.model.embed_tokens.weight)


# ---------------------------------------------------------------- RoPE in bf16
def test_inv_freq_stays_fp32(tiny_model):
    """model.to(bf16) once rounded RoPE's inverse frequencies; the cos/sin table the GPU path
    gathers (rope_table) must come from the fp32 ones."""
    from prefixscore.model import rope_inv_freq

    m = load(tiny_model("llama"), "cpu", torch.bfloat16).model
    exact = rope_inv_freq(m.config)[0]
    assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, exact)
    cos, sin = m.rope_table(torch.device("cpu"), torch.bfloat16)
    ang = torch.arange(m.config.context_limit).float()[:, None] * exact[None, :]
    ang = torch.cat([ang, ang], -1)
    assert torch.equal(cos, ang.cos().bfloat16()) and torch.equal(sin, ang.sin().bfloat16())


# ---------------------------------------------------------------- GGUF
def _write_gguf(path, tokenizer: str):
    """A one-layer llama GGUF without weights past the embeddings: tokenizer metadata none, partial."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    if tokenizer == "partial":  # a token list without scores: transformers raises KeyError
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c"])
        w.add_token_types([1, 1, 1])
        w.add_token_merges([])
    w.add_tensor("token_embd.weight", np.zeros((3, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tokenizer", ["none", "partial"])
def test_gguf_without_tokenizer_metadata(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("PREFIXSCORE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    _write_gguf(path, tokenizer)
    refused(path, str(path), "tokenizer metadata")


@pytest.mark.parametrize("content", [b"", b"GGUF" + b"\0" * 60, b"not a gguf file at all"])
def test_unreadable_gguf(tmp_path, monkeypatch, content):
    pytest.importorskip("gguf")
    monkeypatch.setenv("PREFIXSCORE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    refused(path, str(path))
