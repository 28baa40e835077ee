"""The engine process: owns the device, the model, the pinned prefix, the CUDA graphs and one
EngineLoop, behind a ZeroMQ ROUTER socket that every front end's DEALER connects to.

Start-up order: build (load, prefill, capture), run one batch, save the tokenizer files where the
front ends can load them, then bind the socket and answer each front end's Hello with Ready. The
loop polls the socket itself (no input thread: a request's decode is microseconds and a thread hop
would cost more), and replies on the same socket from the same thread.

SIGINT and SIGTERM are ignored: a terminal's Ctrl-C, and the SIGTERM that systemd or an init
sends to the whole process group, reach every process, and the engine must serve on while the
front ends drain; the launcher decides the order of shutdown. Its STOP_SIGNAL ends the process at
once, abandoning the pass in flight (Stopped): it is sent only once the front ends are gone or
have answered everything 503, so no answer is lost, and a long pass (a CPU backlog) cannot hold
the shutdown past --shutdown-timeout. (The process dies with the launcher however that dies:
launch.die_with_parent.) Any fault ends the process non-zero: the front ends see its socket
close, answer 503, and the launcher restarts it with --restart-engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
import time

from ..errors import ConfigError

# A ModelSpec's fields each declared classifier sets for itself (ClassifierSpec.kwargs), and the
# adapter, which Classifier.many refuses (merged into the weights: one classifier); the rest are
# the model's, shared by all.
PER_PROMPT = ("template", "labels", "chat", "mode", "head", "adapter")
from .config import EngineConfig
from .engine_loop import STOP, EngineLoop, Stopped
from .wire import EngineSocket

log = logging.getLogger("prefixscore.engine")


def build(cfg: EngineConfig):
    """(classifier, scorer) as cfg describes them: the Classifier, or with --classifier {name:
    Classifier} over one loaded model (Classifier.many: shared weights and engine, a prefix,
    label rows and graphs each), the default first; and the /v1/score Scorer on those weights."""
    from ..classifier import Classifier

    spec = cfg.spec
    if not cfg.classifiers:
        clf = Classifier(spec=spec)
    elif spec.adapter is not None:  # merged into the weights: one classifier (classifiers.specs)
        (one,) = cfg.classifiers
        clf = {one.name: Classifier(spec=spec.replace(**one.kwargs(spec.chat, spec.mode)))}
    else:  # the model's options (those no classifier sets) shared by every classifier
        common = {k: v for k, v in dataclasses.asdict(spec).items() if k not in PER_PROMPT}
        clf = Classifier.many({s.name: s.kwargs(spec.chat, spec.mode) for s in cfg.classifiers}, **common)
    scorer = None
    if cfg.score_template:
        from ..scorer import Scorer

        # The server's options but not the classifier's prompt, head and mode. Its weights: the
        # classifier's, unless an adapter is merged into them (the seed one by default): then a
        # copy of the base weights of its own, since /v1/score's template was written for the base
        # model and the adapter would change its scores (and dropping the adapter would cost
        # classify its accuracy). The copy's bytes are in /healthz (score_weights).
        model = first(clf).loaded if spec.adapter is None else spec.model
        scorer = Scorer(spec=spec.replace(model=model, template=cfg.score_template,
                                          labels=cfg.score_labels, mode=None, head=None,
                                          adapter=None, truncate=False),
                        item_table=cfg.item_table)
        if spec.adapter is not None:
            log.info("/v1/score runs the base weights, a copy of its own (%.0f MB); classify's carry "
                     "the %s adapter", scorer.engine.weight_bytes() / 1e6, spec.adapter)
    return clf, scorer


def first(clf):
    """The default classifier of what build() returns (the one whose model every one shares)."""
    return next(iter(clf.values())) if isinstance(clf, dict) else clf


def spin_seconds(spec: str, device: str) -> float:
    """--engine-spin-ms: after each batch the loop polls this long before it sleeps ('auto': 2 ms
    on a GPU, where it saves a wake-up per request; 0 on CPU inference, whose threads need every
    CPU)."""

    if spec == "auto":
        return 2e-3 if device == "cuda" else 0.0
    try:
        ms = float(spec)
    except ValueError:
        ms = -1.0
    if not 0 <= ms < float("inf"):
        raise ConfigError(f"--engine-spin-ms must be milliseconds (>= 0) or 'auto', got {spec!r}")
    return ms / 1e3


def engine_cpu(spec: str, device: str) -> int | None:
    """--engine-cpu: the CPU for the engine thread, or None (off by default: pinning measured
    better in one GPU run and worse in another). Never on CPU inference: its OpenMP workers
    would inherit the one-CPU mask."""

    if spec == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = os.sched_getaffinity(0)
    if spec == "auto":
        return max(cpus) if device == "cuda" and len(cpus) >= 4 else None
    try:
        cpu = int(spec)
    except ValueError:
        raise ConfigError(f"--engine-cpu must be a CPU number, 'auto' or 'none', got {spec!r}") from None
    if cpu not in cpus or len(cpus) < 2:
        raise ConfigError(f"--engine-cpu {cpu}: this process may run on CPUs {sorted(cpus)}, and "
                          f"needs one more for the event loop")
    return cpu


def engine_config(ecfg: EngineConfig, index: int, engines: int) -> EngineConfig:
    """Engine index's config: its own GPU (cli.configs resolved the device to its type when
    engines > 1), or the one config as given."""
    import dataclasses

    if engines > 1 and ecfg.spec.device == "cuda":
        return dataclasses.replace(ecfg, spec=ecfg.spec.replace(device=f"cuda:{index}"))
    return ecfg


def save_tokenizer(tokenizer, run_dir: str) -> str:
    """The tokenizer files, for the front ends (a GGUF model's tokenizer exists only in memory)."""
    path = os.path.join(run_dir, f"tokenizer-{os.getpid()}")
    tokenizer.save_pretrained(path)
    return path


def main(cfg: EngineConfig, address: str, run_dir: str, log_level: str = "info",
         ready_event=None, index: int = 0, engines: int = 1, log_format: str = "text") -> None:
    """index of engines (--data-parallel): its metrics carry it when there are several; cfg
    already names its own device (engine_config)."""
    from . import logs

    logs.setup(log_level, log_format, "engine" if engines == 1 else f"engine {index}")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    source = EngineSocket(address)
    _stop_on_signal(source)
    try:
        if engines > 1 and str(cfg.spec.device).startswith("cuda:"):  # engine i: cuda:i
            import torch

            # Current device too, not only the tensors': Triton launches, CUDA graphs and streams
            # are made on the current device, which is cuda:0 unless set.
            torch.cuda.set_device(cfg.spec.device)
        classifiers, scorer = build(cfg)
        clf = first(classifiers)
        from .classifiers import log_memory
        from .metrics import Metrics

        cpu = engine_cpu(cfg.engine_cpu, clf.engine.device.type)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

        loop = EngineLoop(classifiers, scorer, source=source, window=cfg.batch_window_ms / 1e3,
                          spin=spin_seconds(cfg.engine_spin_ms, clf.engine.device.type),
                          metrics=Metrics(engines, index), schedule=cfg.schedule)
        loop.warmup()
        model = cfg.served_model_name or os.path.basename(str(clf.loaded.name))
        ready = loop.ready(save_tokenizer(clf.loaded.tokenizer, run_dir), model)
        log_memory(ready.classifiers)
        source.bind(ready)
        log.info("ready on %s (pid %d)", clf.engine.device, os.getpid())
        if ready_event is not None:
            ready_event.set()
        gc.collect()
        gc.freeze()  # what start-up built is never collected: shorter GC pauses in the loop
        loop.run()
    except Stopped:
        log.info("stopped (pid %d)", os.getpid())
    except BaseException as e:  # noqa: B036 -- the launcher and front ends act on the exit status
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # a stop now must not cut the report short
        if isinstance(e, ConfigError):  # a setting or a file the user gave: one line says it
            log.error("%s", e)
        else:
            log.error("engine fault: the engine process exits", exc_info=e)
        source.close(linger=1000)  # the FAULT answers still leave
        sys.exit(1)
    # Nobody waits for an answer now (the front ends answered or left): nothing lingers, else
    # the context's teardown at exit would wait a second per unsent message's socket.
    source.close(linger=0)


# ---------------------------------------------------------------- how an engine ends

STOP_SIGNAL = signal.SIGUSR1  # the launcher's order to stop now (SIGTERM may reach every process)


def _stop_on_signal(source) -> None:
    def stop(signum, frame):
        signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # once: the way out is not interrupted
        source.put(STOP, None)
        raise Stopped

    signal.signal(STOP_SIGNAL, stop)


def freeze_for_exit() -> None:
    """Before a server process returns to exit, all closed and answered: the interpreter's last
    garbage collections traverse every object torch and transformers made, 0.4-1.0 s of a busy
    2-CPU host per process (0.1-0.2 s frozen), of the one second shutdown allows after
    --shutdown-timeout. Frozen objects are still freed by reference counts and module teardown;
    only cycles among them are left to the OS, which frees the memory."""
    gc.freeze()


def end_engine_thread(client, deadline: float, code: int | None) -> None:
    """The engine thread (--workers 1) must be gone before the interpreter finalizes: a daemon
    thread still inside torch then (a pass in flight, the GIL released) is ended by pthread_exit
    when it takes the GIL back (CPython's take_gil during finalization), and that forced unwind
    through libtorch's C++ frames ends in std::terminate: "terminate called without an active
    exception", SIGABRT, exit 134. So, once the server has answered everything: STOP (an idle
    loop ends at once), then Stopped raised in the thread, which abandons the pass in flight at
    its next Python step (as STOP_SIGNAL does in an engine process); joined until the deadline.
    Only a thread stuck in one native call past it is left behind, without finalizing, which
    loses nothing: every request is answered, logs and stdio are flushed first. code: the exit
    status then; None: return anyway (an error is on its way up)."""
    client.stop()
    thread = client.thread
    if thread is None:
        return
    thread.join(min(0.1, max(0.0, deadline - time.monotonic())))
    if thread.is_alive():
        import ctypes

        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(Stopped))
        thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive() and code is not None:
        log.warning("the engine thread is stuck in a native call at the shutdown deadline: "
                    "exiting without waiting for it")
        logging.shutdown()
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        os._exit(code)
