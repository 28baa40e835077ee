import csv
import faulthandler
import os
import random
import string
from pathlib import Path

import pytest
import torch


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A crash after the last test (interpreter teardown: extension threads, Ray, gRPC) leaves a
    stack in the log: pytest's own faulthandler is off by then. One such run ended in a segfault
    (exit 139) after every test had passed; it did not come back in the next run."""
    import sys

    faulthandler.enable(file=sys.__stderr__, all_threads=True)

# Without a GPU the kernel tests run Triton's interpreter, which must be chosen before anything
# imports triton (each kernel test module also sets it, for running alone).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# PREFIXSCORE_TEST_THREADS=1 keeps parallel test runs from fighting over 2 cores (OpenMP spins).
torch.set_num_threads(int(os.environ.get("PREFIXSCORE_TEST_THREADS", min(2, os.cpu_count() or 1))))

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# A copy of ../shared/data/intent_dev.csv (12 KB), so a clone runs its tests wherever it lies.
DEV_CSV = Path(__file__).resolve().parent / "data" / "intent_dev.csv"


def dev_queries():
    with open(DEV_CSV, newline="", encoding="utf-8") as f:
        return [row["query"] for row in csv.DictReader(f)]


@pytest.fixture(scope="session")
def bundled():
    """The bundled SmolLM2-135M-Instruct, loaded once (fp32). A GPU run (tests/gpu.sh) carries
    only its tokenizer (PREFIXSCORE_TEST_TOKENIZER): there its tests skip; everywhere else a
    missing bundled model fails them."""
    from prefixscore.errors import ModelLoadError
    from prefixscore.weights.loading import load

    try:
        return load(None, "cpu", torch.float32)
    except ModelLoadError as e:
        if os.environ.get("PREFIXSCORE_TEST_TOKENIZER"):
            pytest.skip(f"the bundled model is not installed here ({e})")
        raise


@pytest.fixture(scope="session")
def smol_tokenizer(request):
    """SmolLM2's tokenizer (tiny test models use it). PREFIXSCORE_TEST_TOKENIZER names a folder
    with its tokenizer files instead of the bundled GGUF (the GPU machine has no `gguf`)."""
    folder = os.environ.get("PREFIXSCORE_TEST_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    return request.getfixturevalue("bundled").tokenizer


def tiny_hf_config(arch: str, **kw):
    from transformers import AutoConfig

    base = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
    if arch == "qwen3":
        base["head_dim"] = 32  # Qwen3 sets head_dim explicitly (≠ hidden / heads)
    if arch == "llama":
        base["tie_word_embeddings"] = True
    base.update(kw)
    return AutoConfig.for_model(arch, **base)


def make_tiny_model(path, arch, tokenizer, seed=0, **kw):
    """A random tiny model of `arch` saved as a HF folder (safetensors) with the SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **kw)
    cfg.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so logits are well separated
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smol_tokenizer):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, smol_tokenizer)
        return made[arch]

    return get


class Lowering:
    """A tokenizer that edits text in Python before its Rust backend sees it (lower-cases it): its
    backend disagrees with its own call, so prompt.py must keep the call."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, **kw):
        return self.inner([t.lower() for t in text] if isinstance(text, list) else text.lower(), **kw)


def random_queries(n, seed):
    rng = random.Random(seed)
    words = ["dress", "jeans", "shirt", "trench", "coat", "skirt", "tee", "hoodie", "knit", "women",
             "men", "blue", "red", "oversized", "vintage", "连衣裙", "牛仔裤", "卫衣", "毛衣", "风衣",
             "2024新款", "size", "xl", "cotton", "😀", "black", "summer", "¿", "camisa", "ジーンズ"]
    out = []
    for _ in range(n):
        k = rng.randint(1, 6)
        q = " ".join(rng.choice(words) for _ in range(k))
        if rng.random() < 0.2:
            q = "".join(rng.choice(string.printable[:94]) for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.1:
            q = "  " + q
        out.append(q)
    return out


def fix_interpreter_loop_bounds():
    """triton#9171: with numpy >= 2.4 the interpreter's scalars are (1,)-shaped arrays whose
    int() raises, so every runtime loop bound (`range(0, P, BLOCK)`) fails. Fixed upstream after
    Triton 3.6; patch the one lambda here (test-only, harmless where already fixed)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_index_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._index_fixed = True
    interpreter._patch_lang_tensor = patched


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's in-process runs (its subprocesses get OMP_NUM_THREADS=1):
    on a busy 2-core host, OpenMP threads spinning for a core made classification ~30x slower.
    The session's setting is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The quick tier (`python -m pytest -q -m "not slow"`, under 3 minutes on 2 cores) leaves out these
# modules whole: each takes 30 s to 3 min here, starting servers or Ray in subprocesses, fine-tuning,
# comparing with Hugging Face over several architectures, or streaming big files. Tests elsewhere
# mark themselves slow one by one. CI runs everything.
SLOW_MODULES = {"test_finetune", "test_parity_hf", "test_serve_procs", "test_data_parallel",
                "test_ray_data", "test_ray_serve", "test_cli", "test_startup", "test_stream",
                "test_fp8_checkpoints", "test_overlap", "test_server"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module is not None and item.module.__name__.rpartition(".")[2] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
