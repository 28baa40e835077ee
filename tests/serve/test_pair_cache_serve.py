"""The pair cache on the serve routes (issue 34, item 4; serve/cache.py): a repeated /v1/score
request is answered from the cache (no engine call, `cached` = its items, usage 0), a partly
cached one sends only its misses; keys keep label sets, apply_softmax, scorers (labels, adapter,
template) and whitespace apart, and share an answer only between identical token ids. Tiny random
model, CPU, servers in threads."""
import httpx
import msgspec
import pytest
import torch

from prefixscore.errors import ConfigError
from prefixscore.scorer import Scorer
from prefixscore.serve import create_app
from prefixscore.serve import protocol as P
from prefixscore.serve.cache import scorer_id, score_keys
from prefixscore.serve.config import ScheduleOptions
from tests.serve.helpers import LIMITS, SCORE_TEMPLATE, metric, running

ITEMS = [" a long camel coat", " flip flops", " a wool parka"]
CACHE = dict(cache_size=256, **LIMITS)


def sent_scores(app) -> list:
    """The ScoreReqs the front end sends its (in-process) engine, recorded: per request, its
    items' token ids."""
    client, sent = app.state.client, []
    send = client._send

    def record(msg):
        if isinstance(msg, P.ScoreReq):
            sent.append(P.unpack_ids(msg.ids, msg.offsets))
        send(msg)

    client._send = record
    return sent


def post(base, body, path="/v1/score"):
    r = httpx.post(base + path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x is not None and max(abs(u - v) for u, v in zip(x, y)) < 1e-5


def test_repeated_request_is_answered_from_the_cache(clf, scorer):
    """The same request twice: the second is every item from the cache (no engine call), the same
    scores and labels, usage 0; a request adding one item sends only that item to the engine, and
    its usage is what that item alone costs."""
    req = {"query": "wool coat", "items": ITEMS, "apply_softmax": True}
    want = scorer.score_request(req)
    app = create_app(clf, scorer, **CACHE)
    sent = sent_scores(app)
    with running(app) as (base, _):
        first = post(base, req)
        assert first["cached"] == 0 and len(sent) == 1
        assert first["usage"] == want["usage"] and first["labels"] == want["labels"]
        close(first["scores"], want["scores"])
        again = post(base, req)
        assert again["cached"] == len(ITEMS) and len(sent) == 1  # no engine call
        assert again["scores"] == first["scores"] and again["labels"] == first["labels"]
        assert again["scored"] == [True] * 3 and again["depth"] == 3
        assert again["usage"] == {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
        more = {**req, "items": [ITEMS[0], " socks", ITEMS[2]]}
        mixed = post(base, more)
        assert mixed["cached"] == 2 and len(sent) == 2 and len(sent[1]) == 1  # " socks" alone
        close(mixed["scores"], scorer.score_request(more)["scores"])
        alone = scorer.score_request({**req, "items": [" socks"]})
        assert mixed["usage"] == alone["usage"]
        assert [mixed["scores"][0], mixed["scores"][2]] == [first["scores"][0], first["scores"][2]]
        # other routes on the same scorer share it: vLLM's rerank (its own `cached`) and /score
        # (vLLM's exact keys: only its usage tells)
        rr = post(base, {"query": "wool coat", "documents": ITEMS}, "/rerank")
        assert rr["cached"] == 3 and rr["usage"]["prompt_tokens"] == 0
        vs = post(base, {"text_1": "wool coat", "text_2": ITEMS}, "/score")
        assert vs["usage"]["prompt_tokens"] == 0 and "cached" not in vs
        assert [d["score"] for d in vs["data"]] == [s[0] for s in first["scores"]]
        text = httpx.get(base + "/metrics").text
        assert metric(text, "prefixscore_score_cache_hits_total") == 3 + 2 + 3 + 3
        assert metric(text, "prefixscore_score_cache_misses_total") == 3 + 1
        assert metric(text, "prefixscore_cache_entries") == 4 and metric(text, "prefixscore_cache_bytes") > 0
        assert metric(text, "prefixscore_cache_hits_total") == 0  # classify's, as before


def test_cache_off_by_default(clf, scorer):
    req = {"query": "wool coat", "items": ITEMS[:1]}
    app = create_app(clf, scorer, **LIMITS)
    sent = sent_scores(app)
    with running(app) as (base, _):
        assert app.state.frontend.cache is None
        assert [post(base, req)["cached"] for _ in range(2)] == [0, 0] and len(sent) == 2


def test_label_sets_and_softmax_never_share(clf, scorer):
    """The same query and items under another label set (named by text, by token ids, or the
    scorer's own) or apply_softmax: each its own entries, never another's scores."""
    tok = clf.loaded.tokenizer
    yes, no = tok(" yes")["input_ids"][-1], tok(" no")["input_ids"][-1]
    base_req = {"query": "wool coat", "items": ITEMS[:2]}
    variants = [{}, {"apply_softmax": True}, {"labels": ["yes", "no"]},
                {"labels": ["yes", "no"], "apply_softmax": True}, {"labels": ["no", "yes"]},
                {"label_token_ids": [yes, no]}, {"label_token_ids": [no, yes]}]
    app = create_app(clf, scorer, **CACHE)
    with running(app) as (base, _):
        fe = app.state.frontend
        keys = [score_keys(fe.scorer_id, fe.scoring.parse({**base_req, **v}))[0] for v in variants]
        assert len(set(keys)) == len(variants)
        for v in variants:
            req = {**base_req, **v}
            got = post(base, req)
            assert got["cached"] == 0, v
            close(got["scores"], scorer.score_request(req)["scores"])
        for v in variants:  # and each is now cached as itself
            req = {**base_req, **v}
            got = post(base, req)
            assert got["cached"] == 2, v
            close(got["scores"], scorer.score_request(req)["scores"])


def test_whitespace_and_ids(clf, scorer, monkeypatch):
    """Text items are keyed by their text: "red dress" and "red  dress" never share an entry, a
    whole repeat is answered without a tokenizer call, and a flag sent as 1 instead of true is
    still refused (never served from the cache). Token-id requests are keyed by their ids."""
    from prefixscore.prompt import Prompt
    from prefixscore.serve.cache import text_keys

    app = create_app(clf, scorer, **CACHE)
    with running(app) as (base, _):
        fe = app.state.frontend
        one, two = ({"query": q, "items": [" a red dress"]} for q in ("red dress", "red  dress"))
        assert text_keys(fe.scorer_id, one, one["items"]) != text_keys(fe.scorer_id, two, two["items"])
        assert post(base, one)["cached"] == 0
        got = post(base, two)
        assert got["cached"] == 0
        close(got["scores"], scorer.score_request(two)["scores"])
        calls = []
        orig = Prompt.encode_ids
        monkeypatch.setattr(Prompt, "encode_ids", lambda self, *a: calls.append(1) or orig(self, *a))
        assert post(base, one)["cached"] == 1 and not calls  # not tokenized again
        bad = httpx.post(base + "/v1/score", json={**one, "apply_softmax": 1})
        assert bad.status_code == 422, bad.text
        # the text request's prompt as token ids: its own key (ids), shared by its repeats
        c1 = fe.scoring.parse(one)
        full = c1.prep.full[0]
        ids = {"query": full[:-2], "items": [full[-2:]]}
        assert score_keys(fe.scorer_id, fe.scoring.parse(ids)) == score_keys(fe.scorer_id, c1)
        assert post(base, ids)["cached"] == 0
        same = post(base, ids)
        assert same["cached"] == 1
        close(same["scores"], scorer.score_request(ids)["scores"])


def test_scorers_never_share(clf, scorer):
    """Two servers over one cache (as if what is served changed under it): a scorer with other
    labels of its own, or another template, gets none of the other's answers; the identity in
    the keys separates adapters and templates too."""
    other_labels = Scorer(clf.loaded, SCORE_TEMPLATE, ["no", "yes"], chat=False)
    other_template = Scorer(clf.loaded, SCORE_TEMPLATE.replace("Decide", "Say"), ["yes", "no"],
                            chat=False)
    req = {"query": "wool coat", "items": ITEMS[:2]}
    a = create_app(clf, scorer, **CACHE)
    with running(a) as (base_a, _):
        assert post(base_a, req)["cached"] == 0 and post(base_a, req)["cached"] == 2
        for sc in (other_labels, other_template):
            b = create_app(clf, sc, **CACHE)
            b.state.frontend.cache = a.state.frontend.cache  # one cache, two scorers
            with running(b) as (base_b, _):
                got = post(base_b, req)
                assert got["cached"] == 0 and got["labels"] == sc.labels
                close(got["scores"], sc.score_request(req)["scores"])
                assert b.state.frontend.scorer_id != a.state.frontend.scorer_id
        info = a.state.frontend.info
        ids = {scorer_id(info)}
        for change in (dict(template=info.scorer.template + " "), dict(labels=["yes"]),
                       dict(prefix_ids=info.scorer.prefix_ids[:-1])):
            ids.add(scorer_id(msgspec.structs.replace(
                info, scorer=msgspec.structs.replace(info.scorer, **change))))
        adapted = [msgspec.structs.replace(c, adapter="seed") for c in info.classifiers]
        ids.add(scorer_id(msgspec.structs.replace(info, classifiers=adapted)))
        ids.add(scorer_id(msgspec.structs.replace(info, model="another")))
        assert len(ids) == 6


def test_depth_control_spends_nothing_on_cached_items(clf, scorer):
    """With a latency target only the misses go to the engine and depth control cuts them alone:
    cached items are scored for free. `depth` stays "the first depth items are scored" (the
    leading run); `scored` says which are. Only items the engine scored are stored."""
    schedule = ScheduleOptions(target_p99_ms=1000.0, depth_min=1, depth_max=2)
    app = create_app(clf, scorer, schedule=schedule, **CACHE)
    sent = sent_scores(app)
    items = ["camel coat", "wool scarf", "red dress", "blue jeans"]
    want = dict(zip(items + ["parka", "socks", "boots"], scorer.score_request(
        {"query": "winter coat", "items": items + ["parka", "socks", "boots"]})["scores"]))
    with running(app) as (base, _):
        r = post(base, {"query": "winter coat", "items": items})
        assert r["depth"] == 2 and r["scored"] == [True, True, False, False] and r["cached"] == 0
        r = post(base, {"query": "winter coat", "items": items})  # the first two cached: free
        assert r["depth"] == 4 and all(r["scored"]) and r["cached"] == 2 and len(sent[-1]) == 2
        close(r["scores"], [want[i] for i in items])
        order = ["parka", "camel coat", "socks", "boots"]
        r = post(base, {"query": "winter coat", "items": order, "prior": [0.1, 0.2, 0.3, 0.4]})
        assert r["cached"] == 1 and len(sent[-1]) == 3  # parka, socks, boots; depth 2 of them
        assert r["scored"] == [True, True, True, False] and r["depth"] == 3
        close(r["scores"][:3], [want[i] for i in order[:3]])
        assert r["scores"][3] == [0.4, 0.4]
        r = post(base, {"query": "winter coat", "items": ["boots"]})
        assert r["cached"] == 0  # boots was not scored, so not stored


def test_cache_bounds_and_config(clf, scorer):
    with pytest.raises(ConfigError, match="--cache-bytes"):
        create_app(clf, scorer, cache_size=8, cache_bytes=0)
    with pytest.raises(ConfigError, match="--cache-size"):
        create_app(clf, scorer, cache_size=-1)
    req = {"query": "wool coat", "items": ITEMS}
    # a few hundred bytes hold no entry of a whole prompt's ids; 2 entries hold 2 items
    for limits, cached in ((dict(cache_size=8, cache_bytes=200), 0), (dict(cache_size=2), 2)):
        app = create_app(clf, scorer, **{**LIMITS, **limits})
        with running(app) as (base, _):
            post(base, req)
            assert post(base, req)["cached"] == cached
            cache = app.state.frontend.cache
            assert len(cache) <= cache.max_entries and cache.bytes <= cache.max_bytes


def test_cli_cache_flags(tmp_path):
    """--cache-bytes takes bytes or K/M/G (binary), from a flag or the config file; a bad size is
    the flag's error."""
    from prefixscore.cli.commands import build_parser
    from prefixscore.cli.common import apply_sources
    from prefixscore.cli.serve import configs

    def front(*words, config=None):
        argv = ["serve", "--device", "cpu", "--score-template", SCORE_TEMPLATE, *words] + (
            ["--config", str(config)] if config else [])
        a = build_parser().parse_args(argv)
        a.argv = argv[1:]
        apply_sources(a, a.command_parser, environ={})
        return configs(a)[0]

    f = front("--cache-size", "1000", "--cache-bytes", "64M", "--cache-ttl", "30")
    assert (f.cache_size, f.cache_bytes, f.cache_ttl) == (1000, 64 << 20, 30.0)
    assert front().cache_size == 0 and front().cache_bytes == 256 << 20  # off by default
    toml = tmp_path / "serve.toml"
    toml.write_text('cache_size = 10\ncache_bytes = "1GiB"\n')
    f = front(config=toml)
    assert (f.cache_size, f.cache_bytes) == (10, 1 << 30)
    with pytest.raises(SystemExit):
        front("--cache-bytes", "lots")


def test_embedding_items_are_keyed_by_their_vector(clf, scorer):
    """An embedding item's key holds its vector's digest beside the prompt's ids (where SOFT
    marks the soft token): the same vector shares an entry, any other vector does not; through
    the route, a repeated mixed request is all cached and a changed vector is computed."""
    import asyncio

    H = clf.loaded.model.config.hidden_size
    vecs = (torch.randn(2, H, generator=torch.Generator().manual_seed(1)) * 0.02).tolist()
    app = create_app(clf, scorer, **CACHE)
    sent = sent_scores(app)
    with running(app) as (base, _):
        fe = app.state.frontend

        def keys(items):
            return score_keys(fe.scorer_id, fe.scoring.parse({"query": "wool coat", "items": items}))

        a, b, c, t = keys([{"embedding": vecs[0]}, {"embedding": vecs[0]}, {"embedding": vecs[1]},
                           "parka"])
        assert a == b and a != c and a[:-1] == c[:-1]  # the same ids, SOFT included; other bytes
        assert len(t) == len(a) - 1 and t != a[:-1]

        def score(items):  # Frontend.score on its own loop (the HTTP schema is not ours to widen)
            fut = asyncio.run_coroutine_threadsafe(
                fe.score({"query": "wool coat", "items": items}), fe.client.loop)
            return fut.result(60)

        items = ["parka", {"embedding": vecs[0]}]
        first = score(items)
        assert first["cached"] == 0 and len(sent) == 1
        again = score(items)
        assert again["cached"] == 2 and again["scores"] == first["scores"] and len(sent) == 1
        other = score(["parka", {"embedding": vecs[1]}])
        assert other["cached"] == 1 and len(sent) == 2 and len(sent[1]) == 1
        assert other["scores"][1] != first["scores"][1]
