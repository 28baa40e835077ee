"""The training subcommands of `prefixscore`: finetune (LoRA, train.lora), fit-head and eval-modes
(train.heads). cli.py registers them through add_command; `python -m prefixscore.train` runs them
alone."""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from .common import COMMANDS, batch_tokens, err, make_classifier, quiet, run_batches
from ..errors import ConfigError, InputError
from ..rows.report import format_confusion
from ..train.options import LORA_DEFAULTS as DEFAULTS, HeadFitOptions as FitOptions
from ..values import ADAPTER_OBJECTIVES, HEAD_KINDS as KINDS


def cmd_finetune(a) -> int:
    import torch

    from ..rows.io import labels_option, read_text, template_option
    from ..rows.writer import check_output
    from ..train.lora import finetune

    check_output(a.output)  # before minutes of training
    labels, teacher = labels_option(a), None
    if a.teacher:  # a (bigger) prompted model's decisions are the targets: the data needs only queries
        from ..classifier import Classifier

        tt = read_text(a.teacher_template_file, "teacher template").rstrip("\n") \
            if a.teacher_template_file else a.teacher_template
        teacher = Classifier(a.teacher, tt, labels, device=a.device, chat=a.teacher_chat,
                             truncate=a.truncate)
        err(f"teacher: {teacher.loaded.name}, prompt mode, prefix {teacher.prefix_len} tokens")
    finetune(a.data, model=a.model, template=template_option(a), labels=labels, chat=a.chat,
             teacher=teacher, objective=a.objective, rank=a.rank, alpha=a.alpha, lr=a.lr,
             epochs=a.epochs, seed=a.seed, val_fraction=a.val_fraction, patience=a.patience,
             batch_size=a.batch_size, progress=a.verbosity != "quiet", output=a.output, refit=a.refit,
             save_dtype=getattr(torch, a.save_dtype), device=a.device, dtype=a.dtype,
             query_column=a.column, label_column=a.label_column, input_format=a.input_format)
    return 0  # (finetune said where it saved the adapter, as it does for a Python caller)


def add_command(sub, model_args) -> None:
    """Register finetune, fit-head and eval-modes as subcommands of `sub` (the `prefixscore` command)."""
    add_finetune_command(sub, model_args)
    add_head_commands(sub, model_args)


def add_finetune_command(sub, model_args) -> None:
    p = sub.add_parser("finetune", help=COMMANDS["finetune"][1],
                       description="LoRA on the attention and MLP projections; the adapter file is "
                                   "merged into the weights at load, so inference runs at base speed.")
    p.add_argument("data", help="CSV or JSONL with query and label columns")
    p.add_argument("-o", "--output", required=True, help="adapter file to write (.safetensors)")
    p.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl"])
    p.add_argument("--column", default="query")
    p.add_argument("--label-column", default="label")
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--objective", default="label", choices=ADAPTER_OBJECTIVES,
                   help="label: next-token loss on the label tokens (default); head: a linear N-way head")
    g.add_argument("--rank", type=int, default=8)
    g.add_argument("--alpha", type=float, default=16)
    g.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    g.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="at most this many epochs")
    g.add_argument("--patience", type=int, default=DEFAULTS["patience"],
                   help="early stopping: epochs without a better validation accuracy")
    g.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    g.add_argument("--val-fraction", type=float, default=0.2, help="stratified validation share (0: none)")
    g.add_argument("--refit", default=DEFAULTS["refit"], action=argparse.BooleanOptionalAction,
                   help="after early stopping, train again on every row for the best epoch count")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--teacher", default=None, metavar="MODEL",
                   help="label the data's queries with this model's zero-shot decisions first "
                        "(distillation; the data then needs only a query column)")
    g.add_argument("--teacher-template", default=None, help="the teacher's prompt (default: the seed prompt)")
    g.add_argument("--teacher-template-file", default=None)
    g.add_argument("--teacher-chat", default=None, action=argparse.BooleanOptionalAction,
                   help="wrap the teacher's prompt in its chat template (default: if it has one)")
    g.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the LoRA weights' dtype in the file (bfloat16: half the size)")
    model_args(p)
    p.set_defaults(func=cmd_finetune)


def _shots(text: str) -> list[int]:
    try:
        ks = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--shots takes comma-separated integers, got {text!r}") from None
    if any(k < 0 for k in ks):
        raise ConfigError("--shots must be >= 0")
    return ks


def _fit_options(a) -> FitOptions:
    return FitOptions(kind=a.kind, hidden=a.hidden, epochs=a.epochs, patience=a.patience, lr=a.lr,
                      weight_decay=a.weight_decay, batch_size=a.batch_size, val_frac=a.val_frac,
                      refit=a.refit, seed=a.seed).check()


def _labeled(path, fmt, column, label_column, labels) -> tuple[list[str], list[str]]:
    from ..rows.io import read_rows

    rows = read_rows(path, fmt, (column, label_column))
    unknown = sorted({r[label_column] for r in rows} - set(labels))
    if unknown:
        raise InputError(f"{path}: labels not in the label set: {', '.join(map(repr, unknown))} "
                         f"(the label set: {', '.join(labels)}; pass --labels to change it)")
    return [r[column] for r in rows], [r[label_column] for r in rows]


def cmd_fit_head(a) -> int:
    import torch

    from ..rows.io import labels_option, template_option
    from ..classifier import Classifier
    from ..train.fit_heads import few_shot_template, fit_head
    from ..weights.heads import save_head
    from ..rows.io import read_rows
    from ..rows.writer import check_output
    from ..prompt import SEED_LABELS, SEED_TEMPLATE

    opts = _fit_options(a)
    if a.soft and not a.teacher:
        raise ConfigError("--soft fits the teacher's label distribution: it needs --teacher")
    check_output(a.output)
    labels = labels_option(a) or SEED_LABELS
    if a.teacher:  # unlabeled queries: the prompted model's decisions are the targets
        queries = [r[a.column] for r in read_rows(a.data, a.input_format, (a.column,))]
    else:
        queries, gold = _labeled(a.data, a.input_format, a.column, a.label_column, labels)
    template = template_option(a)
    if a.examples:
        ex_q, ex_l = _labeled(a.examples, "auto", a.column, a.label_column, labels)
        template = few_shot_template(template or SEED_TEMPLATE, list(zip(ex_q, ex_l)), a.shots, labels, a.seed)
    a.template, a.template_file = template, None
    clf = make_classifier(a)
    if a.teacher:
        tt = a.teacher_template
        if a.teacher_template_file:
            from ..rows.io import read_text

            tt = read_text(a.teacher_template_file, "teacher template").rstrip("\n")
        teacher = Classifier(clf.loaded, tt, labels, chat=a.teacher_chat, truncate=a.truncate,
                             max_batch_tokens=batch_tokens(a))
        err(f"teacher: prompt mode, prefix {teacher.prefix_len} tokens; labeling {len(queries)} queries")
        results, _ = run_batches(teacher, queries)
        # scores are log-probabilities under label-constrained decoding: softmax = that distribution
        scores = torch.tensor([[r.scores[l] for l in labels] for r in results])
        targets = scores.softmax(-1) if a.soft else torch.tensor([labels.index(r.label) for r in results])
        err("teacher decisions: " + ", ".join(f"{l}: {c}" for l, c in
                                                Counter(r.label for r in results).most_common()))
    else:
        targets = torch.tensor([labels.index(g) for g in gold])
    err(f"reading the hidden state of {len(queries)} queries (prefix {clf.prefix_len} tokens)")
    t0 = time.perf_counter()
    x = clf.features(queries)
    err(f"done in {time.perf_counter() - t0:.1f} s; training a {opts.kind} head")
    head, info = fit_head(x, targets, labels, opts, log=None if a.verbosity == "quiet" else print)
    info |= {"source": ("teacher-soft" if a.soft else "teacher") if a.teacher else "labels",
             "data": a.data}
    save_head(a.output, head, clf, info)
    what = "val" if info["val_rows"] else "train"
    print(f"saved {a.output}: {opts.kind} head, {len(labels)} labels, epoch {info['best_epoch']}, "
          f"{what} accuracy {info[what + '_acc']:.3f}" + (" (agreement with the teacher)" if a.teacher else ""))
    return 0


def cmd_eval_modes(a) -> int:
    from ..rows.io import labels_option, template_option
    from ..rows.progress import Bar
    from ..train.fit_heads import check_compare_options, compare_modes, modes_rows
    from ..rows.writer import Output, check_output
    from ..weights.loading import obtain
    from ..prompt import SEED_LABELS, SEED_TEMPLATE

    labels = labels_option(a) or SEED_LABELS
    shots, opts, template = _shots(a.shots), _fit_options(a), template_option(a) or SEED_TEMPLATE
    check_compare_options(labels, a.folds, a.latency_queries)  # all before the model loads
    check_output(a.json)
    queries, gold = _labeled(a.data, a.input_format, a.column, a.label_column, labels)
    loaded = obtain(a.model, a.device, a.dtype)
    with Bar(modes_rows(len(queries), shots), "row", "eval-modes", disable=quiet()) as bar:
        rep = compare_modes(loaded, queries, gold, labels, template, chat=a.chat,
                            head_template=a.head_template, head_chat=a.head_chat, shots=shots,
                            folds=a.folds, seed=a.seed, opts=opts,
                            latency_queries=a.latency_queries, log=err, progress=bar.update,
                            truncate=a.truncate, max_batch_tokens=batch_tokens(a))
    print(format_confusion_all(rep))
    if a.json:
        with Output(a.json) as f:
            f.write(json.dumps(rep, indent=1))
    return 0


def format_confusion_all(rep: dict) -> str:
    from ..train.fit_heads import format_modes

    out = [f"{rep['rows']} rows, {rep['folds']}-fold cross-validation (seed {rep['seed']})",
           format_modes(rep)]
    for m in rep["modes"]:
        out += ["", m["mode"], format_confusion({"labels": rep["labels"], "confusion": m["confusion"]})]
    return "\n".join(out)


def _fit_args(p) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--kind", default="linear", choices=KINDS, help="linear (default) or a small MLP")
    g.add_argument("--hidden", type=int, default=256, help="MLP width")
    g.add_argument("--epochs", type=int, default=200, help="at most this many epochs")
    g.add_argument("--patience", type=int, default=20, help="early stopping: epochs without a better val loss")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--weight-decay", type=float, default=1.0, help="AdamW decoupled weight decay")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--val-frac", type=float, default=0.2, help="stratified validation share (0: none)")
    g.add_argument("--refit", default=True, action=argparse.BooleanOptionalAction,
                   help="after early stopping, train again on all rows for the best epoch count")
    g.add_argument("--seed", type=int, default=0, help="split, initialization and example choice")


def add_head_commands(sub, model_args) -> None:
    p = sub.add_parser("fit-head", help=COMMANDS["fit-head"][1])
    p.add_argument("data", help="CSV or JSONL with a query column and (unless --teacher) a label column")
    p.add_argument("-o", "--output", required=True, help="head file to write (.safetensors)")
    p.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl"])
    p.add_argument("--column", default="query")
    p.add_argument("--label-column", default="label")
    p.add_argument("--teacher", action="store_true",
                   help="targets = the prompted model's decisions on the (unlabeled) queries")
    p.add_argument("--teacher-template", default=None, help="the teacher's prompt (default: the seed prompt)")
    p.add_argument("--teacher-template-file", default=None)
    p.add_argument("--teacher-chat", default=None, action=argparse.BooleanOptionalAction,
                   help="wrap the teacher's prompt in the chat template (default: if the model has one)")
    p.add_argument("--soft", action="store_true", help="with --teacher: fit the teacher's label distribution")
    p.add_argument("--examples", default=None, help="labeled CSV/JSONL: put a few-shot block in the template")
    p.add_argument("--shots", type=int, default=2, help="examples per label with --examples")
    _fit_args(p)
    model_args(p)
    p.set_defaults(func=cmd_fit_head)

    e = sub.add_parser("eval-modes", help=COMMANDS["eval-modes"][1])
    e.add_argument("data", help="CSV or JSONL with query and label columns")
    e.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl"])
    e.add_argument("--column", default="query")
    e.add_argument("--label-column", default="label")
    e.add_argument("--folds", type=int, default=5)
    e.add_argument("--shots", default="1,2,4", help="few-shot examples per label to try")
    e.add_argument("--head-template", default="{query}", help="template of the no-instruction head mode")
    e.add_argument("--head-chat", default=False, action=argparse.BooleanOptionalAction,
                   help="wrap the no-instruction template in the chat template (default: no)")
    e.add_argument("--latency-queries", type=int, default=32, help="rows timed one at a time per mode")
    e.add_argument("--json", default=None, help="also write the report as JSON")
    _fit_args(e)
    model_args(e)
    e.set_defaults(func=cmd_eval_modes)
