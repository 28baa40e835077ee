"""`classify --resume` alone: the options an output was written with (its sidecar, rows/resume.py)
fill in every option this command leaves unsaid, before the input is opened or the model loads.
An option said (on the command line, in the environment or the config file) and in conflict with
the record is refused by the sidecar check, as before; a resume that had to repeat the job's
options (`--batch-tokens 512` left out: refused) no longer does."""
from __future__ import annotations

import argparse
import json

from ..options import keys
from ..rows.resume import META_FORMAT, meta_path
from ..values import ModelSpec

# The sidecar's options that are the command's own (the same name), and how a recorded value
# becomes the option's value where they differ.
SAME = ("input_format", "column", "format", "chunk_rows", "probs", "top_k", "template",
        *keys(ModelSpec))  # (the model's options: values.ModelSpec)
AS_FLAG = {"keep_columns": lambda v: v if isinstance(v, str) else ",".join(v),
           "labels": lambda v: ",".join(v) if not any("," in x for x in v) else None}


def said(a) -> set[str]:
    """The options this command was given (command line, environment, config file): its parser
    run again over its words with every default suppressed."""
    parser = a.command_parser
    saved = [(act, act.default) for act in parser._actions]
    for act, _ in saved:
        act.default = argparse.SUPPRESS
    try:
        words = a.source_words + a.argv
        return set(vars(parser.parse_known_args(words, argparse.Namespace())[0]))
    finally:
        for act, default in saved:
            act.default = default


def fill_from_sidecar(a) -> list[str]:
    """Options of a.output's sidecar set on `a` where the command said nothing -> their names.
    Nothing without --resume, an output or a readable sidecar (the job then says what is wrong)."""
    if not a.resume or a.output in (None, "-"):
        return []
    try:
        with open(meta_path(a.output), encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format") != META_FORMAT or not isinstance(meta.get("options"), dict):
            return []
    except (OSError, ValueError):
        return []
    options, given, filled = meta["options"], said(a), []
    if not a.queries and "input" not in given and options.get("input") not in (None, "-", "arguments"):
        a.input = options["input"]
        filled.append("input")
    for k, v in options.items():
        if k in given or not hasattr(a, k) or (k not in SAME and k not in AS_FLAG):
            continue
        value = AS_FLAG[k](v) if k in AS_FLAG and v is not None else v
        if value is not None and getattr(a, k) != value:
            setattr(a, k, value)
            filled.append(k)
    if ("template" in filled or "labels" in filled) and "labels_file" not in given:
        a.labels_file = None
    if "template" in filled and "template_file" not in given:
        a.template_file = None
    return filled
