"""`prefixscore classify` over inputs of any size (issue 21). Rows are read lazily and classified a
chunk at a time; while the engine runs chunk k, a worker thread reads and tokenizes chunk k+1
(overlap.run_ahead); rows are written and flushed as the engine's passes complete them, on a
writer thread while the engine runs the next pass, so memory is flat in the input's length.
SIGINT/SIGTERM stop at the engine's next pass (the rows done are written and recorded, a second
signal ends the process at once); --resume continues the output file.

Where chunks end (resume.chunk_ends) is a function of the row number alone, never of timing, and
a chunk's passes are a function of its rows: the engine rounds a row's scores by the flat batch it
runs in, so a resumed run must cut the input exactly where the first run did to write the same
bytes. A chunk a stop cut short is read again from its first row and cut into the same passes."""
from __future__ import annotations

import contextlib
import gc
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
from ..overlap import collector_paused, run_ahead
from .io import Row, RowReader
from .progress import EVERY, Shown, duration
from .resume import CHUNK_ROWS, Kept, check_meta, chunk_ends, scan_output, verified, write_meta
from .writer import ResultWriter, RowFormat, check_output, chunk_digest, digest_text, output_format

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    """Rows read and tokenized together: the engine's passes over them are cut from them alone."""
    rows: list[Row]
    encoded: list  # Encoded of the rows without an error, in order
    at: list[int]  # where each of those is in rows
    sent: int = 0  # rows handed to the writer (a resume's first chunk: those written before)
    answered: int = 0  # encoded rows with a result, handed to the writer or written before
    digest: object = None  # of its bytes so far (writer.chunk_digest), for the sidecar


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


# Rows read and tokenized in one go on the worker: closing the chunks (a stop) waits for the piece
# being read, not for the whole chunk (with --chunk-rows in the millions, seconds).
PIECE = 4096
# The job runs with the collector paused (overlap.collector_paused); every this many chunks its young
# generations are collected, for the few cycles threads and generators leave (each collection
# scans everything in flight: once a chunk it cost ~3 us a row).
YOUNG_EVERY = 16


def tokenized_chunks(clf, rows, reader: RowReader, chunk_rows: int, strict: bool, start: int = 0):
    """Chunks of the rows after row `start` (a chunk's end), each read and tokenized on a worker
    thread one chunk ahead of the caller, a PIECE of rows at a time."""
    rows, closed = iter(rows), threading.Event()

    def next_chunk(size):  # on the worker; run_ahead calls it in order, one at a time
        batch, encoded = [], []
        while len(batch) < size and not closed.is_set():
            piece = list(itertools.islice(rows, min(PIECE, size - len(batch))))
            if not piece:
                break
            encoded += encode_rows(clf, piece, strict, reader.where)
            batch += piece
        if not batch or closed.is_set():
            return None
        return Chunk(batch, encoded, [i for i, r in enumerate(batch) if r.error is None])

    ends = (end for end in chunk_ends(chunk_rows) if end > start)
    sizes = ((b - a,) for a, b in itertools.pairwise(itertools.chain([start], ends)))
    with contextlib.closing(run_ahead(next_chunk, sizes, depth=1)) as chunks:
        try:
            for chunk in chunks:
                if chunk is None:
                    return
                yield chunk
        finally:
            closed.set()  # the worker stops after its piece; run_ahead's close waits for that


class Progress(Shown):
    """Rows written, on stderr (rows/progress.py: a bar on a terminal, else a line every `every`
    seconds from a timer): rows, errors, rows/s, and the share done with an ETA when the input's
    size or row count is known (the bytes of the rows done over a file's size). It counts a row
    once its write returned, so the output holds every row a line counted, whenever a stop comes;
    never backwards."""

    def __init__(self, reader: RowReader, start: int = 0, stream=None, every: float | None = EVERY,
                 clock=time.monotonic, quiet: bool = False, pos: int | None = None):
        """start: rows done before this run (a resume's kept rows), pos: their input bytes (the
        reader has read past them)."""
        self.reader, self.start = reader, start
        self.now = (start, 0, reader.pos if pos is None else pos)  # rows, errors, bytes: set whole
        self.shown = self.now
        f0 = self._fraction(start, self.now[2]) if start else 0.0
        super().__init__("classify", "row", start=start, f0=f0 or 0.0, disable=quiet, stream=stream,
                         every=every, clock=clock)

    def _fraction(self, rows: int, pos: int):
        if self.reader.size:
            return pos / self.reader.size
        return rows / self.reader.total if self.reader.total else None

    def update(self, rows: int, errors: int, pos: int) -> None:
        old = self.now
        self.now = (max(rows, old[0]), errors, max(pos, old[2]))

    def state(self) -> tuple[int, float | None]:
        self.shown = rows, _, pos = self.now  # (the timer's thread: one read of the three)
        return rows, self._fraction(rows, pos)

    def line(self, n: int, share: float | None, rate: float, left: float | None) -> str:
        if n == self.start:  # (on Ray: the actors start and load the model, tens of seconds)
            return f"classify: waiting for the first rows, {duration(self.clock() - self.pace.t0)} so far"
        line = f"classify: {n} rows ({self.shown[1]} errors), {rate:.0f} rows/s"
        if share is not None:
            line += f", {100 * share:.0f}%" + (f", ETA {duration(left)}" if left is not None else "")
        return line


class StopSignals:
    """While rows stream, the first SIGINT or SIGTERM asks to stop (`signum`) at the engine's next
    pass boundary: the rows that pass completed are written, the sidecar records how far the chunk
    in flight got, the output is closed, and --resume goes on from the next row (a stop that
    dropped the chunk in flight lost up to 4,096 rows). A second ends the process at once (a
    second SIGINT unwound through the chunk's passes for another 40 s): --resume redoes the chunk
    it tears. Handlers can only be set on the main thread; elsewhere the defaults stay."""

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
        kept, chunks = Kept(), []
        if self.resuming:
            chunks = check_meta(self.output, self.options)
            kept = scan_output(self.output, form, self.rows, self.chunk_rows, self.reader.where,
                               verified(self.output, chunks))
            # a record from before digests, or past the rows kept: only those of the rows kept
            chunks = [c for c in chunks if c[0] <= kept.rows] if chunks or not kept.rows else None
            os.truncate(self.output, kept.end)  # a torn chunk goes, and a torn last line with it
            self.rows = itertools.chain(kept.redo, self.rows)
            if kept.end == 0:
                form.names = None  # the file starts over: its header is written again
        elif self.resumable:
            write_meta(self.output, self.options)
        err = err or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if self.fmt == "parquet":
            from .parquet import ParquetResultWriter

            writer = ParquetResultWriter(self.output, form, self.reader)
        else:
            writer = ResultWriter(self.output, form, append=kept.end > 0)
        digest = self._partial_digest(kept, chunks) if kept.rows > kept.start else None
        commits = Commits(self, writer, kept, chunks if self.resumable else None)
        with collector_paused():  # rows and results make no cycles: no full scans mid-run
            return self._stream(clf, commits, kept, digest, err, warn or err)

    def _partial_digest(self, kept: Kept, chunks: list):
        """The digest of the bytes written of a chunk a stop cut short, which its rest extends."""
        start = next((c[1] for c in reversed(chunks) if c[0] <= kept.start), 0)
        with open(self.output, "rb") as f:
            f.seek(start)
            return chunk_digest(f.read(kept.end - start))

    def _stream(self, clf, commits: "Commits", kept: Kept, digest, err, warn) -> int:
        """The main thread runs the engine; as each pass completes, the rows it completed go to the
        writer thread (Commits). A resume starts at the chunk grid's row kept.start: a chunk a stop
        cut short is read, tokenized and cut into passes again as it was, and its passes that
        answer only rows already written do not run (Classifier.classify_lists' skip)."""
        t0, start = time.perf_counter(), kept.rows
        handed = deque()  # chunks the engine has been given and not finished, in order
        with commits, StopSignals() as stop, contextlib.closing(tokenized_chunks(
                clf, self.rows, self.reader, self.chunk_rows, self.strict, kept.start)) as chunks:

            def encoded():
                for k, chunk in enumerate(chunks):
                    if k % YOUNG_EVERY == 0:  # the few cycles chunks leave (overlap.collector_paused)
                        gc.collect(1)
                    if chunk.rows[0].n <= kept.rows:  # a chunk a stop cut short
                        self._resume_chunk(chunk, kept, digest)
                    handed.append(chunk)
                    yield chunk.encoded

            def stopped():  # asked before each pass: a stop lands between the engine's passes
                return stop.signum is not None

            # One stream of passes over every chunk: a chunk's batches are its own, but the
            # next chunk's first pass queues behind the last of this one (Classifier.classify_lists).
            with contextlib.closing(clf.classify_lists(encoded(), skip=kept.answered,
                                                       stop=stopped)) as passes:
                for batch in passes:
                    commits.answered(handed, batch)
            if not stopped():  # chunks of error rows alone, at the end
                commits.answered(handed, [])
            commits.confirm()
            if stop.signum is not None and handed:
                commits.record(handed[0])  # the rows of the chunk in flight written so far
        self.done = done = commits.done  # the last row written (files.py records it when complete)
        secs, n, errors = time.perf_counter() - t0, done - start, commits.errors
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
            + "".join(f"; {l}: {c}" for l, c in commits.counts.most_common())
            + (f"; rows not classified: {errors} (see their error column)" if errors else "")
            + (f"; resumed after row {start}" if self.resuming else ""))
        return 0

    def _resume_chunk(self, chunk: Chunk, kept: Kept, digest) -> None:
        """The first chunk of a resume, when a stop cut it short: its rows up to kept.rows are
        written, kept.answered of them with a result, which its tokenizing must agree with."""
        chunk.sent = kept.rows - chunk.rows[0].n + 1
        chunk.answered, chunk.digest = kept.answered, digest
        if sum(r.error is None for r in chunk.rows[:chunk.sent]) != kept.answered:
            raise InputError(f"--resume: rows {chunk.rows[0].n}-{kept.rows} of {self.output} hold "
                             f"other error rows than the input gives now (another tokenizer?): "
                             f"drop --resume to write it again")


class Commits:
    """Rows into the output as their passes complete. A chunk's rows are ready up to its first row
    without a result (its passes run in the order of their first row); they go to the writer
    thread, one write in flight; the progress counts them once their write returned, the job
    (done, the summary's counts) when it confirms that write (after the next pass has run, or
    at the end or a stop). The sidecar records each chunk as its last rows are written
    ([last row, end byte, digest]: a resume keeps only rows as they were written), and on a stop
    how far the chunk in flight got (record)."""

    def __init__(self, job: ClassifyJob, writer, kept: Kept, digests: list | None):
        self.job, self.writer, self.digests = job, writer, digests
        self.done, self.end, self.errors, self.counts = kept.rows, kept.end, 0, Counter()
        self.progress = Progress(job.reader, kept.rows, quiet=job.quiet, pos=kept.pos)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefixscore-write")
        self.pending = deque()  # (a write in flight, its chunk, its rows, their results), in order
        self.t0 = time.perf_counter()

    def answered(self, handed: deque, results: list) -> None:
        """A pass's results, in order: those of the chunks in flight, the first first."""
        while handed:
            chunk = handed[0]
            n = min(len(results), len(chunk.encoded) - chunk.answered)
            self.take(chunk, results[:n])
            results = results[n:]
            if chunk.sent < len(chunk.rows):
                return
            handed.popleft()

    def take(self, chunk: Chunk, results: list) -> None:
        """The results of a chunk's next rows: the rows now ready go to the writer."""
        chunk.answered += len(results)
        upto = len(chunk.rows) if chunk.answered == len(chunk.encoded) else chunk.at[chunk.answered]
        rows = chunk.rows[chunk.sent:upto]
        if not rows:
            return
        got = iter(results)
        out = [None if row.error else next(got) for row in rows]
        if chunk.digest is None and self.digests is not None:
            chunk.digest = chunk_digest()
        self.confirm(keep=1)  # one write queued behind the one running: the engine waits for neither
        chunk.sent = upto
        write = self.pool.submit(self.writer.write_rows, rows, out, chunk.digest, upto == len(chunk.rows))
        self.pending.append((write, chunk, rows, out))
        shown = rows[-1].n, self.errors + sum(r is None for r in out), rows[-1].end

        def landed(write):  # on the writer thread: the progress moves as the rows reach the file
            if write.exception() is None:
                self.progress.update(*shown)

        write.add_done_callback(landed)

    def confirm(self, keep: int = 0) -> None:
        """Wait for the writes in flight but the last `keep`, in order; their rows are done."""
        while len(self.pending) > keep:
            write, chunk, rows, out = self.pending.popleft()
            self.end += write.result()  # its error (a full disk, a closed pipe) is raised here
            log.debug("rows %d-%d written, %.2f s in", rows[0].n, rows[-1].n, time.perf_counter() - self.t0)
            self.done = rows[-1].n
            self.errors += sum(r is None for r in out)
            self.counts.update(r.label for r in out if r is not None)
            if rows[-1] is chunk.rows[-1]:
                self.record(chunk)

    def record(self, chunk: Chunk) -> None:
        """The sidecar's record of a chunk's rows written: the whole chunk, or those a stop left
        (a record inside the grid's chunk; the next record of the chunk replaces it)."""
        if self.digests is None or chunk.sent == 0:
            return
        if self.digests and self.digests[-1][0] >= chunk.rows[0].n:
            self.digests.pop()
        self.digests.append([chunk.rows[chunk.sent - 1].n, self.end, digest_text(chunk.digest)])
        write_meta(self.job.output, self.job.options, chunks=self.digests)

    def __enter__(self) -> "Commits":
        self.writer.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.pool.shutdown(wait=True)  # what was handed over is written before the file closes
            self.progress.close()
        finally:
            self.writer.__exit__(*exc)
