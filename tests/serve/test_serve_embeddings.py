"""Embedding items through the server (issue 34): /v1/score and /rerank take items as vectors
(lists or base64) or ids into the item table, mixed with text; the front end checks them (a 4xx
naming the item), the engine gets the vectors in the ScoreReq and answers what the Scorer answers.
Tiny random model, CPU, a server in a thread."""
import base64

import httpx
import numpy as np
import pytest
import torch

from prefixscore.item_table import write_table
from prefixscore.weights.loading import base_hash
from prefixscore.scorer import Scorer
from prefixscore.serve import create_app
from prefixscore.serve import protocol as P
from tests.serve.conftest import SCORE_TEMPLATE
from tests.serve.helpers import LIMITS, running


@pytest.fixture(scope="module")
def table_scorer(clf, tmp_path_factory):
    H = clf.loaded.model.config.hidden_size
    vecs = torch.randn(3, H, generator=torch.Generator().manual_seed(0)) * 0.02
    path = tmp_path_factory.mktemp("items") / "items.safetensors"
    write_table(path, ["sku-1", "sku-2", "sku-3"], vecs.half(), {"base_model": base_hash(clf.loaded)})
    return Scorer(clf.loaded, SCORE_TEMPLATE, ["yes", "no"], chat=False, item_table=path), vecs.half()


def b64(v: torch.Tensor) -> str:
    return base64.b64encode(v.half().numpy().tobytes()).decode()


def test_mixed_request_answers_as_the_scorer(clf, table_scorer):
    sc, vecs = table_scorer
    items = ["a long camel coat", {"embedding": b64(vecs[0])}, {"id": "sku-2"},
             {"embedding": vecs[2].float().tolist()}, {"text": "flip flops"}]
    req = {"query": "wool coat", "items": items, "apply_softmax": True}
    want = sc.score_request(req)
    assert want["scores"][1] != want["scores"][2]  # the vectors matter
    app = create_app(clf, scorer=sc, **LIMITS)
    with running(app) as (base, _):
        r = httpx.post(base + "/v1/score", json=req)
        assert r.status_code == 200, r.text
        got = r.json()
        assert np.allclose(got["scores"], want["scores"], atol=1e-6)
        # the same vector three ways: base64 f16, by id, as a list of its values
        same = {"query": "wool coat", "apply_softmax": True,
                "items": [{"embedding": b64(vecs[1])}, {"id": "sku-2"},
                          {"embedding": vecs[1].float().tolist()}]}
        s = httpx.post(base + "/v1/score", json=same).json()["scores"]
        assert np.allclose(s[0], s[1], atol=1e-6) and np.allclose(s[1], s[2], atol=1e-6)
        rr = httpx.post(base + "/rerank", json={"query": "wool coat", "documents": items[:3]})
        assert rr.status_code == 200, rr.text


def test_bad_embedding_items_are_4xx_naming_the_item(clf, table_scorer):
    sc, vecs = table_scorer
    H = vecs.shape[1]
    cases = [({"embedding": [0.0] * (H - 1)}, f"items[1]: the embedding has {H - 1} values, the "
                                                f"model's hidden size is {H}"),
             ({"embedding": base64.b64encode(np.zeros(H, np.float32).tobytes()).decode()},
              f"items[1]: the embedding has {2 * H} values"),
             ({"embedding": "%%%"}, "items[1]: the embedding is not valid base64"),
             ({"embedding": b64(vecs[0]), "dtype": "float64"}, "items[1]: dtype 'float64'"),
             ({"id": "nope"}, "items[1]: id 'nope' is not in the item table"),
             ({"vector": [1.0]}, "items[1]: an item is a string")]
    app = create_app(clf, scorer=sc, **LIMITS)
    with running(app) as (base, _):
        for bad, msg in cases:
            r = httpx.post(base + "/v1/score", json={"query": "coat", "items": ["fine", bad]})
            assert r.status_code == 422, (bad, r.text)
            assert msg in r.text, (msg, r.text)


def test_unpack_refuses_a_malformed_soft_payload():
    ids, offsets = P.pack_ids([[1, -1, 2], [3, 4]])
    m = P.ScoreReq(0, 1, ids, offsets, b"", None, None, False, 0.0, soft=b"\0" * 4 * 8)
    full, _, soft = P.unpack_score(m, 100, 8)
    assert full[0][1] == -1 and soft[1] is None and soft[0].shape == (8,)
    for bad in (b"\0" * 4 * 7, b""):
        with pytest.raises(Exception, match="outside this model's vocabulary|bytes of embeddings"):
            P.unpack_score(P.ScoreReq(0, 1, ids, offsets, b"", None, None, False, 0.0, soft=bad), 100, 8)


def test_served_item_table_through_processes(model, clf, table_scorer, tmp_path):
    """`prefixscore serve --item-table` (engine and front ends in their own processes): items by
    id, in base64 and as text in one request answer what the in-process Scorer does; a table in
    an unknown form is one error line before anything loads."""
    from tests.serve.procs import serve

    sc, vecs = table_scorer
    req = {"query": "wool coat", "apply_softmax": True,
           "items": [{"id": "sku-3"}, "a long camel coat", {"embedding": b64(vecs[0])}]}
    want = sc.score_request(req)["scores"]
    with serve(model, "--score-template", SCORE_TEMPLATE, "--no-chat", "--workers", "2",
               "--item-table", sc.item_table.path) as (base, _):
        for _ in range(2):  # each front end maps the table
            r = httpx.post(base + "/v1/score", json=req, timeout=60)
            assert r.status_code == 200, r.text
            assert np.allclose(r.json()["scores"], want, atol=1e-5)
    from prefixscore.cli.commands import main

    bad = tmp_path / "items.npy"
    bad.write_bytes(b"x")
    assert main(["serve", "--device", "cpu", "--score-template", SCORE_TEMPLATE,
                 "--item-table", str(bad)]) == 2


def test_grpc_items_mixed(clf, table_scorer):
    """gRPC Score with `item_list`: text, raw embedding bytes (float16 by default, or a dtype) and
    ids answer what the Scorer answers for the same items in JSON; a wrong size is
    INVALID_ARGUMENT naming the item."""
    import grpc

    from prefixscore.serve.proto import prefixscore_pb2 as pb
    from tests.serve.test_grpc import run, serving

    sc, vecs = table_scorer
    items = [pb.Item(text="a long camel coat"), pb.Item(embedding=vecs[0].numpy().tobytes()),
             pb.Item(embedding=vecs[1].float().numpy().tobytes(), dtype="float32"), pb.Item(id="sku-3")]
    want = sc.score_request({"query": "wool coat", "apply_softmax": True, "items": [
        "a long camel coat", {"embedding": b64(vecs[0])}, {"embedding": vecs[1].float().tolist()},
        {"id": "sku-3"}]})["scores"]
    bad = pb.Item(embedding=vecs[0][:-1].numpy().tobytes())

    async def go():
        async with serving(clf, sc) as s:
            ok = await s.score(pb.ScoreRequest(query_text="wool coat", apply_softmax=True,
                                               item_list=pb.Items(values=items)))
            try:
                await s.score(pb.ScoreRequest(query_text="wool coat", item_list=pb.Items(values=[bad])))
            except grpc.aio.AioRpcError as e:
                return ok, e
            return ok, None

    ok, err = run(go())
    assert np.allclose([list(s.values) for s in ok.scores], want, atol=1e-6)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0]: the embedding has" in err.details()
