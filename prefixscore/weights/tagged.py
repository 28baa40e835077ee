"""Our own safetensors files (a trained head, a LoRA adapter) carry their format and version in the
metadata; this reads one and refuses anything else with a message that says what to do."""
from __future__ import annotations

from ..errors import ModelLoadError


def read_tagged(path, what: str, fmt: str, version: str, again: str) -> tuple[dict, dict]:
    """(metadata, tensors) of one of our safetensors files (a trained head, an adapter), whose
    metadata names its format and version; ModelLoadError for anything else, naming `what` the
    file is and what to do `again` for another version."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise ModelLoadError(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise ModelLoadError(f"{what} path is a directory, not a file: {path}") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
    if meta.get("format") != fmt:
        raise ModelLoadError(f"{path}: not a prefixscore {what} file (no '{fmt}' metadata)")
    if meta.get("version") != version:
        raise ModelLoadError(f"{path}: {what} file version {meta.get('version')!r}, this prefixscore "
                             f"reads version {version}: {again}")
    return meta, tensors
