"""python -m prefixscore.train finetune data.csv -o seed.adapter.safetensors [--template "{query}" --no-chat]
(also fit-head and eval-modes: the training subcommands without the rest of the CLI)."""
from __future__ import annotations

import argparse
import sys

from ..cmdline import model_args
from ..errors import PrefixScoreError
from .commands import add_command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixscore.train")
    add_command(parser.add_subparsers(dest="command", required=True), model_args)
    a = parser.parse_args(argv)
    try:
        return a.func(a)
    except PrefixScoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
