"""gRPC front end (serve/grpc_server.py): a real grpc.aio server on 127.0.0.1 around the Frontend
that serve.create_app builds, and a real gRPC client. The HTTP route of the same app (through
httpx's ASGI transport) is the reference for statuses and error texts. Tiny random model, CPU."""
import asyncio
import socket
import threading
import time
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest
import uvicorn

from prefixscore import Classifier, ConfigError, InputError
from prefixscore.scorer import Scorer
from prefixscore.serve import create_app
from prefixscore.serve.grpc_server import check_port, score_dict, start_grpc, stop_grpc
from prefixscore.serve.http import UNAUTHORIZED
from prefixscore.serve.proto import prefixscore_pb2 as pb

LIMITS = dict(max_queries=8, max_tokens=48, max_body_bytes=4096, max_queue=64)
SCORE_TEMPLATE = "Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\nAnswer:"
C = grpc.StatusCode


@pytest.fixture(scope="module")
def clf(tiny_model):
    return Classifier(tiny_model("llama"), device="cpu")


@pytest.fixture(scope="module")
def scorer(clf):
    return Scorer(clf.loaded, SCORE_TEMPLATE, ["yes", "no"], chat=False)


class Gated:
    """The real classifier whose engine calls wait for `release` once `hold` is set."""

    def __init__(self, clf):
        self.clf, self.hold = clf, False
        self.entered, self.release = threading.Event(), threading.Event()
        self.batches = []

    def __getattr__(self, name):
        return getattr(self.clf, name)

    def decide_encoded(self, encoded):  # what the engine loop calls
        if self.hold:
            self.entered.set()
            assert self.release.wait(30)
        self.batches.append(len(encoded))
        return self.clf.decide_encoded(encoded)


class Conn:
    """A running server: the app, its Frontend, a channel and the methods as client stubs."""

    def __init__(self, app, server, channel):
        self.app, self.fe, self.server, self.channel = app, app.state.frontend, server, channel
        rpc = "/prefixscore.v1.PrefixScore/"
        self.classify = channel.unary_unary(rpc + "Classify", pb.ClassifyRequest.SerializeToString,
                                            pb.ClassifyResponse.FromString)
        self.score = channel.unary_unary(rpc + "Score", pb.ScoreRequest.SerializeToString,
                                         pb.ScoreResponse.FromString)
        self.health = channel.unary_unary("/grpc.health.v1.Health/Check",
                                          pb.HealthCheckRequest.SerializeToString,
                                          pb.HealthCheckResponse.FromString)

    async def http(self, path, body, headers=None):
        """The same request to the same Frontend over HTTP: (status, detail or body, headers)."""
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.post(path, json=body, headers=headers)
        body = r.json()
        return r.status_code, body.get("detail", body), r.headers

    def count(self, endpoint, status) -> float:
        v = self.fe.metrics.registry.get_sample_value(
            "prefixscore_http_requests_total", {"endpoint": endpoint, "status": str(status)})
        return v or 0.0


@asynccontextmanager
async def serving(clf, scorer=None, **limits):
    app = create_app(clf, scorer, **{**LIMITS, **limits})
    fe = app.state.frontend
    fe.client.start(asyncio.get_running_loop())
    server = None
    try:
        deadline = time.monotonic() + 60
        while fe.client.error is not None:
            assert time.monotonic() < deadline, f"engine never ready: {fe.client.error}"
            await asyncio.sleep(0.01)
        server = await start_grpc(fe, "127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Conn(app, server, channel)
    finally:
        if server is not None:
            await stop_grpc(server, 5)
        fe.client.stop()


async def failure(call):
    """The status of a call that must fail: (code, details, trailing metadata as a dict)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    e = info.value
    return e.code(), e.details(), dict(e.trailing_metadata() or ())


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- the schema

def test_descriptor_matches_proto():
    """The committed prefixscore_pb2 is the current prefixscore.proto, compiled."""
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    from prefixscore.serve.proto import compile_descriptor

    want = descriptor_pb2.FileDescriptorProto.FromString(compile_descriptor())
    got = descriptor_pb2.FileDescriptorProto.FromString(pb.SERIALIZED)
    assert got == want, ("prefixscore_pb2.py is out of date: python -c \"from "
                         "prefixscore.serve.proto import regenerate; regenerate()\"")
    assert set(pb.DESCRIPTOR.services_by_name["PrefixScore"].methods_by_name) == {"Classify", "Score"}


@pytest.mark.parametrize("req", [
    {"query": "wool coat", "items": ["a", "b"]},
    {"query": "wool coat", "items": ["a"], "item_first": False},  # present and false: kept
    {"query": "wool coat", "items": ["a"], "item_first": True, "apply_softmax": False, "model": "m"},
    {"query": [5, 6], "items": [[7], [8, 9]], "label_token_ids": [1, 2], "apply_softmax": True},
    {"query": "", "items": []},
    {"labels": ["yes", "no"]},
    {},
])
def test_score_request_fields(req):
    """A ScoreRequest becomes exactly the dict the HTTP route passes on: the fields set, no more."""
    m = pb.ScoreRequest()
    for k, v in req.items():
        if k == "query":
            if isinstance(v, str):
                m.query_text = v
            else:
                m.query_ids.ids.extend(v)
        elif k == "items":
            if v and not isinstance(v[0], str):
                for ids in v:
                    m.item_ids.values.add().ids.extend(ids)
            else:
                m.item_texts.SetInParent()
                m.item_texts.values.extend(v)
        elif k in ("label_token_ids", "labels"):
            getattr(m, k).extend(v)
        else:
            setattr(m, k, v)
    m = pb.ScoreRequest.FromString(m.SerializeToString())  # as the server receives it
    assert score_dict(m) == req


# ---------------------------------------------------------------- round trips

def test_classify_round_trip(clf):
    queries = ["beige trench coat women", "levis 501", "红色连衣裙", "  oversized hoodie 😀"]

    async def go():
        async with serving(clf) as s:
            one = await s.classify(pb.ClassifyRequest(queries=queries[:1]))
            many = await s.classify(pb.ClassifyRequest(queries=queries))
            return one, many, s.count("grpc:Classify", 200)

    one, many, ok = run(go())
    assert one.batch_size == 1 and one.timing.forward_ms > 0
    assert one.timing.total_ms >= one.timing.forward_ms
    assert list(many.labels) == clf.labels and len(many.results) == len(queries)
    for got, want in zip(many.results, clf.classify_batch(queries)):
        assert got.query == want.query and got.label == want.label and not got.cached
        assert clf.labels[got.label_index] == want.label
        assert list(got.scores) == [want.scores[label] for label in clf.labels]  # exactly
    assert ok == 2


def test_score_round_trip(clf, scorer):
    """Score answers exactly what Scorer.score_request answers, errors included (422 with the
    scorer's text)."""
    tok = clf.loaded.tokenizer
    yes, no = tok(" yes")["input_ids"][-1], tok(" no")["input_ids"][-1]
    q_ids = tok("wool coat")["input_ids"]
    cases = [
        ({"query": "wool coat", "items": [" a long camel coat", " flip flops"],
          "label_token_ids": [yes, no]},
         pb.ScoreRequest(query_text="wool coat", item_texts=pb.Texts(values=[" a long camel coat", " flip flops"]),
                         label_token_ids=[yes, no])),
        ({"query": "wool coat", "items": ["s", " parka"], "labels": ["yes", "no"], "apply_softmax": True},
         pb.ScoreRequest(query_text="wool coat", item_texts=pb.Texts(values=["s", " parka"]),
                         labels=["yes", "no"], apply_softmax=True)),
        ({"query": "wool coat", "items": ["parka"], "item_first": False},  # the scorer's own labels
         pb.ScoreRequest(query_text="wool coat", item_texts=pb.Texts(values=["parka"]), item_first=False)),
        ({"query": q_ids, "items": [tok(" parka")["input_ids"]], "label_token_ids": [yes, no],
          "item_first": True},
         pb.ScoreRequest(query_ids=pb.TokenIds(ids=q_ids), label_token_ids=[yes, no], item_first=True,
                         item_ids=pb.TokenIdLists(values=[pb.TokenIds(ids=tok(" parka")["input_ids"])]))),
        # errors, told by the scorer: item_first=true against a query-first template (present
        # matters), labels and ids both, an id out of range, an empty item
        ({"query": "wool coat", "items": ["parka"], "item_first": True},
         pb.ScoreRequest(query_text="wool coat", item_texts=pb.Texts(values=["parka"]), item_first=True)),
        ({"query": "q", "items": ["a"], "labels": ["yes"], "label_token_ids": [yes]},
         pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=["a"]), labels=["yes"],
                         label_token_ids=[yes])),
        ({"query": "q", "items": ["a"], "label_token_ids": [10 ** 9]},
         pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=["a"]), label_token_ids=[10 ** 9])),
        ({"query": "q", "items": [""]}, pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=[""]))),
    ]

    async def go():
        out = []
        async with serving(clf, scorer) as s:
            for _, m in cases:
                m.model = "anything"
                try:
                    out.append(await s.score(m))
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details(), dict(e.trailing_metadata())))
            return out, s.count("grpc:Score", 200), s.count("grpc:Score", 422)

    got, ok, bad = run(go())
    n_bad = 0
    for (req, _), g in zip(cases, got):
        try:
            want = scorer.score_request(req)
        except InputError as e:
            n_bad += 1
            assert g == (C.INVALID_ARGUMENT, str(e), {"http-status": "422"}), req
            continue
        assert isinstance(g, pb.ScoreResponse), (req, g)
        assert list(g.labels) == want["labels"] and g.model == clf.loaded.name.split("/")[-1]
        assert [list(s.values) for s in g.scores] == want["scores"]  # exactly
        u = want["usage"]
        assert (g.usage.prompt_tokens, g.usage.completion_tokens, g.usage.total_tokens) == (
            u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])
    assert n_bad == 4 and bad == 4 and ok == len(cases) - 4


# ---------------------------------------------------------------- errors, as HTTP answers them

def test_bad_requests_as_http(clf, scorer):
    """Each bad request gets the mapped code, the HTTP route's detail text and its status in
    trailing metadata, and is counted with that status."""
    long = "dress " * 100
    classify = [  # (queries, HTTP body, HTTP status, gRPC code)
        ([], {"query": []}, 422, C.INVALID_ARGUMENT),
        ([""], {"query": ""}, 422, C.INVALID_ARGUMENT),
        (["ok", "  "], {"query": ["ok", "  "]}, 422, C.INVALID_ARGUMENT),
        (["q"] * 9, {"query": ["q"] * 9}, 413, C.INVALID_ARGUMENT),
        ([long], {"query": long}, 422, C.INVALID_ARGUMENT),
    ]
    score = [
        (pb.ScoreRequest(query_text="q"), {"query": "q"}, 422),
        (pb.ScoreRequest(item_texts=pb.Texts(values=["a"])), {"items": ["a"]}, 422),
        (pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=["a"] * 9)),
         {"query": "q", "items": ["a"] * 9}, 413),
        (pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=["a"]), label_token_ids=list(range(65))),
         {"query": "q", "items": ["a"], "label_token_ids": list(range(65))}, 413),
        (pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=["a"]), label_token_ids=[10 ** 9]),
         {"query": "q", "items": ["a"], "label_token_ids": [10 ** 9]}, 422),
    ]

    async def go():
        async with serving(clf, scorer) as s:
            for queries, body, status, code in classify:
                got = await failure(s.classify(pb.ClassifyRequest(queries=queries)))
                h_status, h_detail, _ = await s.http("/v1/classify", body)
                assert h_status == status, body
                assert got == (code, h_detail, {"http-status": str(status)}), queries[:2]
            for m, body, status in score:
                got = await failure(s.score(m))
                h_status, h_detail, _ = await s.http("/v1/score", body)
                assert h_status == status, body
                assert got == (C.INVALID_ARGUMENT, h_detail, {"http-status": str(status)}), body
            # over --max-body-bytes: refused by gRPC before any handler
            code, details, _ = await failure(s.classify(pb.ClassifyRequest(queries=["x" * 5000])))
            assert code == C.RESOURCE_EXHAUSTED, details
            counts = {(e, st): s.count(e, st) for e in ("grpc:Classify", "grpc:Score")
                      for st in (200, 413, 422)}
            assert counts == {("grpc:Classify", 200): 0, ("grpc:Classify", 413): 1,
                              ("grpc:Classify", 422): 4, ("grpc:Score", 200): 0,
                              ("grpc:Score", 413): 2, ("grpc:Score", 422): 3}
            # bytes that are no ClassifyRequest: INVALID_ARGUMENT (grpc's own deserializer: UNKNOWN)
            raw = s.channel.unary_unary("/prefixscore.v1.PrefixScore/Classify",
                                        lambda b: b, pb.ClassifyResponse.FromString)
            code, details, trailers = await failure(raw(b"\x0a\xff\xff\xff\xff\x0f"))
            assert code == C.INVALID_ARGUMENT and "malformed" in details, details
            assert trailers == {"http-status": "400"} and s.count("grpc:Classify", 400) == 1
            # the bad requests did no harm: a good one still answers
            ok = await s.classify(pb.ClassifyRequest(queries=["red dress"]))
            assert ok.results[0].label in clf.labels

    run(go())


def test_score_without_scorer_is_unimplemented(clf):
    async def go():
        async with serving(clf) as s:
            m = pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=["a"]), label_token_ids=[1])
            code, details, trailers = await failure(s.score(m))
            status, detail, _ = await s.http("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1]})
            assert (code, trailers["http-status"]) == (C.UNIMPLEMENTED, "501") and status == 501
            assert details == detail and "--score-template" in details
            assert s.count("grpc:Score", 501) == 1

    run(go())


def test_api_key(clf):
    req = pb.ClassifyRequest(queries=["red dress"])
    refused = [None, [("authorization", "Bearer wrong")], [("authorization", "sekrit")],
               [("authorization", "Bearer sekrit"), ("authorization", "Bearer sekrit")]]

    async def go():
        async with serving(clf, api_key="sekrit") as s:
            for md in refused:
                code, details, trailers = await failure(s.classify(req, metadata=md))
                assert (code, details, trailers["http-status"]) == (C.UNAUTHENTICATED, UNAUTHORIZED, "401"), md
            score = pb.ScoreRequest(query_text="q", item_texts=pb.Texts(values=["a"]))
            assert (await failure(s.score(score)))[0] == C.UNAUTHENTICATED  # before the 501
            for md in ([("authorization", "Bearer sekrit")], [("authorization", "bearer  sekrit")]):
                r = await s.classify(req, metadata=md)
                assert r.results[0].label in s.fe.classifiers[0].labels
            h = await s.health(pb.HealthCheckRequest())  # no key, as /healthz
            assert h.status == pb.HealthCheckResponse.SERVING
            assert s.count("grpc:Classify", 401) == len(refused) and s.count("grpc:Score", 401) == 1
            assert s.count("grpc:Classify", 200) == 2

    run(go())


def test_health_and_drain(clf):
    async def go():
        async with serving(clf) as s:
            h = await s.health(pb.HealthCheckRequest(service="prefixscore.v1.PrefixScore"))
            assert h.status == pb.HealthCheckResponse.SERVING
            code, _, _ = await failure(s.health(pb.HealthCheckRequest(service="other.Service")))
            assert code == C.NOT_FOUND
            s.fe.begin_drain()
            h = await s.health(pb.HealthCheckRequest())
            assert h.status == pb.HealthCheckResponse.NOT_SERVING
            code, details, trailers = await failure(s.classify(pb.ClassifyRequest(queries=["x"])))
            assert code == C.UNAVAILABLE and "shutting down" in details
            assert trailers == {"http-status": "503", "retry-after": "1"}
            assert s.count("grpc:Classify", 503) == 1
            # a NOT_SERVING answer is a call that succeeded
            assert s.count("grpc:Health/Check", 200) == 2 and s.count("grpc:Health/Check", 404) == 1

    run(go())


def test_server_reflection_lists_and_describes_the_service(clf):
    """What grpcurl's `list` and `describe` ask: the service's name, and its file descriptor."""
    from grpc_reflection.v1alpha import reflection_pb2 as rpb, reflection_pb2_grpc as rgrpc

    async def go():
        async with serving(clf) as s:
            stub = rgrpc.ServerReflectionStub(s.channel)
            asks = [rpb.ServerReflectionRequest(list_services=""),
                    rpb.ServerReflectionRequest(file_containing_symbol="prefixscore.v1.PrefixScore")]
            answers = [a async for a in stub.ServerReflectionInfo(iter(asks))]
            names = {x.name for x in answers[0].list_services_response.service}
            assert "prefixscore.v1.PrefixScore" in names, names
            files = answers[1].file_descriptor_response.file_descriptor_proto
            assert files and b"ClassifyRequest" in files[0]

    run(go())


# ---------------------------------------------------------------- queue, cancellation

def test_queue_full_is_resource_exhausted(clf):
    gated = Gated(clf)

    async def go():
        async with serving(gated, max_queue=2, max_queries=2) as s:
            gated.hold = True
            first = asyncio.ensure_future(s.classify(pb.ClassifyRequest(queries=["red dress"])))
            assert await asyncio.to_thread(gated.entered.wait, 30)
            code, details, trailers = await failure(s.classify(pb.ClassifyRequest(queries=["a", "b"])))
            status, detail, headers = await s.http("/v1/classify", {"query": ["a", "b"]})
            gated.release.set()
            assert (await first).results[0].label in clf.labels
            assert code == C.RESOURCE_EXHAUSTED and status == 429 and details == detail
            assert "queue full" in details
            assert trailers["http-status"] == "429" and int(trailers["retry-after"]) >= 1
            assert trailers["retry-after"] == headers["retry-after"]
            assert s.count("grpc:Classify", 429) == 1 and s.count("grpc:Classify", 200) == 1

    run(go())


def test_deadline_cancels_engine_work(clf):
    """A call whose deadline passes is answered DEADLINE_EXCEEDED by the server's own timer (the
    call's deadline is the request's: 504, expired "deadline"), or cancelled as the client gives up
    (499, "client_left"), whichever comes first; either way its queued engine work is dropped
    unrun."""
    gated = Gated(clf)

    async def go():
        async with serving(gated) as s:
            expired = [s.fe.metrics.expired.labels(r) for r in ("client_left", "deadline")]
            gated.hold = True
            first = asyncio.ensure_future(s.classify(pb.ClassifyRequest(queries=["red dress"])))
            assert await asyncio.to_thread(gated.entered.wait, 30)
            gated.batches.clear()
            code, _, _ = await failure(s.classify(pb.ClassifyRequest(queries=["a", "b", "c"]), timeout=0.3))
            assert code == C.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 10

            def ended():
                return s.count("grpc:Classify", 499) + s.count("grpc:Classify", 504)

            while ended() < 1:  # the server's side of the call
                assert time.monotonic() < deadline, "the server call did not end"
                await asyncio.sleep(0.01)
            assert sum(e._value.get() for e in expired) == 1 and s.fe.admission.inflight == 1  # the held query
            gated.hold = False
            gated.release.set()
            assert (await first).results[0].label in clf.labels
            after = await s.classify(pb.ClassifyRequest(queries=["blue jeans"]))
            assert after.results[0].label in clf.labels
            # the held batch, then "blue jeans": the three late queries never ran
            assert gated.batches == [1, 1]
            assert s.count("grpc:Classify", 200) == 2 and ended() == 1

    run(go())


# ---------------------------------------------------------------- beside uvicorn

def test_beside_uvicorn_on_uvloop(clf):
    """gRPC on uvicorn's own event loop (uvloop), wired as launch.py does: started after
    uvicorn's startup (the engine client is started by the app's lifespan), stopped first on
    shutdown. HTTP and gRPC answer alike; after shutdown gRPC is gone."""
    pytest.importorskip("uvloop")
    app = create_app(clf, **LIMITS)
    fe = app.state.frontend
    seen = {}

    class Server(uvicorn.Server):
        grpc = None

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                seen["loop"] = type(asyncio.get_running_loop()).__module__
                self.grpc = await start_grpc(fe, "127.0.0.1", 0)

        async def shutdown(self, sockets=None):
            fe.begin_drain()
            if self.grpc is not None:
                await stop_grpc(self.grpc, 5)
            await super().shutdown(sockets)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn.Config(app, loop="uvloop", log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while server.grpc is None or fe.client.error is not None:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        assert seen["loop"].startswith("uvloop")
        target = f"127.0.0.1:{server.grpc.port}"
        with grpc.insecure_channel(target) as channel:
            classify = channel.unary_unary("/prefixscore.v1.PrefixScore/Classify",
                                           pb.ClassifyRequest.SerializeToString,
                                           pb.ClassifyResponse.FromString)
            got = classify(pb.ClassifyRequest(queries=["red dress", "levis 501"]), timeout=30)
            http = httpx.post(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/classify",
                              json={"query": ["red dress", "levis 501"]}, timeout=30).json()
            for g, h in zip(got.results, http["results"]):
                assert g.label == h["label"] and list(g.scores) == [h["scores"][l] for l in got.labels]
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive()
        with grpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/prefixscore.v1.PrefixScore/Classify",
                                    pb.ClassifyRequest.SerializeToString,
                                    pb.ClassifyResponse.FromString)(pb.ClassifyRequest(queries=["x"]), timeout=2)
            assert info.value.code() == C.UNAVAILABLE
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def test_port_shared_and_busy(clf):
    """SO_REUSEPORT: two servers (front-end processes) share a port; a port held by anything
    else is a ConfigError naming it."""
    app = create_app(clf, **LIMITS)
    fe = app.state.frontend

    async def go():
        a = await start_grpc(fe, "127.0.0.1", 0)
        try:
            with pytest.raises(ConfigError, match="--grpc-port"):  # the launcher's check: taken
                check_port("127.0.0.1", a.port)
            b = await start_grpc(fe, "127.0.0.1", a.port)
            assert b.port == a.port
            await stop_grpc(b, 0)
        finally:
            await stop_grpc(a, 0)
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        try:
            with pytest.raises(ConfigError, match=f"127.0.0.1:{busy.getsockname()[1]}"):
                await start_grpc(fe, "127.0.0.1", busy.getsockname()[1])
            with pytest.raises(ConfigError, match=f"127.0.0.1:{busy.getsockname()[1]}"):
                check_port("127.0.0.1", busy.getsockname()[1])
        finally:
            busy.close()
        check_port("127.0.0.1", a.port)  # free again once both servers stopped

    run(go())


def test_priority_and_depth_fields(clf, scorer):
    """priority travels on both methods (a negative one is named, INVALID_ARGUMENT); a score
    answer says its depth and which items were scored."""
    async def go():
        async with serving(clf, scorer) as s:
            code, details, _ = await failure(s.classify(pb.ClassifyRequest(queries=["a"], priority=-1)))
            assert code == C.INVALID_ARGUMENT and "priority" in details
            # one range on both transports: HTTP refuses past 2^30, so does gRPC (int32 goes on)
            code, details, _ = await failure(s.classify(pb.ClassifyRequest(queries=["a"], priority=2**31 - 1)))
            assert code == C.INVALID_ARGUMENT and "1073741824" in details
            r = await s.classify(pb.ClassifyRequest(queries=["a"], priority=2))
            assert r.results[0].label in clf.labels
            r = await s.score(pb.ScoreRequest(query_text="coat", item_texts=pb.Texts(values=["a", "b"]),
                                              priority=1))
            assert r.depth == 2 and list(r.scored) == [True, True] and len(r.scores) == 2

    run(go())


def test_score_says_what_the_pair_cache_answered(clf, scorer):
    """Score's `cached`: the items answered from the pair cache (--cache-size), as /v1/score's."""
    async def go():
        async with serving(clf, scorer, cache_size=64) as s:
            m = pb.ScoreRequest(query_text="coat", item_texts=pb.Texts(values=["a", "b"]))
            first, again = await s.score(m), await s.score(m)
            assert (first.cached, again.cached) == (0, 2) and again.usage.prompt_tokens == 0
            assert [list(x.values) for x in again.scores] == [list(x.values) for x in first.scores]

    run(go())
