"""What every `prefixscore` subcommand shares: the model and prompt flags, the command-line flags
(--config, --quiet, --verbose) with the config file and PREFIXSCORE_* environment variables under
them, the info/warning lines on stderr, building a Classifier from the flags with a one-line report,
and classifying a list of queries in streamed batches with a progress bar. cli.py and the modules
that add their own subcommands (scorer, serve, train) import this; it imports no command."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time

from ..errors import ConfigError
from ..rows.io import labels_option, template_option
from ..options import add_flags, values
from ..values import CPU_BATCH_TOKENS, GPU_BATCH_TOKENS, ModelSpec


# Every subcommand: (the cli module that adds it, None for commands.py's own; its one-line help).
# The command line builds only the parser of the command it runs (commands.build_parser), so
# --version, --help and a light command's option errors answer before torch is imported.
COMMANDS = {
    "classify": (None, "classify queries (arguments, a file, or stdin)"),
    "eval": (None, "accuracy and confusion matrix against a label column"),
    "score": ("score", 'score many items per query (JSONL {"query", "items"} per line)'),
    "serve": ("serve", "HTTP service: POST /v1/classify, /v1/score; GET /healthz, /metrics, /docs"),
    "finetune": ("train", "fine-tune a LoRA adapter (peft) on labeled queries"),
    "fit-head": ("train", "train an N-way head on the model's read-out hidden state"),
    "eval-modes": ("train", "prompt zero/few-shot vs trained heads with and without the instruction, "
                            "k-fold on one labeled file"),
    "fit-item-encoder": ("items", "fit the map from an item's text to its soft token (distilled from "
                                  "the text scorer)"),
    "embed-items": ("items", "precompute a catalogue's item-embedding table with an item encoder"),
    "completion": ("completion", "print a shell completion script: source <(prefixscore completion bash)"),
}

def model_args(p: argparse.ArgumentParser) -> None:
    """The model and prompt flags: ModelSpec's options (values.py), the template and labels (each
    also from a file) and --no-adapter."""
    g = p.add_argument_group("model and prompt")
    add_flags(g, ModelSpec, skip=("template", "labels"))
    g.add_argument("--template", default=None, help="prompt template with one {query} slot (default: the seed prompt)")
    g.add_argument("--template-file", default=None, help="read the template from a file")
    g.add_argument("--labels", default=None, help="comma-separated labels (default: the nine seed labels)")
    g.add_argument("--labels-file", default=None, help="one label per line")
    g.add_argument("--no-adapter", action="store_true",
                   help="the raw model with the seed prompt, not the shipped seed adapter")
    common_args(p)


def common_args(p: argparse.ArgumentParser) -> None:
    """Flags of every command (model_args adds them): where options come from, and how much is said."""
    g = p.add_argument_group("options and messages")
    g.add_argument("--config", default=None,
                   help=f"TOML file of options: keys are the long flags without '--' (batch-tokens = "
                        f"8192, labels = [\"yes\", \"no\"], truncate = true). Precedence: command line, "
                        f"then {ENV_PREFIX}* environment variables ({ENV_PREFIX}BATCH_TOKENS for "
                        f"--batch-tokens), then this file (default: ${ENV_PREFIX}CONFIG)")
    # One destination, so the last of --quiet / --verbose given wins, the command line's over the
    # environment's (the environment's words come first: see apply_sources).
    g.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const="quiet",
                   default="normal", help="no progress bar or info lines (errors and warnings still shown)")
    g.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const="verbose",
                   help="debug logging on stderr")


def batch_tokens(a) -> int:
    """--batch-tokens, or its default for the device the model will run on."""
    if a.batch_tokens is not None:
        return a.batch_tokens
    from ..weights.loading import resolve_device

    device = a.device
    try:
        gpu = resolve_device(device).type == "cuda"
    except ConfigError:  # a bad --device is reported where the model loads
        gpu = str(device).startswith("cuda")
    return GPU_BATCH_TOKENS if gpu else CPU_BATCH_TOKENS


def model_spec(a, warn: bool = True) -> ModelSpec:
    """The model and prompt flags as a ModelSpec (template and label files read here, so a process
    that builds the classifier elsewhere, a Ray actor or the engine process, needs neither).
    warn: say when the seed prompt runs without its adapter (not for declared classifiers)."""
    labels, template = labels_option(a), template_option(a)
    if warn:
        warn_seed_prompt(labels, template, a.adapter, a.head)
    spec = ModelSpec(template=template, labels=labels, **{
        **values(ModelSpec, a, skip=("template", "labels")), "max_batch_tokens": batch_tokens(a)})
    log.debug("%s", spec)
    return spec


def classifier_kwargs(a) -> dict:
    """Classifier's keyword arguments from the flags (Ray Data's actors take them as they are)."""
    spec = model_spec(a)
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def make_classifier(a, graphs: bool = True):
    from ..classifier import Classifier
    from ..overlap import settle_collector

    t0 = time.perf_counter()
    from ..weights.hub import quiet_downloads

    with quiet_downloads(quiet()):  # a hub name downloads here (loading.resolve), bars on stderr
        clf = Classifier(spec=model_spec(a), graphs=graphs)
    settle_collector()  # what loading built is never scanned again by a collection mid-run
    err(f"model ready in {time.perf_counter() - t0:.1f} s: {clf.loaded.name} on {clf.engine.device} "
         f"({str(clf.engine.dtype).removeprefix('torch.')}), prefix {clf.prefix_len} tokens cached, "
         f"{len(clf.labels)} labels")
    return clf


def warn_seed_prompt(labels, template, adapter, head) -> None:
    """Labels of one's own under the default prompt: that prompt lists the nine seed labels, so the
    model is asked one question and scored on another's answers. Said, not refused: it runs."""
    from ..prompt import SEED_LABELS

    if labels is None or template is not None or adapter is not None or head is not None:
        return
    if sorted(labels) != sorted(SEED_LABELS):
        warn(f"--labels without --template: the default prompt names the nine seed labels "
             f"({', '.join(SEED_LABELS)}), not these; give a --template (or --template-file) that "
             f"names them")


# ---------------------------------------------------------------- messages on stderr

class _Stderr(logging.Handler):
    """Writes to sys.stderr as it is when each message comes (pytest's capsys replaces it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


class _Format(logging.Formatter):
    """A command's own lines as they are; debug lines and other modules' records name their source."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == log.name and record.levelno >= logging.INFO:
            return record.getMessage()
        return f"{record.levelname.lower()}: {record.name}: {super().format(record)}"


# The commands' info and warning lines ("model ready ...", "classified ..."): a logger of their own
# that does not propagate, so a server's root logging setup neither drops nor doubles them.
log = logging.getLogger("prefixscore.cli")
log.propagate = False
log.setLevel(logging.INFO)
_handler = _Stderr()
_handler.setFormatter(_Format("%(message)s"))
log.addHandler(_handler)


@contextlib.contextmanager
def line_format(formatter: logging.Formatter | None):
    """The command's own lines (err, warn) in another form while it runs (serve --log-format
    json: as the server's); None: as they are."""
    saved = _handler.formatter
    if formatter is not None:
        _handler.setFormatter(formatter)
    try:
        yield
    finally:
        _handler.setFormatter(saved)


def err(msg: str) -> None:
    """An info line on stderr (--quiet drops it)."""
    log.info(msg)


def warn(msg: str) -> None:
    """A warning on stderr, shown under --quiet too."""
    log.warning(f"prefixscore: warning: {msg}")


def error(msg: str) -> None:
    """An error line on stderr: always shown."""
    print(msg, file=sys.stderr, flush=True)


def quiet() -> bool:
    """--quiet: no progress bars either."""
    return not log.isEnabledFor(logging.INFO)


@contextlib.contextmanager
def verbosity(level: str, package_logging: bool = True):
    """The command's --quiet / --verbose while it runs, restored after (main() may run again in the
    same process: the tests). verbose: debug lines of every prefixscore module on stderr too, unless
    the command sets up logging itself (`serve` maps the flags to its --log-level)."""
    pkg = logging.getLogger("prefixscore")
    saved = log.level, pkg.level
    log.setLevel({"quiet": logging.WARNING, "verbose": logging.DEBUG}.get(level, logging.INFO))
    handler = None
    if level == "verbose" and package_logging:
        handler = _Stderr()
        handler.setFormatter(_Format("%(message)s"))
        pkg.addHandler(handler)
        pkg.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.setLevel(saved[0])
        pkg.setLevel(saved[1])
        if handler is not None:
            pkg.removeHandler(handler)


# ---------------------------------------------------------------- config file and environment

ENV_PREFIX = "PREFIXSCORE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _long(act) -> str | None:
    """An option's first long name without '--' (batch-tokens); None for a positional."""
    return next((s[2:] for s in act.option_strings if s.startswith("--")), None)


def _options(parser) -> dict:
    """A command's flags by long name (what a config key or an environment variable names):
    {"batch-tokens": action, ...}; --help and --config are not options to set this way."""
    return {_long(act): act for act in parser._actions
            if _long(act) and act.dest not in ("help", "config")}


def _switch_words(act, on: bool) -> list[str]:
    """A switch's words: its flag when on; off, its "--no-" form where it has one (--no-chat), else
    nothing (the default is off)."""
    if on:
        return [f"--{_long(act)}"]
    return [act.option_strings[-1]] if isinstance(act, argparse.BooleanOptionalAction) else []


def _config_words(path: str, options: dict) -> list[tuple[str, list[str]]]:
    """(where, words) per key of a TOML config file."""
    import tomllib

    where = f"config file {path}"
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: {e}") from None
    out = []
    for key, value in cfg.items():
        act = options.get(key.replace("_", "-"))
        if act is None:
            raise ConfigError(f"{where}: unknown option {key!r}; known: {', '.join(sorted(options))}")
        if act.nargs == 0:  # a switch: --truncate, --quiet, --chat / --no-chat
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {key} is a switch: true or false")
            out.append((where, _switch_words(act, value)))
            continue
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key} takes a value, not {str(value).lower()}")
        if isinstance(value, list):  # labels = ["yes", "no"]: the flag's comma-separated form
            if any("," in str(v) for v in value):
                raise ConfigError(f"{where}: {key}: an element contains a comma, which would split "
                                  f"it; put such labels in a labels-file")
            value = ",".join(map(str, value))
        out.append((where, [f"--{_long(act)}={value}"]))  # one word: a value may start with '-'
    return out


def env_name(option: str) -> str:
    """The environment variable of a flag: batch-tokens -> PREFIXSCORE_BATCH_TOKENS."""
    return ENV_PREFIX + option.upper().replace("-", "_")


def _env_words(options: dict, environ) -> list[tuple[str, list[str]]]:
    """(where, words) per PREFIXSCORE_* variable that names one of the command's flags. Unset or
    empty is "not given"; variables of other commands' flags (PREFIXSCORE_PORT for classify) and
    others (PREFIXSCORE_CACHE) are not this command's and are left alone."""
    out = []
    for name, act in options.items():
        var = env_name(name)
        value = environ.get(var)
        if not value or act.help == argparse.SUPPRESS:  # suppressed: refused by its command anyway
            continue
        where = f"environment variable {var}"
        if act.nargs == 0:
            if value.strip().lower() not in _TRUE + _FALSE:
                raise ConfigError(f"{where}: --{name} is a switch: {'/'.join(_TRUE)} or {'/'.join(_FALSE)}, "
                                  f"got {value!r}")
            out.append((where, _switch_words(act, value.strip().lower() in _TRUE)))
        else:
            out.append((where, [f"--{name}={value}"]))
    return out


def apply_sources(a, parser, environ=None) -> list[str]:
    """Fill a command's options from its config file (--config, else $PREFIXSCORE_CONFIG) and from
    PREFIXSCORE_* environment variables, under the command line: command line > environment > config
    file > the flag's default. Each value becomes its flag's words, put before the command line's own
    words (`a.argv`) and parsed by the command's parser, so it is typed and checked as that flag is,
    and argparse keeping the last of a repeated option gives the precedence (a flag given on the
    command line wins even where it equals the default). -> where each option came from, for the
    debug log (names only: a value may be a secret, PREFIXSCORE_API_KEY)."""
    environ = os.environ if environ is None else environ
    options = _options(parser)
    config = a.config if a.config is not None else (environ.get(ENV_PREFIX + "CONFIG") or None)
    sources = (_config_words(config, options) if config else []) + _env_words(options, environ)
    a.source_words = [w for _, words in sources for w in words]  # what they said (resume_args.said)
    if not sources:
        return []
    parser.exit_on_error = False  # a bad value raises, to be reported as its source's
    try:
        for where, words in sources:  # each alone over the (valid) command line: an error is its own
            try:
                parser.parse_args(words + a.argv)
            except argparse.ArgumentError as e:
                raise ConfigError(f"{where}: {e}") from None
        merged = parser.parse_args([w for _, words in sources for w in words] + a.argv)
    finally:
        parser.exit_on_error = True
    for k, v in vars(merged).items():
        setattr(a, k, v)
    a.config = config
    return [f"{' '.join(w.split('=', 1)[0] for w in words)} from {where}" for where, words in sources if words]


def classify_batches(clf, queries: list[str]):
    """Yield each flat batch's results, in input order, with a progress bar on stderr (shown for
    long inputs on a terminal). The next queries are tokenized while a batch runs, so a query only
    the tokenizer can fault (over the context limit) fails after the batches before it
    (Classifier.classify_batch_iter)."""
    from ..rows.progress import Bar

    with Bar(len(queries), "row", "classify", disable=len(queries) <= 256 or quiet()) as bar:
        yield from clf.classify_batch_iter(queries, progress=bar.update)


def run_batches(clf, queries: list[str]):
    """Tokenize and classify -> (results, seconds)."""
    t0 = time.perf_counter()
    results = [r for batch in classify_batches(clf, queries) for r in batch]
    return results, time.perf_counter() - t0


# Flags that describe another task than the seed one: with any of them the raw model runs as asked.
_OWN_TASK = ("model", "template", "template_file", "labels", "labels_file", "head", "chat")


def seed_adapter_default(a) -> None:
    """The default task (the bundled model, the seed labels, no template, head or adapter given) runs
    with the shipped seed adapter, fine-tuned for it: the raw 135M model answers "Dress" for almost
    everything. Sets a.adapter = "seed" and says so on stderr; --no-adapter keeps the raw model."""
    from ..errors import ConfigError
    from ..weights.adapter import SEED_ADAPTER

    if a.no_adapter:
        if a.adapter is not None:
            raise ConfigError("--adapter and --no-adapter: pass one")
        return
    # (serve's --score-template leaves the seed task as it is: /v1/score then runs a copy of the
    # base weights of its own, serve/engine_proc.build)
    own = [k for k in _OWN_TASK if vars(a).get(k) is not None]
    if a.adapter is not None or own:
        return
    if not SEED_ADAPTER.is_file():
        err(f"note: the shipped seed adapter is missing ({SEED_ADAPTER}); the raw model runs")
        return
    a.adapter = "seed"
    err("using the shipped seed adapter (the seed prompt, fine-tuned on the bundled intent data): "
        "--no-adapter for the raw model")
