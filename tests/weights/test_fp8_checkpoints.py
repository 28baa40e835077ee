"""Pre-quantized FP8 checkpoints (prefixscore/quant.py): compressed-tensors per-channel/per-tensor
and fp8 block-wise (128x128, ragged last blocks) load as their exact fp32 dequantization, score
like Hugging Face on those dequantized weights, and every other quantized format is refused with a
ModelLoadError naming the tensor or setting.

The checkpoints are synthetic: a random tiny model whose linear weights are replaced by fresh
random e4m3 values and scales that differ per row/block (so a wrong index convention changes the
weights), written the way llm-compressor and Qwen/DeepSeek write theirs."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import make_tiny_model, random_queries
from prefixscore import Classifier
from prefixscore.errors import ModelLoadError
from prefixscore.weights.loading import check, load
from prefixscore.weights.quant import checkpoint_format, dequantize_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread

FP8 = torch.float8_e4m3fn
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Widths that are not multiples of 128: q [192, 200], k/v [96, 200], o [200, 192], gate/up [300, 200],
# down [200, 300], lm_head [49152, 200]: 128x128 grids of 2x2, 1x2, 2x2, 3x2, 2x3, 384x2.
SHAPE = dict(hidden_size=200, intermediate_size=300, head_dim=48)

CT_GROUP = {"targets": ["Linear"], "output_activations": None,
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                  "symmetric": True, "group_size": None, "block_structure": None},
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                        "symmetric": True, "group_size": None, "block_structure": None,
                        "observer": "minmax"}}


def ct_config(strategy="channel", static=False):
    """As the RedHatAI / Neural Magic FP8 model cards' config.json (llm-compressor output)."""
    group = json.loads(json.dumps(CT_GROUP))
    group["weights"]["strategy"] = strategy
    if static:
        group["input_activations"].update(strategy="tensor", dynamic=False)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": 1.5}


def fp8_config(block=(128, 128), activation_scheme="dynamic"):
    """As Qwen's -FP8 releases and DeepSeek-V3 (block) or AutoFP8 (block=None, one scale per tensor)."""
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": activation_scheme}
    if block is not None:
        qc["weight_block_size"] = list(block)
    return qc


# name: (arch, quantization_config, the format quant.py reports, static input scales written)
FORMATS = {
    "ct-channel": ("qwen2", ct_config(), "compressed-tensors-channel", False),
    "ct-channel-static": ("qwen2", ct_config(static=True), "compressed-tensors-channel", True),
    "ct-tensor": ("qwen2", ct_config("tensor"), "compressed-tensors-tensor", False),
    "fp8-block128": ("qwen3", fp8_config(), "fp8-block128", False),
    "fp8-block64x32": ("qwen3", fp8_config((64, 32)), "fp8-block64x32", False),
    "fp8-tensor-static": ("qwen3", fp8_config(None, "static"), "fp8-tensor", True),
}


def scale_grid(N, K, qc):
    """The scale tensor's shape for a [N, K] weight: [N, 1] per channel, [1] per tensor,
    [ceil(N/bn), ceil(K/bk)] per block."""
    if "weight_block_size" in qc:
        bn, bk = qc["weight_block_size"]
        return (-(-N // bn), -(-K // bk))
    if qc["quant_method"] == "compressed-tensors" and \
            qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel":
        return (N, 1)
    return (1,)


def reference_dequant(q, s, qc):
    """W = q * s with s looked up block by block, the slow obvious way (not quant.py's)."""
    W = torch.empty(q.shape, dtype=torch.float32)
    N, K = q.shape
    if "weight_block_size" in qc:
        bn, bk = qc["weight_block_size"]
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                W[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = \
                    q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * s[i, j].float()
        return W
    for n in range(N):
        W[n] = q[n].float() * (s[n, 0] if s.shape == (N, 1) else s[0]).float()
    return W


def write_fp8(base, dst, qc, static=False, lm_head=False, seed=1):
    """Quantized folder dst/"fp8" (config.json with `qc`) and its fp32 dequantization dst/"ref"
    (no quantization_config), both from the tiny model folder `base`. Returns (fp8 dir, ref dir,
    {name: (e4m3 weight, scale, dequantized)})."""
    g = torch.Generator().manual_seed(seed)
    t = load_file(base / "model.safetensors")
    ref = dict(t)
    names = [k for k in t if k.endswith(".weight") and any(f".{m}." in k for m in LINEARS)]
    names += ["lm_head.weight"] if lm_head else []
    parts = {}
    for k in names:
        N, K = t[k].shape
        q = (torch.randn(N, K, generator=g) * 64).clamp(-448, 448).to(FP8)
        # 0.15 / 64 keeps the weights near make_tiny_model's scale; the factor spreads rows/blocks
        s = (0.15 / 64) * torch.exp(0.5 * torch.randn(scale_grid(N, K, qc), generator=g))
        parts[k] = (q, s, reference_dequant(q, s, qc))
        base_name = k.removesuffix("weight")
        t[k] = q
        t[base_name + ("weight_scale_inv" if "weight_block_size" in qc else "weight_scale")] = s
        if static:
            t[base_name + "input_scale"] = torch.rand(1, generator=g) + 0.01
        ref[k] = parts[k][2]
    config = json.loads((base / "config.json").read_text())
    out = []
    for sub, tensors, c in (("fp8", t, dict(config, quantization_config=qc)), ("ref", ref, config)):
        d = dst / sub
        shutil.copytree(base, d, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
        (d / "config.json").write_text(json.dumps(c))
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        out.append(d)
    return out[0], out[1], parts


@pytest.fixture(scope="module")
def base(tmp_path_factory, smol_tokenizer):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(f"fp8base-{arch}"), arch,
                                         smol_tokenizer, **SHAPE)
        return made[arch]

    return get


@pytest.fixture
def checkpoint(tmp_path, base):
    def get(fmt, **kw):
        arch, qc, _, static = FORMATS[fmt]
        return write_fp8(base(arch), tmp_path, qc, static=static, **kw)

    return get


# ---------------------------------------------------------------- (a) exact dequantization
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_loads_as_exact_dequantization(fmt, checkpoint):
    """dequantize_checkpoint gives the reference fp32 weights bit for bit and drops every scale,
    and the whole load (fused weights, output head) equals loading the dequantized fp32 folder."""
    _, qc, name, _ = FORMATS[fmt]
    fp8_dir, ref_dir, parts = checkpoint(fmt, lm_head=fmt.startswith("fp8-block128"))
    assert checkpoint_format(qc) == name
    raw = load_file(fp8_dir / "model.safetensors")
    assert raw[next(iter(parts))].dtype == FP8  # safetensors reads F8_E4M3 as float8_e4m3fn
    deq = dequantize_checkpoint(raw, qc, str(fp8_dir))
    assert set(deq) == set(load_file(ref_dir / "model.safetensors"))  # scales gone, nothing else
    for k, (q, s, W) in parts.items():
        assert deq[k].dtype == torch.float32 and torch.equal(deq[k], W), k
        # the scales really differ across rows/blocks: one scale for all would not give W
        assert s.numel() == 1 or not torch.equal(W, q.float() * s.flatten()[0].float()), k
    got, want = load(fp8_dir), load(ref_dir)
    assert got.quantized == name and want.quantized is None
    sd, ref = got.model.state_dict(), want.model.state_dict()
    assert sd.keys() == ref.keys()
    for k in sd:
        assert torch.equal(sd[k], ref[k]), k
    assert torch.equal(got.lm_head, want.lm_head)


def test_block_grid_is_ragged(checkpoint):
    """(d) N and K not multiples of 128: the last row/column block is partial, the grid is ceil."""
    _, _, parts = checkpoint("fp8-block128")
    shapes = {tuple(q.shape): tuple(s.shape) for q, s, _ in parts.values()}
    assert shapes == {(192, 200): (2, 2), (96, 200): (1, 2), (200, 192): (2, 2), (300, 200): (3, 2),
                      (200, 300): (2, 3)}


# ---------------------------------------------------------------- (b) scores as HF on the dequantized weights
@pytest.mark.parametrize("fmt", ["ct-channel-static", "fp8-block128"])
def test_scores_match_hf_on_dequantized_weights(fmt, checkpoint):
    from transformers import AutoModelForCausalLM

    from tests.test_parity_hf import check_parity

    # seed: weights whose decisions vary over these queries (some random heads pick one label)
    fp8_dir, ref_dir, _ = checkpoint(fmt, lm_head=fmt == "fp8-block128", seed=2)
    clf = Classifier(str(fp8_dir), device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    queries = random_queries(24, seed=23)
    check_parity(clf, hf, queries)
    assert len({r.label for r in clf.classify_batch(queries)}) > 1  # a wrong argmax would show


def test_block_convention_matches_transformers(tmp_path, base):
    """Independent of this file's reference: transformers' own fp8 loader (integrations/
    finegrained_fp8.py Fp8Dequantize, which dequantizes on a machine without a GPU) reads the same
    block checkpoint to the same fp32 weights. It needs whole blocks, so 4x4 blocks here (every
    width is a multiple of 4; the 4x4 grid still varies along both axes)."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("accelerate")  # (transformers' fp8 quantizer asks for it)
    qc = fp8_config((4, 4))
    qc["dequantize"] = True  # (on a GPU machine transformers would keep the e4m3 weights otherwise)
    fp8_dir, _, parts = write_fp8(base("qwen3"), tmp_path, qc, lm_head=True)
    ours = dequantize_checkpoint(load_file(fp8_dir / "model.safetensors"), qc, str(fp8_dir))
    hf = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).state_dict()
    for k in parts:
        assert hf[k].dtype == torch.float32 and torch.equal(ours[k], hf[k]), k


# ---------------------------------------------------------------- (c) everything else refused
DOWN = "model.layers.0.mlp.down_proj."
GATE = "model.layers.1.mlp.gate_proj."


def _config(qc):
    return lambda c, t: c.update(quantization_config=qc)


def _weights(fn):
    return lambda c, t: fn(t)


def _group(**kw):
    return lambda c, t: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(kw)


# id: (format written, edit(config dict, tensors), words the message must hold)
REFUSED = {
    "gptq": ("ct-channel", _config({"quant_method": "gptq", "bits": 4, "group_size": 128}),
             ["quant_method 'gptq'", "compressed-tensors", "fp8"]),
    "awq": ("fp8-block128", _config({"quant_method": "awq", "bits": 4}), ["'awq'"]),
    "bitsandbytes": ("ct-channel", _config({"quant_method": "bitsandbytes", "load_in_8bit": True}),
                     ["'bitsandbytes'"]),
    "ct-int8": ("ct-channel", _group(type="int"), ["group 'group_0'", "type='int'"]),
    "ct-int4-packed": ("ct-channel", lambda c, t: c["quantization_config"].update(format="pack-quantized"),
                       ["format 'pack-quantized'"]),
    "ct-block": ("ct-channel", _group(strategy="block", block_structure=[128, 128]), ["strategy='block'"]),
    "ct-group": ("ct-channel", _group(strategy="group", group_size=128), ["strategy='group'"]),
    "ct-sparse-24": ("ct-channel", lambda c, t: c["quantization_config"].update(
        sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}), ["sparsity_config"]),
    "ct-transform": ("ct-channel", lambda c, t: c["quantization_config"].update(
        transform_config={"config_groups": {"R1": {"type": "hadamard"}}}), ["transform_config"]),
    "ct-malformed": ("ct-channel", lambda c, t: c["quantization_config"].update(config_groups=[1, 2]),
                     ["malformed quantization_config"]),
    "ct-asymmetric": ("ct-channel", _group(symmetric=False), ["symmetric=False"]),
    "fp8-e5m2-config": ("fp8-block128", lambda c, t: c["quantization_config"].update(fmt="e5m2"),
                        ["'e5m2'", "e4m3"]),
    "fp8-bad-block": ("fp8-block128", lambda c, t: c["quantization_config"].update(weight_block_size=[128]),
                      ["weight_block_size [128]"]),
    "e5m2-tensor": ("fp8-block128",
                    _weights(lambda t: t.update({DOWN + "weight": t[DOWN + "weight"].float().to(torch.float8_e5m2)})),
                    [DOWN + "weight", "float8_e5m2"]),
    "block-scale-missing": ("fp8-block128", _weights(lambda t: t.pop(DOWN + "weight_scale_inv")),
                            [DOWN + "weight", "no weight_scale_inv"]),
    "block-scale-misnamed": ("fp8-block128",
                             _weights(lambda t: t.update({GATE + "weight_scale": t.pop(GATE + "weight_scale_inv")})),
                             [GATE + "weight", "no weight_scale_inv"]),
    "channel-scale-missing": ("ct-channel", _weights(lambda t: t.pop(DOWN + "weight_scale")),
                              [DOWN + "weight", "no weight_scale"]),
    "block-grid-transposed": ("fp8-block128",
                              _weights(lambda t: t.update({DOWN + "weight_scale_inv": t[DOWN + "weight_scale_inv"].t().contiguous()})),
                              [DOWN + "weight", "should be [2, 3], not [3, 2]"]),
    "channel-scale-per-column": ("ct-channel",
                                 _weights(lambda t: t.update({GATE + "weight_scale": torch.ones(200, 1)})),
                                 [GATE + "weight", "[300, 200]", "shape [200, 1]"]),
    "channel-scale-in-tensor-config": ("ct-tensor",
                                       _weights(lambda t: t.update({GATE + "weight_scale": torch.ones(300, 1)})),
                                       [GATE + "weight", "expected one value"]),
    "fp8-without-config": ("fp8-block128", lambda c, t: c.pop("quantization_config"),
                           ["float8_e4m3fn", "no quantization_config"]),
    "stray-scale": ("ct-channel", _weights(lambda t: t.update({"model.embed_tokens.weight_scale": torch.ones(1)})),
                    ["model.embed_tokens.weight_scale", "belongs to no float8_e4m3fn weight"]),
    "inf-scale": ("fp8-block128", _weights(lambda t: t[DOWN + "weight_scale_inv"].__setitem__((0, 0), float("inf"))),
                  [DOWN + "weight", "finite"]),
    "int-scale": ("ct-channel", _weights(lambda t: t.update({DOWN + "weight_scale": torch.ones(200, 1, dtype=torch.int32)})),
                  [DOWN + "weight", "torch.int32"]),
    "zero-point": ("ct-channel", _weights(lambda t: t.update({DOWN + "weight_zero_point": torch.ones(200, 1)})),
                   [DOWN + "weight_zero_point", "asymmetric"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_formats_refused(case, checkpoint):
    fmt, edit, words = REFUSED[case]
    fp8_dir, _, _ = checkpoint(fmt)
    config = json.loads((fp8_dir / "config.json").read_text())
    tensors = load_file(fp8_dir / "model.safetensors")
    edit(config, tensors)
    (fp8_dir / "config.json").write_text(json.dumps(config))
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ModelLoadError) as e:
        load(fp8_dir)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert str(fp8_dir) in str(e.value)


def test_unsupported_method_refused_before_reading_weights(checkpoint):
    """check() (what a server runs before starting its processes) reads config.json only."""
    fp8_dir, _, _ = checkpoint("ct-channel")
    config = json.loads((fp8_dir / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "gptq"})))
    (fp8_dir / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ModelLoadError, match="quant_method 'gptq'"):
        check(fp8_dir)


def test_harmless_extras_load(checkpoint):
    """An all-zero weight_zero_point (symmetric) and FP8 KV-cache scales load and change nothing."""
    fp8_dir, ref_dir, _ = checkpoint("ct-channel")
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors[DOWN + "weight_zero_point"] = torch.zeros(200, 1)
    for i in range(2):
        for kv in "kv":
            tensors[f"model.layers.{i}.self_attn.{kv}_scale"] = torch.ones(())
    save_file(tensors, fp8_dir / "model.safetensors")
    got, want = load(fp8_dir), load(ref_dir)
    assert all(torch.equal(a, b) for a, b in zip(got.model.state_dict().values(),
                                                 want.model.state_dict().values()))
