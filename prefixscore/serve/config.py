"""The server's configuration: one frozen dataclass per process kind, built once from the flags
(and a TOML file) and handed to each process at spawn (nano-vllm's Config, vLLM's VllmConfig)."""
from __future__ import annotations

import os
import time
from argparse import ArgumentTypeError
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..options import option
from ..values import ModelSpec

if TYPE_CHECKING:
    from .classifiers import ClassifierSpec

MAX_WINDOW_MS = 10_000.0  # a longer batch window would outlast any client's timeout
MAX_TIMEOUT_S = 3600.0  # a request's deadline (--request-timeout, X-Request-Timeout) at most this


def gains(text: str) -> tuple[float, float, float]:
    """--depth-gains: KP,KI,KD."""
    try:
        out = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        out = ()
    if len(out) != 3:
        raise ArgumentTypeError(f"three numbers KP,KI,KD, got {text!r}")
    return out


def byte_size(text: str) -> int:
    """--cache-bytes: an integer, optionally with K, M or G (KiB, MiB, GiB; a trailing B or iB
    allowed): "268435456", "256M", "1GiB"."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except (ValueError, OverflowError):
        raise ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 268435456, 256M, 1G)") from None


@dataclass(frozen=True)
class ScheduleOptions:
    """How the engine loop holds a latency target (--target-p99-ms and the flags beside it).

    Every engine pass is kept near pass_ms (default: a quarter of the target, else 25 ms; never
    under 3x a pass's fixed cost, scheduler.PassBudget): classify rows up to that many tokens' worth, and multi-item requests a run of items at a time, so no
    request holds the engine for long. With a target, /v1/score's real-time requests score only as
    many items as depth control allows (depth.py: a PID controller on their measured p99)."""
    target_p99_ms: float | None = option(
        None, "the p99 latency to hold: engine passes of about a quarter of it (classify rows, and "
        "multi-item requests a run of items at a time), and depth control on /v1/score and "
        "/rerank (default: none)", type=float)
    pass_ms: float | None = option(
        None, "engine pass length (default: a quarter of --target-p99-ms, else 25)", type=float)
    depth_min: int = option(50, "depth control: items a real-time score request gets scored at least")
    depth_max: int = option(250, "and at most")
    depth_gains: tuple[float, float, float] = option(
        (0.8, 0.2, 0.05), "depth control's PID gains (default 0.8,0.2,0.05)", parse=gains,
        metavar="KP,KI,KD")

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

    def shed_lag_ms(self, flag: float | None = None) -> float | None:
        """--shed-lag-ms (FrontendConfig's): as given (0: off), else twice the latency target (a
        front end that far behind cannot hold it; once is within a busy loop's ordinary jitter),
        else off."""
        if flag is not None:
            return flag or None
        return 2 * self.target_p99_ms if self.target_p99_ms else None

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
    host: str = option("127.0.0.1", "bind address (default 127.0.0.1: this machine only)")
    port: int = option(8000, "the HTTP port")
    grpc_port: int | None = option(
        None, "also serve gRPC (prefixscore.v1.PrefixScore: Classify, Score; and grpc.health.v1) "
        "on this port, same limits and API key (needs grpcio)", type=int)
    workers: int = option(
        1, "front-end processes (HTTP, validation, tokenization) in front of one engine process; "
        "1: one process, the engine on a thread (default: half the CPUs, at most 8; 1 on 2 CPUs "
        "or fewer)", flag_default=None)
    data_parallel: int = option(
        1, "engine processes, one per GPU (engine i on cuda:i; choose the GPUs with "
        "CUDA_VISIBLE_DEVICES): each front end sends each batch of requests to the least-loaded "
        "engine (default: every visible GPU when the device is cuda, else 1). With N > 1, "
        "--workers 1 means one front-end process", flag_default=None, metavar="N")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on /v1/* (default: $PREFIXSCORE_API_KEY; a "
        "blank key is refused)", proxy=True)
    max_queue: int = option(
        1024, "queries in flight per front-end process; beyond it requests get 429 with "
        "Retry-After (a client under its share, --max-queue over the clients holding queries, "
        "is still admitted)", proxy=True)
    max_queue_tokens: int = option(
        65536, "their tokens after the cached prefix, per front-end process: admission by cost "
        "(429 beyond it; a request alone in the queue is always admitted)", proxy=True)
    max_queue_ms: float | None = option(
        None, "a request none of whose queries the engine has started within this is dropped "
        "unrun and answered 503 with Retry-After (default: no limit, as TEI: the bounded queue "
        "answers 429 at once when full, and a request's own deadline bounds its wait)",
        type=float, proxy=True)
    request_timeout: float | None = option(
        None, "a request's deadline when it sets none (HTTP: X-Request-Timeout: SECONDS; gRPC: "
        "its own deadline): answered 504 then, never computed after it (default: none)",
        type=float, metavar="SECONDS", proxy=True)
    max_body_bytes: int = option(1 << 20, "request body limit (413)", proxy=True)
    max_queries: int = option(256, "queries (or items) per request (413)", proxy=True)
    max_tokens: int = option(512, "tokens per query after the cached prefix (422)", proxy=True)
    max_score_tokens: int = option(8192, "tokens of query + items per /v1/score request (413)",
                                   proxy=True)
    max_label_ids: int = option(64, "labels or label_token_ids per /v1/score request (413)",
                                proxy=True)
    cache_size: int = option(
        0, "pair cache entries per front end: a classify query's or a /v1/score item's answer, "
        "keyed by its prompt's token ids, label set and model (default 0: off)", proxy=True)
    cache_bytes: int = option(
        256 << 20, "and its bytes per front end, least recently used evicted first (a number, or "
        "with K, M, G: binary units; default 256M)", parse=byte_size, metavar="BYTES", proxy=True)
    cache_ttl: float = option(0.0, "pair cache TTL in seconds (0: none)", proxy=True)
    max_connections: int = option(
        4096, "connections per front-end process (must exceed its --max-queue share): at the "
        "limit the oldest idle ones are closed for new ones; with all of them busy, new requests "
        "get 503 + Retry-After (/healthz is always served)")
    shed_lag_ms: float | None = option(
        None, "a front end whose event loop runs this far behind (requests wait unread) answers "
        "new compute requests 503 + Retry-After at once, before parsing them (default: twice "
        "--target-p99-ms, else off; 0: off)", type=float)
    header_timeout: float = option(
        10.0, "seconds for a request's headers to arrive (408 and close; idle sockets too)")
    body_timeout: float = option(
        30.0, "seconds for a request's body to arrive after its headers (408)", proxy=True)
    max_header_bytes: int = option(16384, "request line + headers (431)")
    shutdown_timeout: float = option(
        30.0, "on SIGTERM/SIGINT, seconds to finish accepted requests; the rest get 503",
        proxy=True)
    restart_engine: bool = option(False, "restart the engine when it dies (requests meanwhile get 503)")
    log_level: str = option(
        "info", "the server's log (default info; --verbose: debug, --quiet: warning)",
        choices=["debug", "info", "warning", "error"], proxy=True)
    access_log: bool = option(False, "log every request (costs throughput)", proxy=True)
    log_format: str = option(
        "text", "text, or json: one object a line (time, level, logger, process, pid, message), "
                "uvicorn's lines too, for log collectors (default text)",
        choices=["text", "json"], proxy=True)
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
