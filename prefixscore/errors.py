"""Typed errors: every user mistake raises one of these with a message that says what to change."""


class PrefixScoreError(Exception):
    """Base class: the CLI prints these as one line and exits with status 2, never a traceback."""


class ConfigError(PrefixScoreError):
    """Bad template, labels, options or model configuration."""


class ModelLoadError(PrefixScoreError):
    """Missing files, unsupported architecture or format."""


class InputError(PrefixScoreError):
    """A bad query or item: empty, too long for the model's context, wrong type."""
