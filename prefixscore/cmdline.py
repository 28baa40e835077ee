"""What every `prefixscore` subcommand shares: the model and prompt flags, building a Classifier from
them with a one-line report on stderr, and classifying a list of queries in streamed batches with a
progress bar. cli.py and the modules that add their own subcommands (scorer, serve, train) import
this; it imports no command."""
from __future__ import annotations

import argparse
import sys
import time

from .io import labels_option, template_option


def model_args(p: argparse.ArgumentParser) -> None:
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
                        "template, labels and chat flag are the defaults. 'seed': the shipped one, "
                        "which classify, eval and serve use by default on the bundled model")
    g.add_argument("--no-adapter", action="store_true",
                   help="the raw model with the seed prompt, not the shipped seed adapter")
    g.add_argument("--head", default=None,
                   help="trained head (prefixscore fit-head); its template, labels and chat flag are the defaults")


def make_classifier(a):
    from .classifier import Classifier

    t0 = time.perf_counter()
    clf = Classifier(a.model, template_option(a), labels_option(a), device=a.device, dtype=a.dtype, chat=a.chat,
                     mode=a.mode, truncate=a.truncate, max_batch_tokens=a.batch_tokens,
                     head=getattr(a, "head", None), adapter=getattr(a, "adapter", None),
                     allow_special_tokens=a.allow_special_tokens)
    err(f"model ready in {time.perf_counter() - t0:.1f} s: {clf.loaded.name} on {clf.engine.device} "
         f"({str(clf.engine.dtype).removeprefix('torch.')}), prefix {clf.prefix_len} tokens cached, "
         f"{len(clf.labels)} labels")
    return clf


def err(msg: str) -> None:
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


# Flags that describe another task than the seed one: with any of them the raw model runs as asked.
_OWN_TASK = ("model", "template", "template_file", "labels", "labels_file", "head", "chat",
             "score_template")


def seed_adapter_default(a) -> None:
    """The default task (the bundled model, the seed labels, no template, head or adapter given) runs
    with the shipped seed adapter, fine-tuned for it: the raw 135M model answers "Dress" for almost
    everything. Sets a.adapter = "seed" and says so on stderr; --no-adapter keeps the raw model."""
    from .errors import ConfigError
    from .loading import SEED_ADAPTER

    if getattr(a, "no_adapter", False):
        if a.adapter is not None:
            raise ConfigError("--adapter and --no-adapter: pass one")
        return
    if a.adapter is not None or any(getattr(a, k, None) is not None for k in _OWN_TASK):
        return
    if not SEED_ADAPTER.is_file():
        err(f"note: the shipped seed adapter is missing ({SEED_ADAPTER}); the raw model runs")
        return
    a.adapter = "seed"
    err("using the shipped seed adapter (fine-tuned on the bundled intent data; its prompt replaces "
        "the seed instruction): --no-adapter for the raw model and the seed prompt")
