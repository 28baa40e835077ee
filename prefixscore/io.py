"""Reading queries and labeled rows from files (plain lines, CSV, JSONL) and writing results."""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

from .errors import InputError


def _format(path: str | None, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = Path(path).suffix.lower() if path and path != "-" else ""
    return {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}.get(suffix, "txt")


def _open(path: str):
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="strict")
    try:
        return open(path, newline="", encoding="utf-8")
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
                reader = csv.DictReader(f)
                missing = [c for c in columns if c not in (reader.fieldnames or [])]
                if missing:
                    raise InputError(f"{path}: no column {missing[0]!r} (columns: "
                                     f"{', '.join(reader.fieldnames or []) or 'none, the file is empty'})")
                for n, r in enumerate(reader, start=2):
                    rows.append(_checked(r, columns, path, n))
            elif fmt == "jsonl":
                rows = [_checked(obj, columns, path, n) for n, obj in iter_jsonl(f, path)]
            else:
                raise InputError(f"unknown input format {fmt!r}: use txt, csv or jsonl")
        except UnicodeDecodeError:
            raise InputError(f"{path}: not valid UTF-8") from None
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


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
        if not isinstance(v, str) or not v.strip():
            raise InputError(f"{path}:{n}: {c!r} is missing or empty")
        out[c] = v
    return out


def write_results(results, path: str | None, fmt: str, labels: list[str]) -> None:
    fmt = _format(path, fmt)
    fmt = "csv" if fmt == "txt" else fmt
    f = sys.stdout if path in (None, "-") else open(path, "w", newline="", encoding="utf-8")
    try:
        if fmt == "jsonl":
            for r in results:
                f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
        else:
            w = csv.writer(f)
            w.writerow(["query", "label"] + [f"score:{l}" for l in labels])
            for r in results:
                w.writerow([r.query, r.label] + [f"{r.scores[l]:.6g}" for l in labels])
    finally:
        if f is not sys.stdout:
            f.close()
