"""The wire between front ends and an engine: msgspec structs, msgpack-encoded, no pickle.

Every message crossing a process boundary is declared here (as SGLang's io_struct.py does), and
`_check_names()` refuses at import a struct whose name does not say which way it travels
(`...Req` front end -> engine, `...Out` engine -> front end). Requests travel in batches: one
message carries every classify request a front end parsed in one event-loop pass, and one reply
carries a whole engine batch's answers for that front end, so a message costs microseconds per
batch, not per request. Token ids and scores travel as raw int32 / float32 bytes.
"""
from __future__ import annotations

import itertools

import msgspec
import numpy as np

from ..errors import PrefixScoreError

# Per-request status in a ClassifyOut; the front end turns them into HTTP/gRPC answers.
OK, EXPIRED, ABORTED, BAD_INPUT, FAULT = 0, 1, 2, 3, 4


class ProtocolError(PrefixScoreError):
    """A message that breaks the wire's rules (a front end of another version, or a bug): refused
    with what is wrong, never run."""


class HelloReq(msgspec.Struct, tag=True, array_like=True):
    """A front end asks for the engine's Ready (at start, and after the engine went away)."""
    client: int


class ClassifyReq(msgspec.Struct, tag=True, array_like=True):
    """Many tokenized classify requests. Request i's prompt is its classifier's first starts[i]
    prefix tokens (the pinned prefix, or none: 0), which are not sent, then
    ids[offsets[i]:offsets[i+1]] (int32), the tokens the engine computes: a front end packed the
    whole prompt, 5x the ids, for nothing (the seed prompt pins 73 tokens). deadlines are
    time.monotonic() values (one clock for every process of a host): a request still queued then
    is answered EXPIRED instead of being run (the earlier of its start-by time, --max-queue-ms, and
    its own deadline). classifiers[i]: the index (in ReadyOut.classifiers)
    of the classifier that runs request i; empty: all the default (0), so a server of one
    classifier sends nothing per request for it."""
    client: int
    rids: list[int]
    ids: bytes
    offsets: list[int]
    starts: list[int]
    deadlines: list[float]
    classifiers: list[int] = []
    priorities: list[int] = []  # per request: 0 real-time, higher batch work; empty: all 0
    # Per row, the rid of the first row of the client request it belongs to (a list of queries
    # is one request of many rows): once any of a request's rows has started, its start-by time
    # no longer applies to the others. Empty: each row a request of its own.
    groups: list[int] = []
    # Per row, its client's deadline (0: none), which still ends a started request's rows; empty:
    # none.
    finish_bys: list[float] = []
    # Per row, its client (X-Client-Id or address, hashed: frontend.tenant_of), whose rows take
    # turns with other clients' in a lane; empty: all one client.
    tenants: list[int] = []


class ScoreReq(msgspec.Struct, tag=True, array_like=True):
    """One multi-item scoring request (SGLang's /v1/score), checked and tokenized by the front end
    (score_input.ScoreInput, over ReadyOut.scorer): item i's whole prompt is
    ids[offsets[i]:offsets[i+1]] (int32 bytes, as ClassifyReq's), `shared` the tokens before the
    item slot (the query part the items may share; empty for token ids scored item first).
    labels / label_token_ids: the request's label set as it named it (checked), neither for the
    scorer's own: the engine keeps their head rows. apply_softmax: softmax over the labels, else
    each label token's probability under the whole vocabulary (SGLang's default). The engine
    runs it in passes of bounded cost, a run of items each, between other requests' passes."""
    client: int
    rid: int
    ids: bytes
    offsets: list[int]
    shared: bytes
    labels: list[str] | None
    label_token_ids: list[int] | None
    apply_softmax: bool
    deadline: float  # not started by then (--max-queue-ms, or finish_by if earlier): EXPIRED, unrun
    finish_by: float = 0.0  # the client's deadline: passes stop there (EXPIRED); 0: none
    priority: int = 0  # 0 real-time (depth control applies), higher: batch work in idle time
    sent: float = 0.0  # when the front end sent it (time.monotonic()): the latency depth control reads
    # Embedding items (score_input.SOFT in their ids, once each): their vectors in item order,
    # float32 [E, hidden] bytes; empty: text or token-id items only.
    soft: bytes = b""
    tenant: int = 0  # its client, as ClassifyReq.tenants


class AbortReq(msgspec.Struct, tag=True, array_like=True):
    """Requests whose clients left: dropped if not yet run."""
    client: int
    rids: list[int]


class ClassifierInfo(msgspec.Struct, array_like=True, kw_only=True):
    """One classifier of the engine, as a front end needs it to build its Prompt (over the
    tokenizer every classifier shares) and to name and answer it. Not a message: part of ReadyOut."""
    name: str
    template: str
    chat: bool
    special_tokens: bool
    labels: list[str]
    mode: str
    truncate: bool
    prefix_ids: list[int]
    context_limit: int  # of the prompt: the model's, less the longest label
    memory: dict[str, int]  # bytes it adds to the shared weights (Classifier.memory)
    adapter: str | None = None  # the LoRA adapter merged into the weights ("seed": the shipped one)


class ScorerInfo(msgspec.Struct, array_like=True, kw_only=True):
    """The engine's Scorer, as a front end needs it to check and tokenize score requests itself
    (its Prompt rebuilt over the shared tokenizer, checked against prefix_ids). Not a message:
    part of ReadyOut. template None: a scorer without a tokenizer (token ids only)."""
    template: str | None
    chat: bool
    special_tokens: bool
    labels: list[str]  # its own label set (a request that names none)
    item_first: bool  # the template's slot order
    prefix_ids: list[int]
    vocab_size: int
    context_limit: int  # of a prompt: the model's, less the scorer's longest label
    max_items: int
    hidden_size: int = 0  # an embedding item's size
    item_table: str | None = None  # the item table's path: each front end maps it (items by id)
    # The base weights' bytes when the scorer has a copy of its own (the classifiers' carry a
    # merged adapter: engine_proc.build); 0: it runs the classifiers' weights
    own_weight_bytes: int = 0


class ReadyOut(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """What only the engine knows, for the front ends (vLLM's EngineCoreReadyResponse).
    classifiers: every classifier over the one loaded model, the default first; a request names
    one by its index there."""
    model: str
    tokenizer_path: str
    classifiers: list[ClassifierInfo]
    max_batch_tokens: int
    scorer: ScorerInfo | None  # None: no /v1/score on this engine
    device: str
    pid: int
    dtype: str = ""  # the weights' (bfloat16, float32, float8_e4m3fn: TEI's /info model_dtype)


class ClassifyOut(msgspec.Struct, tag=True, array_like=True):
    """Answers of one engine batch for one front end: best[i] (label index) and scores rows
    [n, width] as float32 bytes (width: the most labels of any classifier; a classifier with
    fewer fills the first len(labels) columns), for rids[i] with status[i] OK; other statuses have a row of
    zeros and, for BAD_INPUT / FAULT, a message in errors."""
    rids: list[int]
    status: list[int]
    best: list[int]
    scores: bytes
    errors: dict[int, str]
    forward_s: float  # the engine call this batch took
    batch_size: int  # requests in the engine call
    queued: int  # requests still waiting in the engine after this batch was taken
    drain_rps: float = 0.0  # rows the engine answers per second while busy (0: not measured yet)


class ScoreOut(msgspec.Struct, tag=True, array_like=True):
    """The answer to one ScoreReq: per item a score per label, in the order of labels (the label
    set's names), and the prompt tokens computed (SGLang's usage); for BAD_INPUT / FAULT, a message
    in error and nothing else."""
    rid: int
    status: int
    scores: list[list[float]]  # per item scored; an item past the depth has an empty row
    labels: list[str]
    prompt_tokens: int  # the tokens the engine computed for it
    error: str | None
    depth: int = 0  # items scored: the first `depth`, the rest unscored (depth control)
    controlled: bool = False  # depth control decided the depth (a real-time request, a target)
    p99_ms: float = 0.0  # depth control's measured p99 of real-time score requests (0: none yet)
    run_s: float = 0.0  # from its first pass to its answer (other work's passes between included)


class ProgressOut(msgspec.Struct, tag=True, array_like=True):
    """After each pass of a score request that needs more: how far it got (passes run, and all it
    will take at the current pass budget: an estimate), so that its front end can say so at its
    deadline ("stopped after k of n passes") and /healthz can show the running request."""
    rid: int
    passes: int
    total: int
    items_done: int  # items scored so far
    filling: bool  # the last pass was a chunk of its query part


REQ = HelloReq | ClassifyReq | ScoreReq | AbortReq
OUT = ReadyOut | ClassifyOut | ScoreOut | ProgressOut


def _check_names() -> None:
    for union, end in ((REQ, "Req"), (OUT, "Out")):
        for t in union.__args__:
            if not t.__name__.endswith(end):
                raise ProtocolError(f"message {t.__name__} must be named ...{end} (its direction: "
                                    f"Req front end -> engine, Out engine -> front end)")


_check_names()
encoder = msgspec.msgpack.Encoder()
req_decoder = msgspec.msgpack.Decoder(REQ)
out_decoder = msgspec.msgpack.Decoder(OUT)


def pack_ids(ids_list: list[list[int]], starts: list[int] | None = None) -> tuple[bytes, list[int]]:
    """Many id lists (each from starts[i] on, if given) as one int32 byte string and its
    offsets (len + 1)."""
    if starts is not None:
        ids_list = [ids[s:] for ids, s in zip(ids_list, starts)]
    offsets = [0]
    for ids in ids_list:
        offsets.append(offsets[-1] + len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids_list), dtype=np.int32, count=offsets[-1])
    return flat.tobytes(), offsets


def unpack_ids(data: bytes, offsets: list[int]) -> list[list[int]]:
    flat = np.frombuffer(data, dtype=np.int32).tolist()
    return [flat[a:b] for a, b in zip(offsets, offsets[1:])]


def unpack_score(m: ScoreReq, vocab_size: int, hidden_size: int = 0):
    """A ScoreReq's (item prompts, shared ids, per item its soft vector or None / None for no
    embedding items), checked: the engine runs them as given, so ids out of the vocabulary or a
    malformed layout are refused (ProtocolError), not an engine fault."""
    from ..score_input import SOFT

    n = len(m.ids) // 4
    o = m.offsets
    if len(m.ids) % 4 or len(m.shared) % 4 or len(o) < 2 or o[0] != 0 or o[-1] != n or \
            any(a >= b for a, b in zip(o, o[1:])):
        raise ProtocolError(f"score request {m.rid}: ids ({len(m.ids)} bytes) and offsets "
                            f"{o[:4]}... do not describe int32 items of at least one token")
    flat = np.frombuffer(m.ids, dtype=np.int32)
    shared = np.frombuffer(m.shared, dtype=np.int32)
    at = np.flatnonzero(flat == SOFT) if m.soft else np.empty(0, np.int64)
    for a, low in ((flat, SOFT if m.soft else 0), (shared, 0)):
        if a.size and (int(a.min()) < low or int(a.max()) >= vocab_size):
            raise ProtocolError(f"score request {m.rid}: a token id outside this model's "
                                f"vocabulary (0 <= id < {vocab_size})")
    soft = None
    if m.soft:
        owner = np.searchsorted(np.asarray(o), at, side="right") - 1  # the item of each soft token
        E, H = len(at), hidden_size
        if not H or len(m.soft) != 4 * E * H or len(set(owner.tolist())) != E:
            raise ProtocolError(f"score request {m.rid}: {len(m.soft)} bytes of embeddings for {E} "
                                f"soft tokens of {H} values (one per embedding item)")
        import torch

        vectors = torch.from_numpy(np.frombuffer(m.soft, np.float32).reshape(E, H).copy())
        soft = [None] * (len(o) - 1)
        for i, v in zip(owner.tolist(), vectors):
            soft[i] = v
    flat = flat.tolist()
    return [flat[a:b] for a, b in zip(o, o[1:])], shared.tolist(), soft


# -- a Ready's parts, from the engine's Classifier and Scorer

def classifier_info(name: str, clf) -> ClassifierInfo:
    """What a front end needs of one classifier (its Prompt rebuilt over the shared tokenizer)."""
    prompt = clf.prompt
    return ClassifierInfo(
        name=name, template=prompt.template, chat=prompt.chat,
        special_tokens=getattr(prompt, "special_tokens", False), labels=list(clf.labels),
        mode=clf.mode, truncate=clf.truncate, prefix_ids=list(prompt.prefix_ids),
        context_limit=prompt.context_limit or 0, memory=dict(getattr(clf, "memory", None) or {}),
        adapter=_adapter_name(getattr(getattr(clf, "spec", None), "adapter", None)))


def _adapter_name(adapter) -> str | None:
    """How /healthz names a merged adapter: "seed", or its file's name."""
    import os

    return None if adapter is None else adapter if adapter == "seed" else os.path.basename(str(adapter))


def scorer_info(sc, clf) -> ScorerInfo | None:
    """What a front end needs of the Scorer to check and tokenize score requests itself
    (score_input.ScoreInput over its Prompt rebuilt from the template); clf: the default
    classifier, whose weights the scorer shares or not."""
    if sc is None:
        return None
    own = sc.engine is not clf.engine
    prompt, inp = sc.prompt, sc.input
    return ScorerInfo(
        template=None if prompt is None else prompt.template,
        chat=bool(prompt and prompt.chat), special_tokens=bool(prompt and prompt.special_tokens),
        labels=list(sc.labels), item_first=sc.item_first, prefix_ids=list(sc.prefix_ids),
        vocab_size=inp.vocab_size, context_limit=inp.context_limit, max_items=inp.max_items,
        hidden_size=inp.hidden_size or 0,
        item_table=None if getattr(sc, "item_table", None) is None else sc.item_table.path,
        own_weight_bytes=sc.engine.weight_bytes() if own else 0)
