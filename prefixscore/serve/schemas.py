"""The HTTP routes' request and response shapes (pydantic: validation and the OpenAPI schema)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag

from .api_error import MAX_PRIORITY


def model_field():
    return Field(None, description="a served classifier (GET /v1/models), or the served model "
                                   "(--served-model-name, else the model's file or folder name) for "
                                   "the default classifier; another name is answered 404. Default: "
                                   "the default classifier")


def priority_field():
    return Field(0, ge=0, le=MAX_PRIORITY, strict=True,
                 description="0 (default): real-time; higher: batch work, run only in engine time "
                             "the real-time lane leaves idle and never cut by depth control "
                             "(vLLM's and SGLang's `priority`: lower is served first)")


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"query": "beige trench coat women"}, {"query": ["levis 501", "红色连衣裙"]},
                     {"query": ["levis 501"], "classifiers": ["category", "gender"]}]})
    query: str | list[str] = Field(description="one query, or a list classified independently")
    model: str | None = model_field()
    classifier: str | None = Field(None, description="the served classifier (GET /v1/models); "
                                                     "another name is answered 404. Default: the "
                                                     "first one")
    classifiers: list[str] | None = Field(
        None, description="several served classifiers, each answering every query: the answer is "
                          "then a ClassifyManyResponse (per query, a result per classifier). "
                          "Queries x classifiers count against --max-queries")
    priority: int = priority_field()


class ClassifyResult(BaseModel):
    query: str = Field(description="the query as the model saw it (cut if the server truncates)")
    label: str = Field(description="what greedy decoding constrained to the labels outputs")
    scores: dict[str, float] = Field(description="per label: log-probability (mode logprobs) or raw "
                                                 "first-token logit (mode logits)")
    probs: dict[str, float] = Field(description="per label: probability, the softmax of the scores "
                                                "over the labels")
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


class ClassifierResults(BaseModel):
    query: str = Field(description="the query as sent")
    classifiers: dict[str, ClassifyResult] = Field(
        description="per classifier of the request, in its order: exactly what a request naming "
                    "that classifier alone answers for this query")


class ClassifyManyResponse(BaseModel):
    """The answer to a /v1/classify request with `classifiers`."""
    results: list[ClassifierResults] = Field(description="one per query, in request order")
    classifiers: list[str] = Field(description="the classifiers of the request, in its order")
    batch_size: int = Field(description="rows (queries x classifiers) in the engine batch (0: all "
                                        "from the cache)")
    timing: Timing


class ScoreRequest(BaseModel):
    """SGLang's /v1/score request; `labels` (label texts instead of token ids) is ours. Strict
    types: "yes" is no boolean and "9891" no token id (Scorer.score_request refuses them too)."""
    query: str | list[StrictInt] | None = None
    items: str | list[str | dict[str, Any]] | list[list[StrictInt]] | None = Field(
        None, description="strings; or token-id lists (with a token-id query); or, mixed with "
                          "strings, embedding items of the model's hidden size: {\"embedding\": "
                          "[numbers]}, {\"embedding\": base64, \"dtype\": \"float16\" (default) | "
                          "\"bfloat16\" | \"float32\"}, {\"id\": key} into the server's "
                          "--item-table, or {\"text\": string}")
    label_token_ids: list[StrictInt] | None = None
    labels: list[str] | None = None
    apply_softmax: StrictBool = False
    item_first: StrictBool = False
    model: str | None = Field(None, description="accepted for compatibility; never loads a model")
    priority: int = priority_field()
    prior: list[float | list[float]] | None = Field(
        None, description="per item, the score (or per-label scores) to answer an item past the "
                          "depth with (depth control, --target-p99-ms); default: null")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ScoreResponse(BaseModel):
    scores: list[list[float] | None] = Field(
        description="per item, one score per label, in label order; an item past the depth: the "
                    "request's prior, else null")
    depth: int | None = Field(None, description="the first `depth` items are scored (depth control; "
                                                "with the pair cache, cached items past them too)")
    scored: list[bool] | None = Field(None, description="per item, whether it was scored (now or "
                                                       "from the pair cache)")
    cached: int = Field(0, description="items answered from the pair cache (--cache-size), not "
                                       "computed: usage counts only the others")
    labels: list[str] = Field(description="the label order (ours; not in SGLang's response)")
    model: str
    usage: Usage | None = None
    object: Literal["scoring"] = "scoring"


class Error(BaseModel):
    detail: str


ERRORS = {s: {"model": Error, "description": d} for s, d in [
    (400, "body is not UTF-8"), (401, "missing or wrong API key"),
    (404, "model or classifier not served (GET /v1/models lists them)"),
    (408, "headers or body not received in time"),
    (413, "body, query count, tokens or labels over the limit"), (422, "invalid request or query"),
    (429, "queue full: retry after Retry-After seconds"),
    (503, "engine fault, not ready, shutting down, or not started within --max-queue-ms")]}


# ---------------------------------------------------------------- other servers' shapes (compat.py)
# Requests ignore fields they do not know, as their peers do (vLLM's OpenAIBaseModel, TEI's serde,
# Infinity's pydantic models).

class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = model_field()
    classifier: str | None = Field(None, description="ours: the served classifier (GET /v1/models)")


class VllmClassifyRequest(Lenient):
    """vLLM's (and Infinity's) POST /classify: text only (no token ids, no chat messages)."""
    model_config = ConfigDict(json_schema_extra={"examples": [{"input": ["levis 501", "红色连衣裙"]}]})
    input: str | list[str]


class VllmClassifyData(BaseModel):
    index: int
    label: str = Field(description="the decision: greedy decoding constrained to the labels")
    probs: list[float] = Field(description="per label, in `labels` order: softmax over the labels")
    num_classes: int
    logprobs: list[float] = Field(description="ours: per label, log-softmax over the labels")


class VllmUsage(BaseModel):
    prompt_tokens: int = Field(description="whole prompts, the cached prefix included")
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: dict | None = Field(None, description="cached_tokens: not computed")


class VllmClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[VllmClassifyData]
    usage: VllmUsage
    labels: list[str] = Field(description="ours: the label order of probs and logprobs")


class HfParameters(BaseModel):
    """huggingface_hub's text-classification parameters."""
    top_k: int | None = Field(None, ge=1, description="the best k labels (default: all)")
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="softmax (default: over the labels), sigmoid or none (of the label's "
                          "log-probability)")


class TeiPredictRequest(Lenient):
    """TEI's POST /predict: one text, or a batch [[text], [text], ...]. A pair [text, text] (for a
    cross-encoder) is refused: the prompt has one text slot."""
    model_config = ConfigDict(json_schema_extra={"examples": [{"inputs": "levis 501"},
                                                              {"inputs": [["levis 501"], ["红色连衣裙"]]}]})
    inputs: str | list[str] | list[list[str]]
    raw_scores: bool = Field(False, description="score: the raw scores (log-probabilities, or logits "
                                                "in mode logits) instead of probabilities")
    truncate: bool | None = Field(None, description="accepted; the server's --truncate decides")
    parameters: HfParameters | None = Field(
        None, description="the Hugging Face Inference API's (huggingface_hub.InferenceClient sends "
                          "it): the answer is then a list of lists, as that API's")


class TeiPrediction(BaseModel):
    score: float = Field(description="probability (softmax over the labels), or raw with raw_scores")
    label: str
    logprob: float = Field(description="ours: log-softmax over the labels")


class RerankDocumentIn(BaseModel):
    """A document: {"text"}, or ours, an embedding item (ScoreRequest.items says the forms)."""
    text: str | None = None
    embedding: list[float] | str | None = None
    dtype: str | None = None
    id: str | int | None = None

    def item(self):
        """As a score request's item: the text, else the fields given."""
        given = self.model_dump(exclude_none=True)
        return self.text if set(given) == {"text"} else given


class RerankRequest(Lenient):
    """vLLM's /rerank (Jina's and Cohere's shape): documents are strings or {"text": ...}."""
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"query": "wool coat", "documents": ["a long camel coat", "flip flops"], "top_n": 1}]})
    query: str
    documents: list[str | RerankDocumentIn]
    top_n: int | None = Field(None, ge=0, description="the best n (0 or absent: all)")
    return_documents: bool = Field(True, description="false: results without the document")


class TeiRerankRequest(Lenient):
    """TEI's /rerank: `texts` for the documents; the answer is TEI's bare list, best first."""
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"query": "wool coat", "texts": ["a long camel coat", "flip flops"], "return_text": True}]})
    query: str
    texts: list[str]
    raw_scores: bool = Field(False, description="score: the log-probability instead of the probability")
    return_text: bool = Field(False, description="each result with its text")
    truncate: bool | None = Field(None, description="accepted; a request over the limits is refused")


def told_by(field: str, unless: str, cls, tag: str, default: str):
    """A discriminator for a route peers share: `tag` for a body that has `field` and not `unless`
    (or a `cls` already), else `default`."""
    def kind(v) -> str:
        if isinstance(v, dict):
            return tag if field in v and unless not in v else default
        return tag if isinstance(v, cls) else default
    return kind


AnyRerankRequest = Annotated[Union[Annotated[RerankRequest, Tag("cohere")],
                                   Annotated[TeiRerankRequest, Tag("tei")]],
                             Discriminator(told_by("texts", "documents", TeiRerankRequest, "tei", "cohere"))]


class RerankResult(BaseModel):
    index: int = Field(description="the document's position in the request")
    document: RerankDocumentIn | None = None
    relevance_score: float = Field(description="the probability of the scorer's first label (yes), "
                                               "softmax over its labels")
    logprob: float = Field(description="ours: the log of relevance_score")


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="best first")
    cached: int = Field(0, description="ours: documents answered from the pair cache (--cache-size)")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixscore"
    root: str
    parent: str | None = None
    max_model_len: int = Field(description="the prompt's token limit (the model's, less the longest "
                                           "label)")
    labels: list[str] = Field(description="ours: what the classifier chooses from")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VllmErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class VllmError(BaseModel):
    error: VllmErrorInfo


class TeiError(BaseModel):
    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


# -- vLLM's /score, and the shared routes' request unions (told apart by their fields)

class VllmScoreRequest(Lenient):
    """vLLM's /score and /v1/score: text_1 against text_2, 1:1, 1:N or N:N (newer vLLM names the
    sides queries and documents or items, or data_1 and data_2). A pair's score is the probability
    of the scorer's first label (yes), softmax over its labels."""
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"text_1": "wool coat", "text_2": ["a long camel coat", "flip flops"]}]})
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    priority: int = priority_field()

    def sides(self) -> tuple[list[str], list[str]] | None:
        """The two sides as lists (a text is a list of one); None without a whole pair."""
        for a, b in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                     ("data_1", "data_2")):
            one, two = getattr(self, a), getattr(self, b)
            if one is not None and two is not None:
                return _listed(one), _listed(two)
        return None


def _listed(v) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


VLLM_SCORE_FIELDS = ("text_1", "text_2", "queries", "documents", "data_1", "data_2")


def _score_kind(v) -> str:
    keys = v if isinstance(v, dict) else v.model_fields_set if isinstance(v, BaseModel) else ()
    return "vllm" if isinstance(v, VllmScoreRequest) or any(k in keys for k in VLLM_SCORE_FIELDS) \
        else "sglang"


AnyScoreRequest = Annotated[Union[Annotated[ScoreRequest, Tag("sglang")],
                                  Annotated[VllmScoreRequest, Tag("vllm")]], Discriminator(_score_kind)]
AnyClassifyRequest = Annotated[Union[Annotated[ClassifyRequest, Tag("ours")],
                                     Annotated[VllmClassifyRequest, Tag("vllm")]],
                               Discriminator(told_by("input", "query", VllmClassifyRequest, "vllm", "ours"))]


class VllmScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float | None = Field(description="null: not scored (past the depth, --target-p99-ms)")


class VllmScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[VllmScoreData] = Field(description="in pair order")
    usage: VllmUsage


class TeiInfo(BaseModel):
    """TEI's GET /info: a classifier's."""
    model_id: str
    model_sha: str | None = None
    model_dtype: str
    served_model_name: str
    model_type: dict = Field(description='{"classifier": {"id2label", "label2id"}}')
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None = None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None = None
    docker_label: str | None = None
