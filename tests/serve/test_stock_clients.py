"""Every shape a stock client sends, on the routes peers share, answered in that client's own shape
(serve/compat.py, compat_tei.py): vLLM's and SGLang's bodies told apart on /v1/classify and
/v1/score, vLLM's /score, TEI's /rerank, POST / and /info, the Inference API's `parameters`, and
the real client libraries where the package index has one (openai, cohere, huggingface_hub)."""
import json
import math

import httpx
import pytest

from prefixscore.serve import create_app
from tests.serve.helpers import JSON, LIMITS, running
from tests.serve.test_routes_compat import (ClassificationResponse, TeiError, softmax, tei_error,
                                            vllm_error)

QUERY, DOCS = "wool coat", ["a long camel coat", "flip flops", "a red scarf"]


@pytest.fixture(scope="module")
def server(clf, scorer):
    with running(create_app(clf, scorer, model_name="intent-v1", **LIMITS)) as (base, _):
        yield base


def p_yes(scorer, query, docs):
    """The reference: the scorer's first label's probability, softmax over its labels."""
    return [row[0] for row in scorer.score_request({"query": query, "items": docs,
                                                    "apply_softmax": True})["scores"]]


# ---------------------------------------------------------------- vLLM's / SGLang's classify body

def test_v1_classify_takes_vllms_body_and_answers_vllms_shape(server, clf):
    """SGLang documents vLLM's {"model", "input"} for /v1/classify: told from ours by its fields."""
    r = httpx.post(server + "/v1/classify", json={"model": "intent-v1", "input": ["levis 501", "红色连衣裙"]})
    assert r.status_code == 200, r.text
    body = ClassificationResponse.model_validate(r.json())
    want = clf.classify_batch(["levis 501", "红色连衣裙"])
    assert [d.label for d in body.data] == [w.label for w in want] and body.model == "intent-v1"
    assert body.data[0].probs == pytest.approx(softmax([want[0].scores[l] for l in clf.labels]), abs=1e-5)
    ours = httpx.post(server + "/v1/classify", json={"query": "levis 501"}).json()
    assert ours["results"][0]["label"] == want[0].label  # our own body: our own answer
    vllm_error(httpx.post(server + "/v1/classify", json={"input": []}), 400, "input is an empty list",
               "BadRequestError", "input")
    vllm_error(httpx.post(server + "/v1/classify", json={"input": 5}), 400, "input", "Bad Request")
    r = httpx.post(server + "/v1/classify", json={"query": 5})  # ours: our error shape
    assert r.status_code == 422 and "detail" in r.json(), r.text


# ---------------------------------------------------------------- vLLM's /score

@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_vllm_score_pairs(server, scorer, path):
    """1:N, N:N and 1:1 (vLLM's rules), the newer field names, a score per pair in pair order."""
    r = httpx.post(server + path, json={"model": "intent-v1", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"} and body["object"] == "list"
    assert body["id"].startswith("score-") and body["model"] == "intent-v1"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx(p_yes(scorer, QUERY, DOCS), abs=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    pairs = httpx.post(server + path, json={"text_1": ["levis 501", QUERY], "text_2": DOCS[:2]}).json()
    want = [p_yes(scorer, "levis 501", DOCS[:1])[0], p_yes(scorer, QUERY, DOCS[1:2])[0]]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want, abs=1e-5)
    newer = httpx.post(server + path, json={"queries": QUERY, "documents": DOCS[0]}).json()
    assert newer["data"][0]["score"] == pytest.approx(p_yes(scorer, QUERY, DOCS[:1])[0], abs=1e-5)


@pytest.mark.parametrize("body, says, param", [
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "1:1, 1:N or N:N", "text_2"),
    ({"text_1": ["a", "b"], "text_2": "c"}, "1:1, 1:N or N:N", "text_2"),  # N:1: vLLM refuses it
    ({"text_1": [], "text_2": ["c"]}, "At least one text element", None),
    ({"text_1": "a"}, "text_1 and text_2", "text_2"),
])
def test_vllm_score_errors(server, body, says, param):
    vllm_error(httpx.post(server + "/score", json=body), 400, says, None, param)


def test_sglang_score_body_still_sglangs_on_both_paths(server, scorer):
    body = {"query": QUERY, "items": DOCS, "apply_softmax": True}
    for path in ("/v1/score", "/score"):
        r = httpx.post(server + path, json=body)
        assert r.status_code == 200 and r.json()["object"] == "scoring", r.text
        assert [row[0] for row in r.json()["scores"]] == pytest.approx(p_yes(scorer, QUERY, DOCS), abs=1e-5)


# ---------------------------------------------------------------- TEI

def test_tei_rerank_body_gets_teis_bare_list(server, scorer):
    want = p_yes(scorer, QUERY, DOCS)
    r = httpx.post(server + "/rerank", json={"query": QUERY, "texts": DOCS})
    assert r.status_code == 200, r.text
    ranks = r.json()
    assert isinstance(ranks, list) and [set(x) for x in ranks] == [{"index", "score"}] * 3
    assert [x["index"] for x in ranks] == sorted(range(3), key=lambda i: -want[i])  # best first
    assert [x["score"] for x in ranks] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    full = httpx.post(server + "/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True,
                                                "raw_scores": True}).json()
    assert [list(x) for x in full] == [["index", "text", "score"]] * 3  # TEI's key order
    assert {x["index"]: x["text"] for x in full} == dict(enumerate(DOCS))
    assert [x["score"] for x in full] == pytest.approx([math.log(p) for p in sorted(want, reverse=True)],
                                                       abs=1e-4)
    tei_error(httpx.post(server + "/rerank", json={"query": QUERY, "texts": []}), 400, "cannot be empty",
              "Empty")
    tei_error(httpx.post(server + "/rerank", json={"query": 3, "texts": ["a"]}), 422, "query", "Validation")
    cohere = httpx.post(server + "/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert [x["index"] for x in cohere["results"]] == [x["index"] for x in ranks]  # the other body


def test_tei_root_route_and_info(server, clf):
    """TEI's POST / runs the model's task (a classifier: /predict); /info says it is one."""
    want = clf.classify("levis 501")
    r = httpx.post(server + "/", json={"inputs": "levis 501"})
    assert r.status_code == 200, r.text
    assert r.json()[0]["label"] == want.label and len(r.json()) == len(clf.labels)
    tei_error(httpx.post(server + "/", content=b'{"inputs": 5}', headers=JSON), 422, "inputs", "Validation")
    info = httpx.get(server + "/info").json()
    assert info["model_id"] == "intent-v1" and info["max_client_batch_size"] == LIMITS["max_queries"]
    assert info["model_type"] == {"classifier": {"id2label": {str(i): l for i, l in enumerate(clf.labels)},
                                                 "label2id": {l: i for i, l in enumerate(clf.labels)}}}
    # the same truth as /v1/models: the weights' dtype, and an input's tokens within both the
    # server's --max-tokens and the prompt's limit past the cached prefix
    assert info["model_dtype"] == str(clf.engine.dtype).removeprefix("torch.")
    card = next(m for m in httpx.get(server + "/v1/models").json()["data"] if m["id"] == "intent-v1")
    assert info["max_input_length"] == min(LIMITS.get("max_tokens", 512), card["max_model_len"] - clf.prefix_len)


def test_inference_api_parameters(server, clf):
    """The Inference API's body (what huggingface_hub posts): a list of lists, top_k and the
    function applied; without `parameters`, TEI's flat list."""
    want = clf.classify("levis 501")
    raw = sorted((want.scores[l] for l in clf.labels), reverse=True)
    for path in ("/", "/predict"):
        top2 = httpx.post(server + path, json={"inputs": "levis 501", "parameters": {"top_k": 2}}).json()
        assert len(top2) == 1 and [x["label"] for x in top2[0]][0] == want.label and len(top2[0]) == 2
        assert set(top2[0][0]) == {"label", "score"}
        none = httpx.post(server + path, json={"inputs": "levis 501",
                                               "parameters": {"function_to_apply": "none"}}).json()[0]
        assert [x["score"] for x in none] == pytest.approx(raw, abs=1e-4)
        sig = httpx.post(server + path, json={"inputs": "levis 501",
                                              "parameters": {"function_to_apply": "sigmoid"}}).json()[0]
        assert [x["score"] for x in sig] == pytest.approx([1 / (1 + math.exp(-s)) for s in raw], abs=1e-5)
    r = httpx.post(server + "/", json={"inputs": "x", "parameters": {"top_k": 0}})
    assert r.status_code == 422 and TeiError.model_validate(r.json()).error_type == "Validation"


def test_huggingface_hub_inference_client(server, clf):
    hub = pytest.importorskip("huggingface_hub")
    want = clf.classify("levis 501")
    client = hub.InferenceClient(base_url=server)
    out = client.text_classification("levis 501", top_k=3)
    assert len(out) == 3 and out[0].label == want.label
    assert out[0].score >= out[1].score >= out[2].score
    every = client.text_classification("levis 501")
    assert len(every) == len(clf.labels) and sum(x.score for x in every) == pytest.approx(1, abs=1e-5)
    info = hub.InferenceClient(server, provider="hf-inference").get_endpoint_info()
    assert "classifier" in info["model_type"]


# ---------------------------------------------------------------- OpenAI, Cohere

def test_openai_models_retrieve(server, clf):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data][0] == "intent-v1"
    card = client.models.retrieve("intent-v1")
    assert card.id == "intent-v1" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(server + "/v1/models/gpt-4%2Fmini")  # an id with "/", %2F-encoded (openai>=2.30)
    vllm_error(r, 404, "`gpt-4/mini` does not exist", "NotFoundError", "model")


def test_cohere_rerank(server, scorer):
    cohere = pytest.importorskip("cohere")
    want = p_yes(scorer, QUERY, DOCS)
    order = sorted(range(3), key=lambda i: -want[i])
    v2 = cohere.ClientV2(api_key="unused", base_url=server).rerank(model="intent-v1", query=QUERY,
                                                                   documents=DOCS, top_n=2)
    assert [x.index for x in v2.results] == order[:2]
    assert [x.relevance_score for x in v2.results] == pytest.approx([want[i] for i in order[:2]], abs=1e-5)
    v1 = cohere.Client(api_key="unused", base_url=server).rerank(query=QUERY, documents=DOCS)
    assert [x.index for x in v1.results] == order


def test_bodies_decide_the_error_shape(server):
    """On a route peers share, a malformed body gets the error shape of the peer it is from."""
    bad = {"text_1": "a", "text_2": 5}
    vllm_error(httpx.post(server + "/v1/score", content=json.dumps(bad), headers=JSON), 400, "text_2",
               "Bad Request")
    r = httpx.post(server + "/v1/score", json={"query": "a", "items": 5})
    assert r.status_code == 422 and "detail" in r.json(), r.text
