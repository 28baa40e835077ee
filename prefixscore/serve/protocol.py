"""The wire between front ends and an engine: msgspec structs, msgpack-encoded, no pickle.

Every message crossing a process boundary is declared here (as SGLang's io_struct.py does), and
`_check_names()` refuses at import a struct whose name does not say which way it travels
(`...Req` front end -> engine, `...Out` engine -> front end). Requests travel in batches: one
message carries every classify request a front end parsed in one event-loop pass, and one reply
carries a whole engine batch's answers for that front end, so a message costs microseconds per
batch, not per request. Token ids and scores travel as raw int32 / float32 bytes.
"""
from __future__ import annotations

import msgspec
import numpy as np

# Per-request status in a ClassifyOut; the front end turns them into HTTP/gRPC answers.
OK, EXPIRED, ABORTED, BAD_INPUT, FAULT = 0, 1, 2, 3, 4


class HelloReq(msgspec.Struct, tag=True, array_like=True):
    """A front end asks for the engine's Ready (at start, and after the engine went away)."""
    client: int


class ClassifyReq(msgspec.Struct, tag=True, array_like=True):
    """Many tokenized classify requests. Request i is ids[offsets[i]:offsets[i+1]] (the whole
    prompt, int32), of which the engine computes ids[offsets[i] + starts[i]:]. deadlines are
    time.monotonic() values (one clock for every process of a host): a request still queued then
    is answered EXPIRED instead of being run. classifiers[i]: the index (in ReadyOut.classifiers)
    of the classifier that runs request i; empty: all the default (0), so a server of one
    classifier sends nothing per request for it."""
    client: int
    rids: list[int]
    ids: bytes
    offsets: list[int]
    starts: list[int]
    deadlines: list[float]
    classifiers: list[int] = []


class ScoreReq(msgspec.Struct, tag=True, array_like=True):
    """One multi-item scoring request in SGLang's /v1/score shape (a dict), run by the Scorer."""
    client: int
    rid: int
    request: dict
    deadline: float


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


class ReadyOut(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """What only the engine knows, for the front ends (vLLM's EngineCoreReadyResponse).
    classifiers: every classifier over the one loaded model, the default first; a request names
    one by its index there."""
    model: str
    tokenizer_path: str
    classifiers: list[ClassifierInfo]
    max_batch_tokens: int
    scorer: bool
    device: str
    pid: int


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


class ScoreOut(msgspec.Struct, tag=True, array_like=True):
    rid: int
    status: int
    result: dict | None
    error: str | None


REQ = HelloReq | ClassifyReq | ScoreReq | AbortReq
OUT = ReadyOut | ClassifyOut | ScoreOut


def _check_names() -> None:
    for t in REQ.__args__:
        assert t.__name__.endswith("Req"), t
    for t in OUT.__args__:
        assert t.__name__.endswith("Out"), t


_check_names()
encoder = msgspec.msgpack.Encoder()
req_decoder = msgspec.msgpack.Decoder(REQ)
out_decoder = msgspec.msgpack.Decoder(OUT)


def pack_ids(ids_list: list[list[int]]) -> tuple[bytes, list[int]]:
    """Many id lists as one int32 byte string and its offsets (len + 1)."""
    offsets = [0]
    for ids in ids_list:
        offsets.append(offsets[-1] + len(ids))
    flat = np.fromiter((i for ids in ids_list for i in ids), dtype=np.int32, count=offsets[-1])
    return flat.tobytes(), offsets


def unpack_ids(data: bytes, offsets: list[int]) -> list[list[int]]:
    flat = np.frombuffer(data, dtype=np.int32).tolist()
    return [flat[a:b] for a, b in zip(offsets, offsets[1:])]
