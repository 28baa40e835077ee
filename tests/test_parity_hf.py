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

