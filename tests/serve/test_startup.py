"""`prefixscore serve` start-up order: every flag, file and port is checked before the model loads.
A mistake is one line on stderr and exit status 2, in both layouts (--workers 1: one process;
--workers 2: a launcher, front ends and an engine process).

"Before the model loads" is checked, not timed: the model folder's weights file is a FIFO that
no one writes, so anything that reads the weights blocks, and the run outlives its timeout."""
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.procs import one_error, serve_cmd



@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_busy_port_before_the_model(unreadable_model, busy_port, workers):
    t = time.perf_counter()
    p = serve_cmd("--model", unreadable_model, "--port", str(busy_port), "--workers", workers)
    one_error(p, f"cannot listen on 127.0.0.1:{busy_port}: Address already in use")
    assert time.perf_counter() - t < 60


def test_busy_grpc_port_before_the_model(unreadable_model, busy_port):
    pytest.importorskip("grpc")
    p = serve_cmd("--model", unreadable_model, "--port", "0", "--grpc-port", str(busy_port), "--workers", "2")
    one_error(p, f"cannot listen for gRPC on 127.0.0.1:{busy_port}")


def test_busy_port_before_a_hub_download(busy_port, tmp_path):
    """The port first, then the model: a hub name is resolved (downloaded) only once the ports are
    held, so a busy port does not wait for a download."""
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    p = serve_cmd("--model", "acme/absent", "--port", str(busy_port), "--workers", "1", env=env)
    one_error(p, f"cannot listen on 127.0.0.1:{busy_port}")
    p = serve_cmd("--model", "acme/absent", "--port", "0", "--workers", "2", env=env)
    one_error(p, "HF_HUB_OFFLINE")


@pytest.mark.parametrize("flags, text", [
    (["--port", "70000"], "--port must be from 0 to 65535"),
    (["--grpc-port", "-1"], "--grpc-port must be from 0 to 65535"),
    (["--engine-spin-ms", "soon"], "--engine-spin-ms must be"),
    (["--engine-cpu", "4096"], "--engine-cpu 4096"),
    (["--head", "/nonexistent/head.safetensors"], "head file not found"),
    (["--adapter", "/nonexistent/adapter.safetensors"], "adapter file not found"),
    (["--score-template", "{query} only"], "{item}"),
    (["--dtype", "int3"], "unknown dtype"),
    (["--dtype", "fp8"], "dtype fp8 needs an NVIDIA GPU"),  # (--device cpu: Hopper only)
    # every classifier's files and flags (--classifier: several classifiers over the one model)
    (["--classifier", "name=a,template-file=/nonexistent/t.txt"], "cannot read template file"),
    (["--classifier", "name=a,template=Is {query} x or y?,labels=x|y",
      "--classifier", "name=b,head=/nonexistent/h.safetensors"],
     "classifier b: head file not found"),
    (["--classifier", "name=a,template={query}?,labels=x|y", "--classifier", "name=b,labels=p|q",
      "--adapter", "seed"], "--adapter with 2 classifiers"),
])
def test_flags_and_files_before_the_model(unreadable_model, flags, text):
    """Mistakes the engine process would otherwise meet only after loading (or while: the head and
    adapter files), each one line and exit 2 from the launcher."""
    p = serve_cmd("--model", unreadable_model, "--port", "0", "--workers", "2", *flags)
    one_error(p, text)


def test_bad_model_folder_before_the_engine_starts(tmp_path):
    """A folder that is not a model is reported by the launcher, not by an engine process's
    traceback."""
    p = serve_cmd("--model", str(tmp_path), "--port", "0", "--workers", "2")
    one_error(p, "no config.json")


def test_serve_a_hub_name(tiny_model, tmp_path):
    """--workers 2 with a hub name: the launcher resolves it offline from the cache, the engine
    loads the snapshot, and the server calls the model by its hub name."""
    from tests.weights.test_hub import COMMIT, add_snapshot

    add_snapshot(tmp_path / "hub", "acme/tiny", COMMIT, tiny_model("llama"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "serve", "--device", "cpu",
                             "--model", "acme/tiny", "--port", str(port), "--workers", "2",
                             "--log-level", "warning"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
                if health.get("status") == "ok":
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert health and health["status"] == "ok" and health["model"] == "acme/tiny", health
        r = httpx.post(f"http://127.0.0.1:{port}/v1/classify", json={"query": "blue jeans"}, timeout=30)
        assert r.status_code == 200 and r.json()["results"][0]["query"] == "blue jeans", r.text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_ready_lines_name_each_endpoint_once(tiny_model, tmp_path, workers):
    """Once the engine is ready, one line per endpoint: "ready", the model, its URL (the bound
    port), said once whatever the number of front ends."""
    pytest.importorskip("grpc")
    from tests.serve.procs import free_port, wait_healthy

    port, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "serve", "--device", "cpu",
                                 "--model", str(tiny_model("llama")), "--port", str(port),
                                 "--grpc-port", str(grpc_port), "--workers", workers,
                                 "--served-model-name", "tiny-intent"], env=env, stderr=err)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc)
            time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(60)
    text = log.read_text()
    http = [l for l in text.splitlines() if "ready: tiny-intent" in l and f"http://127.0.0.1:{port}" in l]
    grpc = [l for l in text.splitlines() if "ready: tiny-intent over gRPC" in l and f":{grpc_port}" in l]
    assert len(http) == 1 and len(grpc) == 1, text[-3000:]
    assert "POST /v1/classify" in http[0]
