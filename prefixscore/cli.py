"""Command line: `prefixscore classify`, `prefixscore eval`. With no flags every command uses the
bundled model, the seed prompt and the nine seed labels."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from collections import Counter

from .errors import InputError, PrefixScoreError
from .io import labels_option, template_option
from .prompt import SEED_LABELS


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and prompt")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--template", default=None, help="prompt template with one {query} slot (default: the seed prompt)")
    g.add_argument("--template-file", default=None, help="read the template from a file")
    g.add_argument("--labels", default=None, help="comma-separated labels (default: the nine seed labels)")
    g.add_argument("--labels-file", default=None, help="one label per line")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--mode", default="logprobs", choices=["logprobs", "logits"],
                   help="scores: label log-probs (default) or raw first-token logits (fastest)")
    g.add_argument("--chat", default=None, action=argparse.BooleanOptionalAction,
                   help="wrap the template in the model's chat template (default: if it has one)")
    g.add_argument("--truncate", action="store_true", help="cut queries that exceed the context instead of failing")
    g.add_argument("--allow-special-tokens", action="store_true",
                   help="parse special-token text such as <|im_end|> inside queries as control tokens "
                        "(default: plain text)")
    g.add_argument("--batch-tokens", type=int, default=16384, help="max new tokens per forward batch")
    g.add_argument("--adapter", default=None,
                   help="LoRA adapter (prefixscore finetune), merged into the weights at load; its "
                        "template, labels and chat flag are the defaults")
    g.add_argument("--head", default=None,
                   help="trained head (prefixscore fit-head); its template, labels and chat flag are the defaults")


def make_classifier(a):
    from .classifier import Classifier

    t0 = time.perf_counter()
    clf = Classifier(a.model, template_option(a), labels_option(a), device=a.device, dtype=a.dtype, chat=a.chat,
                     mode=a.mode, truncate=a.truncate, max_batch_tokens=a.batch_tokens,
                     head=getattr(a, "head", None), adapter=getattr(a, "adapter", None),
                     allow_special_tokens=a.allow_special_tokens)
    _err(f"model ready in {time.perf_counter() - t0:.1f} s: {clf.loaded.name} on {clf.engine.device} "
         f"({str(clf.engine.dtype).removeprefix('torch.')}), prefix {clf.prefix_len} tokens cached, "
         f"{len(clf.labels)} labels")
    return clf


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def classify_batches(clf, queries: list[str]):
    """Yield each flat batch's results, in input order, with a progress bar on stderr (shown for
    long inputs on a terminal). The next queries are tokenized while a batch runs, so a query only
    the tokenizer can fault (over the context limit) fails after the batches before it
    (Classifier.classify_batch_iter)."""
    from tqdm import tqdm

    with tqdm(total=len(queries), unit="q", disable=None if len(queries) > 256 else True,
              file=sys.stderr, desc="classify") as bar:
        yield from clf.classify_batch_iter(queries, progress=bar.update)


def run_batches(clf, queries: list[str]):
    """Tokenize and classify -> (results, seconds)."""
    t0 = time.perf_counter()
    results = [r for batch in classify_batches(clf, queries) for r in batch]
    return results, time.perf_counter() - t0


def cmd_classify(a) -> int:
    from .io import ResultWriter, check_output, read_rows

    if a.queries and a.input:
        raise InputError("give queries as arguments or --input, not both")
    if a.queries:
        queries = a.queries
    elif a.input or not sys.stdin.isatty():
        queries = [r[a.column] for r in read_rows(a.input or "-", a.input_format, (a.column,))]
    else:
        raise InputError("no queries: pass them as arguments, with --input FILE, or on stdin")
    for i, q in enumerate(queries):
        if not q.strip():
            raise InputError(f"query {i + 1} is empty")
    check_output(a.output)  # a bad path must fail now, not after the whole run
    clf = make_classifier(a)
    t0 = time.perf_counter()
    counts = Counter()
    with ResultWriter(a.output, a.format, clf.labels) as out:
        for batch in classify_batches(clf, queries):  # streamed: a crash or Ctrl-C keeps what is done
            out.write_results(batch)
            counts.update(r.label for r in batch)
    secs = time.perf_counter() - t0
    _err(f"classified {len(queries)} queries in {secs:.2f} s ({1e3 * secs / len(queries):.1f} ms/query); "
         + ", ".join(f"{l}: {n}" for l, n in counts.most_common()))
    return 0


def confusion_report(gold: list[str], pred: list[str], labels: list[str]) -> dict:
    idx = {l: i for i, l in enumerate(labels)}
    m = [[0] * len(labels) for _ in labels]
    for g, p in zip(gold, pred):
        m[idx[g]][idx[p]] += 1
    f1s = []
    for i in range(len(labels)):
        tp = m[i][i]
        prec = tp / max(1, sum(m[r][i] for r in range(len(labels))))
        rec = tp / max(1, sum(m[i]))
        f1s.append(0.0 if tp == 0 else 2 * prec * rec / (prec + rec))
    acc = sum(m[i][i] for i in range(len(labels))) / max(1, len(gold))
    return {"n": len(gold), "accuracy": acc, "macro_f1": sum(f1s) / len(f1s),
            "f1": dict(zip(labels, f1s)), "labels": labels, "confusion": m}


def format_confusion(rep: dict) -> str:
    labels = rep["labels"]
    w = max(8, max(len(l) for l in labels) + 1)
    lines = ["gold \\ predicted".ljust(w + 2) + "".join(l[:w].rjust(w) for l in labels)]
    for l, row in zip(labels, rep["confusion"]):
        lines.append(l[: w + 2].ljust(w + 2) + "".join(str(v).rjust(w) for v in row))
    return "\n".join(lines)


def cmd_eval(a) -> int:
    from .io import Output, check_output, read_rows

    check_output(a.json)
    rows = read_rows(a.data, a.input_format, (a.column, a.label_column))
    labels = labels_option(a) or (None if getattr(a, "head", None) else SEED_LABELS)
    if labels is not None:  # fail before loading the model when we can
        _check_gold(rows, a, labels)
    clf = make_classifier(a)
    _check_gold(rows, a, clf.labels)
    queries = [r[a.column] for r in rows]
    results, secs = run_batches(clf, queries)
    rep = confusion_report([r[a.label_column] for r in rows], [r.label for r in results], clf.labels)
    rep["ms_per_query"] = 1e3 * secs / len(rows)
    print(f"{a.data}: {rep['n']} rows, accuracy {rep['accuracy']:.3f}, macro-F1 {rep['macro_f1']:.3f}, "
          f"{rep['ms_per_query']:.2f} ms/query (batched)")
    print(format_confusion(rep))
    if a.json:
        with Output(a.json) as f:
            f.write(json.dumps(rep, indent=1))
    return 0


def _check_gold(rows, a, labels) -> None:
    unknown = sorted({r[a.label_column] for r in rows} - set(labels))
    if unknown:  # repr: a trailing space or a case difference must show
        raise InputError(f"{a.data}: gold labels not in the label set: {', '.join(map(repr, unknown))}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixscore", description=__doc__)
    sub = p.add_subparsers(dest="command")
    c = sub.add_parser("classify", help="classify queries (arguments, a file, or stdin)")
    c.add_argument("queries", nargs="*", help="queries to classify")
    c.add_argument("-i", "--input", help="file with queries (txt: one per line, csv, jsonl); - for stdin")
    c.add_argument("--input-format", default="auto", choices=["auto", "txt", "csv", "jsonl"])
    c.add_argument("--column", default="query", help="query column for CSV/JSONL input")
    c.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    c.add_argument("--format", default="auto", choices=["auto", "csv", "jsonl"],
                   help="output format (default: from the output file's extension, else csv)")
    _model_args(c)
    c.set_defaults(func=cmd_classify)
    e = sub.add_parser("eval", help="accuracy and confusion matrix against a label column")
    e.add_argument("data", help="CSV or JSONL with query and label columns")
    e.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl"])
    e.add_argument("--column", default="query")
    e.add_argument("--label-column", default="label")
    e.add_argument("--json", default=None, help="also write the report as JSON")
    _model_args(e)
    e.set_defaults(func=cmd_eval)
    # Other commands live beside what they drive: each module adds its own subcommand.
    for name in ("scorer", "server", "heads", "train.__main__"):
        if importlib.util.find_spec(f"prefixscore.{name}") is not None:
            importlib.import_module(f"prefixscore.{name}").add_command(sub, _model_args)
    return p


def main(argv=None) -> int:
    p = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    a.argv = argv[1:]  # the command's own arguments (`serve --config` parses them again)
    if not getattr(a, "func", None):
        p.print_help()
        return 2
    try:
        return a.func(a)
    except PrefixScoreError as e:
        _err(f"prefixscore: error: {e}")
        return 2
    except KeyboardInterrupt:
        _err("prefixscore: interrupted")
        return 130
    except BrokenPipeError:  # the reader left (`prefixscore classify ... | head -1`): stop quietly
        # stdout to /dev/null, or the interpreter's last flush of it fails again on the way out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what a shell reports for a tool the signal stopped


if __name__ == "__main__":
    sys.exit(main())
