"""The HTTP server's own cost: `create_app` around a stub classifier, no model, no GPU.

    python -m bench.server_stub [--requests 3000]             # instant stub: the bare server path
    python -m bench.server_stub --stub gpu [--rounds 5]       # GPU-like stub: server overhead, as W5

Serves the real app as `prefixscore serve --workers 1` runs it (`prefixscore.serve.create_app` and
`launch.uvicorn_server`: uvicorn, httptools, uvloop when installed) in a child process with a stub
in place of the model, and times, one request at a time on a keep-alive connection from a load
process (bench/loadgen.py), GET /healthz (the bare HTTP round trip), POST /v1/classify, and the
same POST refused (a deadline already past: 504 before tokenizing, what shedding costs a front end).

--stub instant  tokenize and classify return at once: classify - healthz is the classify path's
                cost apart from the model (parse, validate, queue, engine-thread hand-offs, JSON).
--stub gpu      a call shaped like `classify(q)` on the H200 host: ~50 us of pure-Python work in
                encode_many (the tokenizer), ~100 us in decide_encoded (plan, copies), then ~650
                us busy with the GIL released (a CUDA sync: torch drops the GIL, the driver
                spin-waits on a core). The busy wait is one hashlib call over a buffer sized at
                start-up, so it occupies a core and takes the GIL back once, as the sync does.
                Also times the call in this process (`inproc`) and handed to a worker thread
                (`worker`), as bench.http does: server overhead = HTTP serial p50 - inproc p50.
                Each round times every phase; the report is the median of the rounds' p50s.
                The server polls for work as `prefixscore serve` does on a GPU (--engine-spin-ms).
--real-prompt   the bundled model's tokenizer and the seed prompt in place of the stub's (the
                front end's real tokenizing cost; no model is loaded), and prometheus-client in
                its multiprocess mode (files), as every `prefixscore serve` with an engine process
                writes its metrics.
--wrk PATH      also a closed loop of Debian's wrk on --wrk-conns connections (pinned to the last
                CPU, the server to the others): requests/s = what one front end process can do,
                its CPU per request being the inverse (with the instant stub).
Writes $OUT/server_stub.json (bench/results/server_stub.json without OUT).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

from prefixscore.serve.engine_proc import spin_seconds

from .http import call_times, free_port, load_queries, pct
from .loadgen import LoadGen

OUT = Path(os.environ.get("OUT") or "bench/results")
QUERIES = ["red dress", "levis 501 straight leg", "beige trench coat women", "running shoes"]


# ---------------------------------------------------------------- stubs

class Encoded:
    def __init__(self, q):
        self.values, self.ids, self.start = {"query": q}, [1, 2, 3], 0


class StubPrompt:
    """What a front end reads of the classifier's Prompt."""
    prefix_ids, context_limit, template, chat, special_tokens, tokenizer = [], 0, "{query}", False, False, None

    def __init__(self, work=lambda: None):
        self.work = work

    def encode_many(self, values, truncate=False):
        self.work()
        return [Encoded(v["query"]) for v in values]


class InstantStub:
    """The classifier's surface that the server uses, answering at once."""
    prefix_len, labels, mode, truncate, max_batch_tokens = 0, ["a", "b"], "logprobs", False, 16384

    class engine:
        dtype = "float32"  # (what /info reports)

        class device:
            type = "cpu"

    def __init__(self):
        self.prompt = StubPrompt()

    def encode(self, q):
        return Encoded(q)

    def decide_encoded(self, encoded):
        return [0] * len(encoded), [[-0.1] + [-2.3] * (len(self.labels) - 1)] * len(encoded)

    def classify(self, q):
        return self.decide_encoded(self.prompt.encode_many([{"query": q}]))


def py_work(n: int) -> int:
    """Pure-Python work holding the GIL: small objects made and dropped, as tokenize/plan do."""
    d = {}
    for i in range(n):
        d[i] = (i, [i])
    return len(d)


def gil_free_wait(buf: bytes) -> None:
    """Busy on a core with the GIL released: hashlib drops the GIL for inputs over 2 KiB."""
    hashlib.sha256(buf)


class GpuStub(InstantStub):
    def __init__(self, tok_n: int, plan_n: int, wait_bytes: int):
        self.tok_n, self.plan_n, self.buf = tok_n, plan_n, b"\0" * wait_bytes
        self.prompt = StubPrompt(lambda: py_work(self.tok_n))

    def decide_encoded(self, encoded):
        py_work(self.plan_n)
        gil_free_wait(self.buf)
        return super().decide_encoded(encoded)


def median_us(fn, arg, reps=31) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(arg)
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


def calibrate(tok_us: float, plan_us: float, wait_us: float) -> dict:
    """Sizes of the stub's work for these durations on this machine (measured on this thread;
    rescaled a few times at the target size, as the cost per iteration depends on the size)."""
    def size(fn, make, n, us):
        for _ in range(3):
            n = max(1, round(n * us / median_us(fn, make(n))))
        return n

    return {"tok_n": size(py_work, int, 1000, tok_us), "plan_n": size(py_work, int, 1000, plan_us),
            "wait_bytes": size(gil_free_wait, lambda n: b"\0" * n, 1 << 20, wait_us)}


# ---------------------------------------------------------------- server and client

def real_prompt_stub(stub):
    """stub with the bundled model's seed prompt and labels (the model is loaded for its prompt,
    then only the prompt is used)."""
    from prefixscore.classifier import Classifier

    clf = Classifier()
    stub.prompt, stub.labels, stub.prefix_len = clf.prompt, list(clf.labels), len(clf.prompt.prefix_ids)
    return stub


def serve(port, sizes, spin_ms, real=False, cpus=None):
    import sys
    import tempfile

    if cpus:
        os.sched_setaffinity(0, cpus)
    if real:  # as `prefixscore serve` with an engine process: prometheus' multiprocess files
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="stub_metrics")

    from prefixscore.serve import create_app
    from prefixscore.serve.launch import bind, uvicorn_server

    stub = GpuStub(**sizes) if sizes else InstantStub()
    if real:
        stub = real_prompt_stub(stub)
    app = create_app(stub, max_tokens=512, engine_spin_ms=spin_ms, log_level="error")
    fe = app.state.frontend
    sys.setswitchinterval(0.0005)  # as prefixscore serve --workers 1
    uvicorn_server(app, fe.cfg, fe).run(sockets=[bind("127.0.0.1", port)])


def http_phases(gen: LoadGen, port, n, warm) -> dict:
    """p50/p99 (us) of GET /healthz and POST /v1/classify, one at a time on one connection, and
    the p50 of the server's own timing of the classify requests."""
    for _ in range(300):  # until the server answers
        try:
            if gen.serial(port, 1, 2.0, payload="healthz")["status"][0] == 200:
                break
        except Exception:
            pass
        time.sleep(0.2)
    else:
        raise SystemExit("server did not start")
    out = {}
    for name in ("healthz", "classify", "refused"):
        gen.serial(port, warm, 10.0, payload=name)
        r = gen.serial(port, n, 10.0, payload=name, bodies=name == "classify")
        lat = [1e3 * x for x in r["lat"]]
        out[name] = {"p50_us": statistics.median(lat), "p99_us": pct(lat, 99), "n": n}
        if r.get("timing"):
            t = r["timing"]
            out["server_timing_p50_us"] = {k.replace("_ms", ""): 1e3 * statistics.median(x[k] for x in t)
                                           for k in t[0]}
    return out


def local_phases(stub, n) -> dict:
    """stub.classify(q) in this thread, then handed to a worker thread (as bench.http does)."""
    out = {}
    for name, ms in zip(("inproc", "worker"), call_times(stub.classify, QUERIES, n)):
        lat = [1e3 * x for x in ms]
        out[name] = {"p50_us": statistics.median(lat), "p99_us": pct(lat, 99), "n": n}
    return out


def wrk_phase(a, port) -> dict:
    import tempfile

    from .request_timeline import wrk

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps({"query": q}) + "\n" for q in load_queries(None))
    try:
        return wrk(a, port, a.wrk_conns, f.name)
    finally:
        os.unlink(f.name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stub", choices=["instant", "gpu"], default="instant")
    ap.add_argument("--requests", type=int, default=3000, help="timed requests per phase and round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every phase (medians reported)")
    ap.add_argument("--tokenize-us", type=float, default=50, help="gpu stub: Python work in encode_many")
    ap.add_argument("--plan-us", type=float, default=100, help="gpu stub: Python work before the wait")
    ap.add_argument("--wait-us", type=float, default=650, help="gpu stub: GIL-free busy wait")
    ap.add_argument("--engine-spin-ms", type=float, default=None,
                    help="the server's --engine-spin-ms (default: as `prefixscore serve` on a GPU "
                         "for the gpu stub, 2; 0 for the instant stub)")
    ap.add_argument("--real-prompt", action="store_true", help="the bundled model's tokenizer and seed prompt")
    ap.add_argument("--wrk", default=None, help="wrk binary: also a closed-loop capacity run")
    ap.add_argument("--wrk-conns", type=int, default=16)
    ap.add_argument("--wrk-seconds", type=float, default=5.0)
    a = ap.parse_args()
    ncpu = len(os.sched_getaffinity(0))
    a.load_cpus = {max(os.sched_getaffinity(0))} if a.wrk and ncpu > 1 else None
    server_cpus = set(os.sched_getaffinity(0)) - a.load_cpus if a.load_cpus else None
    try:
        import uvloop  # the client's own overhead, kept small (as bench.http)

        uvloop.install()
    except ImportError:
        pass
    sizes = calibrate(a.tokenize_us, a.plan_us, a.wait_us) if a.stub == "gpu" else None
    port = free_port()
    spin = (a.engine_spin_ms if a.engine_spin_ms is not None  # as `prefixscore serve`
            else 1e3 * spin_seconds("auto", "cuda" if sizes else "cpu"))
    p = mp.Process(target=serve, args=(port, sizes, spin, a.real_prompt, server_cpus), daemon=True)
    p.start()
    rounds = []
    gen = LoadGen(1, "http", QUERIES)
    try:
        for _ in range(a.rounds):
            r = http_phases(gen, port, a.requests, warm=300)
            if sizes:
                r.update(local_phases(GpuStub(**sizes), a.requests))
            if a.wrk:
                r["wrk"] = wrk_phase(a, port)
                print(f"wrk {a.wrk_conns} connections: {r['wrk']['req_s']:.0f} req/s, p50 "
                      f"{r['wrk']['p50_ms']:.2f} ms, errors {r['wrk']['errors']}", flush=True)
            rounds.append(r)
    finally:
        gen.close()
        p.terminate()
        p.join()
    phases = [k for k in ("inproc", "worker", "classify", "refused", "healthz") if k in rounds[0]]
    res = {"stub": a.stub, "cpus": os.cpu_count(), "sizes": sizes, "engine_spin_ms": spin, "rounds": rounds,
           "p50_us": {k: statistics.median(r[k]["p50_us"] for r in rounds) for k in phases}}
    med = res["p50_us"]
    res["classify_minus_healthz_p50_us"] = med["classify"] - med["healthz"]
    for k in phases:
        print(f"{k:9s} p50 {med[k]:7.1f} us   (rounds: {' '.join('%.0f' % r[k]['p50_us'] for r in rounds)})")
    print(f"classify path over the bare round trip: {res['classify_minus_healthz_p50_us']:.1f} us")
    res["refused_minus_healthz_p50_us"] = med["refused"] - med["healthz"]
    print(f"refusal path over the bare round trip: {res['refused_minus_healthz_p50_us']:.1f} us")
    if sizes:
        res["overhead_p50_us"] = med["classify"] - med["inproc"]
        timing = {k: statistics.median(r["server_timing_p50_us"][k] for r in rounds)
                  for k in rounds[0]["server_timing_p50_us"]}
        res["server_timing_p50_us"] = timing
        print("server timing p50: " + ", ".join(f"{k} {v:.0f} us" for k, v in timing.items()))
        print(f"server overhead (HTTP serial - inproc) p50: {res['overhead_p50_us']:.1f} us")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "server_stub.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
