"""Items as embeddings (DESIGN.md §9): `prefixscore fit-item-encoder` fits the map from an item's
text to its soft token by distillation from the text scorer (train/item_fit.py), and `prefixscore
embed-items` precomputes a catalogue's item-embedding table with it (rows/table_job.py: a chunk
at a time, resumable), which `Scorer(item_table=...)` and `serve --item-table` read."""
from __future__ import annotations

import hashlib
import json
import os

from .common import COMMANDS, common_args, err, quiet
from ..errors import ConfigError
from ..options import add_flags
from ..train.options import MAP_KINDS as KINDS, POOLINGS, ItemFitOptions as FitOptions
from ..values import ModelSpec

SAVE_DTYPES = ("float32", "float16", "bfloat16")  # a .safetensors table's vectors (torch's names)


def cmd_fit_item_encoder(a) -> int:
    from ..rows.io import labels_option, template_option
    from ..rows.writer import Output, check_output
    from ..train import ranking
    from ..train.item_fit import fit_item_encoder

    if not a.output.endswith(".safetensors"):
        raise ConfigError(f"{a.output}: an item encoder is written as a .safetensors file")
    check_output(a.output)  # before minutes of work
    check_output(a.json)
    opts = FitOptions(pooling=a.pooling, kind=a.map, width=a.width, rank=a.rank, epochs=a.epochs,
                      lr=a.lr, weight_decay=a.weight_decay, tau=a.tau, listwise=a.listwise,
                      pointwise=a.pointwise, val_fraction=a.val_fraction, seed=a.seed).check()
    cat = ranking.read_catalogue(a.catalogue, a.input_format, a.id_column, a.text_column,
                                 a.label_column)
    queries, qlabels = _first(*ranking.read_queries(a.queries, a.query_column, a.label_column),
                              a.max_queries)
    evq = evl = None
    if a.eval_queries:
        evq, evl = _first(*ranking.read_queries(a.eval_queries, a.query_column, a.label_column),
                          a.max_eval_queries)
    if cat.labels is None or qlabels is None or (evq is not None and evl is None):
        qlabels = evl = None  # candidates by label only where every file has one
    err(f"{len(cat.ids)} items, {len(queries)} queries"
        + (f", {len(evq)} held-out queries" if evq else ""))
    enc, info = fit_item_encoder(cat, queries, eval_queries=evq, query_labels=qlabels, eval_labels=evl,
                                 model=a.model, template=template_option(a), labels=labels_option(a),
                                 chat=a.chat, device=a.device, candidates=a.candidates,
                                 heldout_items=a.heldout_items, eval_fraction=a.eval_fraction,
                                 opts=opts, log=err, progress=not quiet())
    enc.save(a.output)
    print(format_agreement(info))
    print(f"saved {a.output}: {opts.kind} map, pooling {opts.pooling}, epoch {info['best_epoch']} of "
          f"{opts.epochs}, {info['seconds']['total']:.0f} s")
    if a.json:
        with Output(a.json) as f:
            f.write(json.dumps(info, indent=1, ensure_ascii=False) + "\n")
    return 0


def _first(queries, labels, n):
    if n is None:
        return queries, labels
    if n < 1:
        raise ConfigError(f"--max-queries and --max-eval-queries must be positive, got {n}")
    return queries[:n], labels[:n] if labels else None


def format_agreement(info: dict) -> str:
    """The agreement table: per held-out set, each map's NDCG@10 and Spearman with the teacher."""
    lines = [f"{'held-out set':28}{'map':14}{'NDCG@10':>9}{'Spearman':>10}"]
    for name, rows in info["agreement"].items():
        for m, r in rows.items():
            lines.append(f"{name:28}{m:14}{r['ndcg@10']:9.3f}{r['spearman']:10.3f}")
    return "\n".join(lines)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cmd_embed_items(a) -> int:
    import torch

    from ..rows.progress import Bar
    from ..rows.table_job import TableJob
    from ..train import ranking
    from ..train.item_encoder import ItemEncoder
    from ..weights.loading import base_hash, obtain

    enc = ItemEncoder.load(a.encoder)  # unreadable: an error before the catalogue and the model
    cat = ranking.read_catalogue(a.catalogue, a.input_format, a.id_column, a.text_column)
    options = {"encoder_sha256": _sha256(a.encoder), "id_column": a.id_column,
               "text_column": a.text_column, "save_dtype": a.save_dtype}
    job = TableJob(a.output, cat.ids, cat.texts, options, a.chunk_rows, a.resume, a.overwrite)
    loaded = obtain(a.model, a.device, a.dtype)
    enc.check_model(loaded, a.encoder)
    if job.done:
        err(f"--resume: {job.rows_done} of {len(cat.ids)} items kept from {job.output}.partial")
    left = len(cat.ids) - job.rows_done
    meta = {"base_model": base_hash(loaded), "base_name": str(loaded.name),
            "encoder": os.path.basename(a.encoder), "encoder_sha256": options["encoder_sha256"],
            "template": enc.meta.get("template", ""), "chat": json.dumps(enc.meta.get("chat")),
            "labels": json.dumps(enc.meta.get("labels", [])), "pooling": enc.pooling}
    bar = Bar(left, "item", "embed-items", disable=quiet())
    try:
        with bar:
            table = job.run(lambda texts, progress: enc.embed(loaded, texts, progress), meta,
                            getattr(torch, a.save_dtype), bar.update)
    except KeyboardInterrupt:
        err(f"interrupted: {job.rows_done} of {len(cat.ids)} items are in {job.output}.partial; "
            f"the same command with --resume continues")
        return 130
    dtype = a.save_dtype if a.output.endswith(".safetensors") else "float32"
    print(f"wrote {a.output}: {len(table)} items x {table.dim} ({dtype})")
    return 0


def _model_args(p) -> None:
    add_flags(p.add_argument_group("model and prompt"), ModelSpec, only=("model", "device", "dtype"))


def _catalogue_args(p) -> None:
    p.add_argument("catalogue", help="the items: CSV, JSONL or Parquet with an id and a text column")
    p.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl", "parquet"],
                   help="the catalogue's format (default: from its extension)")
    p.add_argument("--id-column", default="id")
    p.add_argument("--text-column", default="text")


def add_command(sub, model_args=None) -> None:
    """Register fit-item-encoder and embed-items as subcommands of `sub` (the `prefixscore` command)."""
    _fit_command(sub)
    _embed_command(sub)


def _fit_command(sub) -> None:
    p = sub.add_parser("fit-item-encoder", help=COMMANDS["fit-item-encoder"][1],
                       description="Fit an item encoder: the frozen model reads an item's text, a "
                                   "trained map turns it into one soft token, distilled from the text "
                                   "scorer's scores so that soft tokens rank candidates as the text does.")
    _catalogue_args(p)
    p.add_argument("--queries", required=True, help="queries (txt, CSV, JSONL or Parquet) to fit on")
    p.add_argument("--eval-queries", default=None, help="held-out queries to report agreement on "
                   "(default: --eval-fraction of --queries)")
    p.add_argument("-o", "--output", required=True, help="encoder file to write (.safetensors)")
    p.add_argument("--json", default=None, help="also write the report (agreement, history) as JSON")
    p.add_argument("--query-column", default="query")
    p.add_argument("--label-column", default="label", help="where the catalogue and the queries both "
                   "have it, candidates include items of the query's label (default: label)")
    p.add_argument("--max-queries", type=int, default=None, help="use the first N training queries")
    p.add_argument("--max-eval-queries", type=int, default=None, help="use the first N held-out queries")
    g = p.add_argument_group("ranking set")
    g.add_argument("--candidates", type=int, default=20, help="candidate items per query (default 20)")
    g.add_argument("--heldout-items", type=float, default=0.2,
                   help="share of the catalogue never trained on, reported apart (default 0.2)")
    g.add_argument("--eval-fraction", type=float, default=0.2,
                   help="share of --queries held out when no --eval-queries (default 0.2)")
    _fit_options_args(p.add_argument_group("the map and its training"))
    g = p.add_argument_group("model and prompt")
    add_flags(g, ModelSpec, only=("model", "chat", "device"))
    g.add_argument("--template", default=None, help="the scorer's template with {query} and {item} "
                   "(default: the Scorer's yes/no relevance prompt)")
    g.add_argument("--template-file", default=None)
    g.add_argument("--labels", default=None, help="comma-separated single-token labels, the relevant "
                   "one first (default: yes,no)")
    g.add_argument("--labels-file", default=None)
    common_args(p)
    p.set_defaults(func=cmd_fit_item_encoder)


def _fit_options_args(g) -> None:
    """FitOptions' flags (the map and its training), their defaults its fields'."""
    d = FitOptions()
    g.add_argument("--pooling", default=d.pooling, choices=POOLINGS,
                   help="the hidden state read: prompt (default), the read-out row of the scorer's "
                        "prompt with the item in its slot and an empty query; mean or last, of the "
                        "item's text read alone")
    g.add_argument("--map", default=d.kind, choices=KINDS, help="linear (default) or linear + a small MLP")
    g.add_argument("--rank", type=int, default=d.rank, help="rank of the linear part (0: full)")
    g.add_argument("--width", type=int, default=d.width, help="the MLP's width")
    g.add_argument("--epochs", type=int, default=d.epochs)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--tau", type=float, default=d.tau, help="listwise temperature, in units of the "
                   "teacher's within-query spread")
    g.add_argument("--listwise", type=float, default=d.listwise, help="weight of the listwise KL loss")
    g.add_argument("--pointwise", type=float, default=d.pointwise, help="weight of the squared-error loss")
    g.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="training queries kept aside to pick the best epoch")
    g.add_argument("--seed", type=int, default=d.seed)


def _embed_command(sub) -> None:
    e = sub.add_parser("embed-items", help=COMMANDS["embed-items"][1], description="Embed every item of a catalogue with an item "
                       "encoder (fit-item-encoder): an id -> soft-token table, .parquet or "
                       ".safetensors, for Scorer(item_table=...) and serve --item-table.")
    _catalogue_args(e)
    e.add_argument("--encoder", required=True, help="the item encoder (.safetensors, fit-item-encoder)")
    e.add_argument("-o", "--output", required=True, help="the table to write: .parquet or .safetensors")
    e.add_argument("--save-dtype", default="float32", choices=list(SAVE_DTYPES),
                   help="the vectors' dtype in a .safetensors table (Parquet holds float32)")
    e.add_argument("--chunk-rows", type=int, default=1024,
                   help="items embedded and written at a time (a resume keeps whole chunks)")
    e.add_argument("--resume", action="store_true",
                   help="continue an interrupted run (OUT.partial) with the same options")
    e.add_argument("--overwrite", action="store_true", help="replace an existing output or partial run")
    _model_args(e)
    common_args(e)
    e.set_defaults(func=cmd_embed_items)
