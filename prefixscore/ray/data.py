"""Ray Data batch classification (issue 21 item 5): `classify_dataset(ds)` adds the results to each
row of any Ray Dataset; files.py builds `prefixscore classify --ray` on the same pool.

The pool: map_batches over one actor per GPU (num_gpus=1), each holding one Classifier; on a cluster
without GPUs, one actor per CPU save one (left to reading and writing; Ray sets a one-CPU actor's
OMP_NUM_THREADS to 1). Ray Data restarts an actor that dies and runs its batch again (max_restarts
and max_task_retries -1: its defaults for an actor pool), and a batch's output counts once, when it
completes: a killed actor loses no row and doubles none.
"""
from __future__ import annotations

import json
import logging
import os

from ..errors import ConfigError, PrefixScoreError
from ..rows.io import Row, query_row
from ..rows.writer import RowFormat, output_name
from ..rows.resume import CHUNK_ROWS, model_record
from ..rows.stream import encode_rows

try:
    import pyarrow as pa
    import ray
    import ray.data
except ImportError:
    raise ConfigError("Ray Data is not installed: pip install 'prefixscore[ray]'") from None

ARROW = {str: pa.string(), float: pa.float64()}


def quiet_logs() -> None:
    """For the CLI (`classify --ray`), which shows its own progress and summary: off stderr go Ray
    Data's info lines (its plan, where its logs are), its note that its progress bars are off, and
    the note on token authentication of the local cluster the command starts. (Ray's core worker
    still prints one ERROR line per actor pool about constructor arguments in the object store,
    ray-project/ray#57733; RAY_BACKEND_LOG_LEVEL would hide it only by adding a line to every
    Ray process.)"""
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def connect() -> None:
    """Join the cluster of RAY_ADDRESS, else the one running here, else start one (ray.init)."""
    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING)


def pool_args(actors: int | None) -> dict:
    """map_batches' resources: one actor per GPU of the cluster; without GPUs, one per CPU save one."""
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 1))
    if actors is not None and actors < 1:
        raise ConfigError(f"actors must be at least 1, got {actors}")
    size, gpu = (actors or gpus, {"num_gpus": 1}) if gpus else (actors or max(1, cpus - 1), {})
    return {"compute": ray.data.ActorPoolStrategy(size=size), "num_cpus": 1} | gpu


class Classify:
    """An actor of the pool: one Classifier; per batch each row's result. raw (files.py): the label,
    every label's score and the model record, for the driver's writers; else the typed result
    columns of the CLI's Parquet output (label, score:LABEL... or the top k, error), after the row's
    own columns."""

    def __init__(self, classifier: dict, column: str, raw: bool, probs: bool = False, top_k=None):
        from ..classifier import Classifier

        self.clf = Classifier(**classifier)
        self.column, self.raw = column, raw
        self.form = RowFormat("parquet", self.clf.labels, column, probs=probs, top_k=top_k)
        # What the driver records beside each output: the model as this actor loaded it (its device
        # and dtype), so no other process loads it to learn them.
        self.record = json.dumps(model_record(self.clf, classifier.get("adapter"), classifier.get("head"))
                                 | {"labels": self.clf.labels})

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.raw:  # the reader said which rows have no query, and why
            rows = [Row(0, 0, {}, q, e) for q, e in zip(batch["query"].to_pylist(),
                                                        batch["error"].to_pylist())]
        else:
            rows = [query_row(0, 0, {self.column: q}, self.column) for q in batch[self.column].to_pylist()]
        # As the CLI does: a query the tokenizer refuses (over the context limit) is an error row.
        results = iter(self.clf.classify_encoded(encode_rows(self.clf, rows, False, str)))
        out = [None if row.error else next(results) for row in rows]
        errors = pa.array([row.error for row in rows], pa.string())
        if self.raw:
            labels, n = self.clf.labels, len(rows)
            record = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int8()), pa.array([self.record]))
            return (batch.drop_columns(["query", "error"]).append_column("error", errors)
                    .append_column("label", pa.array([r and r.label for r in out], pa.string()))
                    .append_column("scores", pa.array([r and [r.scores[l] for l in labels] for r in out],
                                                      pa.list_(pa.float64())))
                    .append_column("model", record))  # one string per batch, an index per row
        ours = [name for name, _ in self.form.result_columns]
        table = batch.rename_columns([c if c == self.column else output_name(c, tuple(ours))
                                      for c in batch.column_names])
        values = zip(*(self.form.result_values(r, row) for r, row in zip(out, rows))) if rows \
            else [()] * len(ours)
        for (name, kind), col in zip(self.form.result_columns, values):
            table = table.append_column(name, pa.array(list(col), ARROW[kind]))
        return table


def pool(ds, classifier: dict, column: str = "query", raw: bool = False, probs: bool = False,
         top_k=None, actors: int | None = None, batch_size: int = CHUNK_ROWS):
    return ds.map_batches(Classify, fn_constructor_kwargs=dict(
        classifier=classifier, column=column, raw=raw, probs=probs, top_k=top_k),
        batch_format="pyarrow", batch_size=batch_size, **pool_args(actors))


def classify_dataset(ds, column: str = "query", *, probs: bool = False, top_k: int | None = None,
                     actors: int | None = None, batch_size: int = CHUNK_ROWS, **classifier):
    """`ds` with each row's result added (lazily, as Ray Data does): label, score:LABEL per label
    (log-probabilities, or logits in mode "logits"), with `probs` prob:LABEL too, with `top_k` the
    k best as label_1, score_1... instead, and error: why a row has no result (its `column` missing,
    blank or not text, or over the context limit without truncate), else null. A column of the
    input named like one of these is renamed input:NAME. `classifier`: Classifier's arguments
    (model, template, labels, adapter, device, ...); `actors`: one per GPU, else one per CPU save
    one. Any Ray reader feeds it: ray.data.read_parquet("s3://bucket/logs/")."""
    classifier = checked(classifier)
    connect()
    return pool(ds, classifier, column, False, probs, top_k, actors, batch_size)


def checked(classifier: dict) -> dict:
    """Classifier's arguments checked here, as `prefixscore serve` checks its engine's: what an actor
    would find wrong only in its constructor (each its traceback, after Ray and the model start) is
    one error now: the template, labels, mode and batch size, the adapter and head files, a local
    model's files, the dtype's name. Local files become absolute paths (an actor's working
    directory is not the caller's)."""
    from ..classifier import MODES, classifier_labels
    from ..weights.loading import bundled_model_path, check, resolve, resolve_dtype
    from ..weights.adapter import read_adapter
    from ..prompt import check_template

    kw = dict(classifier)
    if kw.get("template") is not None:
        check_template(kw["template"], ("query",))
    if kw.get("labels") is not None:
        classifier_labels(kw["labels"])
    if kw.get("mode", "logprobs") not in MODES:
        raise ConfigError(f"unknown mode {kw['mode']!r}: use one of {', '.join(MODES)}")
    if not isinstance(kw.get("max_batch_tokens", 1), int) or kw.get("max_batch_tokens", 1) < 1:
        raise ConfigError(f"max_batch_tokens must be a positive integer, got {kw['max_batch_tokens']!r}")
    resolve_dtype(kw.get("dtype"), None)  # the name only: the device is the actors'
    if kw.get("adapter") is not None and kw.get("head") is not None:
        raise ConfigError("pass an adapter or a head, not both: an adapter brings its own decision rule")
    if kw.get("adapter") is not None:
        read_adapter(kw["adapter"])
    if kw.get("head") is not None:
        from ..weights.heads import read_head

        read_head(kw["head"])
    model = kw.get("model")
    if model is None:
        bundled_model_path()
    elif isinstance(model, (str, os.PathLike)):  # a hub name is fetched here, and again by a node
        path = check(resolve(model))                # without it in its own cache
        kw["model"] = str(path) if os.path.exists(model) else model
    return kw | {k: os.path.abspath(v) for k in ("adapter", "head")
                 if isinstance(v := kw.get(k), str) and os.path.exists(v)}


def _describe(classifier: dict) -> dict:
    from ..classifier import Classifier

    clf = Classifier(graphs=False, **classifier)
    return model_record(clf, classifier.get("adapter"), classifier.get("head")) | {"labels": clf.labels}


def describe(classifier: dict, actors: int | None = None) -> dict:
    """Classify's record (the model as an actor loads it, and the labels) without the pool: one
    Classifier built in a task on an actor's resources. A ConfigError or ModelLoadError comes out
    as itself."""
    opts = {"num_gpus": 1} if pool_args(actors).get("num_gpus") else {"num_cpus": 1}
    try:  # max_calls=1: the task's process goes, and with it the GPU memory it held
        return ray.get(ray.remote(max_calls=1, **opts)(_describe).remote(classifier))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, PrefixScoreError):
            raise e.cause from None
        raise
