"""`prefixscore score`: multi-item scoring of a JSONL file ({"query", "items"} per line) through
Scorer, the next chunk prepared on a worker thread while the engine runs the one before."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from .common import COMMANDS, err, model_spec, quiet
from ..errors import ConfigError, InputError, error_at
from ..values import LAYOUTS, SCORE_MODES

# score_request's keys that the command does not take per line: refused rather than ignored
REQUEST_ONLY_KEYS = ("labels", "label_token_ids", "apply_softmax", "item_first")


def _read_requests(path: str) -> list[tuple[int, dict]]:
    """JSONL, one {"query": ..., "items": [...]} per line (other keys are passed through)."""
    from ..rows.io import _open, iter_jsonl

    out = []
    with _open(path) as f:
        try:
            for n, obj in iter_jsonl(f, path):
                if "query" not in obj or "items" not in obj:
                    raise InputError(f"{path}:{n}: expected an object with \"query\" and \"items\"")
                key = next((k for k in REQUEST_ONLY_KEYS if k in obj), None)
                if key:
                    raise InputError(f"{path}:{n}: {key!r} per request is not supported by `score`: "
                                     f"labels (--labels), mode (--mode) and the template's slot order "
                                     f"hold for the whole file; drop the key, or use Scorer.score_request "
                                     f"or POST /v1/score for per-request label sets")
                out.append((n, obj))
        except UnicodeDecodeError:
            raise InputError(f"{path}: not valid UTF-8") from None
    if not out:
        raise InputError(f"{path}: no requests")
    return out


def cmd_score(a) -> int:
    from ..rows.progress import Bar
    from ..rows.writer import Output, check_output

    if a.truncate:
        raise ConfigError("score does not truncate: an item over the context limit is an error")
    if a.head:
        raise ConfigError("score does not take --head: a trained head is for classify and eval")
    if a.chunk < 1:
        raise ConfigError(f"--chunk must be positive, got {a.chunk}")
    check_output(a.output)  # before the model loads
    src = a.input or "-"
    if src == "-" and sys.stdin.isatty():
        raise InputError("no requests: pass --input FILE (JSONL) or pipe JSONL on stdin")
    rows = _read_requests(src)
    t0 = time.perf_counter()
    from ..overlap import run_ahead
    from ..scorer import Scorer

    sc = Scorer(spec=model_spec(a, warn=False), layout=a.layout, max_items=a.max_items, item_table=a.item_table)
    err(f"model ready in {time.perf_counter() - t0:.1f} s: {sc.loaded.name} on {sc.engine.device} "
         f"({str(sc.engine.dtype).removeprefix('torch.')}), prefix {sc.prefix_len} tokens cached, "
         f"labels {', '.join(sc.labels)}, mode {sc.mode}")
    checked = []
    for n, obj in rows:  # what fails without tokenizing fails before any output
        with error_at(f"{src}:{n}"):
            checked.append((obj["query"], sc._check_text(obj["query"], obj["items"])))

    def prepare(lo, hi):  # on a worker thread, while the engine runs the chunk before
        out = []
        for (n, _), request in zip(rows[lo:hi], checked[lo:hi]):
            with error_at(f"{src}:{n}"):
                out.append(sc.prepare(*request))
        return out

    chunks = [(c, min(c + a.chunk, len(rows))) for c in range(0, len(rows), a.chunk)]
    n_items = sum(len(items) for _, items in checked)
    t0 = time.perf_counter()
    with Output(a.output) as out, Bar(n_items, "item", "score", disable=n_items <= 1024 or quiet()) as bar, \
            contextlib.closing(run_ahead(prepare, chunks)) as prepared:
        for (lo, hi), chunk in zip(chunks, prepared):  # each chunk written (and flushed) when done
            lines = []
            for (_, obj), res in zip(rows[lo:hi], sc.run(chunk, progress=bar.update)):
                rec = {k: v for k, v in obj.items() if k != "items"}
                rec.update(labels=sc.labels, best=[r.label for r in res],
                           scores=[[r.scores[l] for l in sc.labels] for r in res])
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
            out.write("".join(lines))
    secs = time.perf_counter() - t0
    err(f"scored {n_items} items of {len(rows)} requests in {secs:.2f} s "
         f"({n_items / max(secs, 1e-9):.0f} items/s)")
    return 0


def add_command(sub, model_args) -> None:
    p = sub.add_parser("score", conflict_handler="resolve",
                       help=COMMANDS["score"][1],
                       description="Score candidate items against a query: label scores per item, "
                                   "as if each item were scored alone with the whole prompt.")
    p.add_argument("-i", "--input", help="JSONL file, one {\"query\": ..., \"items\": [...]} per line "
                                         "(default: stdin)")
    p.add_argument("-o", "--output", default=None, help="JSONL output (default: stdout): per request "
                   "its other keys, labels, best label per item and scores per item and label")
    model_args(p)
    g = p.add_argument_group("multi-item scoring")
    g.add_argument("--template", default=None, help="template with {query} and {item} slots "
                   "(default: a yes/no relevance prompt)")
    g.add_argument("--labels", default=None, help="comma-separated labels (default: yes,no)")
    g.add_argument("--mode", default="logprobs", choices=SCORE_MODES,
                   help="logprobs (default), softmax (probabilities over the labels), logits, "
                        "vocab_probs (probability under the full vocabulary; single-token labels)")
    g.add_argument("--layout", default="auto", choices=LAYOUTS,
                   help="packed: query part once per span; alone: each item with its own copy; "
                        "auto (default): packed (an item's attention reads its query part and "
                        "its own tokens only, so sharing the query costs nothing)")
    g.add_argument("--max-items", type=int, default=1024, help="most items per request")
    g.add_argument("--item-table", default=None, metavar="FILE",
                   help="item-embedding table (.safetensors or .parquet: id -> vector) for items "
                        "given as {\"id\": ...}; items may also be {\"embedding\": [...]} or text")
    g.add_argument("--truncate", action="store_true", help=argparse.SUPPRESS)  # refused in cmd_score
    g.add_argument("--chunk", type=int, default=64, help="requests per call to the engine")
    p.set_defaults(func=cmd_score)
