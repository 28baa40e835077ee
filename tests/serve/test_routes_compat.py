"""The routes in other servers' shapes (serve/compat.py), each against its peer's request and
response shapes (transcribed below from the peers' sources, error shapes included), the `model` /
`classifier` names, and /metrics' labels. A real uvicorn in a thread (test_server.running), tiny
random model, CPU."""
import json
import math
import os

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

import prefixscore
from prefixscore.serve import create_app
from tests.serve.helpers import JSON, LIMITS, running

QUERIES = ["beige trench coat women", "levis 501", "红色连衣裙"]


# ---------------------------------------------------------------- the peers' shapes
# vLLM: vllm/entrypoints/pooling/classify/protocol.py, pooling/score/protocol.py,
# openai/engine/protocol.py (OpenAIBaseModel allows extra fields: ours are extra).

class Peer(BaseModel):
    model_config = ConfigDict(extra="allow")


class ClassificationData(Peer):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class UsageInfo(Peer):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict | None = None


class ClassificationResponse(Peer):
    id: str
    object: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class RerankDocument(Peer):
    text: str | None = None


class RerankResult(Peer):
    index: int
    document: RerankDocument | None = None  # vLLM: always; Jina/Cohere: unless return_documents=false
    relevance_score: float


class RerankUsage(Peer):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Peer):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):  # vLLM's and Infinity's errors
    model_config = ConfigDict(extra="forbid")
    error: ErrorInfo


class ModelCard(Peer):  # OpenAI's model object
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(Peer):
    object: str
    data: list[ModelCard]


class Prediction(BaseModel):  # TEI: router/src/http/types.rs (+ our logprob)
    model_config = ConfigDict(extra="forbid")
    score: float
    label: str
    logprob: float


class TeiError(BaseModel):  # TEI: router/src/lib.rs ErrorResponse
    model_config = ConfigDict(extra="forbid")
    error: str
    error_type: str


def vllm_error(r, status, says, type_=None, param=None):
    assert r.status_code == status, r.text
    err = ErrorResponse.model_validate(r.json()).error
    assert err.code == status and says in err.message, err
    if type_ is not None:
        assert err.type == type_, err
    if param is not None:
        assert err.param == param, err
    return err


def tei_error(r, status, says, kind):
    assert r.status_code == status, r.text
    err = TeiError.model_validate(r.json())
    assert err.error_type == kind and says in err.error, err


def softmax(scores):
    m = max(scores)
    ex = [math.exp(s - m) for s in scores]
    return [e / sum(ex) for e in ex]


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def server(clf, scorer):
    with running(create_app(clf, scorer, **LIMITS)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def plain(clf):
    """No scorer, a --served-model-name."""
    with running(create_app(clf, model_name="intent-v1", **LIMITS)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def name(clf):
    return os.path.basename(clf.loaded.name)


# ---------------------------------------------------------------- vLLM / Infinity POST /classify

def test_classify_vllm_shape(server, clf, name):
    want = clf.classify_batch(QUERIES)
    r = httpx.post(server + "/classify", json={"model": name, "input": QUERIES, "user": "u",
                                               "truncate_prompt_tokens": -1, "priority": 0})
    assert r.status_code == 200, r.text
    body = ClassificationResponse.model_validate(r.json())
    assert set(r.json()) == {"id", "object", "created", "model", "data", "usage", "labels"}
    assert body.id.startswith("classify-") and body.object == "list" and body.model == name
    assert r.json()["labels"] == clf.labels
    for i, (d, w) in enumerate(zip(body.data, want)):
        assert d.index == i and d.label == w.label and d.num_classes == len(clf.labels)
        assert d.probs == pytest.approx(softmax([w.scores[l] for l in clf.labels]), abs=1e-5)
        assert sum(d.probs) == pytest.approx(1, abs=1e-6)
        assert d.logprobs == pytest.approx([math.log(p) for p in d.probs], abs=1e-4)
        if clf.mode == "logprobs":  # the log-probabilities /v1/classify calls scores
            assert d.logprobs == pytest.approx([w.scores[l] for l in clf.labels], abs=1e-4)
    assert body.usage.prompt_tokens == body.usage.total_tokens > 0 and body.usage.completion_tokens == 0
    one = httpx.post(server + "/classify", json={"input": QUERIES[0]}).json()  # a str, no model
    assert len(one["data"]) == 1 and one["data"][0]["label"] == want[0].label
    # Infinity's client names no model with "default/not-specified"
    assert httpx.post(server + "/classify", json={"model": "default/not-specified",
                                                  "input": [QUERIES[1]]}).status_code == 200


@pytest.mark.parametrize("body, status, says, type_, param", [
    ({"model": "gpt-4", "input": "x"}, 404, "The model `gpt-4` does not exist", "NotFoundError", "model"),
    ({"input": "x", "classifier": "other"}, 404, "classifier `other` does not exist", "NotFoundError",
     "classifier"),
    ({"input": []}, 400, "input is an empty list", "BadRequestError", "input"),
    ({"input": ["ok", ""]}, 400, "input[1]: empty query", "BadRequestError", "input"),
    ({"input": ["q"] * 9}, 413, "limit of 8 (--max-queries)", None, "input"),
    ({"input": "dress " * 100}, 400, "(--max-tokens)", "BadRequestError", "input"),
    ({"input": 5}, 400, "input", "Bad Request", None),  # vLLM's RequestValidationError: 400
    ({"input": [1, 2, 3]}, 400, "input", "Bad Request", None),  # token ids: text only here
    ({"inputs": "x"}, 400, "input: Field required", "Bad Request", None),
])
def test_classify_vllm_errors(server, body, status, says, type_, param):
    r = httpx.post(server + "/classify", content=json.dumps(body), headers=JSON)
    vllm_error(r, status, says, type_, param)


def test_vllm_error_shape_before_the_route(server):
    """Guard's own errors (body size, bad UTF-8, a body that is no JSON) take the route's shape."""
    vllm_error(httpx.post(server + "/classify", content=b'{"input": "' + b"x" * 5000 + b'"}',
                          headers=JSON), 413, "--max-body-bytes")
    vllm_error(httpx.post(server + "/classify", content=b'{"input": "caf\xe9"}', headers=JSON),
               400, "UTF-8")
    vllm_error(httpx.post(server + "/classify", content=b'{"input": ', headers=JSON), 400,
               "JSON decode error", "Bad Request")
    tei_error(httpx.post(server + "/predict", content=b'{"inputs": ', headers=JSON), 422,
              "JSON decode error", "Validation")


# ---------------------------------------------------------------- TEI POST /predict

def test_predict_tei_shape(server, clf):
    want = clf.classify_batch(QUERIES)
    r = httpx.post(server + "/predict", json={"inputs": QUERIES[0]})
    assert r.status_code == 200, r.text
    single = [Prediction.model_validate(p) for p in r.json()]
    probs = dict(zip(clf.labels, softmax([want[0].scores[l] for l in clf.labels])))
    assert [p.label for p in single] == sorted(clf.labels, key=lambda l: -probs[l])  # best first
    for p in single:
        assert p.score == pytest.approx(probs[p.label], abs=1e-5)
        assert p.logprob == pytest.approx(math.log(p.score), abs=1e-4)
    assert r.json() == httpx.post(server + "/predict", json={"inputs": [QUERIES[0]]}).json()  # [text]
    batch = httpx.post(server + "/predict", json={"inputs": [[q] for q in QUERIES], "truncate": True})
    assert batch.status_code == 200 and len(batch.json()) == len(QUERIES)
    for rows, w in zip(batch.json(), want):
        rows = [Prediction.model_validate(p) for p in rows]
        assert rows[0].label == max(w.scores, key=w.scores.get)
    raw = httpx.post(server + "/predict", json={"inputs": QUERIES[1], "raw_scores": True}).json()
    for p in raw:  # the raw scores /v1/classify answers: log-probabilities (or logits)
        assert p["score"] == pytest.approx(want[1].scores[p["label"]], abs=1e-4)
    assert [p["score"] for p in raw] == sorted((p["score"] for p in raw), reverse=True)


@pytest.mark.parametrize("body, status, says, kind", [
    ({"inputs": []}, 400, "cannot be empty", "Empty"),
    ({"inputs": ["a query", "a document"]}, 422, "pair", "Validation"),  # TEI: a pair, not a batch
    ({"inputs": [["a"], ["b", "c"]]}, 422, "pair", "Validation"),
    ({"inputs": [["a", "b", "c"]]}, 422, "3 texts", "Validation"),
    ({"inputs": [["q"]] * 9}, 413, "--max-queries", "Validation"),
    ({"inputs": ""}, 422, "empty query", "Validation"),
    ({"inputs": 5}, 422, "inputs", "Validation"),
    ({"text": "x"}, 422, "inputs: Field required", "Validation"),
    ({"inputs": "x", "model": "nope"}, 404, "does not exist", "Validation"),
])
def test_predict_tei_errors(server, body, status, says, kind):
    tei_error(httpx.post(server + "/predict", content=json.dumps(body), headers=JSON), status, says, kind)


# ---------------------------------------------------------------- rerank (vLLM, Jina, Cohere)

@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_shape(server, scorer, name, path):
    docs = [" a long camel coat", " flip flops", " a wool parka", " socks"]
    want = scorer.score_request({"query": "wool coat", "items": docs, "apply_softmax": True})
    p_yes = [row[0] for row in want["scores"]]
    r = httpx.post(server + path, json={"model": name, "query": "wool coat", "documents": docs})
    assert r.status_code == 200, r.text
    body = RerankResponse.model_validate(r.json())
    assert body.id.startswith("rerank-") and body.model == name
    assert body.usage.prompt_tokens == body.usage.total_tokens == want["usage"]["prompt_tokens"]
    assert sorted(x.index for x in body.results) == list(range(len(docs)))
    scores = [x.relevance_score for x in body.results]
    assert scores == sorted(scores, reverse=True)  # best first
    for x in body.results:
        assert x.document.text == docs[x.index]
        assert x.relevance_score == pytest.approx(p_yes[x.index], abs=1e-5)
        assert x.logprob == pytest.approx(math.log(x.relevance_score), abs=1e-4)
    top = httpx.post(server + path, json={"query": "wool coat", "documents": docs, "top_n": 2,
                                          "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == [x.index for x in body.results[:2]]
    assert all("document" not in x for x in top["results"])
    as_dicts = httpx.post(server + path, json={"query": "wool coat",  # Jina / Cohere v1 documents
                                               "documents": [{"text": d} for d in docs]}).json()
    assert [x["index"] for x in as_dicts["results"]] == [x.index for x in body.results]


def test_rerank_errors(server, plain):
    body = {"query": "wool coat", "documents": ["a coat"]}
    vllm_error(httpx.post(plain + "/rerank", json=body), 400,
               "does not support Rerank (Score) API", "BadRequestError")
    assert "--score-template" in httpx.post(plain + "/v1/rerank", json=body).json()["error"]["message"]
    paths = httpx.get(plain + "/openapi.json").json()["paths"]
    assert "/rerank" not in paths and "/classify" in paths and "/predict" in paths
    vllm_error(httpx.post(server + "/rerank", json={**body, "model": "nope"}), 404,
               "The model `nope` does not exist", "NotFoundError", "model")
    vllm_error(httpx.post(server + "/rerank", json={**body, "documents": []}), 400, "documents")
    vllm_error(httpx.post(server + "/rerank", json={**body, "documents": ["x"] * 9}), 413,
               "9 documents in one request")
    vllm_error(httpx.post(server + "/rerank", json={**body, "top_n": -1}), 400, "top_n", "Bad Request")
    vllm_error(httpx.post(server + "/rerank", json={"documents": ["a"]}), 400, "query", "Bad Request")
    assert "/rerank" in httpx.get(server + "/openapi.json").json()["paths"]


# ---------------------------------------------------------------- names: /v1/models, model, classifier

def test_models_and_names(plain, clf):
    r = httpx.get(plain + "/v1/models")
    assert r.status_code == 200, r.text
    models = ModelList.model_validate(r.json())
    assert models.object == "list" and [m.id for m in models.data] == ["intent-v1"]
    card = r.json()["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "prefixscore" and card["created"] > 0
    assert card["labels"] == clf.labels and card["max_model_len"] > 0
    ok = httpx.post(plain + "/classify", json={"model": "intent-v1", "input": "levis 501"})
    assert ok.status_code == 200 and ok.json()["model"] == "intent-v1"
    base = os.path.basename(clf.loaded.name)  # the path's name is not served once renamed
    vllm_error(httpx.post(plain + "/classify", json={"model": base, "input": "x"}), 404, base,
               "NotFoundError", "model")
    # our /v1/classify: model and classifier name what is served, else 404 (its own {"detail"})
    for body in ({"query": "levis 501", "model": "intent-v1"},
                 {"query": "levis 501", "classifier": "intent-v1"},
                 {"query": ["levis 501"], "model": "intent-v1", "classifier": "intent-v1"}):
        r = httpx.post(plain + "/v1/classify", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["label"] == clf.classify("levis 501").label
    for body, says in [({"query": "x", "model": "gpt-4"}, "The model `gpt-4` does not exist"),
                       ({"query": "x", "classifier": "nope"}, "The classifier `nope` does not exist")]:
        for headers in (JSON, {"content-type": "application/vnd.api+json"}):  # fast path, route
            r = httpx.post(plain + "/v1/classify", content=json.dumps(body), headers=headers)
            assert r.status_code == 404 and says in r.json()["detail"], r.text


def test_v1_classify_probs(server, clf):
    r = httpx.post(server + "/v1/classify", json={"query": QUERIES})
    for got, want in zip(r.json()["results"], clf.classify_batch(QUERIES)):
        assert got["probs"].keys() == got["scores"].keys()
        assert list(got["probs"].values()) == pytest.approx(
            softmax([want.scores[l] for l in clf.labels]), abs=1e-5)


def test_health_and_version(server):
    h, hz = httpx.get(server + "/health"), httpx.get(server + "/healthz")
    assert h.status_code == hz.status_code == 200
    assert {**h.json(), "queue_depth": 0} == {**hz.json(), "queue_depth": 0}
    assert httpx.head(server + "/health").status_code == 200
    assert httpx.get(server + "/version").json() == {"version": prefixscore.__version__}


def test_api_key_on_compatible_routes(clf, scorer):
    headers = {"Authorization": "Bearer k3y"}
    with running(create_app(clf, scorer, api_key="k3y", **LIMITS)) as (base, _):
        for method, path, body in [("POST", "/classify", {"input": "x"}),
                                   ("POST", "/rerank", {"query": "q", "documents": ["d"]}),
                                   ("POST", "/v2/rerank", {"query": "q", "documents": ["d"]}),
                                   ("GET", "/v1/models", None)]:
            r = httpx.request(method, base + path, json=body)
            vllm_error(r, 401, "API key")
            assert httpx.request(method, base + path, json=body, headers=headers).status_code == 200
        tei_error(httpx.post(base + "/predict", json={"inputs": "x"}), 401, "API key", "Validation")
        assert httpx.post(base + "/predict", json={"inputs": "x"}, headers=headers).status_code == 200
        for path in ("/health", "/version"):  # probes need no key
            assert httpx.get(base + path).status_code == 200


# ---------------------------------------------------------------- /metrics

def samples(text):
    """{(name, frozenset of labels): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_labels(server, name):
    for path, body in [("/classify", {"input": QUERIES}), ("/predict", {"inputs": "x"}),
                       ("/rerank", {"query": "q", "documents": ["a", "b"]}),
                       ("/v1/classify", {"query": "red dress"})]:
        assert httpx.post(server + path, json=body).status_code == 200
    got = samples(httpx.get(server + "/metrics").text)

    def value(metric, **labels):
        return got.get((metric, frozenset({"model": name, **labels}.items())), 0)

    for path in ("/classify", "/predict", "/rerank", "/v1/classify"):  # per route
        assert value("prefixscore_http_request_duration_seconds_count", endpoint=path) >= 1
    for stage in ("queue", "tokenize", "forward", "total"):  # per classifier
        assert value("prefixscore_latency_seconds_count", classifier=name, stage=stage) >= 2
    assert value("prefixscore_tokens_total", classifier=name) > 0  # tokens in
    assert value("prefixscore_score_tokens_total") > 0
    assert value("prefixscore_batch_size_count") >= 1  # batch sizes
    # one process, the engine a thread in it: process="server"
    assert value("process_resident_memory_bytes", process="server", pid=str(os.getpid())) > 0
    assert any(n == "python_info" for n, _ in got)
    assert all(("model", name) in labels for _, labels in got)  # a model label on every series


def test_process_metrics_of_the_engine_process():
    """With the engine in another process (--workers > 1), /metrics also shows that process."""
    from prefixscore.serve.metrics import Metrics

    metrics = Metrics()
    engine = os.getppid()  # a process that is not this one
    metrics.served("m", engine)
    got = samples(metrics.exposition().decode())
    for process, pid in (("engine", engine), ("frontend", os.getpid())):
        key = frozenset({"model": "m", "process": process, "pid": str(pid)}.items())
        assert got[("process_cpu_seconds_total", key)] >= 0
