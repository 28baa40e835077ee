"""python -m prefixscore.train finetune data.csv -o seed.adapter.safetensors [--template "{query}" --no-chat]

add_command(subparsers, model_args) registers `finetune` as a subcommand of another parser (the
top-level `prefixscore` command), as scorer.py and heads.py do."""
from __future__ import annotations

import argparse
import sys

from ..errors import PrefixScoreError
from ..loading import ADAPTER_OBJECTIVES
from .lora import DEFAULTS


def cmd_finetune(a) -> int:
    from ..io import labels_option, template_option
    from ..io import check_output
    from .lora import finetune

    check_output(a.output)  # before minutes of training
    adapter = finetune(a.data, model=a.model, template=template_option(a), labels=labels_option(a), chat=a.chat,
                       objective=a.objective, rank=a.rank, alpha=a.alpha, lr=a.lr, epochs=a.epochs,
                       seed=a.seed, val_fraction=a.val_fraction, patience=a.patience,
                       batch_size=a.batch_size, progress=not a.quiet, output=a.output,
                       query_column=a.column, label_column=a.label_column, input_format=a.input_format)
    t = adapter.meta["training"]
    val = f", val accuracy {t['val_acc']:.3f} (epoch {t['best_epoch']})" if "val_acc" in t else ""
    print(f"saved {a.output}: {a.objective} adapter, rank {a.rank}, {len(adapter.meta['labels'])} labels, "
          f"{t['train_rows']} training rows, {t['seconds']:.0f} s{val}")
    return 0


def add_command(sub, model_args) -> None:
    p = sub.add_parser("finetune", help="fine-tune a LoRA adapter (peft) on labeled queries",
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
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    model_args(p)
    p.set_defaults(func=cmd_finetune)


def main(argv=None) -> int:
    from ..cli import _model_args

    parser = argparse.ArgumentParser(prog="python -m prefixscore.train")
    add_command(parser.add_subparsers(dest="command", required=True), _model_args)
    a = parser.parse_args(argv)
    try:
        return a.func(a)
    except PrefixScoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
