"""PairCache (prefixscore/serve/pair_cache.py): its bounds in entries and bytes, TTL, LRU order, hit and
miss counts, and the cost of a lookup on the request path. No model."""
import time

import pytest

from prefixscore.serve.pair_cache import ENTRY_BYTES, PairCache, approx_bytes


def test_entries_bound_evicts_least_recently_used():
    c = PairCache(3, 1 << 30)
    for k in "abc":
        c.put(k, k.upper())
    assert c.get("a") == "A"  # a is now the most recently used: b is the oldest
    c.put("d", "D")
    assert len(c) == 3 and "b" not in c and all(k in c for k in "acd")
    assert c.evictions == 1
    c.put("c", "C2")  # replacing keeps the count and makes c the newest
    c.put("e", "E")
    assert "a" not in c and c.get("c") == "C2" and len(c) == 3


def test_bytes_bound():
    size = ENTRY_BYTES + 100
    c = PairCache(1000, 3 * size)
    for i in range(5):
        c.put(i, None, nbytes=100)
        assert c.bytes <= c.max_bytes
    assert len(c) == 3 and c.bytes == 3 * size and [k for k in c.items] == [2, 3, 4]
    c.put("big", None, nbytes=10 * size)  # larger than the whole cache: not stored, nothing evicted
    assert "big" not in c and len(c) == 3
    c.put(3, None, nbytes=2 * size - ENTRY_BYTES)  # a bigger value under a key: evicts the oldest
    assert c.bytes <= c.max_bytes and 2 not in c and 3 in c
    # sized by approx_bytes when the caller gives no size: longer keys cost more
    d = PairCache(1000, 1 << 30)
    d.put(("score", tuple(range(10))), [0.5, 0.5])
    small = d.bytes
    d.put(("score", tuple(range(1000, 1100))), [0.5, 0.5])
    assert d.bytes - small > small and d.bytes == sum(r[2] for r in d.items.values())
    d.clear()
    assert len(d) == 0 and d.bytes == 0


def test_bytes_estimate():
    ids = tuple(range(1000, 1064))
    assert approx_bytes(ids) >= 64 * 28 + 64 * 8  # each int object and its slot
    assert approx_bytes([0.25] * 3) > approx_bytes([0.25])
    key = ("score", b"\0" * 16, ("text", ("yes", "no")), True, ids)
    assert approx_bytes(key) > approx_bytes(ids) + approx_bytes(("yes", "no"))
    assert approx_bytes(None) == approx_bytes(True) == 0


def test_ttl(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    c = PairCache(10, 1 << 20, ttl=5.0)
    c.put("a", 1)
    now[0] += 4.9
    assert c.get("a") == 1  # a hit does not extend its life
    c.put("b", 2)
    now[0] += 0.2
    assert c.get("a") is None and "a" not in c.items and c.get("b") == 2
    assert (c.hits, c.misses) == (2, 1)
    now[0] += 10
    c.put("c", 3)  # expired entries at the old end go when something is stored
    assert list(c.items) == ["c"] and c.bytes == c.items["c"][2]
    forever = PairCache(10, 1 << 20, ttl=0)
    forever.put("a", 1)
    now[0] += 1e9
    assert forever.get("a") == 1


def test_hit_miss_counts():
    c = PairCache(10, 1 << 20)
    assert c.get(("x",)) is None and c.get(("x",), "dflt") == "dflt"
    c.put(("x",), 0.0)
    assert c.get(("x",)) == 0.0  # a falsy value is a hit
    assert ("x",) in c and ("y",) not in c  # `in` counts nothing
    assert (c.hits, c.misses) == (1, 2)
    assert c.stats() == {"entries": 1, "bytes": c.bytes, "hits": 1, "misses": 2, "evictions": 0}


@pytest.mark.parametrize("args", [(0, 10, 0), (10, 0, 0), (10, 10, -1), (10, 10, float("inf"))])
def test_bad_bounds(args):
    with pytest.raises(ValueError):
        PairCache(*args)


def test_lookup_costs_microseconds():
    """A 100-item score request is 100 lookups: each, key hashing included (a 60-token prompt's
    ids), costs a few microseconds at most (about 1 on a 2-core CI host)."""
    c = PairCache(10_000, 1 << 30, ttl=60)
    ident = b"\1" * 16
    keys = [("score", ident, None, False, tuple(range(1000 + i, 1060 + i))) for i in range(100)]
    for k in keys[:50]:
        c.put(k, (("yes", "no"), (0.9, 0.1)))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20):
            for k in keys:
                c.get(k)
        best = min(best, (time.perf_counter() - t) / 2000)
    assert best < 10e-6, f"{best * 1e6:.2f} us a lookup"
