"""The score path is typed (issue 30): a front end checks and tokenizes a /v1/score request once
(score_input.ScoreInput over the engine's score template, built from its Ready) and sends the
engine token ids in a ScoreReq; the engine runs them (Scorer.score_call), never sees the request's
JSON and never tokenizes its query or items. Tiny random model, CPU, a server in a thread."""
import httpx
import msgspec
import numpy as np
import pytest

from prefixscore.prompt import Prompt
from prefixscore.serve import create_app
from prefixscore.serve import protocol as P
from prefixscore.serve.engine_loop import EngineLoop
from tests.serve.helpers import LIMITS, running


@pytest.fixture
def tokenizer_calls(monkeypatch):
    """Prompt id -> the Prompt methods that tokenize a request, as called."""
    calls = {}
    for name in ("encode_ids", "encode_before"):
        orig = getattr(Prompt, name)

        def counted(self, *a, _orig=orig, _name=name, **kw):
            calls.setdefault(id(self), []).append(_name)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(Prompt, name, counted)
    return calls


def sent_to_engine(app) -> list:
    """Every message the front end sends its (in-process) engine, recorded."""
    client, sent = app.state.client, []
    send = client._send

    def record(msg):
        sent.append(msg)
        send(msg)

    client._send = record
    return sent


def test_front_end_sends_ids_tokenized_once(clf, scorer, tokenizer_calls):
    """One text request: one tokenization (the front end's Prompt: the items' prompts in one call,
    the text before the item slot in another), none by the engine's Scorer; the engine gets a
    ScoreReq of ids (what Scorer.prepare gives), and the answer is score_request's."""
    req = {"query": "wool coat", "items": [" a long camel coat", " flip flops"],
           "label_token_ids": [5, 9], "apply_softmax": True}
    want = scorer.score_request(req)
    prep = scorer.prepare(req["query"], req["items"])
    app = create_app(clf, scorer=scorer, **LIMITS)
    sent = sent_to_engine(app)
    with running(app) as (base, _):
        tokenizer_calls.clear()  # the front end's Prompt was built at the engine's Ready
        r = httpx.post(base + "/v1/score", json=req)
        assert r.status_code == 200, r.text
    assert id(scorer.prompt) not in tokenizer_calls  # the engine tokenized nothing
    assert list(tokenizer_calls.values()) == [["encode_ids", "encode_before"]]
    (m,) = [m for m in sent if isinstance(m, P.ScoreReq)]
    assert P.unpack_ids(m.ids, m.offsets) == prep.full
    assert np.frombuffer(m.shared, np.int32).tolist() == prep.shared
    assert (m.labels, m.label_token_ids, m.apply_softmax) == (None, [5, 9], True)
    assert not any(isinstance(v, dict) for v in msgspec.structs.astuple(m))  # no raw JSON
    assert P.req_decoder.decode(P.encoder.encode(m)) == m  # what a ZeroMQ engine would get
    got = r.json()
    assert got["labels"] == want["labels"] and got["usage"] == want["usage"]
    assert got["scores"] == want["scores"]


def test_token_ids_travel_as_given(clf, scorer):
    """Token-id requests: query + item per item (item + query with item_first, nothing shared);
    a label set named by text reaches the engine as text (its head rows are the engine's)."""
    reqs = [{"query": [11, 12, 13], "items": [[20, 21], [30]], "labels": ["yes", "no"]},
            {"query": [11, 12, 13], "items": [[20, 21], [30]], "item_first": True}]
    app = create_app(clf, scorer=scorer, **LIMITS)
    sent = sent_to_engine(app)
    with running(app) as (base, _):
        for req in reqs:
            r = httpx.post(base + "/v1/score", json=req)
            assert r.status_code == 200, r.text
            assert r.json()["scores"] == scorer.score_request(req)["scores"]
    a, b = [m for m in sent if isinstance(m, P.ScoreReq)]
    assert P.unpack_ids(a.ids, a.offsets) == [[11, 12, 13, 20, 21], [11, 12, 13, 30]]
    assert np.frombuffer(a.shared, np.int32).tolist() == [11, 12, 13]
    assert (a.labels, a.label_token_ids) == (["yes", "no"], None)
    assert P.unpack_ids(b.ids, b.offsets) == [[20, 21, 11, 12, 13], [30, 11, 12, 13]]
    assert b.shared == b"" and (b.labels, b.label_token_ids) == (None, None)


def test_label_set_errors_come_from_the_engine(clf, scorer):
    """A label set the scorer refuses once tokenized (not single tokens) is the engine's to find:
    answered 422 with the Scorer's own words, and the engine keeps serving."""
    from prefixscore import InputError

    req = {"query": "q", "items": ["a"], "labels": ["Trench Coat", "Dress"]}
    with pytest.raises(InputError) as e:
        scorer.score_request(req)
    with running(create_app(clf, scorer=scorer, **LIMITS)) as (base, _):
        r = httpx.post(base + "/v1/score", json=req)
        assert r.status_code == 422 and r.json()["detail"] == str(e.value), r.text
        assert httpx.get(base + "/healthz").status_code == 200


def score_req(ids_list, shared=(), rid=1, **kw):
    data, offsets = P.pack_ids(ids_list)
    fields = dict(labels=None, label_token_ids=[5, 9], apply_softmax=True, deadline=1e18)
    fields.update(kw)
    return P.ScoreReq(0, rid, data, offsets, np.asarray(shared, np.int32).tobytes(), **fields)


def test_engine_refuses_malformed_score_req(clf, scorer):
    """The engine runs ids as they come, so it checks their layout and range first: a malformed
    ScoreReq is answered BAD_INPUT (a ProtocolError's text), never an engine fault."""
    loop = EngineLoop(clf, scorer)
    ok = loop._score(score_req([[11, 12, 20], [11, 12, 30]], [11, 12]))
    want = scorer.score_request({"query": [11, 12], "items": [[20], [30]],
                                 "label_token_ids": [5, 9], "apply_softmax": True})
    assert ok.status == P.OK and ok.scores == want["scores"] and ok.labels == want["labels"]
    # the tokens computed: the query part once in the span, then each item's own
    assert ok.prompt_tokens == want["usage"]["prompt_tokens"] == 4
    V = scorer.config.vocab_size
    bad = [score_req([[11, V]]), score_req([[11]], [-1]), score_req([]),
           P.ScoreReq(0, 1, b"\0\0\0", [0, 1], b"", None, None, False, 1e18),
           P.ScoreReq(0, 1, np.zeros(2, np.int32).tobytes(), [0, 2, 2], b"", None, None, False, 1e18)]
    for m in bad:
        out = loop._score(m)
        assert out.status == P.BAD_INPUT and "score request 1" in out.error, out


def test_protocol_errors_are_typed(monkeypatch):
    """A message named against its direction is a ProtocolError at import (no assert: python -O
    keeps the check)."""
    monkeypatch.setattr(P, "REQ", P.HelloReq | P.ScoreOut)
    with pytest.raises(P.ProtocolError, match="ScoreOut must be named ...Req"):
        P._check_names()
    with pytest.raises(P.ProtocolError, match="at least one token"):  # no items
        P.unpack_score(P.ScoreReq(0, 1, b"", [0], b"", None, None, False, 0.0), 100)


def test_engines_must_agree_on_the_scorer():
    """--data-parallel: a front end tokenizes score requests by the first engine's scorer, so an
    engine whose scorer differs is refused (dp_client.disagreement)."""
    from prefixscore.serve.dp_client import disagreement

    c = P.ClassifierInfo(name="m", template="{query}", chat=False, special_tokens=False,
                         labels=["a", "b"], mode="logprobs", truncate=False, prefix_ids=[1],
                         context_limit=100, memory={})
    s = P.ScorerInfo(template="{query}{item}", chat=False, special_tokens=False, labels=["yes", "no"],
                     item_first=False, prefix_ids=[1], vocab_size=100, context_limit=99,
                     max_items=1024)

    def ready(scorer):
        return P.ReadyOut(model="m", tokenizer_path="", classifiers=[c], max_batch_tokens=64,
                          scorer=scorer, device="cpu", pid=1)

    assert disagreement(ready(s), ready(msgspec.structs.replace(s))) is None
    assert disagreement(ready(None), ready(None)) is None
    assert disagreement(ready(None), ready(s)).startswith("scorer")
    assert disagreement(ready(s), ready(msgspec.structs.replace(s, template="{item}{query}")))


def test_healthz_says_whether_score_is_served(clf, scorer):
    """/healthz's "scorer" is what /v1/score does: true with a scorer (--workers 1 once said false
    while /v1/score answered), false without one (/v1/score: 501)."""
    body = {"query": "wool coat", "items": ["a camel coat"], "apply_softmax": True}
    with running(create_app(clf, scorer, **LIMITS)) as (base, _):
        assert httpx.get(base + "/healthz").json()["scorer"] is True
        assert httpx.post(base + "/v1/score", json=body).status_code == 200
    with running(create_app(clf, **LIMITS)) as (base, _):
        assert httpx.get(base + "/healthz").json()["scorer"] is False
        assert httpx.post(base + "/v1/score", json=body).status_code == 501
