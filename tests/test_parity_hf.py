"""Our engine (cached prefix, flat batch, label trie in one pass) against Hugging Face transformers
on the full prompt: identical decisions (vs constrained `generate`) and scores within 1e-4 (fp32)."""
import pytest
import torch

from conftest import ARCHS, dev_queries, random_queries
from hf_reference import hf_generate, hf_scores
from prefixscore import Classifier

TOL = 1e-4  # fp32: scores are log-probs; flat attention vs HF's full-prompt attention


def check_parity(clf, hf_model, queries):
    results = clf.classify_batch(queries)
    enc = [clf.encode(q) for q in queries]
    prompts = [e.ids for e in enc]
    ref = hf_scores(hf_model, prompts, clf.trie)
    gen = hf_generate(hf_model, prompts, clf.trie, clf.loaded.tokenizer.eos_token_id)
    worst = 0.0
    for q, r, s, g in zip(queries, results, ref, gen):
        assert r.label == clf.labels[g], f"decision differs from HF generate for {q!r}"
        ours = [r.scores[l] for l in clf.labels]
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, s)))
    assert worst < TOL, f"max |score - HF| = {worst:.2e}"
    return worst


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_architectures_match_hf(arch, tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    clf = Classifier(str(path), device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    queries = random_queries(200, seed=hash(arch) % 1000)
    check_parity(clf, hf, queries)
    # decisions must not be all the same label, or the test could not catch a wrong argmax
    assert len({r.label for r in clf.classify_batch(queries)}) > 1


def test_bundled_model_matches_hf(bundled):
    from transformers import AutoModelForCausalLM

    from prefixscore.loading import bundled_model_path, converted_folder

    clf = Classifier(bundled)
    hf = AutoModelForCausalLM.from_pretrained(converted_folder(bundled_model_path()),
                                              dtype=torch.float32).eval()
    queries = dev_queries()[:150] + random_queries(50, seed=7)
    check_parity(clf, hf, queries)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gpu_graphs_with_pdl_equal_graphs_without(arch, tiny_model):
    """CUDA graphs of Triton kernels launched with programmatic dependent launch (each kernel
    overlaps the previous one's tail) against the same graphs captured without PDL: the kernels are
    deterministic and both pad to the same buckets, so a missed wait (a race) is the only way the
    scores can differ -- they must be bitwise equal, over many replays."""
    import prefixscore.kernels as K

    path = tiny_model(arch)
    saved = K.USE_PDL
    try:
        K.USE_PDL = True  # graphs are captured with the switch as it is when they are built
        fast = Classifier(str(path), device="cuda", dtype="bfloat16")
        K.USE_PDL = False
        slow = Classifier(fast.loaded, device="cuda", dtype="bfloat16")
        queries = random_queries(96, seed=11)
        want = [slow.classify(q) for q in queries] + slow.classify_batch(queries)
    finally:
        K.USE_PDL = saved
    for _ in range(3):
        got = [fast.classify(q) for q in queries] + fast.classify_batch(queries)
        assert [r.scores for r in got] == [r.scores for r in want]
        assert [r.label for r in got] == [r.label for r in want]
