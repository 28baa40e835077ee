"""Reading queries and labeled rows from files (plain lines, CSV, JSONL) and writing results."""
from __future__ import annotations

import csv
import errno
import io
import json
import os
import sys
from pathlib import Path

from .errors import InputError


def _format(path: str | None, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = Path(path).suffix.lower() if path and path != "-" else ""
    return {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}.get(suffix, "txt")


def _open(path: str):
    # utf-8-sig: a byte-order mark (Excel, Notepad) would otherwise stick to the first value
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", errors="strict")
    try:
        return open(path, newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise InputError(f"input is a directory, not a file: {path}") from None


def read_rows(path: str, fmt: str = "auto", columns: tuple[str, ...] = ("query",)) -> list[dict]:
    """Rows with the given columns. txt: one query per line (blank lines skipped). CSV needs a header
    row naming the columns; JSONL one object per line. Empty or missing values are errors that name
    the line, so no row is silently dropped."""
    fmt = _format(path, fmt)
    rows = []
    with _open(path) as f:
        try:
            if fmt == "txt":
                if len(columns) > 1:
                    raise InputError(f"{path}: plain text has one query per line; use CSV or JSONL "
                                     f"with columns {', '.join(columns)}")
                rows = [{columns[0]: line.rstrip("\r\n")} for line in f if line.strip()]
            elif fmt == "csv":
                records = iter_csv(f, path)
                header = next(records, (1, []))[1]
                missing = [c for c in columns if c not in header]
                if missing:
                    raise InputError(f"{path}: no column {missing[0]!r} (columns: "
                                     f"{', '.join(header) or 'none, the file is empty'})")
                for n, fields in records:
                    if len(fields) > len(header):  # csv.DictReader would drop the extra fields
                        raise InputError(f"{path}:{n}: {len(fields)} fields but the header has "
                                         f"{len(header)} (quote a field that contains a comma)")
                    rows.append(_checked(dict(zip(header, fields)), columns, path, n))
            elif fmt == "jsonl":
                rows = [_checked(obj, columns, path, n) for n, obj in iter_jsonl(f, path)]
            else:
                raise InputError(f"unknown input format {fmt!r}: use txt, csv or jsonl")
        except UnicodeDecodeError:
            raise InputError(f"{path}: not valid UTF-8") from None
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def iter_csv(f, path: str):
    """(line number, fields) for each non-blank CSV record; the line is where the record starts (a
    quoted field may span lines). Strict: a stray or unclosed quote is an error naming the line, not
    a field that silently swallows the rows after it."""
    # csv's default limit of 128 KiB per field guards memory that reading the whole file spends
    # anyway; a query that long then gets the context-limit error (or --truncate) like any other.
    csv.field_size_limit(max(csv.field_size_limit(), 2 ** 31 - 1))
    reader = csv.reader(f, strict=True)
    while True:
        start = reader.line_num + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            hint = "; a quote opened here is never closed" if "end of data" in str(e) else ""
            raise InputError(f"{path}:{start}: malformed CSV ({e}{hint})") from None
        if fields:
            yield start, fields


def iter_jsonl(f, path: str):
    """(line number, object) for each non-blank line; a line that is not a JSON object is an error
    naming it."""
    for n, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{n}: expected a JSON object per line")
        yield n, obj


def _checked(row: dict, columns, path, n) -> dict:
    out = {}
    for c in columns:
        v = row.get(c)
        if v is not None and not isinstance(v, str):  # JSONL: a number, a list...
            raise InputError(f"{path}:{n}: {c!r} must be a string, got {type(v).__name__}")
        if not v or not v.strip():
            raise InputError(f"{path}:{n}: {c!r} is missing or empty")
        out[c] = v
    return out


# ---------------------------------------------------------------- output

def cannot_write(path, e: OSError) -> InputError:
    return InputError(f"cannot write output file {path}: {e.strerror or e}")


def check_output(path: str | None) -> None:
    """Fail now, before the model loads and the work runs, if `path` cannot be written (a directory,
    a missing folder, no permission). An existing file is opened for appending, so it is not
    truncated yet; a new one is created and removed again. Devices and pipes are left alone."""
    if path in (None, "-"):
        return
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))  # as open() would
        if not os.path.lexists(path):
            open(path, "x").close()
            os.remove(path)
        elif os.path.isfile(path):
            open(path, "a").close()
    except OSError as e:
        raise cannot_write(path, e) from None


class Output:
    """stdout (path None or '-') or a file opened for writing, as a context manager. Each write is
    flushed, so what is written survives a crash or Ctrl-C later on. An OSError on the file is an
    InputError naming it; stdout's own (a closed pipe) are left to the caller."""

    def __init__(self, path: str | None):
        self.path = None if path in (None, "-") else path
        self.f = sys.stdout if self.path is None else self._io(
            open, self.path, "w", newline="", encoding="utf-8")

    def _io(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except OSError as e:
            if self.path is None:
                raise
            raise cannot_write(self.path, e) from None

    def write(self, text: str) -> None:
        self._io(self.f.write, text)
        self._io(self.f.flush)

    def __enter__(self) -> "Output":
        return self

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            self._io(self.f.close)


class ResultWriter(Output):
    """Classifier results as CSV (a header, then a row per result) or JSONL, written batch by batch."""

    def __init__(self, path: str | None, fmt: str, labels: list[str]):
        fmt = _format(path, fmt)
        self.fmt, self.labels = "csv" if fmt == "txt" else fmt, labels
        super().__init__(path)
        if self.fmt == "csv":
            self._rows([["query", "label"] + [f"score:{l}" for l in labels]])

    def _rows(self, rows) -> None:
        buf = io.StringIO()
        csv.writer(buf).writerows(rows)
        self.write(buf.getvalue())

    def write_results(self, results) -> None:
        if self.fmt == "jsonl":
            self.write("".join(json.dumps(r.to_dict(), ensure_ascii=False) + "\n" for r in results))
        else:
            self._rows([r.query, r.label] + [f"{r.scores[l]:.6g}" for l in self.labels]
                       for r in results)


def read_text(path: str, what: str) -> str:
    """A whole UTF-8 text file (a template, a label list), or an InputError naming it."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not text
            return f.read()
    except OSError as e:
        raise InputError(f"cannot read {what} file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"{what} file {path}: not valid UTF-8") from None


def labels_option(a) -> list[str] | None:
    """--labels-file (one per line) or --labels (comma-separated) of a command, or None."""
    if a.labels_file:
        return [l.strip() for l in read_text(a.labels_file, "labels").splitlines() if l.strip()]
    if a.labels is not None:
        return [l.strip() for l in a.labels.split(",")]
    return None


def template_option(a) -> str | None:
    """--template-file or --template of a command, or None."""
    if a.template_file:
        return read_text(a.template_file, "template").rstrip("\n")
    return a.template
