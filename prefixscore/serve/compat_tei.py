"""TEI's routes (text-embeddings-inference), and the Hugging Face Inference API's body on them, so
that TEI's clients and huggingface_hub.InferenceClient work unchanged: registered by compat.py.

    POST /predict, POST /       TEI's: {"inputs": str | [[str], ...], "raw_scores"} -> [{"score",
                                "label"}] best first (a batch: one list per input). TEI's root route
                                runs the model's task: a classifier's is /predict. A body with
                                "parameters" ({"top_k", "function_to_apply"}: what InferenceClient
                                .text_classification sends, to the base URL) is the Inference API's:
                                answered [[{"label", "score"}, ...]], top_k and the function applied
                                (InferenceClient reads the first list; TEI's flat list gave it one
                                label)
    POST /rerank (and /v1, /v2)  TEI's body {"query", "texts", "raw_scores", "return_text"} (told
                                from Cohere's "documents") -> TEI's bare list [{"index", "text"?,
                                "score"}], best first
    GET  /info                  TEI's Info: the model, a classifier's id2label / label2id, limits

Shapes read from TEI 1.9.3 (router/src/http/server.rs, types.rs, lib.rs) and huggingface_hub
(inference/_client.py text_classification, _providers/hf_inference.py: a URL model is posted to
as given).
"""
from __future__ import annotations

import json
import math

from .answers import label_probs
from .frontend import ApiError, Frontend
from .schemas import TeiPredictRequest, TeiRerankRequest


class TeiShape:
    """TEI's {"error", "error_type"}; the status keeps ours (TEI's for the same kinds)."""

    def error(self, status: int, detail: str, param: str | None = None) -> tuple[int, dict]:
        kind = {429: "Overloaded", 503: "Unhealthy"}.get(status) or (
            "Backend" if status >= 500 else "Validation")
        return status, {"error": detail, "error_type": kind}

    def invalid(self, detail: str) -> tuple[int, dict]:
        return 422, {"error": detail, "error_type": "Validation"}


TEI = TeiShape()


def reply(body, status: int = 200, headers=None):
    """A JSON response (compat.py's routes too)."""
    from fastapi.responses import Response

    return Response(json.dumps(body, ensure_ascii=False).encode(), status,
                    headers=headers or None, media_type="application/json")


def fail(e: ApiError, shape=TEI):
    """An ApiError in a peer's error shape (compat.py passes vLLM's)."""
    status, body = shape.error(e.status, e.detail, e.param)
    return reply(body, status, e.headers)


def _inputs(req: TeiPredictRequest) -> tuple[list[str], bool] | tuple[None, object]:
    """(texts, one input) or (None, the error response) from TEI's inputs."""
    inputs = req.inputs
    if not isinstance(inputs, list):
        return [inputs], True
    if not inputs:
        return None, reply({"error": "`inputs` cannot be empty", "error_type": "Empty"}, 400)
    single = isinstance(inputs[0], str)
    seqs = [inputs] if single else inputs  # TEI: [text] is one text, [text, text] one pair
    for seq in seqs:
        if len(seq) != 1:
            what = ("a pair of texts is for a cross-encoder; this server's prompt has one text slot"
                    if len(seq) == 2 else f"a sequence of {len(seq)} texts")
            return None, reply(TEI.error(422, f"inputs: {what}: send a text, or a batch "
                                              f"[[text], [text], ...]")[1], 422)
    return [seq[0] for seq in seqs], single


def _scored(labels, scores, fn: str | None, raw: bool) -> list[dict]:
    """Every label with its score, best first: the probability (softmax over the labels), or the
    raw score (raw_scores; the Inference API's function "none"), or its sigmoid ("sigmoid")."""
    probs, logprobs = label_probs(scores)
    if fn == "sigmoid":
        vals = [1.0 / (1.0 + math.exp(-min(max(s, -700.0), 700.0))) for s in scores]
    else:
        vals = scores if raw or fn == "none" else probs
    rows = [{"score": v, "label": label, "logprob": lp} for label, v, lp in zip(labels, vals, logprobs)]
    rows.sort(key=lambda r: -r["score"])
    return rows


async def predict(fe: Frontend, req: TeiPredictRequest):
    texts, single = _inputs(req)
    if texts is None:
        return single
    try:
        ans = await fe.classify(texts, req.model, req.classifier, field="inputs")
    except ApiError as e:
        return fail(e)
    params = req.parameters
    fn = params.function_to_apply if params else None
    out = [_scored(ans.labels, scores, fn, req.raw_scores) for _, _, scores, _ in ans.results]
    if params is not None:  # the Inference API's: a list of lists, at most top_k each
        k = params.top_k or len(ans.labels)
        return reply([[{"label": r["label"], "score": r["score"]} for r in row[:k]] for row in out])
    return reply(out[0] if single else out)


async def rerank(fe: Frontend, req: TeiRerankRequest):
    if not req.texts:
        return reply({"error": "`texts` cannot be empty", "error_type": "Empty"}, 400)
    try:
        out = await fe.score({"query": req.query, "items": req.texts, "apply_softmax": True},
                             field="texts", model=req.model)
    except ApiError as e:
        if e.status == 501:  # TEI's answer for a model that is not a reranker
            return reply({"error": "model is not a re-ranker model: " + e.detail,
                          "error_type": "Backend"}, 424)
        return fail(e)
    ranks = []
    for i, (text, row) in enumerate(zip(req.texts, out["scores"])):
        p = None if row is None else row[0]
        r = {"index": i} | ({"text": text} if req.return_text else {})
        r["score"] = p if p is None or not req.raw_scores else math.log(max(p, 1e-45))
        ranks.append(r)
    # best first (stable: ties keep request order); unscored (past the depth) last
    ranks.sort(key=lambda r: (r["score"] is None, -(r["score"] or 0.0)))
    return reply(ranks)


def info(fe: Frontend) -> dict:
    from .. import __version__

    i, c = fe.info, fe.classifiers[0]
    # a request's tokens: the query's past the cached prefix (--max-tokens), within the prompt's
    # limit (/v1/models' max_model_len: the model's context less the longest label)
    max_input = min(fe.cfg.max_tokens, c.context_limit - len(c.prefix_ids))
    return {"model_id": i.model, "model_sha": None, "model_dtype": i.dtype,
            "served_model_name": i.model,
            "model_type": {"classifier": {"id2label": {str(k): v for k, v in enumerate(c.labels)},
                                          "label2id": {v: k for k, v in enumerate(c.labels)}}},
            "max_concurrent_requests": fe.cfg.max_queue, "max_input_length": max_input,
            "max_batch_tokens": i.max_batch_tokens, "max_batch_requests": None,
            "max_client_batch_size": fe.cfg.max_queries, "auto_truncate": bool(c.truncate),
            "tokenization_workers": fe.cfg.workers, "version": __version__, "sha": None,
            "docker_label": None}


def register(app, fe: Frontend, deps, tei_errors) -> None:
    from .schemas import TeiInfo, TeiPrediction

    answers = list[TeiPrediction] | list[list[TeiPrediction]]

    @app.post("/predict", response_model=answers, responses=tei_errors, dependencies=deps,
              tags=["compatible"])
    async def predict_route(req: TeiPredictRequest):
        """TEI's predict API: every label with its score, best first; a batch [[text], ...]
        answers one such list per text. With `parameters` (huggingface_hub.InferenceClient), the
        Inference API's answer: [[{"label", "score"}, ...]], top_k and function_to_apply applied."""
        return await predict(fe, req)

    @app.post("/", response_model=answers, responses=tei_errors, dependencies=deps,
              tags=["compatible"])
    async def root(req: TeiPredictRequest):
        """TEI's root route: the model's task, here /predict (what
        `InferenceClient(base_url=...).text_classification` posts to)."""
        return await predict(fe, req)

    @app.get("/info", response_model=TeiInfo, responses=tei_errors, dependencies=deps,
             tags=["compatible"])
    async def info_route():
        """TEI's model info: a classifier, its labels (id2label), this server's limits."""
        try:
            await fe.wait_ready()
        except ApiError as e:
            return fail(e)
        return reply(info(fe))
