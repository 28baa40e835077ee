"""The server's log lines, set up the same way in each of its processes (launcher, front ends, the
engine): text as uvicorn writes it, or with --log-format json one JSON object a line, which log
collectors (Loki, Cloud Logging, ELK) read without a parser."""
from __future__ import annotations

import json
import logging
import time


class JsonLines(logging.Formatter):
    """A record as one line of JSON: time (UTC, ms), level, logger, process (its role in the
    server: launcher, worker N, engine), pid, message, and the exception's text if any."""

    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {"time": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname.lower(),
               "logger": record.name, "process": self.role, "pid": record.process,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(level: str, fmt: str = "text", role: str = "") -> None:
    """The root logger's one handler (stderr) at `level`, unless the process has one already;
    role: the process's part in the server, said on each line."""
    handler = logging.StreamHandler()
    text = f"%(levelname)s:     {role}: %(message)s" if role else "%(levelname)s:     %(message)s"
    handler.setFormatter(JsonLines(role or "server") if fmt == "json" else logging.Formatter(text))
    logging.basicConfig(level=level.upper(), handlers=[handler])
