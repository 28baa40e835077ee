"""Resuming a classify run (stream.ClassifyJob): the chunk grid a run writes in, so an interrupted
output is continued from its last chunk's first row as an uninterrupted run would have done it (a
stop records how far into that chunk it got, a crash's torn chunk is redone whole); the sidecar
that records the options a run was written with and what it wrote; the scan that checks a partial
output against its input row by row."""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

from ..errors import InputError
from .writer import RowFormat, json_text

CHUNK_ROWS = 4096  # rows per chunk: thousands keep the GPU's flat batches full, the memory small
FIRST_CHUNK_ROWS = 32  # the first chunks are short, so the first rows are out moments after the model


def chunk_ends(chunk_rows: int):
    """The last row number of each chunk: 32, 64, 128... rows doubling up to `chunk_rows` a chunk."""
    end, size = 0, min(FIRST_CHUNK_ROWS, chunk_rows)
    while True:
        end += size
        yield end
        size = min(2 * size, chunk_rows)


def meta_path(output: str) -> str:
    return output + ".meta.json"


# The options a run is checked by lie in a sidecar file, OUT.meta.json, not in a header line of OUT:
# then OUT is plain CSV or JSONL with one line per input row, as vLLM's and TEI's batch outputs are,
# which pandas, DuckDB and jq read with no line to skip and whose line N stays row N.
META_FORMAT = "prefixscore.classify.output"
# Options recorded since after the first sidecars were written: a record without one was written
# with its default, so such a file still resumes with the same command.
ADDED_OPTIONS = {"probs": False, "top_k": None}


def write_meta(output: str, options: dict, done: dict | None = None, chunks: list | None = None) -> None:
    """The sidecar of `output`; `done` (files.py: the rows written and the input's size and mtime)
    marks an output that is complete; `chunks`: per chunk written, [its last row, its end in
    bytes, the digest of its bytes], so a resume keeps only rows exactly as they were written."""
    path = meta_path(output)
    tmp = f"{path}.tmp{os.getpid()}"
    meta = {"format": META_FORMAT, "version": 1, "options": options} | ({"done": done} if done else {}) \
        | ({"chunks": chunks} if chunks else {})
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)  # never a half-written sidecar
    except OSError as e:
        raise InputError(f"cannot write output file {path}: {e.strerror or e}") from None


def check_meta(output: str, options: dict) -> list:
    """Refuse to resume `output` if it was written with other options than these; -> the chunks
    its sidecar records (write_meta)."""
    path = meta_path(output)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta["format"] != META_FORMAT or not isinstance(meta["options"], dict):
            raise ValueError("not a prefixscore sidecar")
    except FileNotFoundError:
        raise InputError(f"--resume: {output} has no {path}, so what it was written with cannot be "
                         f"checked: write to a new file, or drop --resume to overwrite it") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"--resume: {path} is not readable as prefixscore's record of {output}") from None
    for k, v in options.items():
        old = meta["options"].get(k, ADDED_OPTIONS.get(k))
        if old != v:
            raise InputError(f"--resume: {output} was written with {k} {_short(old)}, not {_short(v)} "
                             f"(see {path}): leave the option out (--resume takes the one it was "
                             f"written with), or drop --resume to start it over")
    chunks = meta.get("chunks") or []
    return chunks if isinstance(chunks, list) else []


def verified(output: str, chunks: list) -> int | None:
    """The last row of the chunks of `output` whose bytes are what the sidecar recorded (the last
    record may be of a chunk a stop cut short: its rows written); an edited one is refused, naming
    its rows. None: nothing recorded (a record from before digests), and the row check alone
    stands."""
    if not chunks:
        return None
    from .writer import chunk_digest, digest_text

    last_row, start = 0, 0
    with open(output, "rb") as f:
        for end_row, end, digest in chunks:
            raw = f.read(end - start)
            if len(raw) < end - start:  # the file ends inside it: torn, redone
                break
            if digest_text(chunk_digest(raw)) != digest:
                raise InputError(f"--resume: rows {last_row + 1}-{end_row} of {output} are not what "
                                 f"was written there (edited since?): drop --resume to write it "
                                 f"again, or restore them")
            last_row, start = end_row, end
    return last_row


def model_record(clf, adapter=None, head=None) -> dict:
    """What a sidecar records of the model a run classified with (in-process or on Ray's actors)."""
    def path_or_name(v):
        return os.path.abspath(v) if v is not None and os.path.exists(v) else v

    return {"model": clf.loaded.name, "adapter": path_or_name(adapter), "head": path_or_name(head),
            "template": clf.prompt.template, "chat": clf.prompt.chat,
            "dtype": str(clf.engine.dtype).removeprefix("torch."), "device": clf.engine.device.type}


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


@dataclass
class Kept:
    """What a resume keeps of an output (scan_output): its first `rows` rows, `end` bytes."""
    rows: int = 0
    end: int = 0
    pos: int = 0  # input bytes up to the last row kept (Row.end: where progress starts)
    start: int = 0  # the chunk grid's last row at or before `rows`: the first chunk redone starts after it
    redo: list = field(default_factory=list)  # the input rows read after `start`
    answered: int = 0  # rows kept after `start` that have a result (not an error row)


def scan_output(output: str, form: RowFormat, rows, chunk_rows: int, where=str,
                upto: int | None = None) -> Kept:
    """Check what an interrupted run wrote against the input, row by row by the `row` column and the
    input columns. Rows are kept up to a chunk's end, or up to `upto` (the last row whose bytes the
    sidecar verified), which may be inside a chunk a stop cut short: that chunk is redone from its
    first row, as the uninterrupted run cut it, and its rows kept are not written again. A chunk a
    crash tore is redone whole: its flat batches, and its bytes, are those of an uninterrupted run."""
    rows, kept, since, ends = iter(rows), Kept(), [], chunk_ends(chunk_rows)
    end_row = next(ends)
    with open(output, "rb") as f:
        for n, (end, got) in enumerate(_records(f, output, form), 1):
            row = next(rows, None)
            if row is None:
                raise InputError(f"--resume: {output} has more rows than the input ({n - 1}): it was "
                                 f"written from another input")
            _check_row(output, form, n, row, got, where)
            since.append((row, _answered(form, got)))
            if upto is not None and n > upto:
                continue
            if n == end_row:  # a whole chunk
                kept = Kept(n, end, row.end, n)
                since, end_row = [], next(ends)
            elif n == upto:  # the rows written of a chunk a stop cut short
                kept = Kept(n, end, row.end, kept.start, answered=sum(ok for _, ok in since))
    kept.redo = [row for row, _ in since]
    return kept


def _check_row(output: str, form: RowFormat, n: int, row, got, where) -> None:
    want = form.input_part(row)
    if form.fmt == "jsonl":  # as written: a Parquet timestamp is its ISO text there
        want = json.loads(json_text(want))
    same = got[:len(want)] == want if form.fmt == "csv" else \
        all(got.get(k, ...) == v for k, v in want.items())
    if not same:
        raise InputError(f"--resume: row {n} of {output} is not input row {n} ({where(row)}): "
                         f"written {_short(_head(got, want))}, the input gives {_short(want)}; "
                         f"resume with the input it was written from")


def _answered(form: RowFormat, got) -> bool:
    """Whether a written row has a result (else its error says why not)."""
    return got[-1] == "" if form.fmt == "csv" else got.get("error") is None


def _head(got, want):
    return got[:len(want)] if isinstance(got, list) else {k: got.get(k) for k in want}


def _records(f, output: str, form: RowFormat):
    """(end offset, record) of each complete row of an output file, after adopting a CSV header's
    columns; stops at a torn end: a last line without its newline, or a CSV record it leaves open."""
    pos = 0

    def lines():
        nonlocal pos
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            pos += len(raw)
            yield raw.decode("utf-8")

    def unreadable():
        return InputError(f"--resume: {output} is unreadable at byte {pos}: not an output of "
                          f"prefixscore classify")

    source = lines()
    csv.field_size_limit(max(csv.field_size_limit(), 2 ** 31 - 1))  # a query's length is not ours to cap
    try:
        if form.fmt == "jsonl":
            for line in source:
                yield pos, json.loads(line)
            return
        records = csv.reader(source, strict=True)
        header = next(records, None)
        if header is None:
            return
        form.names = [_input_name(c, form) for c in header[2:len(header) - len(form.result_columns)]]
        if header != form.header():
            raise InputError(f"--resume: {output} has the header {_short(header)}, not "
                             f"{_short(form.header())}")
        while True:
            try:
                rec = next(records)
            except StopIteration:
                return
            except csv.Error:
                if next(source, None) is None:  # an open quote at the end: a torn write
                    return
                raise unreadable() from None
            yield pos, rec
    except ValueError:  # JSON or UTF-8 that a complete line of ours never has
        raise unreadable() from None


def _input_name(name: str, form: RowFormat) -> str:
    bare = name.removeprefix("input:")
    return bare if bare != name and form.out_name(bare) == name else name


# ---------------------------------------------------------------- the command
