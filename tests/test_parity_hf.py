"""Our engine (cached prefix, flat batch, label trie in one pass) against Hugging Face transformers
on the full prompt: identical decisions (vs constrained `generate`) and scores within 1e-4 (fp32)."""
import pytest
import torch

from tests.helpers import ARCHS, dev_queries, random_queries
from tests.hf_reference import hf_generate, hf_scores
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

    from prefixscore.weights.loading import bundled_model_path, converted_folder

    clf = Classifier(bundled)
    hf = AutoModelForCausalLM.from_pretrained(converted_folder(bundled_model_path()),
                                              dtype=torch.float32).eval()
    queries = dev_queries()[:150] + random_queries(50, seed=7)
    check_parity(clf, hf, queries)



def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# Queries that take the seed prompt (~80 tokens) to 141-275: past original_max_position_embeddings
# (64, 128) of the scaled RoPE variants below, within max_position_embeddings (512).
LONG_QUERIES = ["levis 501 " * 30, "oversized hoodie " * 15, "红色连衣裙 " * 15]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_o_proj_bias_matches_hf(arch, tmp_path, smol_tokenizer):
    """attention_bias=True gives o_proj a bias too (Llama, Qwen3), once silently dropped."""
    from tests.helpers import make_tiny_model

    path = make_tiny_model(tmp_path, arch, smol_tokenizer, attention_bias=True)
    clf = Classifier(str(path), device="cpu", dtype="float32")
    check_parity(clf, _hf(path), random_queries(40, seed=11))


def test_attention_o_applies_bias():
    """attention_o with an O bias (the fused small-T kernel has none; on CUDA this takes the
    attention + linear_residual path) equals attention_ref @ Wo^T + b + residual."""
    from prefixscore.kernels.attention import attention_o, attention_ref
    from prefixscore.kernels.options import DEFAULTS

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D, N, P = 6, 4, 2, 32, 48, 5
    q = torch.randn(T, Hq, D, generator=g)
    k, v = (torch.randn(T, Hkv, D, generator=g) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, D, generator=g) for _ in range(2))
    wo, b, r = torch.randn(N, Hq * D, generator=g) / 8, torch.randn(N, generator=g), torch.randn(T, N, generator=g)
    zeros = torch.zeros(T, dtype=torch.int32)
    args = [x.to(dev) for x in (q, k, v, pk, pv, zeros, zeros, zeros)]
    out, _ = attention_o(*args, D ** -0.5, wo.to(dev), r.to(dev), bias=b.to(dev), options=DEFAULTS)
    ref = attention_ref(q, k, v, pk, pv, zeros, zeros, zeros, D ** -0.5).reshape(T, -1) @ wo.t() + b + r
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


ROPE = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64, rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, rope_theta=10000.0),
    # HF rescales dynamic NTK only past max_position_embeddings (512), which is our context limit
    "dynamic": dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
}


@pytest.mark.parametrize("rope", list(ROPE))
def test_scaled_rope_matches_hf(rope, tmp_path, smol_tokenizer):
    """Scaled RoPE types load (they once crashed on the meta device) and match HF on short prompts
    and prompts past original_max_position_embeddings."""
    from tests.helpers import make_tiny_model

    path = make_tiny_model(tmp_path, "llama", smol_tokenizer, rope_parameters=ROPE[rope])
    clf = Classifier(str(path), device="cpu", dtype="float32")
    queries = random_queries(20, seed=3) + LONG_QUERIES
    assert max(len(clf.encode(q).ids) for q in queries) > 250
    check_parity(clf, _hf(path), queries)


def test_longrope_capped_at_original_length(tmp_path, smol_tokenizer):
    """HF switches longrope to long_factor for every position once a sequence passes
    original_max_position_embeddings; we stop there and match HF below it."""
    from tests.helpers import make_tiny_model
    from prefixscore.errors import InputError

    rp = dict(rope_type="longrope", long_factor=[4.0] * 8, short_factor=[1.5] * 8, factor=2.0,
              original_max_position_embeddings=200, rope_theta=10000.0)
    path = make_tiny_model(tmp_path, "llama", smol_tokenizer, rope_parameters=rp)
    clf = Classifier(str(path), device="cpu", dtype="float32")
    assert clf.engine.config.context_limit == 200
    check_parity(clf, _hf(path), random_queries(20, seed=4) + ["levis 501 " * 12])
    with pytest.raises(InputError, match="context limit"):
        clf.classify(LONG_QUERIES[0])


def test_tied_config_with_distinct_lm_head_matches_hf(tmp_path, tiny_model):
    """tie_word_embeddings=True but the file has its own lm_head.weight: transformers 5 keeps the
    file's head (it does not tie differing tensors), and so do we."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model("llama"), tmp_path, dirs_exist_ok=True)  # the tied architecture
    f = tmp_path / "model.safetensors"
    t = load_file(f)
    assert "lm_head.weight" not in t
    t["lm_head.weight"] = torch.randn(t["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(5)) * 0.15
    save_file(t, f, metadata={"format": "pt"})
    hf = _hf(tmp_path)
    assert torch.equal(hf.lm_head.weight, t["lm_head.weight"])  # what this transformers version does
    clf = Classifier(str(tmp_path), device="cpu", dtype="float32")
    check_parity(clf, hf, random_queries(40, seed=5))


def test_bf16_long_prompt_as_close_as_hf_bf16(tmp_path, smol_tokenizer):
    """bf16 on a 2000+ token prompt: RoPE's inverse frequencies stay fp32 (as HF keeps them), so our
    bf16 scores are as close to HF fp32 as HF's own bf16 (rounded to bf16 they were off by ~3)."""
    from tests.helpers import make_tiny_model

    path = make_tiny_model(tmp_path, "llama", smol_tokenizer, max_position_embeddings=4096,
                           hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                           rope_parameters=dict(rope_type="default", rope_theta=100000.0))
    template = "Examples: " + " ".join(f"item{i} is label{i % 7}." for i in range(300)) + "\nquery: {query}"
    queries = ["red dress", "levis 501", "hoodie"]
    clf = Classifier(str(path), template=template, device="cpu", dtype="bfloat16", chat=False)
    prompts = [clf.encode(q).ids for q in queries]
    assert len(prompts[0]) > 2000
    ours = [[r.scores[l] for l in clf.labels] for r in clf.classify_batch(queries)]
    hf32, hf16 = (hf_scores(_hf(path, dt), prompts, clf.trie) for dt in (torch.float32, torch.bfloat16))
    dist = lambda a, b: max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert dist(ours, hf32) <= 1.5 * dist(hf16, hf32), (dist(ours, hf32), dist(hf16, hf32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("arch", ARCHS)
def test_last_layer_for_read_rows_equals_full_forward(arch, device, tiny_model):
    """Engine.hidden(read=True) runs the last layer for the read-out rows only (label-trie branch
    ends of several requests, in plan order): the same states as the full forward at those rows.
    fp32; on CUDA the read rows' attention gathers keys per row and their GEMMs run at another
    size (another summation order): 1e-4 there, 1e-5 on the CPU (torch both ways)."""
    from prefixscore.batch import plan_classify

    clf = Classifier(str(tiny_model(arch)), device=device, dtype="float32")
    enc = [clf.encode(q) for q in random_queries(12, seed=5)]
    plan = plan_classify([e.ids[e.start:] for e in enc], [e.start for e in enc], clf.trie)
    assert plan.rows.shape[0] > len(enc)  # branches: several rows per request, not only the last
    full, p = clf.engine.hidden(plan, clf.prefix_kv)
    read, _ = clf.engine.hidden(plan, clf.prefix_kv, read=True)
    assert read.shape == (p.rows.shape[0], full.shape[1])
    tol = 1e-4 if device == "cuda" else 1e-5
    torch.testing.assert_close(read, full[p.rows], atol=tol, rtol=tol)


def test_classify_one_equals_batch(tiny_model):
    """classify(query), the one-request path (own plan and a cached layout), gives each query
    exactly what classify_batch gives it (CPU, fp32: the same math in both)."""
    clf = Classifier(str(tiny_model("qwen2")), device="cpu", dtype="float32")
    queries = random_queries(24, seed=4)
    batch = clf.classify_batch(queries)
    one = [clf.classify(q) for q in queries]
    assert [r.label for r in one] == [r.label for r in batch]
    for a, b in zip(one, batch):
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_classify_one_at_a_time(tiny_model, monkeypatch):
    """On the GPU, classify(query) replays a graph with its layout's filled input reused and the
    tokens rewritten (graphs.GraphRunner.images): bitwise what a fresh fill gives, for queries of
    repeated and new lengths in any order; and as close to HF bf16-tolerance as classify_batch."""
    from prefixscore import graphs

    path = str(tiny_model("qwen2"))
    queries = random_queries(64, seed=6)
    out = {}
    for images in (graphs.MAX_IMAGES, 0):
        monkeypatch.setattr(graphs, "MAX_IMAGES", images)
        clf = Classifier(path, device="cuda", dtype="bfloat16")
        out[images] = [clf.classify(q) for q in queries]
        if images:
            assert clf.engine.graphs and all(g.images for g in clf.engine.graphs.values())
            batch = clf.classify_batch(queries)
    assert [r.scores for r in out[graphs.MAX_IMAGES]] == [r.scores for r in out[0]]
    one = out[graphs.MAX_IMAGES]
    worst = max(abs(a.scores[l] - b.scores[l]) for a, b in zip(one, batch) for l in a.scores)
    assert worst < 5e-2, worst  # bf16: bucket and batch shape move scores by ~1e-2
