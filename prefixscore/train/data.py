"""Training rows: (query, gold label) from a file or from Python values, checked before any model
loads."""
from __future__ import annotations

import os

from ..errors import InputError


def read_data(data, labels, query_col="query", label_col="label", fmt="auto", need_labels=True):
    """(queries, gold label indices) from a file path or a list of (query, label) pairs / dicts.
    InputError for no rows, a missing column, an unknown label or a single class."""
    from ..rows.io import read_rows

    cols = (query_col, label_col) if need_labels else (query_col,)
    if isinstance(data, (str, os.PathLike)):
        rows = read_rows(str(data), fmt, cols)
        where = str(data)
    else:
        rows = [r if isinstance(r, dict) else {query_col: r} if isinstance(r, str) else dict(zip(cols, r))
                for r in data]  # dicts, (query, label) pairs, or bare queries (teacher)
        where = "data"
        if not rows:
            raise InputError("data: no rows")
        for n, r in enumerate(rows):
            if any(not isinstance(r.get(c), str) or not r[c].strip() for c in cols):
                raise InputError(f"data row {n}: needs non-empty string values for {', '.join(cols)}")
    queries = [r[query_col] for r in rows]
    if not need_labels:
        return queries, None
    unknown = sorted({r[label_col] for r in rows} - set(labels))
    if unknown:
        raise InputError(f"{where}: labels not in the label set: {', '.join(map(repr, unknown[:10]))} "
                         f"(the label set: {', '.join(labels)}; pass labels / --labels to change it)")
    gold = [labels.index(r[label_col]) for r in rows]
    if len(set(gold)) < 2:
        raise InputError(f"{where}: every row has the label {labels[gold[0]]!r}: fine-tuning needs "
                         f"at least two classes")
    return queries, gold
