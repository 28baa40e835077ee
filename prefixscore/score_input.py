"""The request side of multi-item scoring: a score request's checks and its tokenization, no model.

A Scorer runs its requests through one (`Scorer.input`), and a server's front end through its own,
built from the engine's Ready over the front end's copy of the tokenizer (serve/catalog.py): a
/v1/score request is checked and tokenized once, in the front end, by the code the library runs,
and the engine gets token ids (serve/protocol.py ScoreReq). Only the label set stays the engine's
to tokenize (its head rows live there, a few label sets in an LRU): here its ids and names are
checked, not tokenized.

    inp = ScoreInput(prompt, item_first, vocab_size, context_limit, max_items)
    call = inp.parse({"query": ..., "items": [...], "labels": [...]})   # InputError if malformed
    scorer.score_call(call)                                              # the engine's half
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .errors import ConfigError, InputError
from .labels import check_labels
from .weights.tokenizer import common_prefix_len

SLOTS = ("query", "item")
# An embedding item's soft token, where Prepared.full holds it: not a vocabulary id, so it matches
# no text token (the query part an item shares ends before it) and no cache key of text.
SOFT = -1


@dataclass
class Prepared:
    """One request, tokenized."""
    items: list  # as given
    full: list[list[int]]  # per item, the whole prompt's tokens (what the model must see)
    shared: list[int]  # tokens of the text before the item slot: the candidate query part
    # Per item, the soft token's vector [hidden] (an embedding item: its `full` holds SOFT there)
    # or None (a text item); None for a request of text items only.
    soft: list | None = None

    def subset(self, idx: list[int]) -> "Prepared":
        """Items idx of this request, in that order (the query part is every item's)."""
        soft = None if self.soft is None else [self.soft[i] for i in idx]
        return Prepared([self.items[i] for i in idx], [self.full[i] for i in idx], self.shared, soft)


@dataclass
class ScoreCall:
    """A checked, tokenized score request (SGLang's /v1/score), ready for Scorer.score_call.
    labels / label_token_ids: the request's label set as it named it (checked), neither: the
    scorer's own."""
    query: str | list[int] | None  # as given (None in an engine: the front end's to read)
    prep: Prepared
    labels: list[str] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False


# An embedding item's vector in base64: the bytes of these dtypes (little-endian), float16 unless
# the item says otherwise.
B64_DTYPES = {"float16": (np.float16, None), "float32": (np.float32, None),
              "bfloat16": (np.uint16, "bfloat16")}


class SoftItem(NamedTuple):
    """An embedding item once checked: its vector (float32 [hidden]) and the item as given."""
    vector: torch.Tensor
    given: object


def item_vector(it, what: str, hidden_size: int | None, table=None, finite: bool = True):
    """An item given as an embedding -> its checked float32 vector; None for a text item (str or
    {"text": ...}). Forms: a 1-D torch tensor or numpy array; {"embedding": [numbers]};
    {"embedding": "<base64>", "dtype": "float16" | "bfloat16" | "float32"}; {"id": key} into the
    item table. InputError naming the item (`what`) for anything else. finite=False leaves the
    check for non-finite values to the caller (check_items: one check for all a request's)."""
    if isinstance(it, torch.Tensor):
        if it.ndim != 1 or not it.dtype.is_floating_point:
            raise InputError(f"{what}: an embedding item is a 1-D float vector, got "
                             f"{tuple(it.shape)} of {it.dtype}")
        v = it.detach().to("cpu", torch.float32)
    elif isinstance(it, np.ndarray):
        if it.ndim != 1 or it.dtype.kind != "f":
            raise InputError(f"{what}: an embedding item is a 1-D float vector, got "
                             f"{it.shape} of {it.dtype}")
        v = torch.from_numpy(it.astype(np.float32))
    elif isinstance(it, dict):
        keys = set(it)
        if keys == {"text"}:
            return None
        if keys == {"id"}:
            if table is None:
                raise InputError(f"{what}: an item by id needs an item table (Scorer(item_table=...), "
                                 f"serve --item-table)")
            v = table.get(it["id"], what).to(torch.float32)
        elif "embedding" in keys and keys <= {"embedding", "dtype"}:
            v = torch.from_numpy(_embedding(it["embedding"], it.get("dtype"), what))
        else:
            raise InputError(f"{what}: an item is a string, {{\"text\"}}, {{\"embedding\"}} (with an "
                             f"optional \"dtype\" for base64) or {{\"id\"}}; got keys "
                             f"{sorted(map(str, keys))}")
    else:
        return None
    if hidden_size is not None and v.shape[0] != hidden_size:
        raise InputError(f"{what}: the embedding has {v.shape[0]} values, the model's hidden size "
                         f"is {hidden_size}")
    if finite and not bool(torch.isfinite(v).all()):
        raise InputError(f"{what}: the embedding has a value that is not a finite number")
    return v


def _embedding(e, dtype, what: str) -> np.ndarray:
    """{"embedding": e, "dtype": dtype} -> float32 values (numpy: ~30 us less an item than torch)."""
    if isinstance(e, (str, bytes)):  # base64 (bytes: raw, from gRPC)
        name = "float16" if dtype is None else dtype
        if name not in B64_DTYPES:
            raise InputError(f"{what}: dtype {dtype!r}; use one of {', '.join(B64_DTYPES)}")
        if isinstance(e, str):
            try:
                raw = base64.b64decode(e, validate=True)
            except (binascii.Error, ValueError):
                raise InputError(f"{what}: the embedding is not valid base64") from None
        else:
            raw = e
        np_dtype, view = B64_DTYPES[name]
        size = np.dtype(np_dtype).itemsize
        if len(raw) % size:
            raise InputError(f"{what}: {len(raw)} bytes of base64 is not a whole number of "
                             f"{name} values ({size} bytes each)")
        a = np.frombuffer(raw, np.dtype(np_dtype).newbyteorder("<"))
        if view is not None:  # bfloat16: the high half of a float32
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)
    if dtype is not None:
        raise InputError(f"{what}: dtype is for base64 embeddings; a list of numbers needs none")
    a = np.array(e) if isinstance(e, (list, tuple)) and e else None
    if a is None or a.ndim != 1 or a.dtype.kind not in "fi":  # (strings, bools, nesting: refused)
        raise InputError(f"{what}: the embedding must be a non-empty list of numbers or a base64 string")
    return a.astype(np.float32)


def check_token_ids(ids, what: str, vocab_size: int, err=InputError) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise err(f"{what} must be a list of token ids")
    V = vocab_size
    # C-speed checks first (a request carries ~10^4 ids); find the culprit only on failure
    if ids and (not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) >= V):
        bad = next(i for i in ids if type(i) is not int or not 0 <= i < V)
        raise err(f"{what}: {bad!r} is not a token id of this model (0 <= id < {V})")
    return list(ids)


def label_key(labels, label_token_ids, vocab_size: int, err) -> tuple:
    """A label set's key, ("ids", ids) or ("text", labels), once its ids or names are checked."""
    if label_token_ids is not None:
        ids = check_token_ids(label_token_ids, "label_token_ids", vocab_size, err)
        if not ids:
            raise err("label_token_ids is empty: give at least one token id")
        if len(set(ids)) != len(ids):
            raise err(f"label_token_ids has duplicates: {ids}")
        return ("ids", tuple(ids))
    try:
        return ("text", tuple(check_labels(labels)))
    except ConfigError as e:
        raise err(str(e)) from None


class ScoreInput:
    def __init__(self, prompt, item_first: bool, vocab_size: int, context_limit: int, max_items: int,
                 hidden_size: int | None = None, table=None):
        """prompt: the template's Prompt (slots SLOTS), None for a model without a tokenizer (token
        ids only); item_first: the template's slot order; context_limit: of a prompt, the model's
        less the scorer's longest label; hidden_size: an embedding item's size (None: unchecked);
        table: an item_table.ItemTable for items given by id."""
        self.prompt, self.item_first, self.vocab_size = prompt, item_first, vocab_size
        self.context_limit, self.max_items = context_limit, max_items
        self.hidden_size, self.table = hidden_size, table
        self._blank = None  # (ids before the item slot, ids of the whole prompt) with empty slots

    def parse(self, req: dict, fits: bool = True) -> ScoreCall:
        """SGLang's /v1/score request {"query", "items", "label_token_ids" | "labels",
        "apply_softmax", "item_first"} checked and tokenized, as Scorer.score_request documents it.
        fits=False leaves the context-limit check to the caller (checked()), so that a server can
        refuse a request over its own token limit first."""
        if not isinstance(req, dict):
            raise InputError("a score request is a JSON object with query and items")
        query, items = req.get("query"), req.get("items")
        if isinstance(items, str):  # SGLang accepts one item as a bare string
            items = [items]
        for k in ("apply_softmax", "item_first"):
            if k in req and not isinstance(req[k], bool):
                raise InputError(f"{k} must be true or false, got {req[k]!r}")
        labels, ids = req.get("labels"), req.get("label_token_ids")
        if labels is not None and ids is not None:
            raise InputError("give labels or label_token_ids, not both")
        by_ids = isinstance(query, (list, tuple))
        item_first = req.get("item_first", False if by_ids else self.item_first)
        if not by_ids and item_first != self.item_first:
            order = "item first" if self.item_first else "query first"
            raise InputError(f"item_first={str(item_first).lower()}, but this scorer's template puts "
                             f"the {order}: the template decides where each slot goes (use a "
                             f"template with the other order, or token ids)")
        if labels is not None or ids is not None:  # tokenized (and checked further) by the engine
            kind, key = label_key(labels, ids, self.vocab_size, InputError)
            labels, ids = (list(key), None) if kind == "text" else (None, list(key))
        prep = self.prepare_ids(query, items, item_first, fits) if by_ids else \
            self.prepare(query, items, fits)
        return ScoreCall(query, prep, labels, ids, req.get("apply_softmax", False))

    # ---- checks

    def check_token_ids(self, ids, what: str, err=InputError) -> list[int]:
        return check_token_ids(ids, what, self.vocab_size, err)

    def check_items(self, items, text: bool) -> list:
        if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
            raise InputError(f"items must be a list of {'strings' if text else 'token id lists'}")
        if not items:
            raise InputError("no items: give at least one item to score")
        if len(items) > self.max_items:
            raise InputError(f"{len(items)} items in one request, over the limit of {self.max_items}; "
                             f"split the request (or raise max_items)")
        out, soft = list(items), {}
        for i, it in enumerate(items):
            if not text:
                if not self.check_token_ids(it, f"items[{i}]"):
                    raise InputError(f"items[{i}] is empty")
                continue
            if isinstance(it, SoftItem):  # checked before (score_batch checks, then prepares)
                continue
            v = None if isinstance(it, str) else \
                item_vector(it, f"items[{i}]", self.hidden_size, self.table, finite=False)
            if v is not None:
                out[i] = soft[i] = SoftItem(v, it)
                continue
            t = it["text"] if isinstance(it, dict) else it
            if not isinstance(t, str):
                raise InputError(f"items[{i}] must be a string or an embedding item, got {type(it).__name__}")
            if not t.strip():
                raise InputError(f"items[{i}] is empty")
        # one check for all (numpy: single-threaded; torch's parallel ops on a busy host cost ms)
        if soft and not np.isfinite(np.stack([x.vector.numpy() for x in soft.values()])).all():
            i = next(i for i, x in soft.items() if not bool(torch.isfinite(x.vector).all()))
            raise InputError(f"items[{i}]: the embedding has a value that is not a finite number")
        return out

    def check_text(self, query, items) -> list:
        """The checks of a text request that need no tokenizer call -> items as a list."""
        if self.prompt is None:
            raise ConfigError("this scorer has no tokenizer: score token ids with score_ids")
        if not isinstance(query, str):
            raise InputError(f"query must be a string, got {type(query).__name__}")
        if not query.strip():
            raise InputError("empty query")
        return self.check_items(items, text=True)

    def checked(self, prep: Prepared) -> Prepared:
        """prep, if every item's whole prompt leaves room for the labels in the context."""
        limit = self.context_limit
        for i, ids in enumerate(prep.full):
            if len(ids) > limit:
                it = prep.items[i]
                size = (f"{len(_text(it))} characters" if isinstance(it, (str, dict)) and
                        (prep.soft is None or prep.soft[i] is None) else
                        "an embedding" if prep.soft is not None and prep.soft[i] is not None else
                        f"{len(it)} tokens")
                raise InputError(f"items[{i}]: the prompt is {len(ids)} tokens, over the model's "
                                 f"context limit of {limit} tokens (the item is {size}); shorten it")
        return prep

    # ---- tokenization

    def prepare(self, query: str, items, fits: bool = True) -> Prepared:
        """Tokenize a text request: each item's whole prompt (one batched tokenizer call), and the
        prompt before the item slot (the query and the item are plain text unless the prompt
        parses special tokens)."""
        items = self.check_text(query, items)
        texts = [i for i, it in enumerate(items) if not isinstance(it, SoftItem)]
        full = self.prompt.encode_ids([{"query": query, "item": _text(items[i])} for i in texts])
        shared = self.prompt.encode_before("item", query=query)
        soft = None
        if len(texts) < len(items):  # embedding items: [before the slot][soft token][after it]
            soft_ids = shared + [SOFT] + self.prompt.encode_after("item", query=query)
            by_text = dict(zip(texts, full))
            full = [by_text[i] if i in by_text else soft_ids for i in range(len(items))]
            soft = [it.vector if isinstance(it, SoftItem) else None for it in items]
            items = [it.given if isinstance(it, SoftItem) else it for it in items]
        prep = Prepared(items, full, shared, soft)
        return self.checked(prep) if fits else prep

    def prepare_ids(self, query_ids, items_ids, item_first: bool = False, fits: bool = True) -> Prepared:
        """Token sequences as given: query + item per item (item + query with item_first)."""
        q = self.check_token_ids(query_ids, "query")
        if not q:
            raise InputError("empty query")
        items = self.check_items(items_ids, text=False)
        full = [list(it) + q if item_first else q + list(it) for it in items]
        prep = Prepared(items, full, [] if item_first else q)
        return self.checked(prep) if fits else prep

    def template_tokens(self) -> tuple[int, int]:
        """The template's own tokens (its slots empty): before the item slot, and in all; counted
        once (a server's front end does it at start-up, not in its first request)."""
        if self._blank is None:
            self._blank = (len(self.prompt.encode_before("item", query="")),
                           len(self.prompt.encode_ids([{"query": "", "item": ""}])[0]))
        return self._blank

    @staticmethod
    def new_tokens(prep: Prepared, prefix_ids: list[int]) -> int:
        """The tokens an engine computes for prep with its items in one span (a server's cost
        limit, --max-score-tokens, and what usage.prompt_tokens reports on a GPU): past the pinned
        prefix, the part before the item slot once, then each item's own tokens. The CPU's smaller
        spans compute the shared part once per span, and usage says so."""
        shared = prep.shared
        P = common_prefix_len(prefix_ids, shared if shared else prep.full[0] if prep.full else [])
        own = max(len(shared), P)
        return max(0, len(shared) - P) + sum(max(0, len(f) - own) for f in prep.full)


def _text(item) -> str:
    return item["text"] if isinstance(item, dict) else item
