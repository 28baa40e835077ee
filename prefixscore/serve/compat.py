"""Routes in other servers' shapes, so their clients work unchanged: registered on the app by
http.create_app, answered by the same Frontend (limits, admission, cache, metrics) as our own.

    POST /classify                      vLLM's (and Infinity's request):  {"model", "input": str | [str]}
                                        -> {"id", "object": "list", "created", "model",
                                            "data": [{"index", "label", "probs", "num_classes"}], "usage"}
                                        and on /v1/classify (SGLang documents vLLM's body there),
                                        told from ours ({"query"}) by its fields
    POST /score, /v1/score              vLLM's: {"text_1", "text_2"} (or "queries" and "documents" or
                                        "items", or "data_1" and "data_2"), 1:1, 1:N or N:N ->
                                        {"id", "object": "list", "created", "model",
                                         "data": [{"index", "object": "score", "score"}], "usage"};
                                        SGLang's {"query", "items"} on the same paths: /v1/score's
    POST /rerank, /v1/rerank, /v2/rerank  vLLM's (Jina's, Cohere's): {"query", "documents", "top_n"}
                                        -> {"id", "model", "usage",
                                            "results": [{"index", "document": {"text"}, "relevance_score"}]};
                                        TEI's {"query", "texts"}: compat_tei.py
    GET  /v1/models                     OpenAI's list: {"object": "list", "data": [{"id", "object": "model",
                                            "created", "owned_by", ...}]}: the model, then each
                                            classifier (as vLLM lists LoRA adapters)
    GET  /v1/models/{id}                one card (OpenAI's models.retrieve; an id with "/" either raw
                                        or %2F-encoded), 404 NotFoundError for another
    TEI's /predict, POST /, /info        compat_tei.py
    GET  /health (and HEAD)             /healthz under vLLM's and TEI's name; GET /version: {"version"}

`model` (and our `classifier`) in a request name a served classifier, or the served model for the
default one (catalog.py); "model" in an answer is the classifier that answered.

Shapes followed (read from the peers' sources):
- vLLM: vllm/entrypoints/pooling/classify/protocol.py (ClassificationRequest/Response),
  pooling/score/protocol.py (RerankRequest/RerankResponse) and score/serving.py (results sorted by
  relevance, best first; top_n 0 = all), pooling/score/api_router.py (/rerank, /v1/rerank,
  /v2/rerank), openai/engine/protocol.py (ErrorResponse {"error": {"message", "type", "param",
  "code"}}, ModelCard/ModelList), openai/engine/serving.py (_check_model: 404 NotFoundError "The
  model `x` does not exist.", param "model"; bad input 400 BadRequestError) and api_server.py (a
  request that fails validation: 400, type "Bad Request").
- Infinity: libs/infinity_emb/infinity_emb/fastapi_schemas/pymodels.py (ClassifyInput: the same
  request, model defaulting to "default/not-specified", which we accept as "the served one") and
  errors.py (the same {"error": {...}} shape). Infinity's /classify *response* differs from vLLM's
  (data: one [{"score", "label"}] list per input); /classify answers vLLM's, and /predict gives
  that per-input list.
- TEI: router/src/http/types.rs (PredictRequest / PredictResponse, untagged single or batch),
  http/server.rs (predictions sorted best first; ErrorType -> status: Validation/Tokenizer 422,
  Overloaded 429, Unhealthy 503, Backend 424, Empty 400) and lib.rs (ErrorResponse {"error",
  "error_type"}, error_type serialized as the variant name, e.g. "Validation").
- TEI's own /rerank answers a bare list [{"index", "score", "text"}]; /rerank here follows vLLM
  (and Jina, Cohere, Infinity), the shape the issue names.

Every route answers probabilities (softmax over the labels) beside log-probabilities (log-softmax
over the labels): fields `logprobs` / `logprob` are ours, added to the peer's shape, and so is
`cached` on /rerank's answer (documents answered from the pair cache; vLLM's, Jina's and Cohere's
models allow extra keys). vLLM's /score answer keeps vLLM's exact keys, and TEI's bare lists carry
nothing of ours.

Rerank is multi-item scoring (/v1/score's Scorer, --score-template with {query} and {item}):
relevance_score is the probability of the scorer's first label (--score-labels, default "yes,no":
P(yes)) under softmax over its labels. A server without --score-template answers vLLM's error for a
model without a rerank API: 400 BadRequestError.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from http import HTTPStatus

from . import compat_tei
from .answers import label_probs
from .compat_tei import TEI, reply
from .frontend import ApiError, Frontend
from .schemas import (VLLM_SCORE_FIELDS, AnyRerankRequest, AnyScoreRequest, ModelCard, ModelList,
                      RerankRequest, RerankResponse, ScoreResponse, TeiError, TeiRerankRequest,
                      VllmClassifyRequest, VllmClassifyResponse, VllmError, VllmScoreRequest,
                      VllmScoreResponse)

RERANK = ("/rerank", "/v1/rerank", "/v2/rerank")
# besides /v1/*: what computes, or tells about the model, needs the API key
AUTHED = ("/classify", "/score", "/predict", "/", "/info", *RERANK)
PATHS = (*AUTHED, "/v1/models", "/health", "/version")
NO_SCORER = ("The model does not support Rerank (Score) API: no multi-item scorer is configured on "
             "this server (start it with --score-template TEMPLATE, whose {query} and {item} slots "
             "take the query and each document; --score-labels lists the relevant label first, "
             "default yes,no)")


class VllmShape:
    """vLLM's (and Infinity's) {"error": {"message", "type", "param", "code"}}; code = the status."""
    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
             501: "NotImplementedError"}

    def error(self, status: int, detail: str, param: str | None = None) -> tuple[int, dict]:
        if status == 422:  # a bad input is 400 BadRequestError in vLLM
            status = 400
        kind = self.TYPES.get(status) or HTTPStatus(status).phrase
        return status, {"error": {"message": detail, "type": kind, "param": param, "code": status}}

    def invalid(self, detail: str) -> tuple[int, dict]:
        """A request the schema refuses: vLLM's RequestValidationError handler."""
        return 400, {"error": {"message": detail, "type": HTTPStatus.BAD_REQUEST.phrase,
                               "param": None, "code": 400}}


VLLM = VllmShape()
SHAPES = {**{p: VLLM for p in ("/classify", "/score", *RERANK, "/v1/models")},
          **{p: TEI for p in ("/predict", "/", "/info")}}


def shape_of(path: str, body=None):
    """The error shape of a request: its route's peer's, or on a route several peers share, the
    peer whose body it is (None: ours, {"detail": ...})."""
    fields = body if isinstance(body, dict) else {}
    if path == "/v1/classify":
        return VLLM if "input" in fields and "query" not in fields else None
    if path in ("/v1/score", "/score"):
        return VLLM if path == "/score" or any(k in fields for k in VLLM_SCORE_FIELDS) else None
    if path in RERANK and "texts" in fields and "documents" not in fields:
        return TEI
    if path.startswith("/v1/models/"):
        return VLLM
    return SHAPES.get(path)


def error_body(path: str, status: int, detail: str, param: str | None = None):
    """(status, JSON bytes) of an error in the shape of the peer whose route `path` is; None for
    our own routes ({"detail": ...})."""
    shape = shape_of(path)
    if shape is None:
        return None
    status, body = shape.error(status, detail, param)
    return status, json.dumps(body, ensure_ascii=False).encode()


def fail(e: ApiError):
    return compat_tei.fail(e, VLLM)


def usage(tokens: int, cached: int | None = None) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None if cached is None else {"cached_tokens": cached}}


async def vllm_classify(fe: Frontend, req: VllmClassifyRequest):
    """vLLM's classification API (SGLang's and Infinity's request too): per input, the label and
    the probabilities of every label (`labels` gives their order)."""
    inputs = [req.input] if isinstance(req.input, str) else req.input
    try:
        ans = await fe.classify(inputs, req.model, req.classifier, field="input")
    except ApiError as e:
        return fail(e)
    data = []
    for i, (_, label, scores, _) in enumerate(ans.results):
        probs, logprobs = label_probs(scores)
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs),
                     "logprobs": logprobs})
    return reply({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": ans.classifier, "data": data,
                  "usage": usage(ans.prompt_tokens, ans.cached_tokens), "labels": ans.labels})


async def vllm_score(fe: Frontend, req: VllmScoreRequest):
    """vLLM's score API: one score per (text_1, text_2) pair, 1:1, 1:N or N:N (vLLM's rules), the
    probability of the scorer's first label (yes), softmax over its labels; the pairs of one
    text_1 run as one multi-item request."""
    sides = req.sides()
    try:
        if sides is None:
            raise ApiError(400, "text_1 and text_2 (or queries and documents) are required",
                           param="text_2")
        one, two = sides
        if not one or not two:
            raise ApiError(400, "At least one text element must be given" if not one else
                           "At least one text_pair element must be given")
        if len(one) > 1 and len(one) != len(two):
            raise ApiError(400, f"Input lengths must be either 1:1, 1:N or N:N, got {len(one)}:"
                                f"{len(two)}", param="text_2")
        if len(one) == 1:
            one = one * len(two)
        by_query: dict[str, list[int]] = {}
        for i, q in enumerate(one):
            by_query.setdefault(q, []).append(i)
        outs = await asyncio.gather(*(
            fe.score({"query": q, "items": [two[i] for i in idx], "apply_softmax": True,
                      "priority": req.priority}, field="text_2", model=req.model)
            for q, idx in by_query.items()))
    except ApiError as e:
        if e.status == 501:
            e = ApiError(400, NO_SCORER)
        return fail(e)
    scores, tokens = [None] * len(two), 0
    for (q, idx), out in zip(by_query.items(), outs):
        tokens += out["usage"]["prompt_tokens"]
        for i, row in zip(idx, out["scores"]):
            scores[i] = None if row is None else row[0]
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return reply({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                  "model": fe.info.model, "data": data, "usage": usage(tokens)})


async def vllm_rerank(fe: Frontend, req: RerankRequest):
    texts = [d if isinstance(d, str) else d.item() for d in req.documents]
    try:
        if not texts:
            raise ApiError(400, "documents must not be empty", param="documents")
        out = await fe.score({"query": req.query, "items": texts, "apply_softmax": True},
                             field="documents", model=req.model)
    except ApiError as e:
        if e.status == 501:
            e = ApiError(400, NO_SCORER)
        return fail(e)
    results = []
    for i, (t, row) in enumerate(zip(texts, out["scores"])):
        p = None if row is None else row[0]  # None: past the depth (--target-p99-ms)
        results.append({"index": i, "document": {"text": t} if isinstance(t, str) else t,
                        "relevance_score": p,
                        "logprob": None if p is None else math.log(max(p, 1e-45))})  # float32's floor
    # best first (stable: ties keep request order); unscored last
    results.sort(key=lambda r: (r["relevance_score"] is None, -(r["relevance_score"] or 0.0)))
    if req.top_n:
        results = results[:req.top_n]
    if not req.return_documents:
        for r in results:
            del r["document"]
    n = out.get("usage", {}).get("prompt_tokens", 0)
    return reply({"id": f"rerank-{uuid.uuid4().hex}", "model": fe.info.model,
                  "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results,
                  "cached": out.get("cached", 0)})  # ours: vLLM's, Jina's, Cohere's allow extra keys


def register(app, fe: Frontend, deps) -> None:
    """The routes above, on `app` (deps: the OpenAPI bearer dependency when there is an API key);
    /v1/classify's and /v1/score's other shapes are told apart in http.py's routes."""
    from fastapi.responses import JSONResponse

    vllm_errors = {s: {"model": VllmError} for s in (400, 401, 404, 413, 429, 503)}
    tei_errors = {s: {"model": TeiError} for s in (400, 401, 413, 422, 424, 429, 503)}

    @app.post("/classify", response_model=VllmClassifyResponse, responses=vllm_errors,
              dependencies=deps, tags=["compatible"])
    async def classify(req: VllmClassifyRequest):
        """vLLM's classification API (Infinity's request too): per input, the label and the
        probabilities of every label (`labels` gives their order)."""
        return await vllm_classify(fe, req)

    @app.post("/score", response_model=VllmScoreResponse | ScoreResponse, responses=vllm_errors,
              dependencies=deps, tags=["compatible"])
    async def score(req: AnyScoreRequest):
        """vLLM's score API: text_1 against text_2 (1:1, 1:N or N:N), a score per pair: the
        probability of the scorer's first label (yes). SGLang's body is /v1/score's. Needs
        --score-template."""
        if isinstance(req, VllmScoreRequest):
            return await vllm_score(fe, req)
        try:
            out = await fe.score(req.model_dump(exclude_unset=True))
        except ApiError as e:
            return fail(e)
        return reply({**out, "model": fe.info.model})

    def rerank_route(path: str):
        async def route(req: AnyRerankRequest):
            """Rerank documents for a query, best first (vLLM's rerank API; Jina's and Cohere's
            shape): relevance_score is the probability that the scorer's first label (yes)
            follows query + document. TEI's body ({"query", "texts"}) gets TEI's answer. Needs
            --score-template."""
            if isinstance(req, TeiRerankRequest):
                return await compat_tei.rerank(fe, req)
            return await vllm_rerank(fe, req)

        return route

    for path in RERANK:
        app.post(path, response_model=RerankResponse, responses=vllm_errors, dependencies=deps,
                 tags=["compatible"], name=f"rerank{path.replace('/', '_')}")(rerank_route(path))

    @app.get("/v1/models", response_model=ModelList, responses=vllm_errors, dependencies=deps,
             tags=["compatible"])
    async def models():
        """OpenAI's model list, as vLLM lists a model and its LoRA adapters: the served model
        (its default classifier), then each classifier (parent: the model); a card's id is what
        `model` fields accept."""
        try:
            await fe.wait_ready()
        except ApiError as e:
            return fail(e)
        return reply({"object": "list", "data": fe.catalog.model_cards(fe.created)})

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=vllm_errors,
             dependencies=deps, tags=["compatible"])
    async def model(model: str):
        """One card of the list (OpenAI's models.retrieve), or 404."""
        try:
            await fe.wait_ready()
        except ApiError as e:
            return fail(e)
        for card in fe.catalog.model_cards(fe.created):
            if card["id"] == model:
                return reply(card)
        return fail(ApiError(404, f"The model `{model}` does not exist.", param="model"))

    compat_tei.register(app, fe, deps, tei_errors)

    @app.get("/health", responses={503: {"description": "starting, unhealthy, or shutting down"}},
             tags=["compatible"])
    @app.head("/health", include_in_schema=False)
    async def health():
        """/healthz under the name vLLM and TEI probe."""
        status, body = fe.health()
        return JSONResponse(body, status_code=status)

    @app.get("/version", tags=["compatible"])
    async def version():
        """The server's version (vLLM's /version)."""
        from .. import __version__

        return {"version": __version__}
