"""Hugging Face hub names for `--model` and `Classifier(model=...)`: `org/name`, or `org/name/FILE.gguf`
for one GGUF file of a repository that holds several, either with `@REVISION` (a branch, tag or
commit). loading.resolve calls this only for a name that is not an existing path.

The files come through huggingface_hub's own cache (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub), so a model another tool downloaded is not downloaded again. Only what the
loader reads is fetched: config.json, the tokenizer and chat-template files, generation_config.json
and the safetensors weights (the shards an index names, never a second copy such as Mistral's
consolidated.safetensors); for a GGUF repository, one .gguf file. Pickle weights (.bin, .pt) never.

HF_HUB_OFFLINE=1 makes it cache-only: the snapshot of the revision is found from the cache folder's
refs/ and snapshots/ alone, with no network call. Without it the hub is asked for the file list (one
call, which also picks up a moved branch); a hub that cannot be reached falls back to the cache."""
from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

log = logging.getLogger(__name__)

# org/name, then optionally /path/to/FILE.gguf, then optionally @revision (which may hold "/": refs/pr/1)
_FORM = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?P<file>/[^@]+\.gguf)?"
                   r"(?:@(?P<rev>\S+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
INDEX = "model.safetensors.index.json"
# The top-level files besides the weights that config and tokenizer loading read (transformers'
# AutoConfig / AutoTokenizer, and the chat template: chat_template.jinja or .json).
META = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
        "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken", "chat_template*")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubName:
    repo_id: str
    filename: str | None = None  # one .gguf file inside the repository
    revision: str | None = None  # None: the default branch (main)

    def __str__(self) -> str:
        return self.repo_id + (f"/{self.filename}" if self.filename else "") + \
            (f"@{self.revision}" if self.revision else "")


def parse(name) -> HubName | None:
    """The hub name `name` spells, or None when it is not one (a path: it has a leading / . ~, a
    drive, more parts without a .gguf file, or characters a repository id cannot have)."""
    m = _FORM.fullmatch(str(name))
    if m is None:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(m["repo"])  # the hub's own rules: no "--" or "..", at most 96 characters
    except HFValidationError:
        return None
    return HubName(m["repo"], m["file"][1:] if m["file"] else None, m["rev"])


def offline() -> bool:
    """HF_HUB_OFFLINE as the environment says now (huggingface_hub reads it once, at import: a
    process that sets it later, a test, still means it), else as huggingface_hub read it."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(var, "").strip()
        if value:
            return value.upper() in _TRUE
    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    """huggingface_hub's cache folder, from the environment as it is now (see offline())."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(ref: HubName, cache: Path) -> Path | None:
    """The cached snapshot folder of ref's revision, from the cache layout alone
    (models--org--name/refs/<branch> holds a commit; snapshots/<commit>/ its files), or None.
    Not snapshot_download(local_files_only=True): newer huggingface_hub versions check the folder
    against the repository's whole file list, which we download only part of."""
    repo = cache / ("models--" + ref.repo_id.replace("/", "--"))
    rev = ref.revision or "main"
    commit = rev if _COMMIT.fullmatch(rev) else None
    if commit is None:
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except OSError:
            return None
    folder = repo / "snapshots" / commit
    return folder if folder.is_dir() else None


def resolve(ref: HubName) -> Path:
    """The local path (a snapshot folder, or a .gguf file in one) that loading reads for ref,
    downloaded first unless offline or already there; ModelLoadError saying what to do otherwise."""
    cache = cache_dir()
    if offline():
        snap = cached_snapshot(ref, cache)
        if snap is None:
            raise ModelLoadError(
                f"model {ref} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set, "
                f"which forbids downloading it: unset HF_HUB_OFFLINE to download it, point "
                f"HF_HUB_CACHE (or HF_HOME) at a cache that holds it, or pass a local folder or "
                f".gguf file")
        return _pick(ref, snap)
    try:
        files = _listing(ref)
    except _unreachable() as e:
        snap = cached_snapshot(ref, cache)
        if snap is None:
            raise ModelLoadError(
                f"cannot reach the Hugging Face hub for {ref} ({type(e).__name__}: {e}) and it is "
                f"not in the cache ({cache}): check the network (or HF_ENDPOINT), or download it "
                f"where there is one and copy the cache here; HF_HUB_OFFLINE=1 then uses the cache "
                f"without trying the network") from None
        log.warning("cannot reach the Hugging Face hub (%s): using the cached %s", e, snap)
        return _pick(ref, snap)
    from huggingface_hub import snapshot_download

    try:  # exact names as patterns: fnmatch's * would also match inside subfolders
        wanted = plan(ref, files, lambda: _index_shards(ref, cache))
        snap = snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=str(cache),
                                 allow_patterns=[glob.escape(f) for f in wanted])
    except _unreachable() as e:
        raise ModelLoadError(f"downloading {ref} into {cache} failed: {type(e).__name__}: {e}") from None
    return _pick(ref, Path(snap))


def _unreachable() -> tuple:
    """What a hub call raises when the hub cannot be reached: OSError (OfflineModeIsEnabled, a
    refused connection), the HTTP client's transport errors (httpx for huggingface_hub 1.x, httpx2
    later), and HfHubHTTPError for a server error (a 5xx; not-found errors are caught before)."""
    from huggingface_hub.errors import HfHubHTTPError

    errors = [OSError, HfHubHTTPError]
    for mod in ("httpx", "httpx2"):
        try:
            errors.append(__import__(mod).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _listing(ref: HubName) -> list[str]:
    """The repository's file names at ref's revision (one hub call)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(ref.repo_id, revision=ref.revision)
    except GatedRepoError:
        raise ModelLoadError(f"{ref.repo_id} is a gated model: accept its terms on huggingface.co, "
                             f"then log in (`hf auth login`) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"no model {ref.repo_id!r} on the Hugging Face hub (or it is private: log "
                             f"in with `hf auth login` or set HF_TOKEN); a local path must exist") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{ref.repo_id} has no revision {ref.revision!r} (a branch, tag or "
                             f"commit)") from None
    return [s.rfilename for s in info.siblings or []]


def _index_shards(ref: HubName, cache: Path) -> list[str]:
    """The weight files a sharded checkpoint's index names (the index is downloaded to read them)."""
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(ref.repo_id, INDEX, revision=ref.revision, cache_dir=str(cache))
    try:
        with open(path, encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{ref.repo_id}: unreadable {INDEX} ({e})") from None


def plan(ref: HubName, files: list[str], shards) -> list[str]:
    """The files to download from a repository holding `files` (shards(): the index's shard names,
    called only when there is an index). A safetensors checkpoint with its config and tokenizer
    wins; else the one .gguf file (or the one ref names); ModelLoadError when nothing loadable."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ref.filename:
        if ref.filename not in files:
            raise ModelLoadError(f"{ref.repo_id} has no file {ref.filename!r}; its .gguf files: "
                                 f"{', '.join(ggufs[:12]) or 'none'}")
        return [ref.filename]
    top = [f for f in files if "/" not in f]
    meta = [f for f in top if any(fnmatch.fnmatch(f, p) for p in META)]
    weights = [f for f in top if f.endswith(".safetensors")]
    if "config.json" in top and INDEX in top:
        return meta + [INDEX] + [s for s in shards() if s not in meta]
    if "config.json" in top and weights:  # model.safetensors alone when there; else every file
        return meta + (["model.safetensors"] if "model.safetensors" in weights else weights)
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        raise ModelLoadError(f"{ref.repo_id} holds {len(ggufs)} GGUF files: name one, as --model "
                             f"{ref.repo_id}/{ggufs[0]} (files: {', '.join(ggufs[:12])}"
                             f"{', ...' if len(ggufs) > 12 else ''})")
    pickles = [f for f in top if f.endswith((".bin", ".pt", ".pth"))]
    raise ModelLoadError(f"{ref.repo_id}: no safetensors weights with a config.json and no .gguf file"
                         + (" (pickle .bin/.pt weights are refused: use a safetensors copy of the "
                            "model)" if pickles else ""))


def _pick(ref: HubName, snap: Path) -> Path:
    """What loading reads from a snapshot folder: the folder (config.json) or its one .gguf file."""
    if ref.filename:
        path = snap / ref.filename
        if not path.is_file():
            raise ModelLoadError(f"{ref}: {ref.filename} is not in the cached snapshot {snap}"
                                 + _offline_hint())
        return path  # not resolved: the blob it links to has no .gguf suffix
    if (snap / "config.json").is_file():
        return snap
    ggufs = sorted(p.name for p in snap.glob("*.gguf"))
    if len(ggufs) == 1:
        return snap / ggufs[0]
    if ggufs:
        raise ModelLoadError(f"{ref} holds {len(ggufs)} GGUF files in {snap}: name one, as --model "
                             f"{ref.repo_id}/{ggufs[0]}")
    raise ModelLoadError(f"{ref}: the cached snapshot {snap} has no config.json and no .gguf file"
                         + _offline_hint())


def _offline_hint() -> str:
    return " (HF_HUB_OFFLINE is set: unset it to download what is missing)" if offline() else ""


@contextlib.contextmanager
def quiet_downloads(quiet: bool = True):
    """huggingface_hub's download bars off while the block runs (--quiet, or stderr not a terminal:
    in a log a bar is one long line of carriage returns), then as they were."""
    import sys

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        terminal = False
    if (terminal and not quiet) or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
