"""Command line: `prefixscore classify`, `prefixscore eval`. With no flags every command uses the
bundled model, the seed prompt and the nine seed labels."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from .. import __version__
from ..errors import InputError, PrefixScoreError
from ..options import recorded, values
from ..values import ModelSpec
from .common import (
    COMMANDS, apply_sources, batch_tokens, classifier_kwargs, err, error, log, make_classifier, model_args,
    quiet, run_batches, seed_adapter_default, verbosity,
)
from ..rows.files import is_many
from ..rows.io import labels_option
from ..rows.report import confusion_report, format_confusion, format_per_label, trained_on
from ..prompt import SEED_LABELS
from ..rows.resume import CHUNK_ROWS, model_record
from .resume_args import fill_from_sidecar


def cmd_classify(a) -> int:
    """Rows stream in chunks (stream.py): read, tokenized one chunk ahead, classified, written and
    flushed; memory stays flat however long the input. Output row N answers input row N."""
    from ..rows.io import RowReader
    from ..rows.stream import ClassifyJob

    if a.queries and a.input:
        raise InputError("give queries as arguments or --input, not both")
    filled = fill_from_sidecar(a)  # --resume alone: the options the output was written with
    if filled:
        err(f"--resume: as {a.output} was written: {', '.join('--' + k.replace('_', '-') for k in filled)}")
    if a.top_k is not None and a.top_k < 1:
        raise InputError(f"--top-k must be at least 1, got {a.top_k}")
    if a.show_prompt:
        return _show_prompt(a, a.queries[0] if a.queries else _first_query(a))
    if a.ray or is_many(a.input):
        if a.queries or not a.input or a.input == "-":
            raise InputError("--ray and several files (a glob or a directory) classify files: give "
                             "them with -i and the output with -o")
        return _classify_files(a)
    if a.queries:
        reader = RowReader(column=a.column, queries=a.queries)
    elif a.input or not sys.stdin.isatty():
        reader = RowReader(a.input or "-", a.input_format, a.column)
    else:
        raise InputError("no queries: pass them as arguments, with --input FILE, or on stdin")
    with reader:
        job = ClassifyJob(reader, a.output, a.format, _keep_columns(a.keep_columns), a.chunk_rows,
                          a.resume, a.strict, _flags(a), quiet=quiet())
        seed_adapter_default(a)
        clf = make_classifier(a)
        return job.run(clf, model_record(clf, a.adapter, a.head), err, log.warning)


def _classify_files(a) -> int:
    """One output file per input file (files.py): on Ray Data with --ray (prefixscore/ray/), else
    here, a file at a time with one model. Each output is written as OUT.partial and renamed when
    complete; --resume skips the finished ones (here a partial CSV or JSONL output also continues)."""
    from ..rows import files
    from ..rows.io import RowReader
    from ..rows.stream import ClassifyJob

    keep = _keep_columns(a.keep_columns)
    if a.ray:
        from ..ray import data  # without Ray: one ConfigError line naming the extra
        from ..ray.file_jobs import classify_files

        data.quiet_logs()
        seed_adapter_default(a)
        classify_files(a.input, a.output, input_format=a.input_format, column=a.column,
                       format=a.format, keep_columns=keep, probs=a.probs, top_k=a.top_k,
                       chunk_rows=a.chunk_rows, resume=a.resume, strict=a.strict, actors=a.ray_actors,
                       quiet=quiet(), info=err, **classifier_kwargs(a))
        return 0
    targets = files.plan(a.input, a.output, a.format, a.input_format)
    flags = _flags(a)
    options = [files.check(t, a.input_format, a.column, keep, a.chunk_rows, a.strict, flags)
               for t in targets]  # every file's, before the model loads
    seed_adapter_default(a)
    clf = make_classifier(a)
    model = model_record(clf, a.adapter, a.head)
    for t, o in zip(targets, options):
        if a.resume and files.finished(t, o | model | {"labels": clf.labels}):
            err(f"{t.src} -> {t.dst}: finished before, skipped")
            continue
        err(f"{t.src} -> {t.dst}")
        with RowReader(t.src, a.input_format, a.column) as reader:
            job = ClassifyJob(reader, t.partial, t.fmt, keep, a.chunk_rows,
                              a.resume and t.fmt != "parquet", a.strict, flags, quiet=quiet())
            status = job.run(clf, model, err, log.warning)
        if status:
            return status
        files.commit(t, job.options, job.done)
    return 0


def _flags(a) -> dict:
    """The options a sidecar records: the model's marked record (values.ModelSpec), batch_tokens
    as run (its default is the device's), as the Ray path records the classifier's; probs, top_k."""
    spec = ModelSpec(**values(ModelSpec, a, skip=("template", "labels")) | {"max_batch_tokens": batch_tokens(a)})
    return recorded(spec) | {"probs": a.probs, "top_k": a.top_k}


def _first_query(a) -> str:
    """--show-prompt's example: the first row of --input that has a query, else a stand-in."""
    from ..rows.files import expand
    from ..rows.io import RowReader

    if a.input:
        path = expand(a.input)[0] if is_many(a.input) else a.input
        with RowReader(path, a.input_format, a.column) as reader:
            q = next((r.query for r in reader if r.error is None), None)
            if q is not None:
                return q
    return "example query"


def _show_prompt(a, query: str, flags=None) -> int:
    """--show-prompt: what the model sees for `query` and how it is split, for each model the
    command would run (eval: each mode it compares); nothing is classified."""
    from .show import describe

    seed_adapter_default(a)
    for i, (name, fl) in enumerate(flags or [(None, {})]):
        clf = make_classifier(argparse.Namespace(**(vars(a) | fl)), graphs=False)
        print(("\n" if i else "") + (f"== {name} ==\n" if name else "") + describe(clf, query))
        del clf
    return 0


def _keep_columns(value: str):
    if value in ("all", "none"):
        return value
    names = [c.strip() for c in value.split(",")]
    if not all(names):
        raise InputError(f"--keep-columns: all, none, or a comma-separated list of columns, got {value!r}")
    return names


def cmd_eval(a) -> int:
    """Accuracy, macro-F1 and speed of every decision rule the flags name, side by side on the same
    rows: zero-shot (the prompt alone), a --head, an --adapter (the shipped seed adapter by default);
    then the confusion matrix of the last. The JSON report is the last rule's, with all in "modes"."""
    from ..rows.io import read_rows
    from ..rows.writer import Output, check_output

    check_output(a.json)
    _check_predictions(a.predictions)
    rows = read_rows(a.data, a.input_format, (a.column, a.label_column))
    head = a.head
    probe = argparse.Namespace(**(vars(a) | {"head": None}))  # a head is compared, not a new task
    seed_adapter_default(probe)
    adapter = probe.adapter
    labels = labels_option(a) or _file_labels(head, adapter) or SEED_LABELS
    _check_gold(rows, a, labels)  # before the model loads
    queries, gold = [r[a.column] for r in rows], [r[a.label_column] for r in rows]
    modes = [("zero-shot", {"head": None, "adapter": None})] if head or adapter else []
    modes += [(f"head {head}", {"head": head, "adapter": None})] if head else []
    modes += [(f"adapter {adapter}", {"head": None, "adapter": adapter})] if adapter else []
    modes = modes or [("zero-shot", {})]
    if a.show_prompt:
        return _show_prompt(probe, queries[0], modes if len(modes) > 1 else None)
    reps = []
    for name, flags in modes:
        clf = make_classifier(argparse.Namespace(**(vars(a) | flags)))
        _check_gold(rows, a, clf.labels)
        results, secs = run_batches(clf, queries)
        rep = confusion_report(gold, [r.label for r in results], clf.labels)
        rep |= {"mode": name, "template": clf.prompt.template, "chat": clf.prompt.chat,
                "ms_per_query": 1e3 * secs / len(rows)}
        trained = (clf.adapter_meta or {}).get("training", {})
        seen = trained_on(trained, queries, gold)
        if seen:  # a training-set score (in part), not a held-out one
            rep["mode"] += (" (trained on these rows)" if seen == len(rows) else
                            f" (trained on {seen} of these {len(rows)} rows)")
            rep["trained_rows"] = seen
        reps.append(rep)
        labels = clf.labels
        del clf  # one model in memory at a time
    print(f"{_data_name(a)}: {len(rows)} rows")
    w = max(len(r["mode"]) for r in reps) + 2
    print("mode".ljust(w) + "accuracy  macro-F1  ms/query (batched)")
    for r in reps:
        print(r["mode"].ljust(w) + f"{r['accuracy']:8.3f}  {r['macro_f1']:8.3f}  {r['ms_per_query']:8.2f}")
    print(f"\nconfusion of {reps[-1]['mode']}:\n" + format_confusion(reps[-1]))
    print(f"\nper label, {reps[-1]['mode']}:\n" + format_per_label(reps[-1]))
    if a.predictions:  # the last mode's, as the confusion matrix is
        _write_predictions(a.predictions, queries, gold, results, labels)
    if a.json:
        with Output(a.json) as f:
            f.write(json.dumps(reps[-1] | {"modes": reps}, indent=1))
    return 0


def _data_name(a) -> str:
    return "<stdin>" if a.data == "-" else a.data


def _check_predictions(path: str | None) -> None:
    """Before the model loads: --predictions can be written (Parquet: pyarrow is there, and a file)."""
    from ..rows.writer import check_output, output_format

    if path is not None and output_format(path, "auto") == "parquet":  # ('-' is stdout, CSV)
        from ..rows.parquet import check_parquet_output

        check_parquet_output(path, resume=False)
    check_output(path)


def _write_predictions(path: str, queries, gold, results, labels) -> None:
    """Each row's query, gold and predicted label and scores: CSV (score:LABEL columns to 6 digits,
    as classify writes them), or by the path's extension JSONL or Parquet (the scores as float64,
    every bit, as in JSONL)."""
    import csv
    import io

    from ..rows.writer import Output, output_format

    fmt = output_format(path, "auto")
    if fmt == "parquet":
        from ..rows.parquet import write_predictions

        write_predictions(path, queries, gold, results, labels)
        return
    if fmt == "jsonl":
        text = "".join(json.dumps({"query": q, "gold": g, "predicted": r.label, "scores": r.scores},
                                  ensure_ascii=False) + "\n" for q, g, r in zip(queries, gold, results))
    else:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["query", "gold", "predicted"] + [f"score:{l}" for l in labels])
        w.writerows([q, g, r.label, *(f"{r.scores[l]:.6g}" for l in labels)]
                    for q, g, r in zip(queries, gold, results))
        text = buf.getvalue()
    with Output(path) as f:
        f.write(text)


def _check_gold(rows, a, labels) -> None:
    unknown = sorted({r[a.label_column] for r in rows} - set(labels))
    if unknown:  # repr: a trailing space or a case difference must show
        raise InputError(f"{_data_name(a)}: gold labels not in the label set: {', '.join(map(repr, unknown))} "
                         f"(the labels: {', '.join(map(repr, labels))})")


def _file_labels(head, adapter) -> list[str] | None:
    """The labels a --head or --adapter file was trained on (its metadata: no model loads), those
    of the head, whose rule eval reports last; None if neither names them."""
    from ..weights.adapter import read_adapter
    from ..weights.heads import read_head

    if head is not None:
        return list(read_head(head).labels)
    if adapter is not None:
        return list(read_adapter(adapter).meta.get("labels") or []) or None
    return None


class Parser(argparse.ArgumentParser):
    """argparse's parser, and a "did you mean" for a mistyped command or flag (as Python 3.14's
    suggest_on_error)."""

    def error(self, message):
        import difflib
        import re

        m = re.search(r"(?:unrecognized arguments|invalid choice): '?(-{0,2}[\w-]+)", message)
        if m:
            word = m.group(1)
            known = list(COMMANDS) if not word.startswith("-") else [
                o for act in self._actions for o in act.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
            if close:
                message += f" (did you mean {close[0]}?)"
        super().error(message)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `prefixscore` parser. argv: the words it will parse, so only their command's module is
    imported and its parser built (the others are stubs that list it in --help): --version and
    the option errors of classify, eval and serve answer before torch loads."""
    p = Parser(prog="prefixscore", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    wanted = "all"  # the module whose command is run (None: commands.py's own, or none)
    if argv is not None:
        first = next((w for w in argv if not w.startswith("-")), None)
        wanted = COMMANDS[first][0] if first in COMMANDS else None
    _classify_command(sub)
    _eval_command(sub)
    # score, serve and the training commands: each module of this package adds its own subcommand.
    import importlib

    for module in dict.fromkeys(m for m, _ in COMMANDS.values() if m):
        if wanted in (module, "all"):
            importlib.import_module(f".{module}", __package__).add_command(sub, model_args)
    for name, (_, text) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=text)
    for command in sub.choices.values():  # main() parses a command's words again (apply_sources)
        command.set_defaults(command_parser=command)
    return p


def _classify_command(sub) -> None:
    c = sub.add_parser("classify", help=COMMANDS["classify"][1])
    c.add_argument("queries", nargs="*", help="queries to classify")
    c.add_argument("-i", "--input", help="file with queries (txt: one per line, csv, jsonl, parquet); - "
                        "for stdin; a glob ('logs/*.parquet') or a directory: one output per file in -o DIR")
    c.add_argument("--input-format", default="auto", choices=["auto", "txt", "csv", "jsonl", "parquet"],
                   help="default: from the file's extension; txt for stdin")
    c.add_argument("--column", default="query", help="query column for CSV/JSONL input")
    c.add_argument("-o", "--output", default=None,
                   help="output file (default: stdout); a directory for several input files")
    c.add_argument("--format", default="auto", choices=["auto", "csv", "jsonl", "parquet"],
                   help="output format (default: from the output file's extension, else csv)")
    c.add_argument("--probs", action="store_true",
                   help="also the probabilities: softmax of the scores over the labels (CSV prob:LABEL "
                        "columns, JSONL a probs object)")
    c.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="only the K best labels by score per row, in place of every label's score "
                        "(CSV label_1, score_1[, prob_1], ... columns; JSONL a top list)")
    c.add_argument("--show-prompt", action="store_true",
                   help="print the prompt for the first query (or an example) and its token split "
                        "(cached prefix, suffix, label tokens), then exit without classifying")
    c.add_argument("--keep-columns", default="all",
                   help="the input's other columns to carry into the output beside row, query, "
                        "label and scores: all (default), none, or a comma-separated list")
    c.add_argument("--strict", action="store_true",
                   help="refuse a blank or invalid row (exit 2, naming its line) instead of writing "
                        "it as a row with an error")
    c.add_argument("--resume", action="store_true",
                   help="continue the interrupted output file -o from the first input row it "
                        "lacks, with the options it was written with (its OUT.meta.json)")
    c.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS,
                   help=f"rows read, classified and written at a time (default {CHUNK_ROWS}; the "
                        "first chunks are shorter); --resume keeps the value it was written with")
    c.add_argument("--ray", action="store_true",
                   help="classify on Ray Data (pip install 'prefixscore[ray]'): one actor per GPU of "
                        "the cluster (RAY_ADDRESS, else a local one), one output file per input file; "
                        "-i may then be a glob or a directory (so it may without --ray), -o a directory")
    c.add_argument("--ray-actors", type=int, default=None, metavar="N",
                   help="with --ray: N actors (default: one per GPU; without GPUs one per CPU save one)")
    model_args(c)
    c.set_defaults(func=cmd_classify)


def _eval_command(sub) -> None:
    e = sub.add_parser("eval", help=COMMANDS["eval"][1])
    e.add_argument("data", help="CSV, JSONL or Parquet file with query and label columns; - for stdin "
                                "(with --input-format csv or jsonl)")
    e.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl", "parquet"],
                   help="default: from the file's extension")
    e.add_argument("--column", default="query")
    e.add_argument("--label-column", default="label")
    e.add_argument("--json", default=None, help="also write the report as JSON")
    e.add_argument("--predictions", default=None, metavar="FILE",
                   help="write each row's query, gold and predicted label and scores (of the last mode "
                        "compared) to a CSV file, or JSONL / Parquet for a .jsonl / .parquet name")
    e.add_argument("--show-prompt", action="store_true",
                   help="print the prompt for the first row's query and its token split for each mode, "
                        "then exit without classifying")
    model_args(e)
    e.set_defaults(func=cmd_eval)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser(argv)
    a, extra = p.parse_known_args(argv)
    if extra:  # said by the command's parser: its usage, and a flag it knows if one is close
        (a.command_parser if "command_parser" in vars(a) else p).error(
            f"unrecognized arguments: {' '.join(extra)}")
    a.argv = argv[1:]  # the command's own arguments (apply_sources parses them again)
    if "func" not in vars(a):  # no command
        p.print_help()
        return 2
    try:
        sources = apply_sources(a, a.command_parser)
        # serve sets up logging in each of its processes: it takes the flags as its --log-level
        with verbosity(a.verbosity, package_logging=a.command != "serve"):
            for line in sources:
                log.debug(line)
            return a.func(a)
    except PrefixScoreError as e:
        error(f"prefixscore: error: {e}")
        return 2
    except KeyboardInterrupt:
        error("prefixscore: interrupted")
        return 130
    except BrokenPipeError:  # the reader left (`prefixscore classify ... | head -1`): stop quietly
        # stdout to /dev/null, or the interpreter's last flush of it fails again on the way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what a shell reports for a tool the signal stopped


def run() -> None:
    """The `prefixscore` program: main(), then exit with its status. A job a signal stopped has
    closed its output and said where it stopped, so it leaves without the interpreter's teardown:
    ~0.9 s of torch and the model's memory on a CPU, as long as the engine pass the stop waited
    for (bench/stop.py)."""
    rc = main()
    if rc in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or file: nothing more to say there
                pass
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    run()
