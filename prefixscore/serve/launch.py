"""Process layout of `prefixscore serve` (DESIGN.md §7):

    --workers 1:  one process: uvicorn's event loop + the engine loop on a thread (InprocClient)
    --workers N:  launcher ── N front-end processes (HTTP, sharing one listening socket)
                         └── 1 engine process (the device), a Unix socket to each (wire.py)
    --data-parallel D > 1: the same, with D engine processes (engine i on cuda:i; all on cpu for
                  the tests), a socket path each; every front end holds a socket per engine and
                  sends each pass's message to the least-loaded one (dp_client.py). --workers 1
                  then means one front-end process, not the single-process layout: the engines
                  need processes of their own, and refusing would break the default on a host of
                  2 CPUs (1 worker) and several GPUs (D = every GPU).

serve() checks in this order, so that nothing slow comes before a mistake it could report: the
flags and small files (cli.configs), the ports (bound now: a busy port is one line and exit 2), the
model's files (a hub name is downloaded here, once, and the engine gets the local path); then the
model loads. The launcher starts the engine, then the front ends, and watches every process: an
engine that dies before it was ever ready ends the server (exit 2, its error on stderr); one that
dies later is restarted with --restart-engine (front ends answer 503 meanwhile), else the front
ends stay up unhealthy. With several engines the same holds per engine, except that the server
stays healthy (the others take the load) until none is left. A dead front end is restarted.
SIGTERM/SIGINT: the front ends drain (accepted requests finish within --shutdown-timeout T; what
still waits at T - 0.5 s is answered 503 + Retry-After), then the engines are stopped, abandoning
the pass in flight (its answers are moot by then), and every process has exited within T + 1 s
(one still alive at T + EXIT_GRACE is killed). The engine processes ignore SIGTERM and SIGINT:
sent to the whole process group (systemd, a terminal), they would cut the drain short.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from ..errors import ConfigError
from . import logs
from .config import EngineConfig, FrontendConfig
from .connections import EXIT_GRACE, uvicorn_server  # uvicorn_server: the tests' import, as before
# engine_cpu: beside the engine process that pins itself with it (and importable from here, as
# before); launch imports engine_proc, never the other way round
from .engine_proc import (STOP_SIGNAL, end_engine_thread, engine_config, engine_cpu,  # noqa: F401
                          freeze_for_exit)

log = logging.getLogger("prefixscore.serve")
# The engines stop at --shutdown-timeout - ENGINES after the signal (or once every front end is
# gone): the front ends answered what waited 503 at T - FAIL (connections.py), so their work is moot.
ENGINES = 0.25


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, before anything slow: a busy port is a clear error at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e} "
                          f"(--host/--port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# ---------------------------------------------------------------- --workers 1

def single_process(fcfg: FrontendConfig, ecfg: EngineConfig, sock=None) -> None:
    from .classifiers import log_memory
    from .client import InprocClient
    from .protocol import classifier_info
    from .engine_proc import build, first, spin_seconds
    from .frontend import Frontend
    from .http import create_app
    from .metrics import Metrics

    logs.setup(fcfg.log_level, fcfg.log_format)
    sock = sock or bind(fcfg.host, fcfg.port)
    fcfg = dataclasses.replace(fcfg, port=sock.getsockname()[1])  # --port 0: the "ready" line's
    classifiers, scorer = build(ecfg)
    clf = first(classifiers)
    cpu = engine_cpu(ecfg.engine_cpu, clf.engine.device.type)
    if cpu is not None:  # the event loop (this thread, and threads it starts) off the engine's CPU
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {cpu})
    metrics = Metrics()
    model = ecfg.served_model_name or os.path.basename(str(clf.loaded.name))
    named = classifiers if isinstance(classifiers, dict) else {model: classifiers}
    log_memory([classifier_info(name, c) for name, c in named.items()])
    client = InprocClient(classifiers, scorer, window=ecfg.batch_window_ms / 1e3,
                          spin=spin_seconds(ecfg.engine_spin_ms, clf.engine.device.type),
                          metrics=metrics, restart=fcfg.restart_engine, model=model, engine_cpu=cpu,
                          schedule=ecfg.schedule)
    fe = Frontend(fcfg, client, metrics, lambda info: [c.prompt for c in named.values()])

    def started(loop):
        client.start(loop)
        gc.collect()
        gc.freeze()

    app = create_app(fe, on_startup=started, on_shutdown=client.stop)
    # The event loop and the engine thread share the GIL. Under load the loop rarely blocks, so
    # the engine thread, back from a GPU sync, would wait up to the 5 ms default switch interval
    # for it: a forward's worth of latency per batch. 0.5 ms bounds that wait.
    sys.setswitchinterval(0.0005)
    server = uvicorn_server(app, fcfg, fe)
    try:
        server.run(sockets=[sock])
    except BaseException:  # a start-up failure: the thread may be warming up (seconds on a GPU)
        end_engine_thread(client, time.monotonic() + 30.0, None)  # then the error is said
        raise
    end_engine_thread(client, server.exit_by or time.monotonic() + EXIT_GRACE, 0)
    freeze_for_exit()


# ---------------------------------------------------------------- --workers N

def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launcher dies, however it dies (SIGKILL included),
    so no engine or front end outlives the server (SGLang's kill_itself_when_parent_died)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


MISMATCH_EXIT = 3  # a front end whose engines disagree (dp_client): the launcher ends the server


def worker_main(fcfg: FrontendConfig, index: int, addresses: list[str], sock, avoid_cpu=None) -> None:
    """A front-end process: HTTP on the shared socket, an engine client over ZeroMQ (a client per
    engine behind a router with --data-parallel)."""
    die_with_parent()
    if avoid_cpu is not None:  # the engine process's CPU (--engine-cpu)
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {avoid_cpu})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards SIGTERM
    logs.setup(fcfg.log_level, fcfg.log_format, f"worker {index}")
    from .wire import SocketClient
    from .frontend import Frontend
    from .http import create_app
    from .metrics import Metrics

    # Imported before this process serves, not when the engine's Ready arrives: transformers
    # (and the torch it imports) takes seconds cold, with several processes starting at once.
    import transformers.models.auto.tokenization_auto  # noqa: F401

    if len(addresses) == 1:
        client = SocketClient(addresses[0], index)
    else:
        from .dp_client import DataParallelClient

        client = DataParallelClient(addresses, index)
        client.on_mismatch = _mismatch
    fe = Frontend(fcfg, client, Metrics(engines=len(addresses)), worker_prompts)

    def started(loop):
        client.start(loop)
        gc.collect()
        gc.freeze()

    app = create_app(fe, on_startup=started, on_shutdown=client.stop)
    uvicorn_server(app, fcfg, fe).run(sockets=[sock])
    freeze_for_exit()


def _mismatch(message: str) -> None:
    print(f"prefixscore: error: {message}", file=sys.stderr, flush=True)
    os._exit(MISMATCH_EXIT)


def worker_prompts(info):
    """The engine's prompts, one per classifier over the one tokenizer, rebuilt from its files
    (the same split, checked by sync)."""
    from transformers import AutoTokenizer

    from ..prompt import Prompt

    tok = AutoTokenizer.from_pretrained(info.tokenizer_path, local_files_only=True)
    return [Prompt(tok, c.template, chat=c.chat, **({"special_tokens": True} if c.special_tokens else {}))
            for c in info.classifiers]


class Launcher:
    def __init__(self, fcfg: FrontendConfig, ecfg: EngineConfig, sock=None):
        self.fcfg, self.ecfg = fcfg, ecfg
        self.sock = sock or bind(fcfg.host, fcfg.port)
        self.ctx = mp.get_context("spawn")
        self.run_dir = tempfile.mkdtemp(prefix="prefixscore-")
        os.makedirs(os.path.join(self.run_dir, "metrics"))
        # Before any child imports prometheus_client: every process writes its metrics there.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(self.run_dir, "metrics")
        n = fcfg.data_parallel
        self.addresses = [f"{self.run_dir}/engine.sock"] if n == 1 else \
            [f"{self.run_dir}/engine-{i}.sock" for i in range(n)]
        self.engines: list = [None] * n
        self.engine_ready = [self.ctx.Event() for _ in range(n)]
        self.ever_ready = [False] * n
        self.workers: list = []
        self.stopping = False
        self.stop_at: float | None = None  # time.monotonic() when the front ends were told to stop
        self.signals = 0

    def start_engine(self, i: int = 0):
        n = len(self.engines)
        self.engine_ready[i].clear()
        self.engines[i] = self.ctx.Process(
            target=_engine_entry, name="prefixscore-engine" + (f"-{i}" if n > 1 else ""),
            daemon=False, args=(engine_config(self.ecfg, i, n), self.addresses[i], self.run_dir,
                                self.fcfg.log_level, self.engine_ready[i], i, n, self.fcfg.log_format))
        self.engines[i].start()

    def start_worker(self, i: int):
        cpu = engine_cpu(self.ecfg.engine_cpu, "cuda") if self.ecfg.engine_cpu != "none" else None
        # the bound port (--port 0: the kernel's pick) for its "ready" line, said by worker 0 only
        fcfg = dataclasses.replace(self.fcfg, port=self.sock.getsockname()[1], announce=i == 0)
        p = self.ctx.Process(target=worker_main, name=f"prefixscore-worker-{i}", daemon=False,
                             args=(fcfg, i, self.addresses, self.sock, cpu))
        p.start()
        return p

    def run(self) -> int:
        logs.setup(self.fcfg.log_level, self.fcfg.log_format, "launcher")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signal)
        try:
            for i in range(len(self.engines)):
                self.start_engine(i)
            if self.stopping:  # a signal while the engines started: the socket is closed already
                return 0
            self.workers = [self.start_worker(i) for i in range(self.fcfg.workers)]
            log.info("serving on http://%s:%d: %d front-end processes, engine pid %s",
                     self.fcfg.host, self.sock.getsockname()[1], self.fcfg.workers,
                     ", ".join(str(p.pid) for p in self.engines))
            return self._watch()
        finally:
            self._shutdown()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.engine_ready = []  # their semaphores unregistered first: the tracker warns of none
            _stop_resource_tracker()
            freeze_for_exit()

    def _signal(self, signum, frame):
        self.signals += 1
        self.stopping = True
        if self.signals == 1:  # drain: the front ends stop accepting and finish what they hold
            self.sock.close()
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self.stop_at is None:
            self.stop_at = time.monotonic()
        for p in self.workers:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def _watch(self) -> int:
        dead: set[int] = set()  # engines that died for good (no --restart-engine)
        name = ["the engine process"] if len(self.engines) == 1 else \
            [f"engine process {i}" for i in range(len(self.engines))]
        while not self.stopping:
            live = [p for i, p in enumerate(self.engines) if i not in dead]
            done = mp.connection.wait([p.sentinel for p in live + self.workers], timeout=0.5)
            self.ever_ready = [r or e.is_set() for r, e in zip(self.ever_ready, self.engine_ready)]
            if self.stopping:
                break
            for i, engine in enumerate(self.engines):
                if i in dead or engine.sentinel not in done:
                    continue
                code = engine.exitcode
                if not self.ever_ready[i]:
                    print(f"prefixscore: error: {name[i]} exited ({code}) before it was ready; "
                          f"see its log above", file=sys.stderr)
                    return 2
                if self.fcfg.restart_engine:
                    log.error("%s died (exit %s): restarting it", name[i], code)
                    self.start_engine(i)
                    continue
                dead.add(i)
                self.engine_ready[i].clear()
                if len(dead) < len(self.engines):
                    log.error("%s died (exit %s): the other engines serve (start with "
                              "--restart-engine to restart it)", name[i], code)
                    continue
                log.error("%s died (exit %s): the server answers 503 and /healthz is unhealthy "
                          "(start with --restart-engine to restart it)", name[i], code)
                self._wait_workers()
                return 1
            for i, p in enumerate(self.workers):
                if p.sentinel in done and not self.stopping:
                    if p.exitcode == MISMATCH_EXIT:  # said why on stderr; a restart would too
                        self._signal(signal.SIGTERM, None)  # the other front ends stop now
                        return 2
                    log.error("front-end process %d died (exit %s): restarting it", i, p.exitcode)
                    self.workers[i] = self.start_worker(i)
        return 0

    def _wait_workers(self) -> None:
        """Without --restart-engine the front ends keep answering (503, unhealthy) until a signal."""
        while not self.stopping:
            mp.connection.wait([p.sentinel for p in self.workers], timeout=0.5)

    def _shutdown(self) -> None:
        """Bounded: every child is gone (and reaped) by --shutdown-timeout + EXIT_GRACE after the
        stop. The engines serve until the front ends are gone or have answered what waited (at
        T - FAIL), then get STOP_SIGNAL, which abandons the pass in flight (engine_proc.Stopped)."""
        if self.stop_at is None:  # a start-up failure, not a signal: the front ends stop now
            self._stop_workers()
        timeout = self.fcfg.shutdown_timeout
        engines = [e for e in self.engines if e is not None]
        _wait(self.workers, self.stop_at + max(0.0, timeout - ENGINES))
        for e in engines:
            if e.is_alive():
                os.kill(e.pid, STOP_SIGNAL)
        _wait(self.workers + engines, self.stop_at + timeout + EXIT_GRACE)
        for p in self.workers + engines:
            if p.is_alive():
                log.warning("%s (pid %d) did not exit within --shutdown-timeout: killing it",
                            p.name, p.pid)
                p.kill()
            p.join()


def _wait(procs: list, deadline: float) -> None:
    """Until every process of procs has exited, or the deadline."""
    while True:
        live = [p.sentinel for p in procs if p.is_alive()]
        left = deadline - time.monotonic()
        if not live or left <= 0:
            return
        mp.connection.wait(live, timeout=left)


def _stop_resource_tracker() -> None:
    """The spawn context's resource tracker process, left alone, outlives the launcher (by seconds,
    measured) until it sees every holder of its pipe gone: stopped and reaped here instead, so no
    process of the server outlives `prefixscore serve`."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # CPython 3.8 to 3.13
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


def _engine_entry(*args) -> None:
    from .engine_proc import main

    die_with_parent()
    main(*args)
    freeze_for_exit()


def serve(fcfg: FrontendConfig, ecfg: EngineConfig) -> int:
    sock = bind(fcfg.host, fcfg.port)
    try:
        if fcfg.grpc_port is not None:
            from .grpc_server import check_port

            check_port(fcfg.host, fcfg.grpc_port)  # a taken port fails before the model loads
        from ..weights.hub import quiet_downloads

        with quiet_downloads(fcfg.log_level in ("warning", "error")):
            ecfg = local_model(ecfg)
    except BaseException:
        sock.close()
        raise
    if fcfg.workers == 1 and fcfg.data_parallel == 1:
        single_process(fcfg, ecfg, sock)
        return 0
    return Launcher(fcfg, ecfg, sock).run()


def local_model(ecfg: EngineConfig) -> EngineConfig:
    """ecfg with its model as a checked local path: a hub name is resolved (downloaded) here, in
    the launcher, so that a missing model is one line and exit 2 rather than an engine process
    dying, and the engine (and a restarted one) loads those same files without asking the hub."""
    from ..weights.loading import check, resolve

    if ecfg.spec.model is None:  # the bundled model: the engine finds it as every command does
        return ecfg
    return dataclasses.replace(ecfg, spec=ecfg.spec.replace(model=str(check(resolve(ecfg.spec.model)))))
