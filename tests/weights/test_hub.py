"""Hub names (`--model org/name`): resolved through a Hugging Face cache folder built here, in the
layout huggingface_hub writes (models--org--name/refs/<branch>, snapshots/<commit>/ of links to
blobs/), never through the network: HF_HUB_OFFLINE=1, or an endpoint nothing listens on."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prefixscore import Classifier
from prefixscore.weights import hub
from prefixscore.errors import ModelLoadError
from prefixscore.weights.loading import load, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"


def add_snapshot(cache: Path, repo: str, commit: str, src: Path, refs=("main",)) -> Path:
    """A snapshot of src's files under cache, as huggingface_hub lays one out."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        blob = root / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return Path(tiny_model("llama"))


@pytest.fixture
def cache(tmp_path, tiny, monkeypatch):
    """HF_HOME in tmp holding acme/tiny (main), offline; HF_HUB_CACHE unset so HF_HOME decides."""
    home = tmp_path / "hf"
    add_snapshot(home / "hub", "acme/tiny", COMMIT, tiny)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home / "hub"


def test_parse():
    assert hub.parse("acme/tiny") == hub.HubName("acme/tiny")
    assert hub.parse("acme/tiny@v1.0") == hub.HubName("acme/tiny", None, "v1.0")
    assert hub.parse("acme/tiny@refs/pr/3") == hub.HubName("acme/tiny", None, "refs/pr/3")
    assert hub.parse("acme/tiny-GGUF/q4/m.Q4_0.gguf@main") == hub.HubName("acme/tiny-GGUF", "q4/m.Q4_0.gguf",
                                                                          "main")
    for not_hub in ("tiny", "/abs/path", "./acme/tiny", "~/acme/tiny", "acme/tiny/config.json",
                    "acme//tiny", "acme/ti ny", "acme/ti--ny", "acme/..", "a/b/c", "acme/tiny@", ""):
        assert hub.parse(not_hub) is None, not_hub


def test_classifier_from_hub_name_offline(cache, tiny, one_thread):
    """Classifier(model="org/name") loads the cached snapshot and scores as the folder does."""
    clf = Classifier(model="acme/tiny", device="cpu")
    assert Path(clf.loaded.name) == cache / "models--acme--tiny" / "snapshots" / COMMIT
    want = Classifier(model=str(tiny), device="cpu").classify_batch(["blue jeans", "red dress"])
    assert clf.classify_batch(["blue jeans", "red dress"]) == want


def test_revision_branch_and_commit(cache, tiny):
    add_snapshot(cache, "acme/tiny", OTHER, tiny, refs=("v2",))
    snaps = cache / "models--acme--tiny" / "snapshots"
    assert resolve("acme/tiny") == snaps / COMMIT
    assert resolve("acme/tiny@v2") == snaps / OTHER
    assert resolve(f"acme/tiny@{COMMIT}") == snaps / COMMIT
    with pytest.raises(ModelLoadError, match="acme/tiny@v3 is not in the Hugging Face cache"):
        resolve("acme/tiny@v3")


def test_hub_cache_env_and_local_path_first(cache, tiny, tmp_path, monkeypatch):
    """HF_HUB_CACHE wins over HF_HOME; an existing folder named like a hub id is the folder."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve("acme/tiny").parent.name == "snapshots"
    local = tmp_path / "cwd" / "acme" / "tiny"
    shutil.copytree(tiny, local)
    monkeypatch.chdir(tmp_path / "cwd")
    assert resolve("acme/tiny") == local.resolve()


def test_uncached_offline_is_a_clear_error(cache):
    with pytest.raises(ModelLoadError) as e:
        resolve("acme/absent")
    msg = str(e.value)
    assert "HF_HUB_OFFLINE" in msg and str(cache) in msg and "acme/absent" in msg
    with pytest.raises(ModelLoadError, match="does not exist.*hub name"):
        resolve("no-such-folder")  # neither a path nor org/name


def test_gguf_in_a_snapshot(cache, tmp_path):
    """A GGUF repository's snapshot: its one .gguf file (a link to a blob: the suffix is kept), or
    the one the name picks among several."""
    src = tmp_path / "gguf"
    src.mkdir()
    (src / "m.Q4_0.gguf").write_bytes(b"GGUF")
    snap = add_snapshot(cache, "acme/tiny-GGUF", COMMIT, src)
    assert resolve("acme/tiny-GGUF") == snap / "m.Q4_0.gguf"
    (src / "m.Q8_0.gguf").write_bytes(b"GGUF")
    shutil.rmtree(cache / "models--acme--tiny-GGUF")
    snap = add_snapshot(cache, "acme/tiny-GGUF", COMMIT, src)
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files.*acme/tiny-GGUF/m.Q4_0.gguf"):
        resolve("acme/tiny-GGUF")
    assert resolve("acme/tiny-GGUF/m.Q8_0.gguf") == snap / "m.Q8_0.gguf"


def closed_endpoint() -> str:
    """An address nothing listens on: a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_hub_uses_the_cache_or_says_so(cache, monkeypatch, caplog):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", closed_endpoint())
    assert resolve("acme/tiny").name == COMMIT
    assert "using the cached" in caplog.text
    with pytest.raises(ModelLoadError) as e:
        resolve("acme/absent")
    msg = str(e.value)
    assert "cannot reach the Hugging Face hub" in msg and "HF_HUB_OFFLINE=1" in msg and str(cache) in msg


def test_download_plan():
    """What is fetched from a repository's file list: config, tokenizer, template and safetensors
    (an index's shards only), never pickles, subfolders or a second copy of the weights."""
    ref = hub.HubName("acme/m")
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "README.md", "pytorch_model.bin",
             "model.safetensors.index.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "consolidated.safetensors", "onnx/model.onnx",
             "original/model.safetensors"]
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    got = hub.plan(ref, files, lambda: shards)
    assert sorted(got) == sorted(["config.json", "generation_config.json", "tokenizer.json",
                                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                                  "model.safetensors.index.json", *shards])
    single = ["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin", "vocab.json",
              "merges.txt"]
    assert sorted(hub.plan(ref, single, None)) == sorted(["config.json", "tokenizer.json",
                                                           "model.safetensors", "vocab.json", "merges.txt"])
    assert hub.plan(ref, ["README.md", "m.Q4_K_M.gguf"], None) == ["m.Q4_K_M.gguf"]
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files: name one"):
        hub.plan(ref, ["a.gguf", "b.gguf"], None)
    assert hub.plan(hub.HubName("acme/m", "b.gguf"), ["a.gguf", "b.gguf"], None) == ["b.gguf"]
    with pytest.raises(ModelLoadError, match="no file 'c.gguf'"):
        hub.plan(hub.HubName("acme/m", "c.gguf"), ["a.gguf", "b.gguf"], None)
    with pytest.raises(ModelLoadError, match="pickle"):
        hub.plan(ref, ["config.json", "pytorch_model.bin", "tokenizer.json"], None)


def test_download_fetches_the_plan(tmp_path, tiny, monkeypatch):
    """Online: the file list decides the allow_patterns handed to snapshot_download (stood in for
    here: it fills the cache as the real one would), and the snapshot is what loads."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    listing = sorted(p.name for p in tiny.iterdir()) + ["pytorch_model.bin", "README.md"]
    monkeypatch.setattr(hub, "_listing", lambda ref: listing)
    seen = {}

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None):
        seen.update(repo_id=repo_id, revision=revision, cache_dir=cache_dir, patterns=allow_patterns)
        return str(add_snapshot(Path(cache_dir), repo_id, COMMIT, tiny))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = resolve("acme/tiny@v1")
    assert seen["repo_id"] == "acme/tiny" and seen["revision"] == "v1" and seen["cache_dir"] == str(cache)
    assert sorted(seen["patterns"]) == sorted(p.name for p in tiny.iterdir())
    assert load(path).model.config.num_layers == 2


def test_index_names_the_weights(tiny, tmp_path):
    """A folder with a safetensors index loads the files it names, not every *.safetensors (a full
    hub download can hold a second copy of the weights); a shard it names but lacks is an error."""
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    (folder / "consolidated.safetensors").write_bytes(b"not read")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": "model.safetensors"}}))
    assert load(folder).model.config.num_layers == 2
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="its index names are missing"):
        load(folder)


@pytest.mark.slow  # slow: the command in a subprocess (~6 s)
def test_cli_hub_name(tiny, tmp_path):
    """`prefixscore classify --model org/name` offline; an uncached name is one line, exit 2."""
    home = tmp_path / "hf"
    add_snapshot(home / "hub", "acme/tiny", COMMIT, tiny)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "prefixscore.cli", "classify", "--device", "cpu",
                               "--format", "jsonl", *args], capture_output=True, text=True, env=env,
                              timeout=300)

    p = run("--model", "acme/tiny", "blue jeans")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[0])["query"] == "blue jeans"
    assert "models--acme--tiny" in p.stderr
    p = run("--model", "acme/absent", "blue jeans")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "HF_HUB_OFFLINE" in lines[0] and str(home / "hub") in lines[0], p.stderr


def test_download_bars_only_on_a_terminal(monkeypatch):
    """huggingface_hub's bars are off under --quiet and whenever stderr is not a terminal (a log
    would get one long line of carriage returns), and back as they were after."""
    import io
    import sys

    from huggingface_hub.utils import are_progress_bars_disabled

    from prefixscore.weights.hub import quiet_downloads

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    if are_progress_bars_disabled():  # (HF_HUB_DISABLE_PROGRESS_BARS in this environment)
        pytest.skip("huggingface_hub's bars are off here already")
    for stderr, quiet, off in ((io.StringIO(), False, True), (Terminal(), False, False), (Terminal(), True, True)):
        monkeypatch.setattr(sys, "stderr", stderr)
        with quiet_downloads(quiet):
            assert are_progress_bars_disabled() == off, (quiet, off)
        assert not are_progress_bars_disabled()
