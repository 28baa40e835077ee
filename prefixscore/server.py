"""`prefixscore serve` lives in the prefixscore.serve package; this module registers the command
(cli.py looks for it here) and keeps `create_app` importable from its old place."""
from .serve import create_app  # noqa: F401
from .serve.cli import add_command  # noqa: F401
