"""Python's cyclic garbage collector around work that makes many objects. A full collection scans
every tracked object of the process: the loaded model's Python objects and every result already
made. Over a million-row call they ran about thirty times, a third of the host's time, each pause
leaving the GPU idle (BENCHMARKS.md, "The CLI on a query log"). Results and rows make no
reference cycles, so pausing the collector for such a call frees nothing later than it would; a
streaming job still collects its young generations now and then (rows/stream.py, YOUNG_EVERY),
for the few cycles threads and generators leave (about 40 objects a chunk of the CLI)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """No cyclic collection inside (reference counting still frees what it always frees); the
    collector's state before is restored after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def settle() -> None:
    """After loading: collect once, then keep what start-up built out of every later collection
    (gc.freeze), as the server's processes do."""
    gc.collect()
    gc.freeze()
