"""Options written once: a field of a frozen value carries its default, its help, and how a command
line spells it; the flags (and so the TOML keys and PREFIXSCORE_* variables, which cli/common reads
through the flags) and Ray Serve's keys are derived here, as vLLM derives its flags from
EngineArgs' fields. A leaf: it imports nothing of the package.

    @dataclass(frozen=True)
    class Limits:
        max_queue: int = option(1024, "queries in flight per front end", proxy=True)

    add_flags(parser, Limits)           # --max-queue N (default 1024): queries in flight ...
    Limits(**values(Limits, args))      # the parsed flags back as the value's fields
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field


def option(default, help: str, *, type=None, parse=None, metavar: str | None = None,
           choices=None, flag_default=dataclasses.MISSING, proxy: bool = False,
           flag: str | None = None, switch: str | None = None, record: bool = False):
    """A dataclass field that is also a flag. type: the flag's value type where the default does
    not say it (None); parse: text -> the field's value (default: type); flag_default: the flag's
    default where it differs from the field's (None: decided from other flags when the value is
    built); proxy: also an option behind a proxy that owns the sockets (Ray Serve's keys); flag:
    the flag's name where it is not the field's (batch-tokens for max_batch_tokens: its key in
    argparse's namespace, TOML and Ray too); switch, for a field that may be None: "on" (a flag
    that sets True, else None) or "both" (--x / --no-x, else None); record: the rows an output
    holds depend on it, so a resumable output's sidecar records it (rows/resume.py)."""
    meta = {"help": help, "type": type, "parse": parse, "metavar": metavar, "choices": choices,
            "flag_default": flag_default, "proxy": proxy, "flag": flag, "switch": switch,
            "record": record}
    return field(default=default, metadata={"option": meta})


def options(cls) -> list[dataclasses.Field]:
    """The fields of cls that are options, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata]


def key(f: dataclasses.Field) -> str:
    """The option's name as the command line, TOML and Ray spell it (argparse's dest)."""
    return (f.metadata["option"]["flag"] or f.name).replace("-", "_")


def flag(f: dataclasses.Field) -> str:
    return "--" + key(f).replace("_", "-")


def add_flags(group, cls, skip=(), only=None) -> None:
    """One flag per option field of cls (but those named in skip; only: those named there), on an
    argparse parser or group:
    a bool field is a switch, any other takes a value parsed by the field's parse or type; the
    help ends with the default where the help does not say it."""
    for f in options(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        m = f.metadata["option"]
        default = f.default if m["flag_default"] is dataclasses.MISSING else m["flag_default"]
        text = m["help"] if "default" in m["help"] or default in (None, False) else \
            f"{m['help']} (default {default})"
        if isinstance(f.default, bool) or m["switch"]:
            action = argparse.BooleanOptionalAction if m["switch"] == "both" else "store_true"
            group.add_argument(flag(f), dest=key(f), action=action, default=default, help=text)
            continue
        kind = m["parse"] or m["type"] or (type(f.default) if f.default is not None else str)
        group.add_argument(flag(f), dest=key(f), type=kind, default=default, help=text,
                           metavar=m["metavar"], choices=m["choices"])


def values(cls, args, skip=()) -> dict:
    """The option fields of cls as the parsed flags set them (args: argparse's namespace), but
    those in skip: keyword arguments for cls."""
    return {f.name: getattr(args, key(f)) for f in options(cls) if f.name not in skip}


def recorded(value) -> dict:
    """{key: value} of a value's options marked record, None as the flag's default (a mode left
    to the component reads as the command line's default)."""
    out = {}
    for f in options(type(value)):
        m = f.metadata["option"]
        if m["record"]:
            v = getattr(value, f.name)
            out[key(f)] = v if v is not None or m["flag_default"] is dataclasses.MISSING else m["flag_default"]
    return out


def keys(cls, skip=()) -> dict[str, str]:
    """{the option's key (flag, TOML, Ray): the field's name} of cls's options but those in skip."""
    return {key(f): f.name for f in options(cls) if f.name not in skip}


def proxy_keys(cls) -> tuple[str, ...]:
    """The option fields of cls that mean something behind a proxy (Ray Serve's keys)."""
    return tuple(f.name for f in options(cls) if f.metadata["option"]["proxy"])
