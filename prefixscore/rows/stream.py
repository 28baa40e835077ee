"""`prefixscore classify` over inputs of any size (issue 21). Rows are read lazily and classified a
chunk at a time; while the engine runs chunk k, a worker thread reads and tokenizes chunk k+1
(overlap.run_ahead); each chunk's rows are written and flushed as it finishes, on a writer
thread while the engine runs chunk k+1, so memory is flat in the input's length. SIGINT/SIGTERM
stop at the engine's next pass (the chunk in flight is dropped, a second signal ends the process
at once); --resume continues the output file.

Where chunks end (resume.chunk_ends) is a function of the row number alone, never of timing: the
engine rounds a row's scores by the flat batch it runs in, so a resumed run must cut the input
exactly where the first run did to write the same bytes."""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import InputError
from .io import Row, RowReader
from .progress import EVERY, Pace, duration
from .writer import check_output, output_format
from ..overlap import run_ahead
from .resume import CHUNK_ROWS, check_meta, chunk_ends, scan_output, verified, write_meta
from .writer import ResultWriter, RowFormat

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    rows: list[Row]
    encoded: list  # Encoded of the rows without an error, in order
    pos: int  # input bytes up to its last row's end


def encode_rows(clf, rows: list[Row], strict: bool, where) -> list:
    """Tokenize the rows that have a query. One the tokenizer refuses (over the context limit, without
    truncation) becomes an error row; with `strict`, the first bad row of either kind is an
    InputError naming its line."""
    first_bad = next((i for i, r in enumerate(rows) if r.error), len(rows)) if strict else len(rows)
    todo, out = [r for r in rows[:first_bad] if r.error is None], []
    while todo:
        try:
            out += clf.encode_many([r.query for r in todo])
            break
        except InputError as e:
            i = getattr(e, "index", None)
            if i is None:
                raise
            if strict:
                raise InputError(f"{where(todo[i])}: {e}") from None
            out += clf.encode_many([r.query for r in todo[:i]]) if i else []
            _clip(todo[i])
            todo[i].query, todo[i].error = None, str(e)
            todo = todo[i + 1:]
    if first_bad < len(rows):
        raise InputError(f"{where(rows[first_bad])}: {rows[first_bad].error}")
    return out


ECHO = 300  # characters of a refused query that its error row echoes


def _clip(row: Row) -> None:
    """A refused query's echo in its error row: its first ECHO characters and its length (a 50 MB
    line was written out whole)."""
    for k, v in row.fields.items():
        if v == row.query and isinstance(v, str) and len(v) > ECHO:
            row.fields[k] = f"{v[:ECHO]}... ({len(v)} characters)"


def tokenized_chunks(clf, rows, reader: RowReader, chunk_rows: int, strict: bool, start: int = 0):
    """Chunks of the rows after row `start` (a chunk's end), each read and tokenized on a worker
    thread one chunk ahead of the caller."""
    rows = iter(rows)

    def next_chunk(size):  # on the worker; run_ahead calls it in order, one at a time
        batch = list(itertools.islice(rows, size))
        return Chunk(batch, encode_rows(clf, batch, strict, reader.where), batch[-1].end) if batch else None

    ends = (end for end in chunk_ends(chunk_rows) if end > start)
    sizes = ((b - a,) for a, b in itertools.pairwise(itertools.chain([start], ends)))
    with contextlib.closing(run_ahead(next_chunk, sizes, depth=1)) as chunks:
        for chunk in chunks:
            if chunk is None:
                return
            yield chunk


class Progress:
    """Rows done, on stderr, after each engine pass (per chunk, lines came 11-48 s apart on a CPU):
    a tqdm bar on a terminal, else a line every `every` seconds (rows, rows/s, and the share done
    with an ETA when the input's size or row count is known: the bytes of the rows done over a
    file's size). Never backwards: a chunk's write is confirmed after the next chunk's passes
    reported."""

    def __init__(self, reader: RowReader, start: int = 0, stream=None, every: float = EVERY,
                 clock=time.monotonic, quiet: bool = False, pos: int | None = None):
        """start: rows done before this run (a resume's kept rows), pos: their input bytes (the
        reader has read past them)."""
        self.reader, self.start, self.every, self.clock = reader, start, every, clock
        self.stream = sys.stderr if stream is None else stream
        self.t0 = self.last = clock()
        # the share done when this run started, which the ETA's rate leaves out
        self.f0 = 0.0 if start == 0 else self._fraction(start, reader.pos if pos is None else pos)
        self.rows, self.pos = start, 0  # the most reported: never backwards
        self.pace = Pace(self.t0, self.f0)
        self.bar, self.quiet = None, quiet
        if self.stream.isatty() and not quiet:
            from tqdm import tqdm

            self.bar = tqdm(initial=start, unit="row", file=self.stream, desc="classify", delay=1.0)

    def _fraction(self, rows: int, pos: int):
        if self.reader.size:
            return pos / self.reader.size
        return rows / self.reader.total if self.reader.total else None

    def update(self, rows: int, errors: int, pos: int) -> None:
        self.rows, self.pos = rows, pos = max(rows, self.rows), max(pos, self.pos)
        f, now = self._fraction(rows, pos), self.clock()
        if self.bar is not None:
            if f:
                self.bar.total = max(rows, round(rows / f))  # an estimate where the input is a file
            self.bar.update(rows - self.bar.n)
            return
        if self.quiet or now - self.last < self.every:
            return
        self.last, secs = now, now - self.t0
        rate = (rows - self.start) / secs if secs > 0 else 0.0
        line = f"classify: {rows} rows ({errors} errors), {rate:.0f} rows/s"
        if f is not None and f > self.f0:
            line += f", {100 * f:.0f}%, ETA {duration(self.pace.eta(now, f))}"
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StopSignals:
    """While rows stream, the first SIGINT or SIGTERM asks to stop (`signum`) at the engine's next
    pass boundary: the chunk in flight is dropped unless that pass completed it, what was written
    is closed, and --resume redoes the chunk (a 4,096-row chunk made the first Ctrl-C wait 15-94 s
    on a CPU). A second ends the process at once (a second SIGINT unwound through the chunk's
    passes for another 40 s): --resume redoes what it tears. Handlers can only be set on the main
    thread; elsewhere the defaults stay."""

    def __init__(self):
        self.signum, self.saved = None, {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        self.__exit__()
        sys.stderr.write(f"prefixscore: stopped at once by a second {signal.Signals(signum).name}; "
                         f"--resume redoes the chunk it tore\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        while self.saved:
            signal.signal(*self.saved.popitem())


class ClassifyJob:
    """One `prefixscore classify` run. The constructor runs before the model loads: options are
    checked, the input opened and its first chunk read (a strict error there fails fast), and an
    output to resume checked against the options known so far; run() then classifies."""

    def __init__(self, reader: RowReader, output: str | None, fmt: str = "auto", keep="all",
                 chunk_rows: int = CHUNK_ROWS, resume: bool = False, strict: bool = False,
                 flags: dict | None = None, quiet: bool = False):
        if chunk_rows < 1:
            raise InputError(f"--chunk-rows must be at least 1, got {chunk_rows}")
        if resume and output in (None, "-"):
            raise InputError("--resume continues an output file: give it with -o")
        self.fmt = output_format(output, fmt)
        if self.fmt == "parquet":
            from .parquet import check_parquet_output

            check_parquet_output(output, resume)
        if keep not in ("all", "none") and reader.columns is not None:
            missing = [c for c in keep if c not in reader.columns]
            if missing:
                raise InputError(f"--keep-columns: the input has no column {missing[0]!r} (columns: "
                                 f"{', '.join(reader.columns)})")
        if keep != "all":
            reader.read_only([] if keep == "none" else keep)
        self.reader, self.output, self.keep, self.chunk_rows = reader, output, keep, chunk_rows
        self.resume, self.strict, self.quiet = resume, strict, quiet
        check_output(output)  # a bad path must fail now, not after the whole run
        is_file = reader.size is not None or reader.fmt == "parquet"
        if is_file and output not in (None, "-") and os.path.exists(output) \
                and os.path.samefile(reader.name, output):  # streaming: writing would erase it
            raise InputError(f"the output file {output} is the input file: write to another file")
        # The sidecar is for a regular output file: resuming into a device or a pipe means nothing,
        # and a Parquet file cannot be resumed (check_parquet_output).
        self.regular = output not in (None, "-") and (not os.path.exists(output) or os.path.isfile(output))
        self.resumable = self.regular and self.fmt != "parquet"
        if resume and not self.regular:
            raise InputError(f"--resume continues a regular file, and {output} is not one")
        self.resuming = resume and os.path.exists(output)
        src = "arguments" if reader.fmt == "args" else "-" if reader.name == "<stdin>" else \
            os.path.abspath(reader.name)
        self.options = {"input": src, "input_format": reader.fmt, "column": reader.column,
                        "keep_columns": keep, "format": self.fmt, "chunk_rows": chunk_rows} | (flags or {})
        if self.resuming:
            check_meta(output, self.options)
        self.rows = iter(reader)
        first = list(itertools.islice(self.rows, chunk_rows))
        if strict:
            bad = next((r for r in first if r.error), None)
            if bad is not None:
                raise InputError(f"{reader.where(bad)}: {bad.error}")
        self.rows = itertools.chain(first, self.rows)

    def run(self, clf, model: dict, err=None, warn=None) -> int:
        """Classify every row not yet written; -> the exit status (128 + the signal's number when
        one stopped it). err: info lines; warn: the line that says where a stop left the output."""
        self.options |= model | {"labels": clf.labels}
        form = RowFormat(self.fmt, clf.labels, self.reader.column, self.keep, self.reader.columns,
                         self.options.get("probs", False), self.options.get("top_k"))
        done, keep_bytes, chunks, read = 0, 0, [], 0
        if self.resuming:
            chunks = check_meta(self.output, self.options)
            done, keep_bytes, redo, read = scan_output(self.output, form, self.rows, self.chunk_rows,
                                                       self.reader.where, verified(self.output, chunks))
            # a record from before digests, or past the rows kept: only those of the rows kept
            chunks = [c for c in chunks if c[0] <= done] if chunks or not done else None
            os.truncate(self.output, keep_bytes)  # a torn chunk goes, and a torn last line with it
            self.rows = itertools.chain(redo, self.rows)
            if keep_bytes == 0:
                form.names = None  # the file starts over: its header is written again
        elif self.resumable:
            write_meta(self.output, self.options)
        err = err or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if self.fmt == "parquet":
            from .parquet import ParquetResultWriter

            writer = ParquetResultWriter(self.output, form, self.reader)
        else:
            writer = ResultWriter(self.output, form, append=keep_bytes > 0)
        return self._stream(clf, writer, done, err, warn or err, keep_bytes, chunks, read)

    def _stream(self, clf, writer, done: int, err, warn, end: int = 0, digests: list | None = None,
                read: int | None = None) -> int:
        """The main thread runs the engine; a chunk's rows are formatted and written on a writer
        thread while the engine runs the next chunk (JSON and CSV formatting are Python, a few us a
        row: in the engine's thread they were its rate's loss). One chunk's write at a time, in
        order; the rows count as done, and the progress moves, once their write returned. read:
        the input bytes of the rows done before (a resume's)."""
        t0, start, counts, errors = time.perf_counter(), done, Counter(), 0
        progress = Progress(self.reader, done, quiet=self.quiet, pos=read)
        pending = None  # (the write in flight, its chunk, its results)

        def written():
            nonlocal pending, done, errors, end
            (write, chunk, out), pending = pending, None
            wrote = write.result()  # its error (a full disk, a closed pipe) is raised here, as it was
            if self.resumable and digests is not None:  # the chunk's bytes (a resume verifies them)
                end += wrote[0]
                digests.append([chunk.rows[-1].n, end, wrote[1]])
                write_meta(self.output, self.options, chunks=digests)
            log.debug("rows %d-%d written, %.2f s in", chunk.rows[0].n, chunk.rows[-1].n,
                      time.perf_counter() - t0)
            done = chunk.rows[-1].n
            counts.update(r.label for r in out if r is not None)
            errors += sum(r is None for r in out)
            progress.update(done, errors, chunk.pos)

        def finished(chunk, got):  # all its rows classified: its write goes to the writer thread
            nonlocal pending
            results = iter(got)
            out = [None if row.error else next(results) for row in chunk.rows]
            if pending is not None:
                written()
            pending = pool.submit(writer.write_rows, chunk.rows, out), chunk, out

        last_pos = read or 0  # input bytes up to the chunk in flight (progress: its rows share the rest)
        pool = ThreadPoolExecutor(1, thread_name_prefix="prefixscore-write")
        handed = deque()  # chunks the engine has been given and not finished, in order
        with writer, StopSignals() as stop, contextlib.closing(tokenized_chunks(
                clf, self.rows, self.reader, self.chunk_rows, self.strict, done)) as chunks:

            def encoded():
                for chunk in chunks:
                    handed.append(chunk)
                    yield chunk.encoded

            try:
                got = []  # results of handed[0] so far
                # One stream of passes over every chunk: a chunk's batches are its own, but the
                # next chunk's first pass queues behind the last of this one (Classifier.classify_lists).
                with contextlib.closing(clf.classify_lists(encoded())) as passes:
                    for batch in passes:  # a stop lands between the engine's passes
                        got += batch
                        while handed and len(got) >= len(handed[0].encoded):
                            chunk = handed.popleft()
                            finished(chunk, got[:len(chunk.encoded)])
                            got, last_pos = got[len(chunk.encoded):], chunk.pos
                        if stop.signum is not None:  # the chunk in flight is not written
                            break
                        if handed:
                            chunk = handed[0]
                            share = len(got) / max(1, len(chunk.encoded))  # of the chunk's bytes
                            progress.update(chunk.rows[0].n - 1 + round(share * len(chunk.rows)),
                                            errors, last_pos + round(share * (chunk.pos - last_pos)))
                    else:  # chunks of error rows alone, at the end
                        while handed:
                            finished(handed.popleft(), [])
                if pending is not None:
                    written()
            finally:
                pool.shutdown(wait=True)  # what was handed over is written before the file closes
                progress.close()
        secs, n = time.perf_counter() - t0, done - start
        self.done = done  # the last row written (files.py records it when the output is complete)
        if stop.signum is not None:
            where = f"in {self.output}" if self.output not in (None, "-") else "on stdout"
            again = ("; the same command with --resume continues from there" if self.resumable else
                     "; a Parquet file cannot be resumed" if self.fmt == "parquet" else
                     "; write to a file (-o) to be able to --resume")
            warn(f"prefixscore: stopped by {signal.Signals(stop.signum).name}: rows 1-{done} are "
                 f"written {where}{again}")
            return 128 + stop.signum
        ok = n - errors
        err((f"classified {ok} queries in {secs:.2f} s ({1e3 * secs / ok:.1f} ms/query)" if ok else
             "classified no queries")
            + "".join(f"; {l}: {c}" for l, c in counts.most_common())
            + (f"; rows not classified: {errors} (see their error column)" if errors else "")
            + (f"; resumed after row {start}" if self.resuming else ""))
        return 0
