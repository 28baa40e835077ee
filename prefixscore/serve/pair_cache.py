"""PairCache: an LRU of answers bounded in entries and in bytes, with a TTL and hit/miss counts.

The server's result cache (`prefixscore serve --cache-size`): /v1/classify's answer per query and
/v1/score's per (query, item) pair. It sits on the request path (a 100-item score request is 100
lookups), so it is an OrderedDict and a few comparisons: a lookup costs about a microsecond plus
hashing its key (tests/serve/test_pair_cache.py measures it).

What a key must contain. A cached answer is served to any request whose key is equal, so a key
must hold everything the answer depends on, as values that are equal only when the answers are:

- the token ids the model sees (the whole prompt, template included): the normalized form of the
  text. Two texts that tokenize alike ("red dress" twice) share an entry; texts that differ in
  any id, whitespace included ("red dress" against "red  dress"), never do. Never the raw text:
  that would miss equal prompts and, worse, could not tell a template change apart;
- what else goes into the model: an embedding item's vector (a digest of its bytes and dtype),
  the weights (the model, the merged adapter), the prompt (template, its pinned prefix);
- what turns the model's outputs into the answer: the label set (as the request named it: label
  texts and label token ids are different sets), the normalization (apply_softmax), the mode;
- the route ("classify", "score"), so that two routes' answers never meet.

The served model, adapter and template are fixed per server, so the serve routes put a short
digest of them (serve/cache.py) in each key rather than the text itself: keys stay small, and
stay safe if what is served ever changes under a live cache. Keys must be hashable: tuples of
ints, strings, bytes, bools and None.

Bytes are approximate (sys.getsizeof of the key's and the value's parts, plus a fixed cost per
entry for the dict and its links; approx_bytes, or the caller's own count, which the serve routes
give from one count per request): the bound is on what the cache holds, to within tens of
percent, not an exact account of the process's memory.
"""
from __future__ import annotations

import sys
import time
from collections import OrderedDict

ENTRY_BYTES = 120  # per entry besides its key and value: the OrderedDict's slot and link, the record
_INT, _FLOAT = sys.getsizeof(100_000), sys.getsizeof(1.0)  # 28, 24 on CPython 64-bit
_size = sys.getsizeof


def approx_bytes(obj) -> int:
    """Approximate bytes of obj and what it holds. A tuple or list whose first and last elements
    are ints (floats) is taken for all ints (floats): token ids and score rows cost no Python loop.
    Small ints and other shared objects are counted as if owned."""
    t = type(obj)
    if t is tuple or t is list:
        n = _size(obj)
        if obj:
            first, last = type(obj[0]), type(obj[-1])
            if first is int and last is int:
                return n + _INT * len(obj)
            if first is float and last is float:
                return n + _FLOAT * len(obj)
            for x in obj:
                n += approx_bytes(x)
        return n
    if t is int:
        return _INT
    if t is float:
        return _FLOAT
    if obj is None or t is bool:
        return 0  # singletons
    if t is dict:
        return _size(obj) + sum(approx_bytes(k) + approx_bytes(v) for k, v in obj.items())
    return _size(obj)


class PairCache:
    """An LRU dict of key -> value, at most max_entries entries and about max_bytes bytes (the
    oldest used evicted until both hold), each entry expiring ttl seconds after it was stored
    (time.monotonic(); ttl 0: never). get() counts hits and misses (an expired entry is a miss)."""

    __slots__ = ("max_entries", "max_bytes", "ttl", "items", "bytes", "hits", "misses", "evictions")

    def __init__(self, max_entries: int, max_bytes: int, ttl: float = 0.0):
        if max_entries < 1 or max_bytes < 1 or not 0 <= ttl < float("inf"):
            raise ValueError(f"PairCache needs max_entries >= 1, max_bytes >= 1 and a finite ttl "
                             f">= 0, got {max_entries}, {max_bytes}, {ttl}")
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        self.items: OrderedDict = OrderedDict()  # key -> [expires, value, bytes]
        self.bytes = self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, key) -> bool:
        """Whether key holds an unexpired value; counts nothing and leaves the LRU order alone."""
        rec = self.items.get(key)
        return rec is not None and not (self.ttl and rec[0] < time.monotonic())

    def get(self, key, default=None):
        """The value stored under key (now the most recently used), else default."""
        rec = self.items.get(key)
        if rec is None:
            self.misses += 1
            return default
        if self.ttl and rec[0] < time.monotonic():
            self._drop(key)
            self.misses += 1
            return default
        self.items.move_to_end(key)
        self.hits += 1
        return rec[1]

    def put(self, key, value, nbytes: int | None = None) -> None:
        """Store value under key (replacing what it held), the most recently used; nbytes: the
        entry's size if the caller knows it, else approx_bytes(key) + approx_bytes(value). An entry
        larger than max_bytes alone is not stored."""
        size = ENTRY_BYTES + (approx_bytes(key) + approx_bytes(value) if nbytes is None else nbytes)
        items = self.items
        old = items.pop(key, None)
        if old is not None:
            self.bytes -= old[2]
        if size > self.max_bytes:
            return
        items[key] = [time.monotonic() + self.ttl if self.ttl else 0.0, value, size]
        self.bytes += size
        while len(items) > self.max_entries or self.bytes > self.max_bytes:
            _, rec = items.popitem(last=False)
            self.bytes -= rec[2]
            self.evictions += 1
        if self.ttl:  # expired entries at the old end go now rather than when evicted
            now = time.monotonic()
            while items:
                k, rec = next(iter(items.items()))
                if rec[0] >= now:
                    break
                self._drop(k)

    def _drop(self, key) -> None:
        rec = self.items.pop(key)
        self.bytes -= rec[2]

    def clear(self) -> None:
        self.items.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {"entries": len(self.items), "bytes": self.bytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}
