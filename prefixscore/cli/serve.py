"""`prefixscore serve`: flags (and a TOML file, and PREFIXSCORE_* variables: cmdline.apply_sources)
-> FrontendConfig + EngineConfig -> launch.serve."""
from __future__ import annotations

import argparse
import ipaddress
import sys

from ..serve.classifiers import parse_tables
from ..serve.config import EngineConfig, FrontendConfig, ScheduleOptions, api_key_from, default_workers


def add_command(subparsers, model_args) -> None:
    p = subparsers.add_parser(
        "serve", help="HTTP service: POST /v1/classify, /v1/score; GET /healthz, /metrics, /docs",
        description="Serve classifiers over HTTP: front-end processes (HTTP, tokenization) and one "
                    "engine process (the model, which several classifiers may share: --classifier). "
                    "Options can also come from a TOML file (--config) and PREFIXSCORE_* "
                    "environment variables (PREFIXSCORE_PORT for --port); flags given on the "
                    "command line win, then the environment, then the file.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--grpc-port", type=int, default=None,
                   help="also serve gRPC (prefixscore.v1.PrefixScore: Classify, Score; and "
                        "grpc.health.v1) on this port, same limits and API key (needs grpcio)")
    g.add_argument("--workers", type=int, default=None,
                   help="front-end processes (HTTP, validation, tokenization) in front of one engine "
                        "process; 1: one process, the engine on a thread (default: half the CPUs, at "
                        "most 8; 1 on 2 CPUs or fewer)")
    g.add_argument("--data-parallel", type=int, default=None, metavar="N",
                   help="engine processes, one per GPU (engine i on cuda:i; choose the GPUs with "
                        "CUDA_VISIBLE_DEVICES): each front end sends each batch of requests to the "
                        "least-loaded engine (default: every visible GPU when the device is cuda, "
                        "else 1). With N > 1, --workers 1 means one front-end process")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PREFIXSCORE_API_KEY; "
                        "a blank key is refused)")
    g.add_argument("--max-queue", type=int, default=1024,
                   help="queries in flight per front-end process; beyond it requests get 429 with "
                        "Retry-After")
    g.add_argument("--max-queue-tokens", type=int, default=65536,
                   help="their tokens after the cached prefix, per front-end process: admission by "
                        "cost (429 beyond it; a request alone in the queue is always admitted)")
    g.add_argument("--max-queue-ms", type=float, default=None,
                   help="a request none of whose queries the engine has started within this is "
                        "dropped unrun and answered 503 with Retry-After (default: no limit, as TEI: "
                        "the bounded queue answers 429 at once when full, and a request's own "
                        "deadline bounds its wait)")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request's deadline when it sets none (HTTP: X-Request-Timeout: SECONDS; "
                        "gRPC: its own deadline): answered 504 then, never computed after it "
                        "(default: none)")
    s = p.add_argument_group("latency target")
    s.add_argument("--target-p99-ms", type=float, default=None,
                   help="the p99 latency to hold: engine passes of about a quarter of it (classify "
                        "rows, and multi-item requests a run of items at a time), and depth control "
                        "on /v1/score and /rerank (default: none)")
    s.add_argument("--pass-ms", type=float, default=None,
                   help="engine pass length (default: a quarter of --target-p99-ms, else 25)")
    s.add_argument("--shed-lag-ms", type=float, default=None,
                   help="a front end whose event loop runs this far behind (requests wait unread) "
                        "answers new compute requests 503 + Retry-After at once, before parsing "
                        "them (default: twice --target-p99-ms, else off; 0: off)")
    s.add_argument("--depth-min", type=int, default=50,
                   help="depth control: items a real-time score request gets scored at least (50)")
    s.add_argument("--depth-max", type=int, default=250, help="and at most (250)")
    s.add_argument("--depth-gains", default="0.8,0.2,0.05", metavar="KP,KI,KD",
                   help="depth control's PID gains (default 0.8,0.2,0.05)")
    g.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="how long a batch may wait for more requests (default 0: run when the engine is free)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413)")
    g.add_argument("--max-queries", type=int, default=256, help="queries (or items) per request (413)")
    g.add_argument("--max-tokens", type=int, default=512,
                   help="tokens per query after the cached prefix (422)")
    g.add_argument("--max-score-tokens", type=int, default=8192,
                   help="tokens of query + items per /v1/score request (413)")
    g.add_argument("--max-label-ids", type=int, default=64,
                   help="labels or label_token_ids per /v1/score request (413)")
    g.add_argument("--cache-size", type=int, default=0,
                   help="pair cache entries per front end: a classify query's or a /v1/score "
                        "item's answer, keyed by its prompt's token ids, label set and model "
                        "(default 0: off)")
    g.add_argument("--cache-bytes", type=byte_size, default=256 << 20, metavar="BYTES",
                   help="and its bytes per front end, least recently used evicted first (a number, "
                        "or with K, M, G: binary units; default 256M)")
    g.add_argument("--cache-ttl", type=float, default=0.0, help="pair cache TTL in seconds (0: none)")
    g.add_argument("--score-template", default=None,
                   help="template with {query} and {item} slots: enables /v1/score")
    g.add_argument("--score-labels", default=None,
                   help="comma-separated labels of /v1/score when a request names none (default: yes,no)")
    g.add_argument("--item-table", default=None, metavar="FILE",
                   help="item-embedding table (.safetensors or .parquet: id -> vector): /v1/score, "
                        "/rerank and gRPC items given as {\"id\": ...} are looked up in it")
    g.add_argument("--max-connections", type=int, default=4096,
                   help="connections per front-end process (must exceed its --max-queue share): at "
                        "the limit the oldest idle ones are closed for new ones; with all of them "
                        "busy, new requests get 503 + Retry-After (/healthz is always served)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request's headers to arrive (408 and close; idle sockets too)")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds for a request's body to arrive after its headers (408)")
    g.add_argument("--max-header-bytes", type=int, default=16384, help="request line + headers (431)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to finish accepted requests; the rest get 503")
    g.add_argument("--restart-engine", action="store_true",
                   help="restart the engine when it dies (requests meanwhile get 503)")
    g.add_argument("--engine-cpu", default="none",
                   help="pin the engine (its thread with --workers 1, else its process) to this CPU "
                        "number, the front ends to the others; 'auto': the last CPU, on a GPU with 4+ "
                        "CPUs; 'none' (default)")
    g.add_argument("--engine-spin-ms", default="auto",
                   help="after each batch the engine polls this long for the next one, busy on its "
                        "CPU, before it sleeps; 'auto' (default): 2 on a GPU, 0 on CPU inference")
    g.add_argument("--served-model-name", default=None,
                   help="the model's name in /healthz and /v1/score answers (default: a hub "
                        "model's org/name, else its file or folder name)")
    g.add_argument("--classifier", action="append", default=None,
                   metavar="name=NAME,template=T,labels=A|B",
                   help="serve this classifier (repeat for several over the one model, the first the "
                        "default): keys name, template or template-file, labels ('|'-separated) or "
                        "labels-file, chat, mode, head; a comma starts the next key only before "
                        "KEY=. In --config: a [classifiers.NAME] table each. Requests name one with "
                        "`classifier` (or `model`)")
    # The config file's [classifiers.NAME] tables arrive here (cmdline passes a table on as its
    # Python form); not a flag to type.
    g.add_argument("--classifiers", type=parse_tables, default=None, help=argparse.SUPPRESS)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the server's log (default info; --verbose: debug, --quiet: warning)")
    g.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    model_args(p)
    p.set_defaults(func=cmd_serve)


def configs(a) -> tuple[FrontendConfig, EngineConfig]:
    """The flags as the two processes' configs (every value checked here, before any model loads)."""
    from ..classifier import classifier_labels
    from .common import batch_tokens, seed_adapter_default, warn, warn_seed_prompt
    from ..errors import ConfigError
    from ..rows.io import labels_option, template_option
    from ..prompt import check_template
    from ..serve.classifiers import seed_prompt_warnings, specs
    from ..values import ModelSpec

    declared = specs(a)  # before the seed adapter's default: declared classifiers run the raw model
    if not declared:
        seed_adapter_default(a)
    elif getattr(a, "no_adapter", False) and a.adapter is not None:
        raise ConfigError("--adapter and --no-adapter: pass one")
    for line in seed_prompt_warnings(declared, a.adapter):
        warn(line)
    template, labels = template_option(a), labels_option(a)
    if not declared:
        warn_seed_prompt(labels, template, a.adapter, getattr(a, "head", None))
    if template is not None:
        check_template(template, ("query",))
    if labels is not None:
        labels = classifier_labels(labels)
    score_labels = None if a.score_labels is None else [l.strip() for l in a.score_labels.split(",")]
    check_before_loading(a, score_labels, declared)
    dp = data_parallel(a)
    engine = EngineConfig(
        spec=ModelSpec(
            a.model, template, labels,
            device=a.device if dp == 1 else _device_type(a.device),  # engine i: cuda:i (launch)
            dtype=a.dtype, mode=a.mode, chat=a.chat, truncate=a.truncate,
            max_batch_tokens=batch_tokens(a), head=getattr(a, "head", None),
            adapter=getattr(a, "adapter", None),
            allow_special_tokens=getattr(a, "allow_special_tokens", False),
            batch_invariant=getattr(a, "batch_invariant", None) or None),
        score_template=a.score_template, score_labels=tuple(score_labels) if score_labels else None,
        item_table=a.item_table, batch_window_ms=a.batch_window_ms, engine_spin_ms=a.engine_spin_ms, engine_cpu=a.engine_cpu,
        served_model_name=a.served_model_name or _hub_name(a.model), classifiers=declared,
        schedule=ScheduleOptions(a.target_p99_ms, a.pass_ms, a.depth_min, a.depth_max,
                                 _gains(a.depth_gains)))
    workers = default_workers() if a.workers is None else a.workers
    front = FrontendConfig(
        host=a.host, port=a.port, grpc_port=a.grpc_port, workers=workers, data_parallel=dp,
        api_key=api_key_from(a.api_key),
        max_queue=a.max_queue, max_queue_tokens=a.max_queue_tokens, max_queue_ms=a.max_queue_ms,
        request_timeout=a.request_timeout, max_body_bytes=a.max_body_bytes,
        max_queries=a.max_queries, max_tokens=a.max_tokens, max_score_tokens=a.max_score_tokens,
        max_label_ids=a.max_label_ids, cache_size=a.cache_size, cache_bytes=a.cache_bytes,
        cache_ttl=a.cache_ttl,
        max_connections=a.max_connections, header_timeout=a.header_timeout,
        body_timeout=a.body_timeout, max_header_bytes=a.max_header_bytes,
        shutdown_timeout=a.shutdown_timeout, restart_engine=a.restart_engine,
        shed_lag_ms=_shed_lag(a.shed_lag_ms, a.target_p99_ms),
        log_level=_log_level(a), access_log=a.access_log)
    return front, engine


def _shed_lag(flag: float | None, target: float | None) -> float | None:
    """--shed-lag-ms: as given (0: off), else twice the latency target (a front end that far
    behind cannot hold it; once is within a busy loop's ordinary jitter), else off."""
    if flag is not None:
        return flag or None
    return 2 * target if target else None


def byte_size(text: str) -> int:
    """--cache-bytes: an integer, optionally with K, M or G (KiB, MiB, GiB; a trailing B or iB
    allowed): "268435456", "256M", "1GiB"."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 268435456, 256M, "
                                         f"1G)") from None


def _gains(text: str) -> tuple[float, float, float]:
    from ..errors import ConfigError

    try:
        gains = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        gains = ()
    if len(gains) != 3:
        raise ConfigError(f"--depth-gains takes three numbers KP,KI,KD, got {text!r}")
    return gains


def check_before_loading(a, score_labels, classifiers=()) -> None:
    """What the engine would otherwise find wrong only after (or while) it loads the model, in
    another process: the ports' range, the engine's CPU and spin flags, the device and dtype, the
    head and adapter files (every classifier's head: their templates and labels were checked as
    they were read, classifiers.specs), the /v1/score template and labels. The model's own files
    are checked after the ports are bound (launch.serve), where a hub name is also downloaded."""
    from ..errors import ConfigError
    from ..weights.loading import resolve_device, resolve_dtype
    from ..weights.adapter import read_adapter
    from ..prompt import check_template
    from ..serve.engine_proc import spin_seconds
    from ..serve.launch import engine_cpu

    for flag, port in (("--port", a.port), ("--grpc-port", a.grpc_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"{flag} must be from 0 to 65535, got {port}")
    if a.grpc_port is not None and a.grpc_port == a.port != 0:
        raise ConfigError(f"--grpc-port and --port are both {a.port}: HTTP and gRPC need a port each")
    spin_seconds(a.engine_spin_ms, "cpu")
    engine_cpu(a.engine_cpu, "cuda")  # the device only decides what 'auto' picks
    data_parallel(a)
    resolve_dtype(a.dtype, resolve_device(a.device))
    if getattr(a, "adapter", None) is not None:
        if getattr(a, "head", None) is not None:
            raise ConfigError("pass --adapter or --head, not both: an adapter brings its own decision rule")
        read_adapter(a.adapter)
    if getattr(a, "head", None) is not None:
        from ..weights.heads import read_head

        read_head(a.head)
    from ..serve.classifiers import check_heads

    check_heads(classifiers)
    if a.score_template is not None:
        from ..labels import check_labels
        from ..scorer import SLOTS

        check_template(a.score_template, SLOTS)
        if score_labels is not None:
            check_labels(score_labels)
    if a.item_table is not None:  # its form now; its contents and size when the scorer loads it
        if a.score_template is None:
            raise ConfigError("--item-table needs --score-template: items by id are /v1/score's")
        import os

        from ..item_table import table_format

        table_format(a.item_table)
        if not os.path.isfile(a.item_table):
            raise ConfigError(f"--item-table {a.item_table}: no such file")


def data_parallel(a) -> int:
    """--data-parallel, checked: at least 1; more only over whole CUDA devices (at most the
    visible ones; --device cuda, not cuda:K: engine i takes cuda:i) or on CPU (each engine its own
    process and threads: how the tests run several); default every visible GPU on cuda, else 1."""
    import torch

    from ..errors import ConfigError
    from ..weights.loading import resolve_device

    dev = resolve_device(a.device)
    visible = torch.cuda.device_count() if dev.type == "cuda" else 0
    n = given = getattr(a, "data_parallel", None)
    if n is None:
        n = max(1, visible) if dev.type == "cuda" and dev.index is None else 1
    if n < 1:
        raise ConfigError(f"--data-parallel must be at least 1, got {n}")
    if n == 1:
        return 1
    flag = f"--data-parallel {n}" + (" (the default: every visible GPU)" if given is None else "")
    if dev.type == "cuda" and dev.index is not None:
        raise ConfigError(f"--data-parallel {n} puts engine i on cuda:i: pass --device cuda, not "
                          f"{a.device} (CUDA_VISIBLE_DEVICES chooses which GPUs)")
    if dev.type == "cuda" and n > visible:
        raise ConfigError(f"--data-parallel {n}: only {visible} CUDA device(s) visible (one engine "
                          f"per GPU)")
    if dev.type not in ("cuda", "cpu"):
        raise ConfigError(f"--data-parallel {n}: one engine per CUDA device; {dev.type} is one device")
    if a.engine_cpu != "none":
        raise ConfigError(f"--engine-cpu pins one engine; with {flag} leave it 'none' (or pass "
                          f"--data-parallel 1)")
    return n


def _device_type(device) -> str:
    """'cuda' or 'cpu' for a device flag (None and 'auto' resolved), as data-parallel engines get
    it before launch.engine_config gives each its index."""
    from ..weights.loading import resolve_device

    return resolve_device(device).type


def _hub_name(model) -> str | None:
    """A hub model's name as the server reports it (org/name; its folder's name is a commit hash)."""
    import os

    from ..weights.hub import parse

    ref = parse(model) if model is not None and not os.path.exists(model) else None
    return None if ref is None else (ref.filename.rsplit("/", 1)[-1] if ref.filename else ref.repo_id)


def _log_level(a) -> str:
    """--quiet / --verbose, every command's flags, as the server's --log-level: an explicit
    --log-level other than the default wins."""
    if a.log_level != "info":
        return a.log_level
    return {"quiet": "warning", "verbose": "debug"}.get(getattr(a, "verbosity", "normal"), "info")


def cmd_serve(a) -> int:
    from ..serve.launch import serve

    front, engine = configs(a)
    try:
        loopback = ipaddress.ip_address(front.host).is_loopback
    except ValueError:
        loopback = front.host == "localhost"
    if not loopback and not front.api_key:
        print(f"prefixscore: warning: listening on {front.host} without an API key: anyone who can "
              f"reach this port can use the model (set --api-key or PREFIXSCORE_API_KEY)",
              file=sys.stderr)
    return serve(front, engine)
