"""Host work overlapped with the engine (DESIGN.md §7): the batch APIs tokenize on one worker thread
while the engine runs, in spans of queries that start small (the engine starts early) and double
up to a cap (what is held ahead stays bounded); on a GPU they plan and launch the next pass while
the one before runs (passes_in_order); and long calls pause the cyclic garbage collector
(collector_paused), whose full scans of every result held up the engine."""
from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

# The batch APIs tokenize on a worker thread while the engine runs (DESIGN.md §7): the Rust tokenizer
# releases the GIL, and so does the host's wait for the GPU. Queries per tokenizer call: the first
# call small, so the engine starts early, then doubling up to a cap (what is held ahead is bounded).
TOKENIZE_FIRST, TOKENIZE_MAX = 32, 512
TOKENIZE_AHEAD = 4  # tokenizer calls queued behind the one the engine waits for
# While a tokenizer thread runs, the interpreter hands the GIL over within this (default: 5 ms). The
# engine's thread lets the GIL go around every CUDA call, hundreds per eager batch, and waited a
# whole interval each time to get it back from the tokenizer's Python: text in now runs closer
# to ids in (BENCHMARKS.md, text in against ids in); 5 us had outliers.
# None leaves the interpreter's setting alone.
SWITCH_INTERVAL = 2e-5


def doubling_spans(sizes, first: int, cap: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of consecutive items with the given sizes: a range closes once its size
    reaches its target, which is `first` for the first range and doubles up to `cap`."""
    spans, lo, total, target, n = [], 0, 0, first, 0
    for n, size in enumerate(sizes, 1):
        total += size
        if total >= target:
            spans.append((lo, n))
            lo, total, target = n, 0, min(2 * target, cap)
    return spans + [(lo, n)] if lo < n else spans


def run_ahead(fn, spans, depth: int = TOKENIZE_AHEAD):
    """fn(lo, hi) for each span, in order, computed on one worker thread up to `depth` spans before
    the caller takes it, so the caller's engine work overlaps the tokenizer (with a short switch
    interval meanwhile: quick_gil_handoff). An exception in fn is raised where the caller takes
    that span. A generator: closing it (the caller stopped early or raised) cancels the calls not
    started and waits for the one running (a few ms at most), so the thread never outlives it. fn
    must not share the tokenizer with the caller's thread meanwhile: the HF call sets state on it
    per call."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="prefixscore-tokenize")
    try:
        with quick_gil_handoff():
            todo = deque()
            for span in spans:
                todo.append(pool.submit(fn, *span))
                if len(todo) > depth:
                    yield todo.popleft().result()
            while todo:
                yield todo.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def passes_in_order(batches, launch, answer, ahead: bool, progress=None):
    """Run each batch of (index, item) pairs and yield the results in index order, as passes
    complete them. launch(batch) queues the batch's pass and returns finish(), which waits for it;
    answer(batch, finish()) -> its (index, result) pairs. ahead (a GPU, where a launch returns
    before its pass has run): the next batch is planned, copied and launched before the one in
    flight is collected, so the GPU does not wait on the host between passes. Otherwise (a CPU,
    where a launch computes) each batch is answered before the next is planned: a stop between
    passes waits for one pass, not two. A batch the stream fails to make (a query only the
    tokenizer can fault) raises after the passes before it are answered."""
    done, ready, pending = {}, 0, None

    def complete(batch, finish):
        nonlocal ready
        done.update(answer(batch, finish()))
        if progress is not None:
            progress(len(batch))
        out = []
        while ready in done:
            out.append(done.pop(ready))
            ready += 1
        return out

    batches = iter(batches)
    while True:
        try:
            batch = next(batches, None)
        except Exception:
            if pending is not None and (out := complete(*pending)):
                yield out
            raise
        if batch is None:
            break
        launched = batch, launch(batch)
        if pending is not None and (out := complete(*pending)):
            yield out
        pending = launched
        if not ahead:  # a CPU pass has run by now: answer it before the next is planned
            out, pending = complete(*pending), None
            if out:
                yield out
    if pending is not None and (out := complete(*pending)):
        yield out


class _Switch:
    """How many quick_gil_handoff blocks are open, and the interval to restore after the last."""
    lock, open, saved = threading.Lock(), 0, 0.0


@contextlib.contextmanager
def quick_gil_handoff():
    """sys.setswitchinterval(SWITCH_INTERVAL) inside (see there), restored after: the setting is
    the process's, so overlapping blocks (streams on several threads) count, and the last one out
    restores what was there before the first."""
    if SWITCH_INTERVAL is None:
        yield
        return
    with _Switch.lock:
        if _Switch.open == 0:
            _Switch.saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_Switch.saved, SWITCH_INTERVAL))
        _Switch.open += 1
    try:
        yield
    finally:
        with _Switch.lock:
            _Switch.open -= 1
            if _Switch.open == 0:
                sys.setswitchinterval(_Switch.saved)


# A full collection scans every tracked object of the process: the loaded model's Python objects
# and every result already made. Over a million-row call they ran about thirty times, a third of
# the host's time, each pause leaving the GPU idle (BENCHMARKS.md, "The CLI on a query log").
# Results and rows make no reference cycles, so pausing the collector for such a call frees
# nothing later than it would; a streaming job still collects its young generations now and then
# (rows/stream.py, YOUNG_EVERY) for the few cycles threads and generators leave.
@contextlib.contextmanager
def collector_paused():
    """No cyclic collection inside (reference counting still frees what it always frees); the
    collector's state before is restored after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def settle_collector() -> None:
    """After loading: collect once, then keep what start-up built out of every later collection
    (gc.freeze), as the server's processes do."""
    gc.collect()
    gc.freeze()
