"""python -m prefixscore.cli ... runs the `prefixscore` command."""
from .commands import run

run()
