"""Many input files in one `prefixscore classify` (issue 21): -i names a glob or a directory, -o a
directory, and each input gets its own output there (its name, the output format's extension).

An output is written as OUT.partial and renamed to OUT when complete; its sidecar OUT.meta.json then
records the options (stream.py) and, last, what was done: the rows written and the input's size and
mtime. That record is what "finished" means, so a torn or stale file never passes for one: --resume
skips the finished outputs and redoes the rest, in-process or on Ray (prefixscore/ray/data.py)."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .io import RowReader
from .writer import output_format
from ..errors import cannot_write
from .resume import META_FORMAT, check_meta, meta_path, write_meta
from .stream import ClassifyJob

# What a directory's input files end with (a glob takes what it matches).
INPUT_SUFFIXES = (".parquet", ".csv", ".jsonl", ".ndjson", ".json", ".txt")
OUTPUT_SUFFIX = {"csv": ".csv", "jsonl": ".jsonl", "parquet": ".parquet"}
PARTIAL = ".partial"


@dataclass(frozen=True, slots=True)
class Target:
    src: str  # the input file
    dst: str  # its output file
    fmt: str  # the output's format

    @property
    def partial(self) -> str:
        """Where the output is written until it is complete."""
        return self.dst + PARTIAL


def is_many(spec) -> bool:
    """-i names several files: a list, a directory, or a glob pattern that is not a file's name."""
    if isinstance(spec, (list, tuple)):
        return True
    return spec not in (None, "-") and (os.path.isdir(spec) or
                                        (glob.has_magic(spec) and not os.path.exists(spec)))


def _ours(name: str) -> bool:
    return name.endswith((".meta.json", PARTIAL)) or ".meta.json.tmp" in name


def expand(spec) -> list[str]:
    """The input files of a list, a directory (its files with an input suffix, not its subfolders')
    or a glob, sorted; never our own sidecars and partial outputs."""
    if isinstance(spec, (list, tuple)):
        files = list(spec)
    elif os.path.isdir(spec):
        files = sorted(str(p) for p in Path(spec).iterdir()
                       if p.is_file() and p.suffix.lower() in INPUT_SUFFIXES and not _ours(p.name))
        if not files:
            raise InputError(f"{spec}: no input files in this directory (names ending "
                             f"{', '.join(INPUT_SUFFIXES)}; a glob takes others)")
    else:
        files = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f) and not _ours(f))
        if not files:
            raise InputError(f"no input files match {spec!r}")
    return files


def plan(inputs, output: str | None, fmt: str = "auto", input_format: str = "auto") -> list[Target]:
    """(input, output, format) of each file. Several inputs write into the directory `output`
    (made if missing); one input writes to `output`, or into it if it is a directory. The output
    format is `fmt`, else the output file's extension, else (into a directory) the input's (text
    becomes CSV)."""
    if output in (None, "-"):
        raise InputError("one output file per input file: give -o DIR (or -o FILE for one input)")
    many = is_many(inputs)
    srcs = expand(inputs) if many else [inputs]
    if not many and not os.path.isdir(output) and not output.endswith(os.sep):
        return [Target(inputs, output, output_format(output, fmt))]
    if many and not isinstance(inputs, (list, tuple)) and os.path.isdir(inputs) \
            and os.path.exists(output) and os.path.samefile(inputs, output):
        raise InputError(f"-o {output} is the input directory: write the outputs to another one")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as e:
        raise cannot_write(output, e) from None
    targets, seen = [], {}
    for src in srcs:
        out = fmt if fmt != "auto" else output_format(src, input_format)
        dst = os.path.join(output, Path(src).stem + OUTPUT_SUFFIX[out])
        if dst in seen:
            raise InputError(f"{seen[dst]} and {src} would both be written to {dst}: give "
                             f"--format, or write them in separate runs")
        if os.path.exists(dst) and os.path.samefile(src, dst):
            raise InputError(f"the output file {dst} is the input file: write to another directory")
        seen[dst] = src
        targets.append(Target(src, dst, out))
    return targets


def check(t: Target, input_format: str, column: str, keep, chunk_rows: int, strict: bool,
          flags: dict) -> dict:
    """Before any model loads: what ClassifyJob checks of one file (its column and --keep-columns,
    the output's path, a --strict error in its first chunk) -> the options its sidecar records."""
    with RowReader(t.src, input_format, column) as reader:
        return ClassifyJob(reader, t.partial, t.fmt, keep, chunk_rows, False, strict, flags).options


def _input_stamp(src: str) -> dict:
    st = os.stat(src)
    return {"input_bytes": st.st_size, "input_mtime_ns": st.st_mtime_ns}


def looks_finished(t: Target) -> bool:
    """The output is complete, from its input as that is now (whether with these options, check_meta
    says: finished() does both)."""
    try:
        with open(meta_path(t.dst), encoding="utf-8") as f:
            meta = json.load(f)
        done = meta["done"] if meta["format"] == META_FORMAT else {}
        return os.path.isfile(t.dst) and all(done[k] == v for k, v in _input_stamp(t.src).items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def finished(t: Target, options: dict) -> bool:
    """looks_finished; and if it was written with other options than these, an InputError (as --resume
    of one file says)."""
    if not looks_finished(t):
        return False
    check_meta(t.dst, options)
    return True


def start(t: Target, options: dict) -> None:
    """Before a file's rows are written to its partial output: the partial's sidecar, so that an
    in-process --resume can continue it (CSV, JSONL) whoever wrote it."""
    if t.fmt != "parquet":
        write_meta(t.partial, options)


def commit(t: Target, options: dict, rows: int) -> None:
    """The partial output is complete: it becomes the output, and then its sidecar says so."""
    try:
        os.replace(t.partial, t.dst)
    except OSError as e:
        raise cannot_write(t.dst, e) from None
    write_meta(t.dst, options, {"rows": rows} | _input_stamp(t.src))
    try:
        os.remove(meta_path(t.partial))
    except FileNotFoundError:
        pass
