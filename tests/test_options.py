"""Options written once (prefixscore/options.py): each server option is a field of a frozen value,
and its flag, help, TOML key, PREFIXSCORE_* variable and Ray Serve key are derived from the field."""
import argparse
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from prefixscore.cli.common import apply_sources
from prefixscore.options import add_flags, option, options, proxy_keys, values
from prefixscore.serve.config import FrontendConfig, ScheduleOptions


def serve_parser():
    from prefixscore.cli.commands import build_parser
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_option_field_has_one_serve_flag_and_back():
    """Each field of FrontendConfig and ScheduleOptions is one `serve` flag (its dest the field's
    name), and no other flag writes a field of theirs."""
    p = serve_parser()
    by_dest = {}
    for act in p._actions:
        by_dest.setdefault(act.dest, []).append(act)
    for cls in (FrontendConfig, ScheduleOptions):
        for f in options(cls):
            (act,) = by_dest[f.name]
            assert act.option_strings == ["--" + f.name.replace("_", "-")] and act.help
    fields = {f.name for cls in (FrontendConfig, ScheduleOptions) for f in dataclasses.fields(cls)}
    assert fields - {f.name for cls in (FrontendConfig, ScheduleOptions) for f in options(cls)} == {"announce"}


def test_parsed_flags_build_the_value():
    p = serve_parser()
    a = p.parse_args(["--target-p99-ms", "5", "--depth-gains", "1,0,0", "--max-queue", "64",
                      "--max-queries", "8", "--cache-bytes", "1M"])
    assert ScheduleOptions(**values(ScheduleOptions, a)) == ScheduleOptions(5.0, depth_gains=(1.0, 0.0, 0.0))
    decided = {"workers": 1, "data_parallel": 1}
    fc = FrontendConfig(**values(FrontendConfig, a, skip=decided), **decided)
    assert (fc.max_queue, fc.max_queries, fc.cache_bytes) == (64, 8, 1 << 20)
    with pytest.raises(SystemExit):
        p.parse_args(["--depth-gains", "1,2"])


def test_a_new_field_gets_its_flag_help_config_key_and_variable(tmp_path):
    """A field added to a value needs no other edit: its flag, help and default, the TOML key and
    the PREFIXSCORE_* variable come from it."""
    @dataclass(frozen=True)
    class Limits:
        max_widgets: int = option(7, "widgets per request", proxy=True)
        fast: bool = option(False, "go fast")
        note: str | None = option(None, "a note")

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--config", default=None)
    add_flags(p, Limits)
    assert "widgets per request (default 7)" in p.format_help()
    assert Limits(**values(Limits, p.parse_args([]))) == Limits()
    assert Limits(**values(Limits, p.parse_args(["--max-widgets", "9", "--fast"]))) == Limits(9, True)
    cfg = tmp_path / "x.toml"
    cfg.write_text("max_widgets = 11\nfast = true\n")
    a = p.parse_args(["--config", str(cfg)])
    a.argv = ["--config", str(cfg)]
    apply_sources(a, p, environ={"PREFIXSCORE_NOTE": "hello"})
    assert Limits(**values(Limits, a)) == Limits(11, True, "hello")
    assert proxy_keys(Limits) == ("max_widgets",)


def test_ray_serve_keys_are_the_proxy_fields():
    from prefixscore.ray.serve import FRONT_KEYS
    assert FRONT_KEYS == proxy_keys(FrontendConfig)
    assert "max_queue" in FRONT_KEYS and "port" not in FRONT_KEYS and "max_connections" not in FRONT_KEYS
