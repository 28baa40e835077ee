"""dtype fp8 at the user's level: refused where it cannot run (CPU, before anything loads), the
quantization after an adapter merge with the base identity of the bf16 weights, and on a GPU a
Classifier in fp8 against the same model in bf16. The kernels: test_kernels_fp8.py."""
import pytest
import torch

from prefixscore import Classifier
from prefixscore.cli import commands as cli
from prefixscore.errors import ConfigError
from prefixscore.kernels.fp8 import is_fp8
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_classifier_on_gpu(tiny_model):
    """Classifier(dtype="fp8"): e4m3 weights through the graphs and the eager path; decisions as
    bf16's but for near-ties (the e4m3 rounding of random weights moves scores by ~1e-2)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    path = str(tiny_model("qwen2"))
    f8 = Classifier(path, device="cuda", dtype="fp8", **SPEC)
    bf = Classifier(path, device="cuda", dtype="bfloat16", **SPEC)
    assert f8.loaded.fp8 is True and f8.memory["model_bytes"] < bf.memory["model_bytes"]
    qs = QUERIES * 30  # one batch past the skinny kernels (FP8 x FP8 GEMMs) and single requests
    for a, b in [(f8.classify_batch(qs), bf.classify_batch(qs)),
                 ([f8.classify(q) for q in QUERIES], [bf.classify(q) for q in QUERIES])]:
        for x, y in zip(a, b):
            assert max(abs(x.scores[k] - y.scores[k]) for k in x.scores) < 0.15
            top = sorted(y.scores.values(), reverse=True)
            assert x.label == y.label or top[0] - top[1] < 0.15
