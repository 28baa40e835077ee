"""`prefixscore serve`: flags (and a TOML file, and PREFIXSCORE_* variables: cmdline.apply_sources)
-> FrontendConfig + EngineConfig -> launch.serve."""
from __future__ import annotations

import argparse
import ipaddress

from .common import COMMANDS
from ..serve.classifiers import parse_tables
from ..options import add_flags, values
from ..serve.config import EngineConfig, FrontendConfig, ScheduleOptions, api_key_from, default_workers


def add_command(subparsers, model_args) -> None:
    p = subparsers.add_parser(
        "serve", help=COMMANDS["serve"][1],
        description="Serve classifiers over HTTP: front-end processes (HTTP, tokenization) and one "
                    "engine process (the model, which several classifiers may share: --classifier). "
                    "Options can also come from a TOML file (--config) and PREFIXSCORE_* "
                    "environment variables (PREFIXSCORE_PORT for --port); flags given on the "
                    "command line win, then the environment, then the file.")
    g = p.add_argument_group("server")
    add_flags(g, FrontendConfig)
    add_flags(p.add_argument_group("latency target"), ScheduleOptions)
    g.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="how long a batch may wait for more requests (default 0: run when the engine is free)")
    g.add_argument("--score-template", default=None,
                   help="template with {query} and {item} slots: enables /v1/score")
    g.add_argument("--score-labels", default=None,
                   help="comma-separated labels of /v1/score when a request names none (default: yes,no)")
    g.add_argument("--item-table", default=None, metavar="FILE",
                   help="item-embedding table (.safetensors or .parquet: id -> vector): /v1/score, "
                        "/rerank and gRPC items given as {\"id\": ...} are looked up in it")
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
    model_args(p)
    p.set_defaults(func=cmd_serve)


def configs(a) -> tuple[FrontendConfig, EngineConfig]:
    """The flags as the two processes' configs (every value checked here, before any model loads)."""
    from ..classifier import classifier_labels
    from .common import model_spec, seed_adapter_default, warn
    from ..errors import ConfigError
    from ..prompt import check_template
    from ..serve.classifiers import seed_prompt_warnings, specs

    declared = specs(a)  # before the seed adapter's default: declared classifiers run the raw model
    if not declared:
        seed_adapter_default(a)
    elif a.no_adapter and a.adapter is not None:
        raise ConfigError("--adapter and --no-adapter: pass one")
    for line in seed_prompt_warnings(declared, a.adapter):
        warn(line)
    spec = model_spec(a, warn=not declared)
    if spec.template is not None:
        check_template(spec.template, ("query",))
    if spec.labels is not None:
        spec = spec.replace(labels=tuple(classifier_labels(spec.label_list)))
    score_labels = None if a.score_labels is None else [l.strip() for l in a.score_labels.split(",")]
    check_before_loading(a, score_labels, declared)
    dp = data_parallel(a)
    if dp > 1:  # engine i: cuda:i (launch)
        spec = spec.replace(device=_device_type(spec.device))
    engine = EngineConfig(
        spec=spec, score_template=a.score_template, score_labels=tuple(score_labels) if score_labels else None,
        item_table=a.item_table, batch_window_ms=a.batch_window_ms, engine_spin_ms=a.engine_spin_ms, engine_cpu=a.engine_cpu,
        served_model_name=a.served_model_name or _hub_name(a.model), classifiers=declared,
        schedule=ScheduleOptions(**values(ScheduleOptions, a)))
    decided = dict(workers=default_workers() if a.workers is None else a.workers, data_parallel=dp,
                   api_key=api_key_from(a.api_key), log_level=_log_level(a),
                   shed_lag_ms=engine.schedule.shed_lag_ms(a.shed_lag_ms))
    front = FrontendConfig(**values(FrontendConfig, a, skip=decided), **decided)
    return front, engine


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
    if a.adapter is not None:
        if a.head is not None:
            raise ConfigError("pass --adapter or --head, not both: an adapter brings its own decision rule")
        read_adapter(a.adapter)
    if a.head is not None:
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
    n = given = a.data_parallel
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
    return {"quiet": "warning", "verbose": "debug"}.get(a.verbosity, "info")


def cmd_serve(a) -> int:
    from .common import line_format, warn
    from ..serve.launch import serve
    from ..serve.logs import JsonLines

    with line_format(JsonLines("launcher") if a.log_format == "json" else None):
        front, engine = configs(a)
        try:
            loopback = ipaddress.ip_address(front.host).is_loopback
        except ValueError:
            loopback = front.host == "localhost"
        if not loopback and not front.api_key:
            warn(f"listening on {front.host} without an API key: anyone who can reach this port can "
                 f"use the model (set --api-key or PREFIXSCORE_API_KEY)")
        return serve(front, engine)
