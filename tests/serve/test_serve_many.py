"""Several classifiers over one model behind one server (--classifier, Classifier.many): through
the server they answer exactly what separate classifiers (separate servers) answer, a request to
several classifiers equals separate requests, names resolve (or 404 in each route's shape), and
the flags and config tables are read and checked before any model loads. A real uvicorn in a
thread (test_server.running), tiny random model, CPU; one test runs the multi-process layout."""
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from prefixscore import Classifier
from prefixscore.errors import ConfigError, PrefixScoreError
from prefixscore.serve import create_app
from tests.serve.helpers import LIMITS, post_all, running

CATEGORY = dict(template="Which category is this query about? Answer with one label.\nquery: {query}",
                labels=["Dress", "Jeans", "Hoodie", "T-shirt", "Trench Coat"])
GENDER = dict(template="Who is this product for?\nquery: {query}\nAnswer:",
              labels=["women", "men", "kids", "unisex"])
SPECS = {"category": CATEGORY, "gender": GENDER}
QUERIES = ["beige trench coat women", "levis 501", "红色连衣裙", "kids hoodie"]
LIMITS = {**LIMITS, "max_queries": 12}


@pytest.fixture(scope="module")
def path(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def many(path):
    return Classifier.many(SPECS, model=path, device="cpu", chat=False)


@pytest.fixture(scope="module")
def multi(many):
    """One server, two classifiers over one model, served as "shop"."""
    with running(create_app(many, model_name="shop", **LIMITS)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def separate(path):
    """Each classifier alone: its own model, its own server."""
    with running(create_app(Classifier(path, device="cpu", chat=False, **CATEGORY), **LIMITS)) as (a, _), \
            running(create_app(Classifier(path, device="cpu", chat=False, **GENDER), **LIMITS)) as (b, _):
        yield {"category": a, "gender": b}


def same(got, want, tol=1e-5):
    """Two lists of /v1/classify results: the same queries, labels and (within tol) scores."""
    assert [(r["query"], r["label"]) for r in got] == [(r["query"], r["label"]) for r in want]
    for g, w in zip(got, want):
        assert g["scores"].keys() == w["scores"].keys() == g["probs"].keys()
        assert max(abs(g["scores"][k] - w["scores"][k]) for k in g["scores"]) <= tol
        assert max(abs(g["probs"][k] - w["probs"][k]) for k in g["probs"]) <= tol


def classify(base, **body):
    r = httpx.post(base + "/v1/classify", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- answers

def test_two_classifiers_answer_what_two_separate_classifiers_answer(multi, separate, many):
    for name, base in separate.items():
        want = classify(base, query=QUERIES)["results"]
        assert [r["label"] for r in want] == [r.label for r in many[name].classify_batch(QUERIES)]
        same(classify(multi, query=QUERIES, classifier=name)["results"], want)
        same(classify(multi, query=QUERIES, model=name)["results"], want)  # as peers name it
        same(classify(multi, query=QUERIES[1], classifier=name)["results"], want[1:2])
    # no name, or the served model's: the first classifier
    for body in ({}, {"model": "shop"}, {"model": "shop", "classifier": "category"}):
        same(classify(multi, query=QUERIES, **body)["results"],
             classify(separate["category"], query=QUERIES)["results"])


def test_a_request_to_several_classifiers_equals_separate_requests(multi, many):
    """... through the fused pass: the engine loop runs the groups over one bank (many.py)."""
    engine = next(iter(many.values())).engine
    engine.__dict__.get("banks", {}).clear()  # (built by the warm-up: must be built again)
    for names in (["category", "gender"], ["gender", "category"], ["gender"]):
        body = classify(multi, query=QUERIES, classifiers=names)
        assert body["classifiers"] == names and len(body["results"]) == len(QUERIES)
        assert body["batch_size"] >= len(QUERIES) * len(names)
        assert set(body["timing"]) == {"queue_ms", "tokenize_ms", "forward_ms", "total_ms"}
        for name in names:
            alone = classify(multi, query=QUERIES, classifier=name)["results"]
            got = [r["classifiers"][name] for r in body["results"]]
            assert [r["query"] for r in body["results"]] == QUERIES
            assert list(body["results"][0]["classifiers"]) == names
            same(got, alone)
            assert all(set(r) == {"query", "label", "scores", "probs", "cached"} for r in got)
    one = classify(multi, query="levis 501", classifiers=["gender", "category"])
    assert one["results"][0]["query"] == "levis 501" and one["batch_size"] >= 2
    bank, = engine.banks.values()
    assert len(bank.clfs) == len(many) and bank.layouts  # one bank; the one-query layout kept


def test_concurrent_requests_of_mixed_classifiers(multi, separate):
    """Requests for different classifiers (and for several) queued together: the engine loop
    groups one batch by classifier; every answer is its classifier's."""
    want = {n: classify(b, query=QUERIES)["results"] for n, b in separate.items()}
    bodies = [{"query": [q], "classifier": n} for q in QUERIES for n in ("category", "gender")]
    bodies += [{"query": QUERIES, "classifiers": ["gender", "category"]}, {"query": QUERIES}] * 3
    for body, r in zip(bodies, post_all(multi, bodies)):
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        if "classifiers" in body:
            for n in body["classifiers"]:
                same([x["classifiers"][n] for x in results], want[n])
        elif "classifier" in body:
            same(results, want[body["classifier"]][QUERIES.index(body["query"][0]):][:1])
        else:
            same(results, want["category"])


def test_the_cache_keeps_classifiers_apart(path):
    """Two classifiers of one prompt (the same token ids) and other labels: a cached answer of
    one is never the other's."""
    both = Classifier.many({"a": CATEGORY, "b": {**CATEGORY, "labels": ["shoes", "bags", "hats"]}},
                           model=path, device="cpu", chat=False)
    assert both["a"].prompt.prefix_ids == both["b"].prompt.prefix_ids
    with running(create_app(both, cache_size=64, **LIMITS)) as (base, _):
        for _ in range(2):
            a = classify(base, query=QUERIES, classifier="a")["results"]
            b = classify(base, query=QUERIES, classifier="b")["results"]
            ab = classify(base, query=QUERIES, classifiers=["a", "b"])["results"]
            assert all(r["label"] in CATEGORY["labels"] for r in a)
            assert all(r["label"] in ("shoes", "bags", "hats") for r in b)
            same([r["classifiers"]["a"] for r in ab], a)
            same([r["classifiers"]["b"] for r in ab], b)
        assert all(r["cached"] for r in b)


# ---------------------------------------------------------------- names, errors, listings

@pytest.mark.parametrize("body, status, says", [
    ({"query": "x", "classifier": "nope"}, 404, "The classifier `nope` does not exist"),
    ({"query": "x", "model": "nope"}, 404, "The model `nope` does not exist"),
    ({"query": "x", "classifiers": ["gender", "nope"]}, 404, "The classifier `nope` does not exist"),
    ({"query": "x", "classifiers": []}, 422, "classifiers is an empty list"),
    ({"query": "x", "classifiers": ["gender", "gender"]}, 422, "twice"),
    ({"query": "x", "classifiers": ["gender"], "classifier": "gender"}, 422, "not both"),
    ({"query": "x", "classifiers": ["gender"], "model": "category"}, 422, "name one"),
    ({"query": "x", "model": "gender", "classifier": "category"}, 422, "name one"),
    ({"query": ["x"] * 7, "classifiers": ["gender", "category"]}, 413, "7 queries x 2 classifiers"),
])
def test_classify_errors(multi, body, status, says):
    r = httpx.post(multi + "/v1/classify", json=body)
    assert r.status_code == status and says in r.json()["detail"], r.text


def test_compatible_routes_name_classifiers(multi, many):
    want = many["gender"].classify_batch(QUERIES)
    r = httpx.post(multi + "/classify", json={"model": "gender", "input": QUERIES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "gender" and body["labels"] == GENDER["labels"]
    assert [d["label"] for d in body["data"]] == [w.label for w in want]
    r = httpx.post(multi + "/predict", json={"model": "gender", "inputs": QUERIES[0]})
    assert r.status_code == 200 and {p["label"] for p in r.json()} == set(GENDER["labels"])
    assert max(r.json(), key=lambda p: p["score"])["label"] == want[0].label
    assert httpx.post(multi + "/classify", json={"input": "x"}).json()["model"] == "category"
    r = httpx.post(multi + "/classify", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert r.json()["error"]["param"] == "model" and "`category`, `gender`" in r.json()["error"]["message"]
    r = httpx.post(multi + "/predict", json={"model": "nope", "inputs": "x"})
    assert r.status_code == 404 and "nope" in r.json()["error"], r.text


def test_models_and_healthz_list_the_classifiers(multi, many):
    cards = httpx.get(multi + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("shop", None, "shop"), ("category", "shop", "shop"), ("gender", "shop", "shop")]
    assert cards[0]["labels"] == cards[1]["labels"] == CATEGORY["labels"]
    assert cards[2]["labels"] == GENDER["labels"]
    h = httpx.get(multi + "/healthz").json()
    assert h["status"] == "ok" and h["model"] == "shop" and h["labels"] == CATEGORY["labels"]
    assert [c["name"] for c in h["classifiers"]] == ["category", "gender"]
    for card in h["classifiers"]:
        mem = many[card["name"]].memory
        assert card["labels"] == many[card["name"]].labels
        assert card["prefix_tokens"] == many[card["name"]].prefix_len
        assert card["adapter"] is None  # none merged (the seed adapter's is "seed")
        assert card["memory"] == {**mem, "added_bytes": mem["prefix_kv"] + mem["label_rows"] + mem["graphs"]}
        assert 0 < card["memory"]["added_bytes"] < mem["model_bytes"]
    schema = httpx.get(multi + "/openapi.json").json()
    body = schema["paths"]["/v1/classify"]["post"]["responses"]["200"]["content"]["application/json"]
    refs = {s["$ref"].rsplit("/", 1)[-1] for s in body["schema"]["anyOf"]}
    assert refs == {"ClassifyResponse", "ClassifyManyResponse", "VllmClassifyResponse"}  # vLLM's body


def test_metrics_per_classifier(multi):
    classify(multi, query="levis 501", classifiers=["category", "gender"])
    text = httpx.get(multi + "/metrics").text
    for name in ("category", "gender"):
        assert f'prefixscore_latency_seconds_count{{classifier="{name}",' in text
        assert f'prefixscore_tokens_total{{classifier="{name}",' in text


# ---------------------------------------------------------------- flags and config file

def configs(*words, config=None):
    """`prefixscore serve WORDS` as the CLI reads it (flags, config file), up to the two configs."""
    from prefixscore.cli.commands import build_parser
    from prefixscore.cli.common import apply_sources
    from prefixscore.cli.serve import configs as serve_configs

    argv = ["serve", "--device", "cpu", *words] + (["--config", str(config)] if config else [])
    a = build_parser().parse_args(argv)
    a.argv = argv[1:]
    apply_sources(a, a.command_parser, environ={})
    return serve_configs(a)


def test_classifier_flags(tmp_path):
    (tmp_path / "cat.txt").write_text("Category of {query}?\n")
    (tmp_path / "labels.txt").write_text("shoes, boots\nbags|totes\n")
    _, e = configs("--classifier", f"name=category,template-file={tmp_path / 'cat.txt'},labels=Dress|Jeans",
                   "--classifier", "name=gender,template=Men, women, or kids? {query},"
                                   f"labels-file={tmp_path / 'labels.txt'},mode=logits,chat=false",
                   "--chat")
    a, b = e.classifiers
    assert (a.name, a.template, a.labels, a.chat, a.mode) == ("category", "Category of {query}?",
                                                               ("Dress", "Jeans"), None, None)
    assert (b.name, b.template, b.labels, b.chat, b.mode) == ("gender", "Men, women, or kids? {query}",
                                                               ("shoes, boots", "bags|totes"), False, "logits")
    assert a.kwargs(e.spec.chat, e.spec.mode) == dict(template=a.template, labels=("Dress", "Jeans"), chat=True,
                                            mode="logprobs", head=None)
    assert e.spec.adapter is None and e.spec.template is None and e.spec.labels is None  # no seed adapter default
    _, e = configs("--classifier", "name=x,labels=a, b|c")  # a comma inside a label
    assert e.classifiers[0].labels == ("a, b", "c")
    assert configs()[1].classifiers == ()


def test_classifier_tables_in_the_config_file(tmp_path):
    (tmp_path / "g.txt").write_text("women\nmen\n")
    config = tmp_path / "serve.toml"
    config.write_text(f'port = 9001\n[classifiers.category]\ntemplate = "Category of {{query}}?"\n'
                      f'labels = ["Dress", "Jeans, slim"]\nchat = false\n'
                      f'[classifiers.gender]\ntemplate = "Who? {{query}}"\nlabels-file = "{tmp_path / "g.txt"}"\n'
                      f'mode = "logits"\n')
    f, e = configs(config=config)
    assert f.port == 9001 and [s.name for s in e.classifiers] == ["category", "gender"]
    assert e.classifiers[0].labels == ("Dress", "Jeans, slim") and e.classifiers[0].chat is False
    assert e.classifiers[1].labels == ("women", "men") and e.classifiers[1].mode == "logits"
    # flags given replace the file's tables
    _, e = configs("--classifier", "name=only,labels=a|b", config=config)
    assert [s.name for s in e.classifiers] == ["only"]


@pytest.mark.parametrize("words, says", [
    (["--classifier", "template={query},labels=a|b"], "name=NAME is required"),
    (["--classifier", "name=a,labels=a|b,colour=red"], "'colour' is not a key"),
    (["--classifier", "oops,name=a,labels=a|b"], "not KEY=VALUE"),
    (["--classifier", "name=a,labels=x|y", "--classifier", "name=a,labels=p|q"], "two classifiers are named 'a'"),
    (["--classifier", "name=a b,labels=x|y"], "the name 'a b' must be"),
    (["--classifier", "name=a,labels=x"], "at least two labels"),
    (["--classifier", "name=a,labels=x|x"], "duplicate labels"),
    (["--classifier", "name=a,template=no slot,labels=x|y"], "{query}"),
    (["--classifier", "name=a,template-file=/nonexistent/t.txt"], "cannot read template file"),
    (["--classifier", "name=a,labels-file=/nonexistent/l.txt"], "cannot read labels file"),
    (["--classifier", "name=a,labels=x|y,labels-file=l.txt"], "labels or labels-file, not both"),
    (["--classifier", "name=a,labels=x|y,mode=best"], "mode='best'"),
    (["--classifier", "name=a,labels=x|y,chat=maybe"], "chat='maybe'"),
    (["--classifier", "name=a,head=/nonexistent/h.safetensors"], "classifier a: head file not found"),
    (["--classifier", "name=a,labels=x|y", "--labels", "p,q"], "--labels describes the one default"),
    (["--classifier", "name=a,labels=x|y", "--classifier", "name=b,labels=p|q", "--adapter", "seed"],
     "--adapter with 2 classifiers"),
])
def test_classifier_flag_errors(words, says):
    with pytest.raises(PrefixScoreError, match=None) as e:
        configs(*words)
    assert says in str(e.value), str(e.value)


def test_config_table_errors(tmp_path):
    for text, says in [('[classifiers.a]\nlabels = ["x", "y"]\ncolour = "red"\n', "unknown key 'colour'"),
                       ('[classifiers.a]\nlabels = ["x", "y"]\nname = "b"\n', "unknown key 'name'"),
                       ('[classifiers.a]\nlabels = 5\n', "labels = 5"),
                       ('classifiers = 5\n', "one table per classifier")]:
        config = tmp_path / "bad.toml"
        config.write_text(text)
        with pytest.raises(ConfigError) as e:
            configs(config=config)
        assert says in str(e.value), str(e.value)


# ---------------------------------------------------------------- the multi-process layout

@pytest.mark.slow  # slow: a launcher, front ends and an engine in subprocesses (~10 s)
def test_workers_serve_the_config_files_classifiers(path, separate, tmp_path):
    """--workers 2 (front-end processes over ZeroMQ, an engine process) with the classifiers of a
    config file: the front ends build each classifier's prompt from the engine's Ready, answers
    equal the separate servers', and start-up logs what each classifier adds."""
    config = tmp_path / "serve.toml"
    config.write_text("".join(f'[classifiers.{n}]\ntemplate = {s["template"]!r}\nlabels = {s["labels"]!r}\n'
                              f"chat = false\n".replace("'", '"') for n, s in SPECS.items()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "prefixscore.cli", "serve", "--device", "cpu",
                             "--model", path, "--port", str(port), "--workers", "2",
                             "--config", str(config), "--max-queries", "12"],
                            env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(base + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        body = classify(base, query=QUERIES, classifiers=["gender", "category"])
        for name, sep in separate.items():
            want = classify(sep, query=QUERIES)["results"]
            same([r["classifiers"][name] for r in body["results"]], want)
            same(classify(base, query=QUERIES, classifier=name)["results"], want)
        h = httpx.get(base + "/healthz").json()
        assert [c["name"] for c in h["classifiers"]] == ["category", "gender"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    for name in SPECS:
        assert f"classifier {name}: " in err and "of the" in err, err[-3000:]


# ---------------------------------------------------------------- gRPC

def test_grpc_classify_names_a_classifier(many):
    """gRPC Classify takes `classifier` (and `model`) as /v1/classify does: the same answers,
    NOT_FOUND for a name not served."""
    pytest.importorskip("grpc")
    import asyncio

    import grpc
    from tests.serve.test_grpc import failure, serving

    from prefixscore.serve.proto import prefixscore_pb2 as pb

    async def go():
        async with serving(many) as s:
            for name in ("category", "gender"):
                want = many[name].classify_batch(QUERIES)
                for kw in ({"classifier": name}, {"model": name}):
                    r = await s.classify(pb.ClassifyRequest(queries=QUERIES, **kw))
                    assert r.classifier == name and list(r.labels) == many[name].labels
                    assert [x.label for x in r.results] == [w.label for w in want]
            r = await s.classify(pb.ClassifyRequest(queries=QUERIES[:1]))
            assert r.classifier == "category"
            code, details, meta = await failure(s.classify(pb.ClassifyRequest(queries=["x"],
                                                                               classifier="nope")))
            assert code == grpc.StatusCode.NOT_FOUND and "`nope`" in details
            assert meta["http-status"] == "404"

    asyncio.run(go())


def test_shed_lag_follows_the_latency_target():
    """--shed-lag-ms: twice --target-p99-ms by default, off without a target, 0 turns it off, and
    a negative value is refused naming the flag."""
    from prefixscore import ConfigError

    assert configs("--target-p99-ms", "5")[0].shed_lag_ms == 10.0
    assert configs()[0].shed_lag_ms is None
    assert configs("--target-p99-ms", "5", "--shed-lag-ms", "0")[0].shed_lag_ms is None
    assert configs("--shed-lag-ms", "30")[0].shed_lag_ms == 30.0
    with pytest.raises(ConfigError, match="--shed-lag-ms"):
        configs("--shed-lag-ms", "-1")


def test_ready_names_the_merged_adapter():
    """/healthz says which adapter a classifier's weights carry: "seed", a file's name, or none."""
    from types import SimpleNamespace

    from prefixscore.serve.protocol import classifier_info

    prompt = SimpleNamespace(template="t {query}", chat=False, special_tokens=False, prefix_ids=[1],
                             context_limit=9)
    for adapter, want in ((None, None), ("seed", "seed"), ("/runs/my.adapter.safetensors",
                                                           "my.adapter.safetensors")):
        clf = SimpleNamespace(prompt=prompt, labels=["a"], mode="logprobs", truncate=False, memory={},
                              spec=SimpleNamespace(adapter=adapter))
        assert classifier_info("c", clf).adapter == want
