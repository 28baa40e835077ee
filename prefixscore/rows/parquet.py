"""Parquet output for `prefixscore classify`, through pyarrow (an optional dependency: the `parquet`
extra; io.ParquetRows reads it a batch at a time, so memory stays flat as it does for text input).
Output has CSV's columns, typed, and each chunk is written as one row group when it finishes."""
from __future__ import annotations

from ..errors import InputError, cannot_write
from .io import _pyarrow
from .writer import RowFormat, _cell


def check_parquet_output(output: str | None, resume: bool) -> None:
    """Before the model loads: pyarrow is there, the output is a file, and no --resume. A Parquet
    file is readable only once its footer is written, at the end: one that a crash cut off holds
    nothing to continue, and continuing one that was closed would need its row groups rewritten to
    come out byte for byte as one run's. Resume needs CSV or JSONL."""
    _pyarrow()
    if output in (None, "-"):
        raise InputError("Parquet output is written to a file (its footer comes last): give "
                         "-o OUT.parquet")
    if resume:
        raise InputError("--resume does not continue a Parquet file (it is readable only once "
                         "complete); write CSV or JSONL to be able to resume, and convert after")


class ParquetResultWriter:
    """Rows in RowFormat's CSV columns, typed: row int64, scores and probabilities float64, labels,
    error and text as strings; the query and the input's other columns keep their types where the
    input is Parquet too, else are written as CSV writes them (text, JSON for JSONL's non-text
    values, null for none). One row group per chunk; the file is complete when closed (a stop by
    SIGINT or SIGTERM closes it too)."""

    def __init__(self, path: str, form: RowFormat, reader):
        self.path, self.form, self.writer, self.schema = path, form, None, None
        self.held = []  # tables of the chunk being written
        self.input_schema = reader.f.schema if reader.fmt == "parquet" else None

    def _input_type(self, name: str):
        pa = _pyarrow()
        if self.input_schema is None:
            return pa.string()
        return self.input_schema.field(name).type

    def _open(self) -> None:
        pa, form = _pyarrow(), self.form
        kinds = {str: pa.string(), float: pa.float64()}
        fields = [pa.field("row", pa.int64()), pa.field("query", self._input_type(form.column))]
        fields += [pa.field(form.out_name(k), self._input_type(k)) for k in form.names]
        fields += [pa.field(name, kinds[kind]) for name, kind in form.result_columns]
        self.schema = pa.schema(fields)
        try:
            self.writer = pa.parquet.ParquetWriter(self.path, self.schema)
        except OSError as e:
            raise cannot_write(self.path, e) from None

    def _value(self, v):
        """An input value as its column holds it: as read (Parquet in), else CSV's text."""
        return v if self.input_schema is not None else (None if v is None else _cell(v))

    def write_rows(self, rows, results, digest=None, ends_chunk: bool = True) -> int:
        """Rows as they come (stream.py: a pass's worth), held until their chunk's last (or the
        close: a stop) so that a chunk is one row group."""
        pa, form = _pyarrow(), self.form
        if form.set_names(rows) or self.writer is None:
            self._open()
        kept = [form.kept(row.fields) for row in rows]
        columns = [[row.n for row in rows], [self._value(row.fields.get(form.column)) for row in rows]]
        columns += [[self._value(k.get(name)) for k in kept] for name in form.names]
        columns += [list(c) for c in zip(*(form.result_values(r, row) for row, r in zip(rows, results)))]
        arrays = [pa.array(c, type=f.type) for c, f in zip(columns, self.schema)]
        self.held.append(pa.Table.from_arrays(arrays, schema=self.schema))
        if ends_chunk:
            self._write_held()
        return 0

    def _write_held(self) -> None:
        if not self.held:
            return
        table, self.held = _pyarrow().concat_tables(self.held), []
        try:
            self.writer.write_table(table, row_group_size=table.num_rows)
        except OSError as e:
            raise cannot_write(self.path, e) from None

    def close(self) -> None:
        if self.writer is None:  # no rows: still a Parquet file, with the columns
            self.form.set_names([])
            self._open()
        self._write_held()
        try:
            self.writer.close()
        except OSError as e:
            raise cannot_write(self.path, e) from None

    def __enter__(self) -> "ParquetResultWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_predictions(path: str, queries, gold, results, labels) -> None:
    """`prefixscore eval --predictions OUT.parquet`: query, gold, predicted (strings) and a float64
    score:LABEL column per label, the columns of the CSV form."""
    pa = _pyarrow()
    columns = {"query": pa.array(queries, pa.string()), "gold": pa.array(gold, pa.string()),
               "predicted": pa.array([r.label for r in results], pa.string())}
    columns |= {f"score:{l}": pa.array([r.scores[l] for r in results], pa.float64()) for l in labels}
    try:
        pa.parquet.write_table(pa.table(columns), path)
    except OSError as e:
        raise cannot_write(path, e) from None
