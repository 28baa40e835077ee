"""How `prefixscore classify` writes result rows: RowFormat (CSV and JSONL; Parquet's writer in
parquet.py takes CSV's columns from it) and ResultWriter, a chunk of rows per flushed write."""
from __future__ import annotations

import csv
import hashlib
import errno
import io
import json
import math
import os
import sys

import msgspec

from ..errors import cannot_write
from .io import Row, _format


# Output names of ours; an input column so named is written as "input:NAME".
RESERVED = ("row", "query", "label", "scores", "error")


def output_name(column: str, reserved=RESERVED) -> str:
    return f"input:{column}" if column in reserved or column.startswith("score:") else column


def softmax(xs: list[float]) -> list[float]:
    """Probabilities over the labels from their scores: in mode logprobs the scores are already
    log-probabilities (then this renormalizes away float error), in mode logits raw logits."""
    m = max(xs)
    if math.isinf(m):  # +inf: it takes all; all -inf: nothing to tell apart
        e = [float(x == m) for x in xs]
    else:
        e = [math.exp(x - m) for x in xs]
    total = sum(e)
    return [v / total for v in e]


def top(xs: list[float], k: int) -> list[int]:
    """Indices of the k highest scores, best first; a tie goes to the label listed first."""
    return sorted(range(len(xs)), key=lambda i: -xs[i])[:k]


class RowFormat:
    """How rows and their results are written: CSV (a header, then a line per row) or JSONL (or
    Parquet: CSV's columns, typed; parquet.py). Each row: `row` (the input row number), `query`
    (whatever the input's query column is called), the input's other columns (`keep`: "all", "none"
    or a list), `label`, the scores and `error`: empty, or why the row could not be classified (its
    label and scores then empty: "" in CSV, null in JSONL). CSV's other columns are those of its
    header (`names`): the input's header, else the first chunk's first valid JSONL object's.

    probs: the softmax of the scores beside them (CSV prob:LABEL columns, JSONL a probs object).
    top_k: only the k best labels by score, best first, in place of every label's score (CSV
    label_1, score_1[, prob_1], ... label_k, ...; JSONL a top list of {label, score[, prob]}); the
    probabilities are still over every label. `label` stays the decision, which in mode logprobs
    need not be top 1 (greedy decoding chooses token by token)."""

    def __init__(self, fmt: str, labels: list[str], column: str = "query", keep="all",
                 columns: list[str] | None = None, probs: bool = False, top_k: int | None = None):
        self.fmt, self.labels, self.column, self.keep, self.columns = fmt, labels, column, keep, columns
        self.probs, self.top_k = probs, None if top_k is None else min(top_k, len(labels))
        self.names = None
        self.result_columns = self._result_columns()
        ours = [name for name, _ in self.result_columns] if fmt != "jsonl" else \
            ["label", "error"] + (["top"] if self.top_k else ["scores"] + (["probs"] if probs else []))
        self.reserved = tuple(dict.fromkeys(RESERVED + tuple(ours)))

    def _result_columns(self) -> list[tuple[str, type]]:
        """CSV's (and Parquet's) columns after the input's, with their value types."""
        cols = [("label", str)]
        if self.top_k:
            for i in range(1, self.top_k + 1):
                cols += [(f"label_{i}", str), (f"score_{i}", float)] + ([(f"prob_{i}", float)] if self.probs else [])
        else:
            cols += [(f"score:{l}", float) for l in self.labels]
            cols += [(f"prob:{l}", float) for l in self.labels] if self.probs else []
        return cols + [("error", str)]

    def out_name(self, column: str) -> str:
        """An input column's name in the output: "input:NAME" where it would clash with ours."""
        return output_name(column, self.reserved)

    def result_values(self, r, row: Row) -> list:
        """The result columns' values (result_columns' order): None where empty."""
        if r is None:
            return [None] * (len(self.result_columns) - 1) + [row.error]
        s = [r.scores[l] for l in self.labels]
        p = softmax(s) if self.probs else None
        if not self.top_k:
            return [r.label, *s, *(p or []), None]
        out = [r.label]
        for i in top(s, self.top_k):
            out += [self.labels[i], s[i]] + ([p[i]] if p else [])
        return out + [None]

    def _plain(self, results) -> bool:
        """JSONL's result keys are a Result's own: no top-k, no probabilities, and its scores'
        keys are the labels in order (one classifier made them all: the first one tells)."""
        first = next((r for r in results if r is not None), None)
        return not self.top_k and not self.probs and first is not None and list(first.scores) == self.labels

    def result_object(self, r, row: Row) -> dict:
        """JSONL's result keys of a row."""
        if self.top_k:
            return {"label": r and r.label, "top": r and self._top(r), "error": row.error if r is None else None}
        out = _result(r, row, self.labels)
        if self.probs:
            probs = None if r is None else dict(zip(self.labels, softmax([r.scores[l] for l in self.labels])))
            out = {"label": out["label"], "scores": out["scores"], "probs": probs, "error": out["error"]}
        return out

    def _top(self, r) -> list[dict]:
        s = [r.scores[l] for l in self.labels]
        p = softmax(s) if self.probs else None
        return [{"label": self.labels[i], "score": s[i]} | ({"prob": p[i]} if p else {})
                for i in top(s, self.top_k)]

    def kept(self, fields: dict) -> dict:
        """The input's other columns written for a row, by their input names."""
        if self.keep == "all":
            return {k: v for k, v in fields.items() if k != self.column}
        return {} if self.keep == "none" else {k: fields.get(k) for k in self.keep if k != self.column}

    def input_part(self, row: Row):
        """What a row's line starts with, from the input alone: a CSV row's first cells, a JSONL
        object's first keys (--resume checks what is written against it)."""
        query = row.fields.get(self.column)
        if self.fmt == "csv":
            kept = self.kept(row.fields)
            return [str(row.n), _cell(query)] + [_cell(kept.get(k)) for k in self.names]
        return {"row": row.n, "query": query} | {self.out_name(k): v for k, v in self.kept(row.fields).items()}

    def header(self) -> list[str]:
        return (["row", "query"] + [self.out_name(k) for k in self.names]
                + [name for name, _ in self.result_columns])

    def set_names(self, rows: list[Row]) -> bool:
        """Fix the input columns written (CSV, Parquet) from the first chunk; -> whether it was now."""
        if self.names is not None:
            return False
        first = next((r.fields for r in rows if r.error is None), {})
        self.names = list(self.kept(dict.fromkeys(self.columns) if self.columns else first))
        return True

    def lines(self, rows: list[Row], results) -> str:
        """Rows in input order and their Results (None for an error row); CSV's header first."""
        if self.fmt == "jsonl":
            encode, part = _JSONL.encode, self.input_part
            if self._plain(results):  # the Result's own scores dict: already in label order
                lines = [encode(part(row) | _result(r, row, None)) for row, r in zip(rows, results)]
            else:
                lines = [encode(part(row) | self.result_object(r, row)) for row, r in zip(rows, results)]
            return (b"\n".join(lines) + b"\n").decode("utf-8") if lines else ""
        out = [self.header()] if self.set_names(rows) else []
        for row, r in zip(rows, results):
            tail = ["" if v is None else f"{v:.6g}" if isinstance(v, float) else v
                    for v in self.result_values(r, row)]
            out.append(self.input_part(row) + tail)
        buf = io.StringIO()
        w = csv.writer(buf)
        for i in range(0, len(out), 256):  # writerows holds the GIL throughout: the engine's thread
            w.writerows(out[i:i + 256])    # waits for it (a writer thread formats: stream.py)
        return buf.getvalue()


# ---------------------------------------------------------------- output files

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

    def __init__(self, path: str | None, mode: str = "w"):
        self.path = None if path in (None, "-") else path
        self.f = sys.stdout if self.path is None else self._io(
            open, self.path, mode, newline="", encoding="utf-8")

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


def output_format(path: str | None, fmt: str) -> str:
    fmt = _format(path, fmt)
    return "csv" if fmt == "txt" else fmt


class ResultWriter(Output):
    """Output in a RowFormat, rows written and flushed as they come (stream.py: a pass's worth);
    `append` continues a file (whose CSV header the format's `names` then already hold)."""

    def __init__(self, path: str | None, form: RowFormat, append: bool = False):
        self.form = form
        super().__init__(path, "a" if append else "w")

    def write_rows(self, rows: list[Row], results, digest=None, ends_chunk: bool = True) -> int:
        """-> the bytes written. digest: a hashlib object of the chunk's bytes so far, which they
        extend (a resume checks the rows it keeps by it: chunk_digest)."""
        data = self.form.lines(rows, results)
        self.write(data)
        raw = data.encode("utf-8")
        if digest is not None:
            digest.update(raw)
        return len(raw)


def chunk_digest(raw: bytes = b""):
    """The digest of a chunk's bytes, as the sidecar records it (hexdigest()[:32]), extended by
    update() as the chunk is written."""
    return hashlib.sha256(raw)


def digest_text(digest) -> str:
    return digest.hexdigest()[:32]


def _result(r, row: Row, labels) -> dict:
    """JSONL's label, scores (in `labels`' order; None: the Result's own dict as it is) and error."""
    if r is None:
        return {"label": None, "scores": None, "error": row.error}
    return {"label": r.label, "scores": r.scores if labels is None else {l: r.scores[l] for l in labels},
            "error": None}


def _cell(v) -> str:
    """A CSV cell for an input value: text as it is, JSONL's numbers and objects as JSON, Parquet's
    dates and times in ISO form."""
    if v is None or isinstance(v, str):
        return "" if v is None else v
    if not isinstance(v, (dict, list, tuple, int, float)):
        return plain(v)
    return json.dumps(v, ensure_ascii=False, default=plain)


def plain(v):
    """JSON's stand-in for a value JSON has no type for (Parquet's timestamps, decimals, bytes)."""
    if hasattr(v, "isoformat"):
        return v.isoformat()
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    return str(v)


# JSONL lines by msgspec, compact: a tenth of json.dumps' time a row (CI host), and on a GPU host
# json.dumps in the writer thread held the GIL for a real share of a log job's samples,
# time the engine's thread waited for. Types JSON lacks: msgspec's own forms for datetimes (ISO
# 8601, as isoformat() for naive ones), decimals (text) and bytes (base64); plain() for the rest.
_JSONL = msgspec.json.Encoder(enc_hook=plain, decimal_format="string")


def json_text(obj) -> str:
    """obj as a JSONL line holds it (resume.py compares what is written with it)."""
    return _JSONL.encode(obj).decode("utf-8")
