"""Fixtures the tests share (the bundled model, its tokenizer, tiny random models, one thread), the
quick tier's marks, and the session settings every test runs under (Triton's interpreter without a
GPU, the torch thread count). Plain helpers are in helpers.py."""
import faulthandler
import os

import pytest
import torch

from tests.helpers import make_tiny_model


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



@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smol_tokenizer):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, smol_tokenizer)
        return made[arch]

    return get



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
# comparing with Hugging Face over several architectures, streaming big files, compiling every
# kernel for sm_90, or holding engines and servers to deadlines (test_slo; its queues alone:
# test_scheduler, quick). Tests elsewhere mark themselves slow one by one. CI runs everything.
SLOW_MODULES = {"test_finetune", "test_parity_hf", "test_serve_procs", "test_data_parallel",
                "test_ray_data", "test_ray_serve", "test_cli", "test_startup", "test_stream",
                "test_fp8_checkpoints", "test_overlap", "test_server", "test_kernels_compile",
                "test_shutdown", "test_slo"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module is not None and item.module.__name__.rpartition(".")[2] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
