"""The command line (`prefixscore ...`): commands.py parses and runs the commands, common.py holds
what they share (model and prompt flags, config file, log lines); score.py, serve.py and train.py
add their subcommands. Everything here imports the library; the library imports nothing here."""
from .commands import main, run

__all__ = ["main", "run"]
