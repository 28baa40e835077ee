"""python -m prefixscore.cli ... runs the `prefixscore` command."""
import sys

from .commands import main

sys.exit(main())
