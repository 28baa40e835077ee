"""dtype fp8 at the user's level: refused where it cannot run (CPU, before anything loads), the
quantization after an adapter merge with the base identity of the bf16 weights, and on a GPU a
Classifier in fp8 against the same model in bf16. The kernels: test_kernels_fp8.py."""
import pytest
import torch

from prefixscore import Classifier
from prefixscore.cli import commands as cli
from prefixscore.errors import ConfigError
from prefixscore.kernels.fp8 import Fp8Weight, is_fp8
from prefixscore.weights.loading import base_hash, finish_load, load
from prefixscore.weights.adapter import merge_adapter

SPEC = dict(template="Which category? {query}", labels=["Dress", "Jeans", "Hoodie"], chat=False)
QUERIES = ["red dress", "levis 501 jeans", "kids hoodie", "连衣裙", "oversized knit sweater"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_fp8_refused_on_cpu(tiny_model, capsys):
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        Classifier(str(tiny_model("qwen2")), device="cpu", dtype="fp8", **SPEC)
    assert cli.main(["classify", "--model", str(tiny_model("qwen2")), "--device", "cpu",
                     "--dtype", "fp8", "--template", SPEC["template"], "--labels", "Dress,Jeans",
                     "red dress"]) == 2
    err = capsys.readouterr().err
    assert "dtype fp8 needs an NVIDIA GPU" in err and "Traceback" not in err


def test_quantized_after_the_merge_with_the_bf16_identity(tiny_model, tmp_path):
    """finish_load (what Classifier and Scorer call before the prefix): the pending fp8 model is
    quantized once; base_hash still names the unquantized weights (heads and adapters check it);
    merging an adapter into e4m3 weights is refused, not done lossily."""
    loaded = load(str(tiny_model("qwen2")), "cpu", torch.float32)
    want = base_hash(loaded)
    loaded.fp8 = "pending"  # (what obtain sets for dtype fp8 on a GPU)
    clf = Classifier(loaded, **SPEC)
    assert loaded.fp8 is True and base_hash(loaded) == want
    assert all(is_fp8(layer.mlp.wgu) for layer in loaded.model.layers)
    assert finish_load(loaded) is loaded and is_fp8(loaded.model.layers[0].self_attn.wqkv)  # once
    assert len(clf.classify_batch(QUERIES)) == len(QUERIES)
    with pytest.raises(ConfigError, match="before they become fp8"):
        merge_adapter(loaded, None)  # (refused before the adapter is looked at)


def rounded_to_e4m3(loaded):
    """The model's block linears rounded to e4m3 (one scale per output row, as Fp8Weight stores
    them) and back to its own dtype: the weights an fp8 classifier computes with, in plain
    arithmetic. Before a Classifier is built on it (its prefix and graphs read the weights)."""
    for layer in loaded.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.wqkv = Fp8Weight.quantize(a.wqkv).dequantize(a.wqkv.dtype)
        m.wgu = Fp8Weight.quantize(m.wgu).dequantize(m.wgu.dtype)
        for lin in (a.o_proj, m.down_proj):
            lin.weight.data = Fp8Weight.quantize(lin.weight.data).dequantize(lin.weight.dtype)
    return loaded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_classifier_on_gpu(tiny_model):
    """Classifier(dtype="fp8") against the rounding alone: a bf16 classifier over the same weights
    rounded to e4m3 (rounded_to_e4m3). On these random weights the rounding itself moves scores by
    ~0.15 (wq: measured here, bf16 against the rounded bf16), so fp8 is judged against the rounded
    model, not against bf16. Past the skinny kernels (a batch, and the pinned prefix that every
    request attends to) the GEMMs also round each token's activations to e4m3 (FP8 x FP8), as
    coarse as the weights: up to another wq on top of bf16's own rounding (0.05)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    path = str(tiny_model("qwen2"))
    f8 = Classifier(path, device="cuda", dtype="fp8", **SPEC)
    bf = Classifier(path, device="cuda", dtype="bfloat16", **SPEC)
    rq = Classifier(rounded_to_e4m3(load(path, "cuda", torch.bfloat16)), **SPEC)
    assert f8.loaded.fp8 is True and f8.memory["model_bytes"] < bf.memory["model_bytes"]

    def diff(a, b):
        return max(abs(x.scores[k] - y.scores[k]) for x, y in zip(a, b) for k in x.scores)

    qs = QUERIES * 30  # one batch past the skinny kernels (FP8 x FP8 GEMMs) and single requests
    ref_batch, ref_one = rq.classify_batch(qs), [rq.classify(q) for q in QUERIES]
    wq = diff(bf.classify_batch(qs), ref_batch)
    assert 0 < wq < 1, wq  # the rounding moved scores, and not beyond recognition
    bound = 0.05 + 2 * wq
    for got, ref in [([f8.classify(q) for q in QUERIES], ref_one), (f8.classify_batch(qs), ref_batch)]:
        assert diff(got, ref) <= bound, (diff(got, ref), bound)
        for x, y in zip(got, ref):
            top = sorted(y.scores.values(), reverse=True)
            assert x.label == y.label or top[0] - top[1] < 2 * bound
