"""Reading queries and labeled rows from files: plain lines, CSV, JSONL and Parquet (through
pyarrow, the `parquet` extra, a batch at a time). Writing them lives in writer.py and parquet.py."""
from __future__ import annotations

import csv
import io
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ..errors import InputError


def _format(path: str | None, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = Path(path).suffix.lower() if path and path != "-" else ""
    return {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
            ".parquet": "parquet"}.get(suffix, "txt")


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
    row naming the columns; JSONL one object per line; Parquet (a file, not stdin) the columns, read
    alone. '-' is stdin (txt unless `fmt` says otherwise). Empty or missing values are errors that
    name the line (Parquet: the row), so no row is silently dropped."""
    fmt = _format(path, fmt)
    name = "<stdin>" if path == "-" else path
    if fmt == "parquet":
        rows = _parquet_rows(path, columns)
    elif fmt not in ("txt", "csv", "jsonl"):
        raise InputError(f"unknown input format {fmt!r}: use txt, csv, jsonl or parquet")
    elif fmt == "txt" and len(columns) > 1:  # before stdin is opened
        how = "; stdin is read as plain text unless --input-format says otherwise" if path == "-" else ""
        raise InputError(f"{name}: plain text has one query per line; use CSV, JSONL or Parquet "
                         f"with columns {', '.join(columns)}{how}")
    else:
        rows = _text_rows(path, name, fmt, columns)
    if not rows:
        raise InputError(f"{name}: no rows")
    return rows


def _text_rows(path: str, name: str, fmt: str, columns: tuple[str, ...]) -> list[dict]:
    rows = []
    with _open(path) as f:
        try:
            if fmt == "txt":
                rows = [{columns[0]: line.rstrip("\r\n")} for line in f if line.strip()]
            elif fmt == "csv":
                records = iter_csv(f, name)
                header = next(records, (1, []))[1]
                missing = [c for c in columns if c not in header]
                if missing:
                    raise InputError(f"{name}: no column {missing[0]!r} (columns: "
                                     f"{', '.join(header) or 'none, the file is empty'})")
                for n, fields in records:
                    if len(fields) > len(header):  # csv.DictReader would drop the extra fields
                        raise InputError(f"{name}:{n}: {len(fields)} fields but the header has "
                                         f"{len(header)} (quote a field that contains a comma)")
                    rows.append(_checked(dict(zip(header, fields)), columns, f"{name}:{n}"))
            else:
                rows = [_checked(obj, columns, f"{name}:{n}") for n, obj in iter_jsonl(f, name)]
        except UnicodeDecodeError:
            raise InputError(f"{name}: not valid UTF-8") from None
    return rows


def _parquet_rows(path: str, columns: tuple[str, ...]) -> list[dict]:
    """A Parquet file's rows, only `columns` decoded; a value that is null, blank or not text is an
    error naming its row, as in JSONL."""
    if path == "-":
        raise InputError("Parquet input is read from a file (its footer says where the rows are), "
                         "not from stdin: give the FILE.parquet")
    f = ParquetRows(path, columns[0])
    try:
        missing = [c for c in columns if c not in f.columns]
        if missing:
            raise InputError(f"{path}: no column {missing[0]!r} (columns: {', '.join(f.columns)})")
        f.select(list(columns))
        return list(f.rows(lambda n, line, fields: _checked(fields, columns, f"{path} row {n}")))
    finally:
        f.close()


def iter_csv(f, path: str, blanks: bool = False):
    """(line number, fields) for each non-blank CSV record (blank ones too, as [], with `blanks`);
    the line is where the record starts (a quoted field may span lines). Strict: a stray or unclosed
    quote is an error naming the line, not a field that silently swallows the rows after it."""
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
        if fields or blanks:
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


BLANK = "blank line"
_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class Row:
    """One input row. Output row n answers input row n: a row that cannot be classified keeps its
    place as an error row, never skipped."""
    n: int                    # 1-based data row (a CSV header is not one)
    line: int                 # the input line it starts on, for messages
    fields: dict              # its columns as read; {column: text} for plain lines
    query: str | None = None  # None when `error` says why there is nothing to classify
    error: str | None = None
    end: int = 0              # input bytes read up to its end (progress; 0 without a file size)


class RowReader:
    """The rows of a file ('-': stdin) or of a list of queries, read one at a time, so memory does
    not grow with the input. Lines are read as bytes: `pos` (bytes read) over `size` (a regular
    file's) is the progress. Blank or invalid rows come as Rows with an `error`; an InputError only
    for what leaves the file unreadable: a missing query column, or a malformed CSV record or
    invalid UTF-8 in CSV (where the next record starts is then unknown)."""

    def __init__(self, path: str | None = None, fmt: str = "auto", column: str = "query",
                 queries: list | None = None):
        self.column, self.pos, self.size, self.f = column, 0, None, None
        self.total = None if queries is None else len(queries)
        if queries is not None:
            self.fmt, self.name, self.columns = "args", "arguments", [column]
            self._rows = (self._checked(n, n, {column: q}) for n, q in enumerate(queries, 1))
            return
        self.fmt, self.name = _format(path, fmt), "<stdin>" if path == "-" else path
        if self.fmt not in ("txt", "csv", "jsonl", "parquet"):
            raise InputError(f"unknown input format {self.fmt!r}: use txt, csv, jsonl or parquet")
        if self.fmt == "parquet":  # columns, typed: read by pyarrow a batch at a time
            self.f = ParquetRows(path, column)
            self.columns, self.total = self.f.columns, self.f.num_rows
            self._rows = self.f.rows(self._checked)
            return
        if path == "-":
            self.f = sys.stdin.buffer
        else:
            try:
                self.f = open(path, "rb")
            except FileNotFoundError:
                raise InputError(f"input file not found: {path}") from None
            except IsADirectoryError:
                raise InputError(f"input is a directory, not a file: {path}") from None
            st = os.fstat(self.f.fileno())
            self.size = st.st_size if stat.S_ISREG(st.st_mode) else None
        self.columns = None if self.fmt == "jsonl" else [column]  # JSONL: each object its own
        if self.fmt == "csv":
            self._records = iter_csv(self._csv_lines(), self.name, blanks=True)
            self.columns = next((fields for _, fields in self._records if fields), [])
            if column not in self.columns:
                raise InputError(f"{self.name}: no column {column!r} (columns: "
                                 f"{', '.join(self.columns) or 'none, the file is empty'})")
        self._rows = self._ends({"txt": self._txt, "csv": self._csv, "jsonl": self._jsonl}[self.fmt]())

    def _ends(self, rows):
        """Each row with the bytes read up to its end: the progress of the rows up to it. The
        reader's own `pos` runs ahead of what is done (a job reads its first chunk of rows at
        start: a 20,000-row log read "20%" before a row was classified)."""
        for row in rows:
            row.end = self.pos
            yield row

    def __iter__(self):
        return self._rows

    def where(self, row: Row) -> str:
        if self.fmt == "parquet":
            return f"{self.name} row {row.n}"
        return f"query {row.n}" if self.fmt == "args" else f"{self.name}:{row.line}"

    def read_only(self, columns: list[str]) -> None:
        """Read no other columns than these and the query's, where the format can skip the rest
        (Parquet: a column not read is never decoded). Before the first row is read."""
        if self.fmt == "parquet":
            self.f.select(columns)

    def _lines(self):
        """(line number, bytes) of each line; a byte-order mark (Excel, Notepad) is not text."""
        for n, raw in enumerate(self.f, 1):
            self.pos += len(raw)
            yield n, raw[3:] if n == 1 and raw.startswith(b"\xef\xbb\xbf") else raw

    def _csv_lines(self):
        for n, raw in self._lines():
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{self.name}:{n}: not valid UTF-8") from None

    def _txt(self):
        for n, raw in self._lines():
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                yield Row(n, n, {}, error="not valid UTF-8")
                continue
            yield self._checked(n, n, {self.column: text})

    def _csv(self):
        width = len(self.columns)
        for n, (line, fields) in enumerate(self._records, 1):
            row = self._checked(n, line, dict(zip(self.columns, fields)))
            if not fields:
                row.error = BLANK
            elif len(fields) > width:  # csv.DictReader would drop the extra fields
                row.query, row.error = None, (f"{len(fields)} fields but the header has {width} "
                                              f"(quote a field that contains a comma)")
            yield row

    def _jsonl(self):
        for n, raw in self._lines():
            try:  # msgspec: ~1 us a line less of the GIL; json for what it refuses (NaN, lone
                obj = _decode(raw)  # surrogates, errors' wording), so both accept the same lines
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
            else:
                if isinstance(obj, dict):
                    yield self._checked(n, n, obj)
                    continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield Row(n, n, {}, error="not valid UTF-8")
                continue
            except json.JSONDecodeError as e:
                yield Row(n, n, {}, error=BLANK if not raw.strip() else f"invalid JSON ({e.msg})")
                continue
            if not isinstance(obj, dict):
                yield Row(n, n, {}, error="expected a JSON object per line")
                continue
            yield self._checked(n, n, obj)

    def _checked(self, n: int, line: int, fields: dict) -> Row:
        return query_row(n, line, fields, self.column, self.fmt)

    def close(self) -> None:
        if self.f is not None and self.f is not sys.stdin.buffer:
            self.f.close()

    def __enter__(self) -> "RowReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def query_row(n: int, line: int, fields: dict, column: str, fmt: str = "parquet") -> Row:
    """A Row of these fields: its query, or the error that says why it has none (a value missing,
    blank or not text; the wording by the input's format)."""
    q = fields.get(column)
    if q is not None and not isinstance(q, str):  # JSONL: a number, a list...
        return Row(n, line, fields, error=f"{column!r} must be a string, got {type(q).__name__}")
    if not q or not q.strip():
        why = {"txt": BLANK, "args": "empty query"}.get(fmt, f"{column!r} is missing or empty")
        return Row(n, line, fields, error=why)
    return Row(n, line, fields, q)


def _checked(row: dict, columns, where: str) -> dict:
    out = {}
    for c in columns:
        v = row.get(c)
        if v is not None and not isinstance(v, str):  # JSONL, Parquet: a number, a list...
            raise InputError(f"{where}: {c!r} must be a string, got {type(v).__name__}")
        if not v or not v.strip():
            raise InputError(f"{where}: {c!r} is missing or empty")
        out[c] = v
    return out


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


# ---------------------------------------------------------------- Parquet input

BATCH_ROWS = 1024  # rows turned into Python objects at a time: a chunk takes a few batches


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise InputError("Parquet needs pyarrow: pip install 'prefixscore[parquet]'") from None
    return pyarrow


class ParquetRows:
    """A Parquet file's rows as dicts of Python values (timestamps as datetime, lists, structs as
    dicts), lazily; `columns` is the file's schema, known before the first row."""

    def __init__(self, path: str, column: str):
        pa = _pyarrow()
        if path == "-":
            raise InputError("Parquet input is read from a file (its footer says where the rows "
                             "are), not from stdin: give -i FILE.parquet")
        try:
            self.file = pa.parquet.ParquetFile(path)
        except FileNotFoundError:
            raise InputError(f"input file not found: {path}") from None
        except IsADirectoryError:
            raise InputError(f"input is a directory, not a file: {path}") from None
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{path}: not a readable Parquet file ({e})") from None
        self.name, self.column, self.read = path, column, None  # read None: every column
        self.schema = self.file.schema_arrow
        self.columns, self.num_rows = list(self.schema.names), self.file.metadata.num_rows
        if column not in self.columns:
            raise InputError(f"{path}: no column {column!r} (columns: {', '.join(self.columns)})")

    def select(self, columns: list[str]) -> None:
        """Decode only these columns and the query's."""
        self.read = [c for c in self.columns if c == self.column or c in columns]

    def rows(self, make_row):
        """make_row(n, line, fields) for each row, n from 1."""
        pa, n = _pyarrow(), 0
        batches = self.file.iter_batches(BATCH_ROWS, columns=self.read)
        while True:
            try:  # only the reading is guarded: an error of the consumer's is its own
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"{self.name}: unreadable after row {n} ({e})") from None
            if batch is None:
                return
            for fields in batch.to_pylist():
                n += 1
                yield make_row(n, n, fields)

    def close(self) -> None:
        self.file.close()
