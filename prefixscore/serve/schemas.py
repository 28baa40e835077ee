"""The HTTP routes' request and response shapes (pydantic: validation and the OpenAPI schema)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"query": "beige trench coat women"}, {"query": ["levis 501", "红色连衣裙"]}]})
    query: str | list[str] = Field(description="one query, or a list classified independently")


class ClassifyResult(BaseModel):
    query: str = Field(description="the query as the model saw it (cut if the server truncates)")
    label: str = Field(description="what greedy decoding constrained to the labels outputs")
    scores: dict[str, float] = Field(description="per label: log-probability (mode logprobs) or raw "
                                                 "first-token logit (mode logits)")
    cached: bool = Field(description="answered from the result cache")


class Timing(BaseModel):
    queue_ms: float = Field(description="waiting for the engine")
    tokenize_ms: float
    forward_ms: float = Field(description="the engine batch this request rode in")
    total_ms: float = Field(description="from the parsed request to the answer")


class ClassifyResponse(BaseModel):
    results: list[ClassifyResult]
    batch_size: int = Field(description="queries in the engine batch (0: all from the cache)")
    timing: Timing


class ScoreRequest(BaseModel):
    """SGLang's /v1/score request; `labels` (label texts instead of token ids) is ours. Strict
    types: "yes" is no boolean and "9891" no token id (Scorer.score_request refuses them too)."""
    query: str | list[StrictInt] | None = None
    items: str | list[str] | list[list[StrictInt]] | None = None
    label_token_ids: list[StrictInt] | None = None
    labels: list[str] | None = None
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: str | None = Field(None, description="accepted for compatibility; never loads a model")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ScoreResponse(BaseModel):
    scores: list[list[float]] = Field(description="per item, one score per label, in label order")
    labels: list[str] = Field(description="the label order (ours; not in SGLang's response)")
    model: str
    usage: Usage | None = None
    object: Literal["scoring"] = "scoring"


class Error(BaseModel):
    detail: str


ERRORS = {s: {"model": Error, "description": d} for s, d in [
    (400, "body is not UTF-8"), (401, "missing or wrong API key"),
    (408, "headers or body not received in time"),
    (413, "body, query count, tokens or labels over the limit"), (422, "invalid request or query"),
    (429, "queue full: retry after Retry-After seconds"),
    (503, "engine fault, not ready, shutting down, or not started within --max-queue-ms")]}
