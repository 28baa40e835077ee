"""`serve --score-template` beside the seed task (issue 51): classify keeps the shipped seed
adapter merged into its weights, and /v1/score runs the base weights its template was written for,
a copy of its own; /healthz says which. Before, the template switched the seed adapter off and the
default classifier fell from 97% to ~11% on held-out queries. The bundled model, CPU."""
import httpx

from prefixscore.classifier import Classifier
from prefixscore.values import ModelSpec
from prefixscore.scorer import Scorer
from prefixscore.serve import create_app
from prefixscore.serve.config import EngineConfig
from prefixscore.serve.engine_proc import build
from prefixscore.serve.protocol import scorer_info
from tests.serve.helpers import LIMITS, SCORE_TEMPLATE, running

QUERIES = ["slim fit blue denim", "a warm wool jumper for winter", "floral summer maxi"]
REQUEST = {"query": "wool coat", "items": ["a long camel coat", "flip flops"], "apply_softmax": True}


def test_score_template_keeps_the_seed_adapter_and_scores_on_base_weights(bundled):
    spec = ModelSpec(adapter="seed", device="cpu", dtype="float32")
    clf, scorer = build(EngineConfig(spec=spec, score_template=SCORE_TEMPLATE, score_labels=("yes", "no")))
    assert scorer.engine is not clf.engine and scorer.loaded is not clf.loaded
    assert clf.spec.adapter == "seed" and scorer.spec.adapter is None

    seeded = Classifier(spec=spec)  # the seed task alone, no scorer beside it
    assert [r.scores for r in clf.classify_batch(QUERIES)] == [r.scores for r in seeded.classify_batch(QUERIES)]
    base = Scorer(None, SCORE_TEMPLATE, ["yes", "no"], device="cpu", dtype="float32")  # raw weights
    assert scorer.score_request(REQUEST) == base.score_request(REQUEST)
    # and the copy is needed: the same scorer on the adapter's weights scores otherwise
    merged = Scorer(clf.loaded, SCORE_TEMPLATE, ["yes", "no"])
    assert merged.score_request(REQUEST) != base.score_request(REQUEST)

    info = scorer_info(scorer, clf)
    assert info.own_weight_bytes == scorer.engine.weight_bytes() > 0
    with running(create_app(clf, scorer=scorer, **LIMITS)) as (url, _):
        health = httpx.get(url + "/healthz").json()
        assert health["classifiers"][0]["adapter"] == "seed"
        assert health["score_weights"] == {"weights": "base", "own_copy": True, "bytes": info.own_weight_bytes}
        r = httpx.post(url + "/v1/score", json=REQUEST)
        assert r.status_code == 200, r.text


def test_scorer_shares_weights_without_an_adapter(bundled):
    """No adapter merged: one weight set serves both routes."""
    clf, scorer = build(EngineConfig(spec=ModelSpec(device="cpu", dtype="float32", chat=False),
                                     score_template=SCORE_TEMPLATE, score_labels=("yes", "no")))
    assert scorer.engine is clf.engine
    assert scorer_info(scorer, clf).own_weight_bytes == 0
