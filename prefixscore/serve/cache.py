"""A front end's pair cache (--cache-size, --cache-bytes, --cache-ttl): one PairCache
(pair_cache.py) shared by /v1/classify and /v1/score (and the routes answered through
them), and what each route keys it by.

    classify  ("classify", classifier identity, the prompt's token ids)
    score     ("score", scorer identity, label set, apply_softmax, the item's whole prompt's ids
              [, the embedding item's vector digest])

An identity is a 16-byte digest of everything the engine's Ready says about what answers: the
served model's name, the adapter merged into its weights, the template and its pinned prefix's
ids, the labels and mode (classify), the label set and slot order (score). A classifier's labels
and adapter are fixed per served classifier and the scorer's per server, so the digest stands for
them in every key: two classifiers never share an entry, nor do two servers' configurations in one
cache. The request's own choices (the label set it names, apply_softmax) are in the key as given.
Token ids include the template, and are compared exactly: whitespace that changes an id changes
the key, and only texts that tokenize to the same ids share an answer.
"""
from __future__ import annotations

import hashlib

from .pair_cache import PairCache, approx_bytes

CLASSIFY_IDS, SCORE_IDS = 2, 4  # where a key of each route holds its token ids


def new_cache(cfg) -> PairCache | None:
    """The front end's cache from its FrontendConfig (None: --cache-size 0, off)."""
    if cfg.cache_size <= 0:
        return None
    return PairCache(cfg.cache_size, cfg.cache_bytes, cfg.cache_ttl)


def digest(*parts) -> bytes:
    """A short stable digest of parts (repr of ints, strings, lists, tuples, bools, None)."""
    return hashlib.blake2b(repr(parts).encode("utf-8", "surrogatepass"), digest_size=16).digest()


def classifier_ids(info) -> list[bytes]:
    """Per classifier of a ReadyOut, in its order: its identity."""
    adapter = info.classifiers[0].adapter if info.classifiers else None
    return [digest("classify", info.model, c.name, c.template, c.chat, c.special_tokens,
                   tuple(c.labels), c.mode, c.truncate, tuple(c.prefix_ids), c.adapter or adapter)
            for c in info.classifiers]


def scorer_id(info) -> bytes | None:
    """The scorer's identity (None: no scorer). Its weights are the classifiers' model: the
    default classifier's adapter is merged into them."""
    s = info.scorer
    if s is None:
        return None
    adapter = info.classifiers[0].adapter if info.classifiers else None
    return digest("score", info.model, adapter, s.template, s.chat, s.special_tokens,
                  tuple(s.labels), s.item_first, tuple(s.prefix_ids), s.vocab_size)


def soft_digest(v) -> bytes:
    """An embedding item's vector as a key part: its dtype and its values' bytes (as float32)."""
    import torch

    data = v.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.blake2b(str(v.dtype).encode() + b"|" + data, digest_size=16).digest()


def score_keys(ident: bytes, call) -> list[tuple]:
    """Per item of a ScoreCall (score_input.py): its key. The label set as the request named it:
    ("text", names), ("ids", token ids) or None (the scorer's own)."""
    labels = (("text", tuple(call.labels)) if call.labels is not None else
              ("ids", tuple(call.label_token_ids)) if call.label_token_ids is not None else None)
    head = ("score", ident, labels, bool(call.apply_softmax))
    prep = call.prep
    soft = getattr(prep, "soft", None)
    if soft is None:
        return [(*head, tuple(f)) for f in prep.full]
    return [(*head, tuple(f)) if v is None else (*head, tuple(f), soft_digest(v))
            for f, v in zip(prep.full, soft)]


TEXT_AT = -1  # where a text key holds its item (store's ids_at)


def text_keys(ident: bytes, req: dict, items: list) -> list[tuple] | None:
    """Per item of a text request, a key by the request's own text: (ident, the fields that decide
    the answer as the client sent them, query, item). None for any other request (token ids,
    embedding items, labels not plain lists). Stored only after the request was checked and
    scored (score_keys' path), so a hit is a request already accepted, and the whole repeat of a
    text request is answered without tokenizing it again (tokenizing 100 items costs a real share
    of the request's engine time on a GPU). Texts that differ, in whitespace too,
    have different keys; the ids keys still join texts that tokenize alike."""
    query = req.get("query")
    if not isinstance(query, str) or not all(type(it) is str for it in items):
        return None
    named = []
    for k in ("labels", "label_token_ids"):
        v = req.get(k)
        if v is not None and not (isinstance(v, list) and all(type(x) in (str, int) for x in v)):
            return None
        named.append(None if v is None else tuple(v))
    # the flags as sent, by repr: 1 == True in a tuple, and 1 is refused where true is not
    head = ("score-text", ident, *named, repr(req.get("apply_softmax")), repr(req.get("item_first")),
            query)
    return [(*head, it) for it in items]


def lookup(cache: PairCache, metrics, keys: list, route: str) -> list:
    """Per key, its cached value or None; counted in the route's hit and miss metrics."""
    get = cache.get
    hits = [get(k) for k in keys]
    missed = hits.count(None)
    metrics.cache_lookups(len(hits) - missed, missed, route)
    return hits


def store(cache: PairCache, keys: list, values: list, ids_at: int) -> None:
    """Put values[i] under keys[i]: keys of one request that differ only in their token ids (at
    ids_at) and a digest, values of one shape. Sized from the first key and value (approx_bytes
    walks a key in microseconds; this costs one walk a request and a length an entry)."""
    if not keys:
        return
    k0 = keys[0]
    rest = approx_bytes(k0) - approx_bytes(k0[ids_at]) + approx_bytes(values[0])
    put, ids = cache.put, lambda k: approx_bytes(k[ids_at])
    for k, v in zip(keys, values):
        put(k, v, rest + ids(k))
