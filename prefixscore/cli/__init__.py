"""The command line (`prefixscore ...`): main.py parses and runs the commands, common.py holds
what they share (model and prompt flags, config file, log lines); score.py, serve.py and train.py
add their subcommands. Everything here imports the library; the library imports nothing here."""
from .main import main

__all__ = ["main"]
