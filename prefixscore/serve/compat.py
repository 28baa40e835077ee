"""Routes in other servers' shapes, so their clients work unchanged: registered on the app by
http.create_app, answered by the same Frontend (limits, admission, cache, metrics) as our own.

    POST /classify                      vLLM's (and Infinity's request):  {"model", "input": str | [str]}
                                        -> {"id", "object": "list", "created", "model",
                                            "data": [{"index", "label", "probs", "num_classes"}], "usage"}
    POST /predict                       TEI's: {"inputs": str | [[str], ...], "raw_scores"}
                                        -> [{"score", "label"}] sorted (a batch: one list per input)
    POST /rerank, /v1/rerank, /v2/rerank  vLLM's (Jina's, Cohere's): {"query", "documents", "top_n"}
                                        -> {"id", "model", "usage",
                                            "results": [{"index", "document": {"text"}, "relevance_score"}]}
    GET  /v1/models                     OpenAI's list: {"object": "list", "data": [{"id", "object": "model",
                                            "created", "owned_by", ...}]}: the model, then each
                                            classifier (as vLLM lists LoRA adapters)
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
over the labels): fields `logprobs` / `logprob` are ours, added to the peer's shape.

Rerank is multi-item scoring (/v1/score's Scorer, --score-template with {query} and {item}):
relevance_score is the probability of the scorer's first label (--score-labels, default "yes,no":
P(yes)) under softmax over its labels. A server without --score-template answers vLLM's error for a
model without a rerank API: 400 BadRequestError.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from http import HTTPStatus

from .answers import label_probs
from .frontend import ApiError, Frontend
from .schemas import (ModelList, RerankRequest, RerankResponse, TeiError, TeiPredictRequest,
                      TeiPrediction, VllmClassifyRequest, VllmClassifyResponse, VllmError)

RERANK = ("/rerank", "/v1/rerank", "/v2/rerank")
AUTHED = ("/classify", "/predict", *RERANK)  # besides /v1/*: what computes needs the API key
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


class TeiShape:
    """TEI's {"error", "error_type"}; the status keeps ours (TEI's for the same kinds)."""

    def error(self, status: int, detail: str, param: str | None = None) -> tuple[int, dict]:
        kind = {429: "Overloaded", 503: "Unhealthy"}.get(status) or (
            "Backend" if status >= 500 else "Validation")
        return status, {"error": detail, "error_type": kind}

    def invalid(self, detail: str) -> tuple[int, dict]:
        return 422, {"error": detail, "error_type": "Validation"}


VLLM, TEI = VllmShape(), TeiShape()
SHAPES = {**{p: VLLM for p in ("/classify", *RERANK, "/v1/models")}, "/predict": TEI}


def error_body(path: str, status: int, detail: str, param: str | None = None):
    """(status, JSON bytes) of an error in the shape of the peer whose route `path` is; None for
    our own routes ({"detail": ...})."""
    shape = SHAPES.get(path)
    if shape is None:
        return None
    status, body = shape.error(status, detail, param)
    return status, json.dumps(body, ensure_ascii=False).encode()


def register(app, fe: Frontend, deps) -> None:
    """The routes above, on `app` (deps: the OpenAPI bearer dependency when there is an API key)."""
    from fastapi.responses import JSONResponse, Response

    def reply(body, status: int = 200, headers=None) -> Response:
        return Response(json.dumps(body, ensure_ascii=False).encode(), status,
                        headers=headers or None, media_type="application/json")

    def fail(path: str, e: ApiError) -> Response:
        status, body = SHAPES[path].error(e.status, e.detail, e.param)
        return reply(body, status, e.headers)

    vllm_errors = {s: {"model": VllmError} for s in (400, 401, 404, 413, 429, 503)}
    tei_errors = {s: {"model": TeiError} for s in (400, 401, 413, 422, 429, 503)}

    @app.post("/classify", response_model=VllmClassifyResponse, responses=vllm_errors,
              dependencies=deps, tags=["compatible"])
    async def classify(req: VllmClassifyRequest):
        """vLLM's classification API (Infinity's request too): per input, the label and the
        probabilities of every label (`labels` gives their order)."""
        inputs = [req.input] if isinstance(req.input, str) else req.input
        try:
            ans = await fe.classify(inputs, req.model, req.classifier, field="input")
        except ApiError as e:
            return fail("/classify", e)
        data = []
        for i, (_, label, scores, _) in enumerate(ans.results):
            probs, logprobs = label_probs(scores)
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs),
                         "logprobs": logprobs})
        usage = {"prompt_tokens": ans.prompt_tokens, "total_tokens": ans.prompt_tokens,
                 "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": ans.cached_tokens}}
        return reply({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                      "created": int(time.time()), "model": ans.classifier, "data": data,
                      "usage": usage, "labels": ans.labels})

    @app.post("/predict", response_model=list[TeiPrediction] | list[list[TeiPrediction]],
              responses=tei_errors, dependencies=deps, tags=["compatible"])
    async def predict(req: TeiPredictRequest):
        """TEI's predict API: every label with its score, best first; a batch [[text], ...]
        answers one such list per text."""
        inputs, single = req.inputs, True
        if isinstance(inputs, list):
            if not inputs:
                return reply({"error": "`inputs` cannot be empty", "error_type": "Empty"}, 400)
            if isinstance(inputs[0], str):  # TEI: [text] is one text, [text, text] one pair
                inputs = [inputs]
            else:
                single = False
            for seq in inputs:
                if len(seq) != 1:
                    what = ("a pair of texts is for a cross-encoder; this server's prompt has one "
                            "text slot" if len(seq) == 2 else f"a sequence of {len(seq)} texts")
                    return reply(TEI.error(422, f"inputs: {what}: send a text, or a batch "
                                                f"[[text], [text], ...]")[1], 422)
            inputs = [seq[0] for seq in inputs]
        else:
            inputs = [inputs]
        try:
            ans = await fe.classify(inputs, req.model, req.classifier, field="inputs")
        except ApiError as e:
            return fail("/predict", e)
        out = []
        for _, _, scores, _ in ans.results:
            probs, logprobs = label_probs(scores)
            row = [{"score": s if req.raw_scores else p, "label": label, "logprob": lp}
                   for label, s, p, lp in zip(ans.labels, scores, probs, logprobs)]
            row.sort(key=lambda r: -r["score"])
            out.append(row)
        return reply(out[0] if single else out)

    async def rerank(req: RerankRequest, path: str) -> Response:
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        try:
            if not texts:
                raise ApiError(400, "documents must not be empty", param="documents")
            out = await fe.score({"query": req.query, "items": texts, "apply_softmax": True},
                                 field="documents", model=req.model)
        except ApiError as e:
            if e.status == 501:
                e = ApiError(400, NO_SCORER)
            return fail(path, e)
        results = [{"index": i, "document": {"text": t}, "relevance_score": row[0],
                    "logprob": math.log(max(row[0], 1e-45))}  # a float32 probability's floor
                   for i, (t, row) in enumerate(zip(texts, out["scores"]))]
        results.sort(key=lambda r: -r["relevance_score"])  # stable: ties keep request order
        if req.top_n:
            results = results[:req.top_n]
        if not req.return_documents:
            for r in results:
                del r["document"]
        n = out.get("usage", {}).get("prompt_tokens", 0)
        return reply({"id": f"rerank-{uuid.uuid4().hex}", "model": fe.info.model,
                      "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results})

    def rerank_route(path: str):
        async def route(req: RerankRequest):
            """Rerank documents for a query (vLLM's rerank API; Jina's and Cohere's shape), best
            first: relevance_score is the probability that the scorer's first label (yes) follows
            query + document. Needs --score-template."""
            return await rerank(req, path)

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
            return fail("/v1/models", e)
        return reply({"object": "list", "data": fe.catalog.model_cards(fe.created)})

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
