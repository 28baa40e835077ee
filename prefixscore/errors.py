"""Typed errors: every user mistake raises one of these with a message that says what to change."""
from __future__ import annotations

import contextlib


class PrefixScoreError(Exception):
    """Base class: the CLI prints these as one line and exits with status 2, never a traceback."""


class ConfigError(PrefixScoreError):
    """Bad template, labels, options or model configuration."""


class ModelLoadError(PrefixScoreError):
    """Missing files, unsupported architecture or format."""


class InputError(PrefixScoreError):
    """A bad query or item: empty, too long for the model's context, wrong type."""


@contextlib.contextmanager
def error_at(where):
    """Put `where` (a string, or a function of the error) in front of an InputError's message, as
    "query 37: empty query"; None leaves it as it is."""
    try:
        yield
    except InputError as e:
        if where is None:
            raise
        raise InputError(f"{where(e) if callable(where) else where}: {e}") from None


def numbered(first: int):
    """An InputError from encode_many named by its query's 1-based place in the whole input, of
    which the encoded queries start at `first`."""
    return error_at(lambda e: f"query {first + e.index + 1}")


def cannot_write(path, e: OSError) -> InputError:
    return InputError(f"cannot write output file {path}: {e.strerror or e}")
