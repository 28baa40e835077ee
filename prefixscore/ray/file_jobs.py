"""`prefixscore classify --ray`: files through Ray Data (data.py's pool), one output per input, the
rows an in-process run writes (the design, and why):

- Reading: one read task per file runs the CLI's own RowReader (io.py) a chunk at a time, so a row
  has the number, columns and error (a blank line, invalid JSON, a CSV record with too many fields)
  it gets in-process. Ray's read_csv/read_json infer types, skip a blank line or fail the whole file
  on a bad one, and number no rows; read_text loads a file whole. Files are read in parallel.
- One dataset over every file to do, order preserved: the actors load the model once for all the
  files, and the driver receives each file's rows in order.
- Writing: the driver writes each file through the CLI's writers (rowformat.py, parquet.py), cut at
  the CLI's chunk ends (so CSV headers and Parquet row groups are the CLI's), to OUT.partial, renamed
  and marked done when complete (prefixscore/files.py): --resume skips finished files, and redoes
  the others whole.
- The options recorded beside an output are the CLI's, the model as the actors loaded it (device,
  dtype, template, labels) included: the actors send it with their rows. Only a --resume with no
  rows to classify builds a Classifier for it alone (data.describe), to check the finished files.
"""
from __future__ import annotations

import itertools
import json
import os
import pickle
import sys
import time
from collections import Counter
from types import SimpleNamespace

from ..classifier import Result
from ..errors import InputError
from ..options import recorded
from ..rows.files import check, commit, looks_finished, plan, start
from ..rows.io import Row, RowReader
from ..rows.writer import ResultWriter, RowFormat
from ..rows.resume import CHUNK_ROWS, check_meta, chunk_ends
from ..rows.stream import Progress
from ..values import ModelSpec
from .data import checked, connect, describe, pool

import pyarrow as pa  # noqa: E402 (after data.py, which says how to install Ray Data and pyarrow)
import ray.data  # noqa: E402

# The rows of the input files as they travel to the actors: the reader's row number, line, query
# (or error) and the row's columns, pickled (Parquet's timestamps, JSONL's objects, as read).
ROWS = pa.schema([("file", pa.int32()), ("row", pa.int64()), ("line", pa.int64()),
                  ("query", pa.string()), ("error", pa.string()), ("fields", pa.binary()),
                  ("pos", pa.int64())])
ROW_BYTES = 256  # a typical row of ROWS, to size blocks by rows (Ray sizes them by bytes)
READ_CPUS = 0.5


def _read_files(batch: pa.Table, input_format: str, column: str, keep, chunk_rows: int):
    """A read task: the rows of its files (their index and path in `batch`), a chunk a block."""
    for index, path in zip(batch["file"].to_pylist(), batch["path"].to_pylist()):
        with RowReader(path, input_format, column) as reader:
            if keep != "all":
                reader.read_only([] if keep == "none" else keep)
            rows = iter(reader)
            while chunk := list(itertools.islice(rows, chunk_rows)):
                k = len(chunk)
                yield pa.Table.from_arrays([
                    pa.array([index] * k, pa.int32()), pa.array([r.n for r in chunk], pa.int64()),
                    pa.array([r.line for r in chunk], pa.int64()),
                    pa.array([r.query for r in chunk], pa.string()),
                    pa.array([r.error for r in chunk], pa.string()),
                    pa.array([pickle.dumps(r.fields, protocol=5) for r in chunk], pa.binary()),
                    pa.array([reader.pos] * k, pa.int64())], schema=ROWS)


def read_rows(files: list[str], input_format: str, column: str, keep, chunk_rows: int):
    """A dataset of the files' rows, in order: a read task per file (a generator over its chunks;
    Ray Data's public map_batches, where a Datasource's interface changes between Ray versions)."""
    ds = ray.data.from_items([{"file": i, "path": f} for i, f in enumerate(files)],
                             override_num_blocks=len(files))
    # Half a CPU a reader: a reader waits on the disk and on the actors much of its time. And
    # resources unlike the actors' keep Ray from fusing the read into them, where one actor would
    # read and classify a whole file alone (the others idle) and never overlap the two.
    return ds.map_batches(_read_files, batch_size=1, batch_format="pyarrow", num_cpus=READ_CPUS,
                          fn_kwargs=dict(input_format=input_format, column=column, keep=keep,
                                         chunk_rows=chunk_rows))


class Writers:
    """The driver: each file's rows, as they come in order, through the CLI's writer for its format
    to its partial output, a CLI chunk at a time; a file is committed when the rows of a later file,
    or the end, show it complete. `skipped`: the finished outputs --resume leaves, whose options
    are checked once the actors' record says what the model is."""

    def __init__(self, todo, skipped, reader_args, keep, chunk_rows, strict, probs, top_k, quiet):
        self.todo, self.skipped, self.reader_args, self.keep = todo, skipped, reader_args, keep
        self.chunk_rows, self.strict, self.probs, self.top_k = chunk_rows, strict, probs, top_k
        self.sizes = [os.path.getsize(t.src) for t, _ in todo]
        self.record, self.labels = None, None
        self.next, self.cur, self.done_bytes = 0, None, 0
        self.rows = self.errors = self.steady_rows = 0
        self.counts, self.first = Counter(), None
        self.progress = Progress(SimpleNamespace(size=sum(self.sizes), total=None, pos=0), quiet=quiet)

    def learn(self, record: dict) -> None:
        """The model's record: the labels to write, and the options the skipped outputs must have."""
        self.record, self.labels = record, record["labels"]
        for t, options in self.skipped:
            check_meta(t.dst, options | record)

    def write(self, batch: pa.Table) -> None:
        if not batch.num_rows:
            return
        if self.first is None:  # the actors are up: what follows is the steady rate
            self.first = time.perf_counter()
            self.learn(json.loads(batch["model"][0].as_py()))
        else:
            self.steady_rows += batch.num_rows
        cols = batch.select(["file", "row", "line", "fields", "error", "label", "scores", "pos"]).to_pydict()
        for f, idx in itertools.groupby(range(batch.num_rows), cols["file"].__getitem__):
            self._advance(f)
            cur = self.cur
            for i in idx:
                row = Row(cols["row"][i], cols["line"][i], pickle.loads(cols["fields"][i]),
                          None, cols["error"][i])
                if row.error is not None and self.strict:
                    raise InputError(f"{cur.reader.where(row)}: {row.error}")
                scores = cols["scores"][i]
                cur.rows.append(row)
                cur.results.append(None if scores is None else
                                   Result(None, cols["label"][i], dict(zip(self.labels, scores))))
                if row.n == cur.end:
                    self._flush()
                    cur.end = next(cur.ends)
            # how far into file f: its rows (Parquet) or bytes (text) read, as a share of its size
            share = row.n / cur.reader.total if cur.reader.fmt == "parquet" else \
                cols["pos"][i] / max(1, self.sizes[f])
            self.progress.update(self.rows, self.errors, self.done_bytes + share * self.sizes[f])

    def _flush(self) -> None:
        cur = self.cur
        if cur.rows:
            cur.writer.write_rows(cur.rows, cur.results)
            cur.last = cur.rows[-1].n
            self.rows += len(cur.rows)
            self.errors += sum(r is None for r in cur.results)
            self.counts.update(r.label for r in cur.results if r is not None)
            cur.rows, cur.results = [], []

    def _advance(self, f: int) -> None:
        """Commit every file before file f (those without rows too), and open f."""
        while self.next <= f:
            self._close(commit_it=True)
            t, options = self.todo[self.next]
            options |= self.record
            reader = RowReader(t.src, *self.reader_args)
            form = RowFormat(t.fmt, self.labels, reader.column, self.keep, reader.columns,
                             self.probs, self.top_k)
            start(t, options)
            if t.fmt == "parquet":
                from ..rows.parquet import ParquetResultWriter

                writer = ParquetResultWriter(t.partial, form, reader)
            else:
                writer = ResultWriter(t.partial, form)
            ends = chunk_ends(self.chunk_rows)
            self.cur = SimpleNamespace(target=t, options=options, reader=reader, writer=writer,
                                       ends=ends, end=next(ends), rows=[], results=[], last=0,
                                       index=self.next)
            self.next += 1

    def _close(self, commit_it: bool) -> None:
        """Close the file being written: complete (commit_it), or given up (its partial stays)."""
        cur = self.cur
        if cur is None:
            return
        try:
            if commit_it:
                self._flush()
        finally:
            self.cur = None
            cur.writer.__exit__(None, None, None)
            cur.reader.close()
        if commit_it:
            commit(cur.target, cur.options, cur.last)
            self.done_bytes += self.sizes[cur.index]

    def finish(self) -> None:
        """Commit the last file and any after it without rows."""
        if self.todo:
            self._advance(len(self.todo) - 1)
            self._close(commit_it=True)
            self.progress.update(self.rows, self.errors, self.done_bytes)
        self.progress.close()

    def abort(self) -> None:
        """A failed run: the file being written closed, never committed."""
        self._close(commit_it=False)
        self.progress.close()


def classify_files(inputs, output: str, *, input_format: str = "auto", column: str = "query",
                   format: str = "auto", keep_columns="all", probs: bool = False,
                   top_k: int | None = None, chunk_rows: int = CHUNK_ROWS, resume: bool = False,
                   strict: bool = False, actors: int | None = None, quiet: bool = False,
                   info=None, **classifier) -> dict:
    """Classify files on Ray Data: `inputs` a file, a glob, a directory or a list of files; `output`
    a directory (or, for one input, a file), one output per input with the rows the in-process
    `prefixscore classify` writes (prefixscore/files.py; the options as its flags: keep_columns
    "all", "none" or a list of columns). `classifier`: Classifier's arguments. info: the summary
    line's sink (default stderr). -> {"files" (written), "skipped" (finished before), "rows",
    "errors", "labels" (rows per label), "wall" (seconds in all), "startup" (until the first rows
    came back: Ray, the model loads), "seconds" (from then to the end), "steady_rows" (rows that
    came back in those)}."""
    t0 = time.perf_counter()
    info = info or (lambda msg: print(msg, file=sys.stderr, flush=True))
    targets = plan(inputs, output, format, input_format)
    spec = ModelSpec(**{k: v for k, v in classifier.items() if k in ModelSpec.__dataclass_fields__})
    flags = recorded(spec) | {"probs": probs, "top_k": top_k}  # as the command line records them
    options = [check(t, input_format, column, keep_columns, chunk_rows, strict, flags) for t in targets]
    done = [resume and looks_finished(t) for t in targets]
    todo = [(t, o) for t, o, d in zip(targets, options, done) if not d]
    skipped = [(t, o) for t, o, d in zip(targets, options, done) if d]
    classifier = checked(classifier)
    connect()
    writers = Writers(todo, skipped, (input_format, column), keep_columns, chunk_rows, strict, probs,
                      top_k, quiet)
    try:
        if todo:
            ds = read_rows([t.src for t, _ in todo], input_format, column, keep_columns, chunk_rows)
            out = pool(ds, classifier, "query", True, probs, top_k, actors, chunk_rows)
            out.context.execution_options.preserve_order = True  # each file's rows in order
            # Blocks of about a chunk's rows (not Ray's 128 MiB): the driver holds one at a time,
            # rows come back (and progress moves) a chunk at a time, and an actor that dies redoes
            # a block at most.
            out.context.target_max_block_size = max(chunk_rows * ROW_BYTES, 1 << 16)
            out.context.enable_progress_bars = False  # ours: rows of all files, as in-process
            for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
                writers.write(batch)
        if writers.record is None:  # no rows came back: ask a Classifier of its own
            writers.learn(describe(classifier, actors))
        writers.finish()
    except BaseException:
        writers.abort()
        raise
    end = time.perf_counter()
    first = writers.first or end
    summary = {"files": len(todo), "skipped": len(skipped), "rows": writers.rows,
               "errors": writers.errors, "labels": dict(writers.counts), "wall": end - t0,
               "startup": first - t0, "seconds": end - first, "steady_rows": writers.steady_rows}
    info(_summary_line(summary, output))
    return summary


def _summary_line(s: dict, output: str) -> str:
    ok = s["rows"] - s["errors"]
    line = (f"classified {ok} queries on Ray in {s['wall']:.1f} s ({s['startup']:.1f} s until the "
            f"first rows came back: Ray and the model loads)" if ok else "classified no queries")
    line += "".join(f"; {l}: {c}" for l, c in Counter(s["labels"]).most_common())
    line += f"; rows not classified: {s['errors']} (see their error column)" if s["errors"] else ""
    line += f"; {s['files']} file(s) written to {output}"
    return line + (f", {s['skipped']} finished before, skipped" if s["skipped"] else "")
