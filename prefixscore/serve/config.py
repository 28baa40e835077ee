"""The server's configuration: one frozen dataclass per process kind, built once from the flags
(and a TOML file) and handed to each process at spawn (nano-vllm's Config, vLLM's VllmConfig)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..values import ModelSpec

if TYPE_CHECKING:
    from .classifiers import ClassifierSpec

MAX_WINDOW_MS = 10_000.0  # a longer batch window would outlast any client's timeout
MAX_TIMEOUT_S = 3600.0  # a request's deadline (--request-timeout, X-Request-Timeout) at most this


@dataclass(frozen=True)
class ScheduleOptions:
    """How the engine loop holds a latency target (--target-p99-ms and the flags beside it).

    Every engine pass is kept near pass_ms (default: a quarter of the target, else 25 ms; never
    under 3x a pass's fixed cost, scheduler.PassBudget): classify rows up to that many tokens' worth, and multi-item requests a run of items at a time, so no
    request holds the engine for long. With a target, /v1/score's real-time requests score only as
    many items as depth control allows (depth.py: a PID controller on their measured p99)."""
    target_p99_ms: float | None = None
    pass_ms: float | None = None
    depth_min: int = 50
    depth_max: int = 250
    depth_gains: tuple[float, float, float] = (0.8, 0.2, 0.05)  # Kp, Ki, Kd

    def __post_init__(self):
        for name in ("target_p99_ms", "pass_ms"):
            v = getattr(self, name)
            if v is not None and not 0 < v < float("inf"):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of "
                                  f"milliseconds, got {v}")
        if not 1 <= self.depth_min <= self.depth_max:
            raise ConfigError(f"--depth-min ({self.depth_min}) and --depth-max ({self.depth_max}) "
                              f"must satisfy 1 <= min <= max")
        if len(self.depth_gains) != 3 or any(not 0 <= g < float("inf") for g in self.depth_gains):
            raise ConfigError(f"--depth-gains takes three numbers >= 0 (Kp,Ki,Kd), got "
                              f"{self.depth_gains}")

    @property
    def pass_times(self) -> float:
        """A classify pass's goal is at least this many times its fixed cost: 3 when a latency is
        asked for (--target-p99-ms, --pass-ms), else 10, passes sized for throughput: on a CPU,
        where a pass's fixed cost is large, a burst is then served in a few passes (BENCHMARKS.md,
        the CPU burst); on a GPU the pass goal is the larger anyway."""
        return 3.0 if self.target_p99_ms or self.pass_ms else 10.0

    @property
    def pass_s(self) -> float:
        """The engine pass's time bound, in seconds."""
        ms = self.pass_ms or (self.target_p99_ms / 4 if self.target_p99_ms else 25.0)
        return ms / 1e3


@dataclass(frozen=True)
class EngineConfig:
    """What the engine process needs to build its Classifier (and Scorer) and run its loop."""
    # What to load and how to prompt it (--batch-tokens is its max_batch_tokens). With several
    # classifiers (--classifier) its template, labels and head are None and each spec has its own.
    spec: ModelSpec = ModelSpec()
    score_template: str | None = None
    score_labels: tuple[str, ...] | None = None
    item_table: str | None = None  # /v1/score's items by id (item_table.py; each front end maps it)
    batch_window_ms: float = 0.0
    engine_spin_ms: str = "auto"
    engine_cpu: str = "none"
    served_model_name: str | None = None
    # Several classifiers over the one model (--classifier); () serves one, named like the model.
    classifiers: tuple[ClassifierSpec, ...] = ()
    schedule: ScheduleOptions = ScheduleOptions()

    def __post_init__(self):
        check_window(self.batch_window_ms)


def check_window(ms: float) -> None:
    if not 0 <= ms <= MAX_WINDOW_MS:  # inf once killed the engine thread
        raise ConfigError(f"--batch-window-ms must be from 0 to {MAX_WINDOW_MS:g}, got {ms}")


# While the engine starts, a request waits this long for it before a 503 (the queue-time limit
# if one is set).
READY_WAIT_S = 2.0


@dataclass(frozen=True)
class FrontendConfig:
    """What each front-end process (HTTP, gRPC) needs: limits, timeouts, auth, the cache."""
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None
    workers: int = 1
    data_parallel: int = 1  # engine processes, one per GPU (the launcher's and the front ends')
    api_key: str | None = None
    max_queue: int = 1024  # queries admitted and not yet answered, per front end
    max_queue_tokens: int = 65536  # and their tokens (a request over it alone is still admitted)
    # A request none of whose queries the engine started by then is answered 503, not run; None
    # (the default, as TEI): no queue-time limit, the bounded queue above refuses at once instead.
    max_queue_ms: float | None = None
    request_timeout: float | None = None  # a request's deadline (504) when it sets none itself
    max_body_bytes: int = 1 << 20
    max_queries: int = 256
    max_tokens: int = 512  # per query, after the cached prefix
    max_score_tokens: int = 8192  # per /v1/score request: query + items
    max_label_ids: int = 64  # label_token_ids / labels per /v1/score request
    # The pair cache (serve/cache.py), per front end: entries (0: off), bytes, seconds (0: no TTL)
    cache_size: int = 0
    cache_bytes: int = 256 << 20
    cache_ttl: float = 0.0
    max_connections: int = 4096  # per front-end process
    # A front end whose event loop runs more than this behind (requests wait unread that long)
    # answers new compute requests 503 at once, before the app reads them: --shed-lag-ms.
    shed_lag_ms: float | None = None
    header_timeout: float = 10.0  # a request's headers must arrive within this
    body_timeout: float = 30.0  # and its body within this after them
    max_header_bytes: int = 16384
    shutdown_timeout: float = 30.0
    restart_engine: bool = False
    log_level: str = "info"
    access_log: bool = False
    # This front end logs the "ready" lines (the launcher's first worker; one process: itself).
    announce: bool = True

    def start_by(self, deadline: float | None) -> float:
        """When a request must have started (time.monotonic()): its deadline, and no later than
        --max-queue-ms from now if set; inf: never dropped for waiting."""
        limit = float("inf") if self.max_queue_ms is None else time.monotonic() + self.max_queue_ms / 1e3
        return limit if deadline is None else min(limit, deadline)

    def __post_init__(self):
        for name in ("max_queue", "max_queue_tokens", "max_body_bytes", "max_queries", "max_tokens",
                     "max_score_tokens",
                     "max_label_ids", "max_connections", "max_header_bytes", "workers",
                     "data_parallel"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {v!r}")
        if self.max_queries > self.max_queue:
            raise ConfigError(f"--max-queries ({self.max_queries}) must not exceed --max-queue "
                              f"({self.max_queue})")
        if self.max_connections <= self.max_queue // max(1, self.workers):
            raise ConfigError(f"--max-connections ({self.max_connections}) must exceed the queue a "
                              f"worker admits (--max-queue {self.max_queue}), so that overload is "
                              f"answered 429 by the server, not refused by the connection limit")
        for name in ("max_queue_ms", "header_timeout", "body_timeout", "shutdown_timeout"):
            v = getattr(self, name)
            if v is None and name == "max_queue_ms":
                continue
            if not 0 < v < float("inf"):
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")
        if self.shed_lag_ms is not None and not 0 < self.shed_lag_ms < float("inf"):
            raise ConfigError(f"--shed-lag-ms must be a positive number of milliseconds (0: off), "
                              f"got {self.shed_lag_ms}")
        if self.request_timeout is not None and not 0 < self.request_timeout <= MAX_TIMEOUT_S:
            raise ConfigError(f"--request-timeout must be seconds in (0, {MAX_TIMEOUT_S:g}], got "
                              f"{self.request_timeout}")
        if not isinstance(self.cache_size, int) or self.cache_size < 0:
            raise ConfigError(f"--cache-size must be entries >= 0 (0: off), got {self.cache_size!r}")
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 1:
            raise ConfigError(f"--cache-bytes must be at least 1, got {self.cache_bytes!r}")
        if not 0 <= self.cache_ttl < float("inf"):  # inf would be "no TTL", which 0 already says
            raise ConfigError(f"--cache-ttl must be seconds >= 0 (0: none), got {self.cache_ttl}")
        if self.api_key is not None:
            check_api_key(self.api_key)


def check_api_key(key: str) -> None:
    """A key a client can send (an HTTP header carries printable ASCII only), and not blank: a
    blank key (an empty secret file) would silently turn authentication off."""
    if not key.strip():
        raise ConfigError("the API key is blank (an empty PREFIXSCORE_API_KEY or secret file?): "
                          "refusing to run without authentication by accident; unset it to run "
                          "without a key")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ConfigError("the API key must be printable ASCII without leading or trailing spaces "
                          "(an HTTP header cannot carry anything else, so no client could send it)")


def api_key_from(flag: str | None) -> str | None:
    """--api-key, else $PREFIXSCORE_API_KEY (a trailing newline of a secret file dropped). Set but
    blank is an error (check_api_key), not "no key"."""
    key = flag if flag is not None else os.environ.get("PREFIXSCORE_API_KEY")
    if key is None:
        return None
    key = key.rstrip("\r\n")
    check_api_key(key)
    return key


def default_workers() -> int:
    """Front-end processes by default: half the CPUs this process may use, at most 8 (the engine
    process, the OS and the clients need the rest); 1 (a single process) on 2 CPUs or fewer."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, n // 2)) if n > 2 else 1
