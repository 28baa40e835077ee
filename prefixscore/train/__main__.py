"""python -m prefixscore.train finetune data.csv -o seed.adapter.safetensors [--template "{query}" --no-chat]
(also fit-head and eval-modes: the training subcommands without the rest of the CLI)."""
from __future__ import annotations

import argparse
import sys

from ..cli.common import apply_sources, model_args, verbosity
from ..errors import PrefixScoreError
from ..cli.train import add_command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixscore.train")
    sub = parser.add_subparsers(dest="command", required=True)
    add_command(sub, model_args)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser.parse_args(argv)
    a.argv = argv[1:]  # the command's own words: apply_sources parses them again
    try:
        apply_sources(a, sub.choices[a.command])  # --config and PREFIXSCORE_*, as `prefixscore` does
        with verbosity(a.verbosity):
            return a.func(a)
    except PrefixScoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
