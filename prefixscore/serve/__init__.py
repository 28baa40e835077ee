"""The server (`prefixscore serve`), as a package (DESIGN.md §7):

    protocol.py     the wire between front ends and an engine (msgspec structs)
    config.py       FrontendConfig, EngineConfig: built once from flags + TOML, checked there
    classifiers.py  several classifiers over one model: --classifier / [classifiers.NAME], memory
    engine_loop.py  the engine loop: queued requests -> passes of bounded cost -> answers
    scheduler.py    its lanes (real-time, batch; clients in turn), pass budgets, deadlines
    engine_proc.py  the engine process: the model, the loop, its socket (wire.EngineSocket)
    client.py       front end -> engine: InprocClient (the engine on a thread)
    wire.py         front end <-> engine process: a Unix socket each (SocketClient, EngineSocket)
    dp_client.py    --data-parallel: one SocketClient per engine, each pass to the least loaded
    frontend.py     request handling shared by HTTP and gRPC: validate, tokenize, cache, admit,
                    deadlines; scoring.py its multi-item route (/v1/score, /rerank); loop_lag.py
                    how late its event loop runs; admission.py what it lets in (per lane and
                    client, by the queue ahead and the request's deadline)
    cache.py        the pair cache (pair_cache.py, a plain LRU) and its keys per route
    catalog.py      the served classifiers by name (`model` / `classifier`), their prompts, cards
    fanout.py       one request to several classifiers ("classifiers": [...]) and its answer
    answers.py      Answer, probabilities; api_error.py: ApiError
    http.py         the FastAPI app and its ASGI guard (auth, body, X-Request-Timeout, X-Client-Id)
    connections.py  the uvicorn server (draining shutdown) and its bounded protocol: header
                    limits, the oldest idle connections closed at the connection limit
    compat.py       routes in other servers' shapes (vLLM, SGLang, OpenAI, Cohere: /classify, /score,
                    /rerank, /v1/models/{id}; on shared paths the body says whose), compat_tei.py
                    TEI's and the Hugging Face Inference API's (/predict, POST /, /info, texts)
    metrics.py      Prometheus series, summed over processes
    launch.py       --workers 1 (one process) or launcher + front ends + engine process

The `serve` command (flags -> these configs) is prefixscore/cli/serve.py.

Data flows one way: cli/serve.py -> launch -> (http -> frontend -> client) | (engine_proc -> engine_loop)
-> the Classifier.
"""
from __future__ import annotations


def create_app(classifier, scorer=None, *, restart_engine: bool = False, batch_window_ms: float = 0.0,
               engine_spin_ms: float = 0.0, engine_cpu: int | None = None,
               model_name: str | None = None, schedule=None, **limits):
    """An ASGI app serving `classifier` (and `scorer` for /v1/score) in this process: the engine
    loop on a thread, as `prefixscore serve --workers 1` runs it. classifier: a Classifier, served
    under model_name (default: the model's file or folder name), or {name: Classifier} over one
    model (Classifier.many), the first the default. schedule: a config.ScheduleOptions (latency
    target, pass length, depth control). limits: FrontendConfig fields (max_queue, max_queries,
    max_tokens, api_key, cache_size, cache_bytes, request_timeout, ...)."""
    import os

    from .client import InprocClient
    from .config import FrontendConfig, check_window
    from .frontend import Frontend
    from .http import create_app as http_app
    from .metrics import Metrics

    if schedule is not None and "shed_lag_ms" not in limits:
        limits["shed_lag_ms"] = schedule.shed_lag_ms()  # as `prefixscore serve` sets it
    cfg = FrontendConfig(restart_engine=restart_engine, **limits)
    check_window(batch_window_ms)
    metrics = Metrics()
    clfs = list(classifier.values()) if isinstance(classifier, dict) else [classifier]
    model = model_name or os.path.basename(str(getattr(getattr(clfs[0], "loaded", None), "name",
                                                      "prefixscore")))
    client = InprocClient(classifier, scorer, window=batch_window_ms / 1e3,
                          spin=engine_spin_ms / 1e3, metrics=metrics, restart=restart_engine,
                          model=model, engine_cpu=engine_cpu, schedule=schedule)
    fe = Frontend(cfg, client, metrics, lambda info: [c.prompt for c in clfs])
    app = http_app(fe, on_startup=client.start, on_shutdown=client.stop)
    app.state.client = client
    return app
