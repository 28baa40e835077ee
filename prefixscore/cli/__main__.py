"""python -m prefixscore.cli ... runs the `prefixscore` command."""
import sys

from .main import main

sys.exit(main())
