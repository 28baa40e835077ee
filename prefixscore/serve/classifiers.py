"""Several classifiers over one loaded model (`prefixscore serve --classifier ...`, or a
`[classifiers.NAME]` table per classifier in the --config file): their specs, read and checked
before the model loads, and what each one adds to the shared weights, logged at start-up.

    --classifier name=category,template-file=cat.txt,labels=Dress|Jeans|Hoodie
    --classifier 'name=gender,template=Men, women or kids? {query},labels-file=gender.txt,mode=logits'

    [classifiers.category]          # in serve.toml
    template-file = "cat.txt"
    labels = ["Dress", "Jeans", "Hoodie"]
    [classifiers.gender]
    template = "Men, women or kids? {query}"
    labels-file = "gender.txt"
    chat = false

Keys: name (the flag's; a table's name is its own), template or template-file, labels (a flag's
separated by '|', a table's a list) or labels-file (one per line: labels with '|' or ','), chat,
mode, head. In a flag a comma starts the next key only where a known key and '=' follow it, so a
template or a label may hold commas. --chat and --mode are every classifier's default. The first
classifier is the default of a request that names none. Flags given replace the file's tables.
"""
from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass

from ..errors import ConfigError, PrefixScoreError

log = logging.getLogger("prefixscore.serve")

KEYS = ("name", "template", "template-file", "labels", "labels-file", "chat", "mode", "head")
# A name is a model id in /v1/models and a Prometheus label value: no spaces, commas or quotes.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+/-]*")
_SPLIT = re.compile(rf",(?=\s*(?:{'|'.join(map(re.escape, KEYS))})\s*=)")
_KEYLIKE = re.compile(r",\s*([A-Za-z][\w-]*)\s*=")  # an unknown key after a comma: a typo, refused
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


@dataclass(frozen=True)
class ClassifierSpec:
    """One declared classifier: template and label files already read (the engine process needs
    none of them). None: the Classifier's default (a head's own, else the seed prompt's), and
    for chat and mode the server's --chat and --mode."""
    name: str
    template: str | None = None
    labels: tuple[str, ...] | None = None
    chat: bool | None = None
    mode: str | None = None
    head: str | None = None

    def kwargs(self, chat: bool | None, mode: str | None) -> dict:
        """Its Classifier keyword arguments (ModelSpec fields), under the server's chat and mode."""
        return dict(template=self.template, labels=tuple(self.labels) if self.labels else None,
                    chat=chat if self.chat is None else self.chat, mode=self.mode or mode,
                    head=self.head)


def parse_flag(text: str) -> ClassifierSpec:
    """One --classifier value."""
    raw = {}
    for part in _SPLIT.split(text):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in KEYS:
            raise ConfigError(f"--classifier {text!r}: {part!r} is not KEY=VALUE with KEY one of "
                              f"{', '.join(KEYS)}")
        if key in raw:
            raise ConfigError(f"--classifier {text!r}: {key} given twice")
        typo = _KEYLIKE.search(value)
        if typo:
            raise ConfigError(f"--classifier {text!r}: {typo.group(1)!r} is not a key (keys: "
                              f"{', '.join(KEYS)}); a template or label holding ',WORD=' goes in "
                              f"template-file or labels-file")
        raw[key] = value if key == "template" else value.strip()
    if "name" not in raw:
        raise ConfigError(f"--classifier {text!r}: name=NAME is required")
    name = raw.pop("name")
    return _spec(name, raw, f"--classifier {name}")


def parse_tables(text: str) -> dict:
    """The hidden --classifiers option: the config file's `classifiers` table, as the config
    reader passes a table on (its Python form; JSON works too)."""
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ConfigError("classifiers: one table per classifier, [classifiers.NAME] with keys "
                          f"{', '.join(k for k in KEYS if k != 'name')}")
    return value


def from_tables(tables: dict, where: str) -> list[ClassifierSpec]:
    out = []
    for name, raw in tables.items():
        at = f"{where}: [classifiers.{name}]"
        raw = {k.replace("_", "-"): v for k, v in raw.items()}
        unknown = sorted(set(raw) - set(KEYS) | ({"name"} & set(raw)))
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]!r} (keys: "
                              f"{', '.join(k for k in KEYS if k != 'name')}; the name is the table's)")
        out.append(_spec(name, raw, at))
    return out


def _spec(name, raw: dict, at: str) -> ClassifierSpec:
    """A spec from its keys (strings from a flag; TOML values from a table), files read."""
    from ..classifier import MODES, classifier_labels
    from ..rows.io import read_text
    from ..prompt import check_template

    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"{at}: the name {name!r} must be letters, digits and _ . : @ + / - "
                          f"(it is a model id in /v1/models)")
    for a, b in (("template", "template-file"), ("labels", "labels-file")):
        if a in raw and b in raw:
            raise ConfigError(f"{at}: give {a} or {b}, not both")
    for key, value in raw.items():
        ok = isinstance(value, str) or (key == "chat" and isinstance(value, bool)) or (
            key == "labels" and isinstance(value, list) and all(isinstance(v, str) for v in value))
        if not ok:
            raise ConfigError(f"{at}: {key} = {value!r}: expected "
                              f"{'a list of strings or ' if key == 'labels' else ''}"
                              f"{'true or false' if key == 'chat' else 'a string'}")
    template = raw.get("template")
    if "template-file" in raw:
        template = read_text(raw["template-file"], "template").rstrip("\n")
    if template is not None:
        try:
            check_template(template, ("query",))
        except ConfigError as e:
            raise ConfigError(f"{at}: {e}") from None
    labels = raw.get("labels")
    if "labels-file" in raw:
        labels = [l.strip() for l in read_text(raw["labels-file"], "labels").splitlines() if l.strip()]
    elif isinstance(labels, str):
        labels = [l.strip() for l in labels.split("|")]
    if labels is not None:
        try:
            labels = tuple(classifier_labels(labels))
        except ConfigError as e:
            raise ConfigError(f"{at}: {e}") from None
    chat = raw.get("chat")
    if isinstance(chat, str):
        if chat.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{at}: chat={chat!r}: true or false")
        chat = chat.lower() in _TRUE
    mode = raw.get("mode")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"{at}: mode={mode!r}: one of {', '.join(MODES)}")
    return ClassifierSpec(name, template, labels, chat, mode, raw.get("head") or None)


def specs(a) -> tuple[ClassifierSpec, ...]:
    """The classifiers the flags declare: --classifier (repeated), else the config file's
    [classifiers.NAME] tables; () when none (one classifier, named like the model). Checked
    against the single-classifier flags, which they replace."""
    flags, tables = getattr(a, "classifier", None), getattr(a, "classifiers", None)
    if flags:
        out = [parse_flag(t) for t in flags]
    elif tables:
        out = from_tables(tables, f"config file {getattr(a, 'config', None)}")
    else:
        return ()
    seen = set()
    for s in out:
        if s.name in seen:
            raise ConfigError(f"two classifiers are named {s.name!r}")
        seen.add(s.name)
    given = [f for f, v in (("--template", a.template), ("--template-file", a.template_file),
                            ("--labels", a.labels), ("--labels-file", a.labels_file),
                            ("--head", getattr(a, "head", None))) if v is not None]
    if given:
        raise ConfigError(f"{given[0]} describes the one default classifier; with --classifier (or "
                          f"[classifiers.NAME] tables) each classifier gives its own template, "
                          f"labels and head")
    adapter = getattr(a, "adapter", None)
    if adapter is not None and len(out) > 1:
        raise ConfigError(f"--adapter with {len(out)} classifiers: an adapter is merged into the "
                          f"weights, which every classifier of a server shares; serve one "
                          f"classifier per adapter (a server each), or the classifiers without it")
    if adapter is not None and out[0].head is not None:
        raise ConfigError("pass --adapter or a head, not both: an adapter brings its own decision rule")
    return tuple(out)


def seed_prompt_warnings(classifiers, adapter) -> list[str]:
    """As cmdline.warn_seed_prompt says it of --labels (said, not refused): a classifier with
    labels of its own and no template gets the seed prompt, which names the nine seed labels."""
    from ..prompt import SEED_LABELS

    return [f"classifier {s.name}: labels without a template: the default prompt names the nine "
            f"seed labels ({', '.join(SEED_LABELS)}), not these; give it a template (or "
            f"template-file) that names them"
            for s in classifiers if s.labels and s.template is None and s.head is None and
            adapter is None and sorted(s.labels) != sorted(SEED_LABELS)]


def check_heads(classifiers) -> None:
    """Every classifier's head file readable (before the model loads)."""
    from ..weights.heads import read_head

    for s in classifiers:
        if s.head is not None:
            try:
                read_head(s.head)
            except PrefixScoreError as e:
                raise type(e)(f"classifier {s.name}: {e}") from None


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory_line(info) -> str:
    """A ClassifierInfo's cost, as start-up logs it: what it adds beside the shared weights."""
    m = info.memory
    added = sum(v for k, v in m.items() if k != "model_bytes")
    share = f" ({100 * added / m['model_bytes']:.2f}% of the {mib(m['model_bytes'])} of weights " \
            f"every classifier shares)" if m.get("model_bytes") else ""
    parts = ", ".join(f"{k.replace('_', ' ').replace('kv', 'KV')} {mib(v)}" for k, v in m.items()
                      if k != "model_bytes")
    return (f"classifier {info.name}: {len(info.labels)} labels, prefix {len(info.prefix_ids)} "
            f"tokens; adds {mib(added)}{share}: {parts}")


def log_memory(infos) -> None:
    for info in infos:
        log.info(memory_line(info))
