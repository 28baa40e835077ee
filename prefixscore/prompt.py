"""Prompt template -> cached prefix tokens + per-request suffix tokens (DESIGN.md §2.1).

The guarantee: the tokens fed to the model are exactly the reference tokens of the whole prompt.
The reference, by default (special_tokens=False), keeps a query from forging chat turns: the
prompt is cut at the template's own special tokens (the chat scaffolding, BOS ...), which stay
control tokens, and each text run between them, slot values included, is tokenized as plain text
(HF `split_special_tokens=True`: `<|im_end|>` typed in a query is ordinary text), plus the tokens
a plain template gets from the tokenizer (BOS). With special_tokens=True the reference is the
tokenizer's tokens of the whole prompt text, as before.

Per request only the text from a resume point near the prefix's end that no token can cross is
tokenized (_resume_point, _run_resume), checked to start with the cached prefix; the split point,
chosen at startup, moves back past any token a probe merges across the boundary, and a request
that still disagrees is computed without the cache. Every shortcut is checked against the Hugging
Face call at startup; one that disagrees is dropped for the plain (slower, exact) form.
"""
from __future__ import annotations

import functools
import re

from .errors import ConfigError, InputError
from .weights.tokenizer import common_prefix_len, plain, rust_backend, second_to_last_word, token_chars

SEED_TEMPLATE = (
    "Analyze the category intent of the given query. Output exactly one label from: Dress, Jeans, "
    "Shirt, Trench Coat, Skirt, T-shirt, Hoodie, Knitwear, Other. Output nothing else\n"
    "query:{query}"
)
SEED_LABELS = ["Dress", "Jeans", "Shirt", "Trench Coat", "Skirt", "T-shirt", "Hoodie", "Knitwear", "Other"]

_SLOT = re.compile(r"\{(\w+)\}")
_SENTINEL = re.compile("\ue000SLOT-(\\w+)\ue001")  # sentinel(name), capturing the name
# Queries that provoke merges across the prefix boundary: letters, digits, spaces, punctuation, ...
PROBES = ["a", "A", " a", "  x", "1", "2024", "中文", "😀", "!", ".", "-", "'s", "\n", "\tx", "é", "x" * 40, ":", "Q"]


def sentinel(name: str) -> str:  # private-use characters: a chat template's `| trim` keeps them
    return f"\ue000SLOT-{name}\ue001"


def check_prefix_fits(prefix_len: int, label_len: int, limit: int) -> None:
    """The cached prefix, one token of the slots' text and the longest label must fit the context
    (else the prefix's own prefill would index past the RoPE table)."""
    if limit and prefix_len + 1 + label_len > limit:
        raise ConfigError(f"the template's fixed part is {prefix_len} tokens, so with the longest "
                          f"label ({label_len} tokens) not even one token of text fits the model's "
                          f"context limit of {limit} tokens: shorten the template")


def check_template(template, slots: tuple[str, ...]) -> None:
    if not isinstance(template, str):
        raise ConfigError(f"template must be a string, got {type(template).__name__}")
    found = _SLOT.findall(template)
    for s in slots:
        if found.count(s) != 1:
            raise ConfigError(f"template must contain the slot {{{s}}} exactly once (found "
                              f"{found.count(s)}): {template[:80]!r}")
    extra = sorted(set(found) - set(slots))
    if extra:
        raise ConfigError(f"template has unknown slot(s) {', '.join('{%s}' % e for e in extra)}; "
                          f"allowed: {', '.join('{%s}' % s for s in slots)}")


class Encoded:
    """One request, tokenized: `ids` is the whole prompt; the model computes ids[start:].
    values: slot name -> text (after truncation, if any); start: len(cached prefix) when the prefix
    matches, else 0 (computed exactly, no cache); text: the whole prompt, rendered when first read
    (nothing on the hot path reads it: rendering every request cost ~15% of encode_many)."""
    __slots__ = ("values", "ids", "start", "_text", "_render")

    def __init__(self, values: dict, text: str | None, ids: list[int], start: int, render=None):
        self.values, self.ids, self.start, self._text, self._render = values, ids, start, text, render

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._render(**self.values)
        return self._text

    def __repr__(self) -> str:
        return f"Encoded(values={self.values!r}, ids=[{len(self.ids)} ids], start={self.start})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Encoded) and (self.values, self.ids, self.start, self.text) == (
            other.values, other.ids, other.start, other.text)


class Prompt:
    def __init__(self, tokenizer, template: str, chat: bool | None = None, slots=("query",),
                 context_limit: int | None = None, special_tokens: bool = False):
        """special_tokens: parse special-token text inside a slot's value (`<|im_end|>` in a query
        becomes the control token). Default False: a slot's value is tokenized as plain text, so a
        query cannot forge chat turns."""
        check_template(template, slots)
        self.tokenizer, self.template, self.slots = tokenizer, template, slots
        self.special_tokens = bool(special_tokens)
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if chat and not has_chat:
            raise ConfigError("chat=True but the tokenizer has no chat template")
        self.chat = has_chat if chat is None else bool(chat)
        self.context_limit = context_limit
        self.rendered = self._render_raw({s: sentinel(s) for s in slots})
        pieces = re.split("(" + "|".join(re.escape(sentinel(s)) for s in slots) + ")", self.rendered)
        if len(pieces) != 2 * len(slots) + 1:
            raise ConfigError("the chat template altered the slot; pass chat=False")
        self.pieces = pieces  # [text0, sentinel, text1, sentinel, text2, ...]
        self.strip = self._edge_strip()
        self.prefix_text = pieces[0]
        self._before: dict = {}  # (slot, after) -> parts of the prompt before (after) it
        self.backend = None  # the HF call first: the reference the Rust backend must match
        texts = [self.prefix_text] + [self.render(**{s: probe for s in slots}) for probe in PROBES]
        whole = self.encode_texts(texts)
        # whole texts (encode_texts: label tries, and today's form with special_tokens=True)
        self.backend = rust_backend(tokenizer, texts, not self.chat, whole)
        if self.special_tokens:
            prefix_ids, *probed = whole
            self.resume = self._resume_point(texts[1:], probed)
        else:
            self._plan()
            probed = self.encode_ids([{s: probe for s in slots} for probe in PROBES])
            # parts[0]: the constant ids up to the first variable run; parts[1][0]: its text before
            # the first slot (from the resume point)
            prefix_ids = self.parts[0] + self._encode_runs([self.parts[1][0]])[0]
        split = len(prefix_ids)
        for full in probed:
            split = min(split, common_prefix_len(full, prefix_ids))
        self.prefix_ids = prefix_ids[:split]

    def _render_raw(self, values: dict) -> str:
        text = self.template
        for s, v in values.items():
            text = text.replace("{%s}" % s, v)
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return text

    def _edge_strip(self) -> dict:
        """slot -> how its value is stripped: a chat template that trims the message (Llama 3:
        `message['content'] | trim`) also trims a value at the message's start or end, as
        rendering the whole prompt would. Found by rendering a padded probe message."""
        if not self.chat:
            return {}
        mark = sentinel("probe")
        out = self.tokenizer.apply_chat_template([{"role": "user", "content": f" \t{mark}\n "}],
                                                 tokenize=False, add_generation_prompt=True)
        lead, trail = f" \t{mark}" not in out, f"{mark}\n " not in out
        at = {s: self.template.index("{%s}" % s) for s in self.slots}
        first, last = min(at, key=at.get), max(at, key=at.get)
        strip = {}
        if lead and not self.template[:at[first]].strip():
            strip[first] = str.lstrip
        if trail and not self.template[at[last] + len(last) + 2:].strip():
            strip[last] = str.strip if strip.get(last) else str.rstrip
        return strip

    def fill(self, name: str, value: str) -> str:
        """A slot's text as the whole prompt holds it (see _edge_strip)."""
        return self.strip[name](value) if name in self.strip else value

    def render(self, **values) -> str:
        """The whole prompt text (template in the chat template) with the slots filled."""
        out = []
        for i, piece in enumerate(self.pieces):
            out.append(self.fill(piece[6:-1], values[piece[6:-1]]) if i % 2 else piece)
        return "".join(out)

    def encode_text(self, text: str) -> list[int]:
        return self.encode_texts([text])[0]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """The tokenizer's ids of whole texts, special-token text parsed (text the template owns,
        e.g. a label after the prompt; a request's prompt is encode_many's)."""
        # A chat template writes its own special tokens; a plain template gets the tokenizer's (BOS).
        special = not self.chat
        if self.backend is not None:  # no offsets: the fast form (tokenizers >= 0.21), ~20% less
            encoded = plain(self.backend).encode_batch_fast(texts, add_special_tokens=special)
            return [e.ids for e in encoded]
        return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    # ---- special_tokens=True: the whole prompt's text, tokenized from a resume point

    def _resume_point(self, texts: list[str], reference: list[list[int]]):
        """(c, ids of prefix_text[:c]) such that a prompt's ids are those ids followed by the ids of
        its text from char c on: a request then tokenizes ~the query, not the whole instruction
        (75 -> 21 us for the seed prompt). c is where the prefix text's second-to-last pre-token
        starts. A regex pre-tokenizer without look-behind (GPT-2, Llama 3, Qwen) decides every match
        before the last one from the prefix text alone, since a match ends at the first character
        of a different class and looks ahead one at most; and BPE runs per pre-token, so no token
        crosses c whatever the query. Checked on the probes (which also catch tokenizers that add a
        space or a special token at the start of any text); None, whole prompts, if one differs."""
        c = second_to_last_word(self.backend, self.prefix_text)
        if c is None:
            return None
        head = self.encode_texts([self.prefix_text[:c]])[0]
        if self._encode_resumed(texts, c, head) != reference:
            return None
        return c, head

    def _encode_resumed(self, texts: list[str], c: int, head: list[int]) -> list[list[int]]:
        """Ids of prompts that start with prefix_text: head, then each text from char c on."""
        tails = plain(self.backend).encode_batch_fast([t[c:] for t in texts], add_special_tokens=False)
        return [head + t.ids for t in tails]

    # ---- default: the template's special tokens, and the text runs between them as plain text

    def _plan(self) -> None:
        """self.parts: the prompt as a list of constant ids and variable runs (text, slot, text,
        ...: the text between two of the template's special tokens that holds slots), each run
        tokenized as plain text, alone (as the tokenizer itself tokenizes the text between two added
        tokens: a value without special-token text gets the whole prompt's ids). The exact form is the HF call per run; the fast form (checked equal
        to it on probe values, special-token text included) calls a copy of the Rust backend that
        does not parse special tokens, and resumes the first run from a point near its first slot
        (_run_resume): a chat template's scaffolding after the query is then a cached constant."""
        self.split_backend, self.resume = None, None
        exact = self.parts = self._parse(self.rendered)
        added = [t.content for t in self.tokenizer.added_tokens_decoder.values()]
        probes = PROBES + ["".join(added), " ".join(added) + " x"] + [f"a{t}\n{t}b" for t in added[:8]]
        values = [{s: p for s in self.slots} for p in probes]
        runs = [self._run_text(p, v) for v in values for p in exact if isinstance(p, tuple)]
        self.split_backend = rust_backend(self.tokenizer, runs, False, self._hf_split(runs), split=True)
        reference = self._assemble(exact, values, self._hf_split)
        resumed = self._run_resume(exact)
        if resumed is not None and self._assemble(resumed, values, self._encode_runs) == reference:
            self.parts = resumed  # resume: (c within the first variable run, the cached ids before c)
            self.resume = (len(exact[1][0]) - len(resumed[1][0]), resumed[0])

    def _run_resume(self, parts: list):
        """parts with the first variable run cut at its resume point c, where its text before the
        first slot starts its second-to-last pre-token (the argument of _resume_point, here within
        one run): the ids before c join the constant head. None where that cannot hold: a
        non-special added token (still parsed in plain text) that could span c, or too few words."""
        lead = parts[1][0]
        backend = self.split_backend or getattr(self.tokenizer, "_tokenizer", None)
        c = second_to_last_word(backend, lead)
        if c is None:
            return None
        norm = getattr(getattr(backend, "normalizer", None), "normalize_str", None) or (lambda s: s)
        plain = [t.content for t in self.tokenizer.added_tokens_decoder.values() if not t.special]
        plain += [norm(t) for t in plain]
        before = (lead[:c], norm(lead[:c]))
        if any(b.endswith(t[:j]) for t in plain for b in before for j in range(1, len(t) + 1)):
            return None
        head = parts[0] + self._encode_runs([lead[:c]])[0]
        return [head, (lead[c:],) + parts[1][1:], *parts[2:]]

    def _parse(self, text: str, lead: bool = True) -> list:
        """`text` (rendered with sentinels in its slots, maybe cut short) as a list of constant ids
        (merged) and variable runs (tuples text, slot, text, ...). Constants: the template's special
        tokens where the tokenizer finds them in the template text (a slot's sentinel between
        breaks any match: a token cannot span template and value), the tokens a plain template gets
        around the text (BOS ...), and the text runs without slots, tokenized by the HF call."""
        special = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        try:  # the tokenizer's own matching (leftmost-longest, lstrip/rstrip, normalized tokens)
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            spans = [(s, e, i) for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])
                     if i in special]
            if not all(special[i] in text[s:e] for s, e, i in spans):
                raise ValueError("offsets that do not hold the token")
        except (NotImplementedError, ValueError, KeyError, TypeError):  # no offsets (slow tokenizer)
            by_text = {c: i for i, c in special.items()}
            alt = "|".join(map(re.escape, sorted(by_text, key=len, reverse=True))) or "(?!)"
            spans = [(m.start(), m.end(), by_text[m.group()]) for m in re.finditer(alt, text)]
        pre, post = self._added_ids()
        items, at = [pre if lead else []], 0  # (lead=False: text that follows a slot, no BOS)
        for s, e, i in spans + [(len(text), len(text), None)]:
            run = tuple(_SENTINEL.split(text[at:s]))  # [text, slot name, text, ...]
            items.append(run if len(run) > 1 else run[0])
            items.append([i] if i is not None else post)
            at = e
        consts = [x for x in items if isinstance(x, str) and x]
        ids = iter(self._hf_split(consts) if consts else [])
        parts = []
        for x in items:
            x = (next(ids) if x else []) if isinstance(x, str) else x
            if isinstance(x, list) and parts and isinstance(parts[-1], list):
                parts[-1] = parts[-1] + x
            else:
                parts.append(x if isinstance(x, tuple) else list(x))
        return parts

    def _added_ids(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds before and after a text (BOS ...): a plain template's."""
        if self.chat:  # a chat template writes its own
            return [], []
        plain = self.tokenizer("x", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("x", add_special_tokens=True)["input_ids"]
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return full[:k], full[k + len(plain):]
        raise ConfigError("cannot tell which tokens the tokenizer adds around a text; "
                          "pass special_tokens=True")

    def _hf_split(self, texts: list[str]) -> list[list[int]]:
        """The HF call, special-token text as plain text. It sets the shared Rust backend's flag
        and leaves it set, which would change anyone's later direct calls of it: restored."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        flag = getattr(backend, "encode_special_tokens", None)
        try:
            return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        finally:
            if flag is not None:
                backend.encode_special_tokens = flag

    def _encode_runs(self, texts: list[str]) -> list[list[int]]:
        if self.split_backend is not None:
            return [e.ids for e in self.split_backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self._hf_split(texts)

    def _run_text(self, run: tuple, values: dict) -> str:
        if len(run) == 3:
            return run[0] + self.fill(run[1], values[run[1]]) + run[2]
        return "".join(self.fill(p, values[p]) if k % 2 else p for k, p in enumerate(run))

    def _assemble(self, parts: list, values_list: list[dict], encode) -> list[list[int]]:
        """Each request's ids: the constants, and its variable runs (one tokenizer call for all)."""
        texts = [self._run_text(p, v) for v in values_list for p in parts if isinstance(p, tuple)]
        runs = iter(encode(texts) if texts else [])
        if len(parts) == 3:  # the usual shape: head, the slots' run, the scaffolding after it
            head, _, tail = parts
            return [head + next(runs) + tail for _ in values_list]
        return [[i for p in parts for i in (p if isinstance(p, list) else next(runs))]
                for _ in values_list]

    def encode_before(self, slot: str, after: bool = False, **values) -> list[int]:
        """Ids of the prompt's text before `slot`'s value (the slots before it filled from values),
        tokenized as a whole prompt is: a candidate shared prefix for requests that differ only
        from that slot on (the Scorer's items). after=True: the text after the slot's value,
        tokenized alone (no BOS): what follows a soft token in that slot (an embedding item), a
        token boundary by definition."""
        at = self.rendered.index(sentinel(slot))
        text = self.rendered[at + len(sentinel(slot)):] if after else self.rendered[:at]
        if self.special_tokens:  # today's form: the text, filled, tokenized whole
            filled = _SENTINEL.sub(lambda m: self.fill(m[1], values[m[1]]), text)
            return (self.tokenizer(filled, add_special_tokens=False)["input_ids"] if filled else []) \
                if after else self.encode_text(filled)
        if (slot, after) not in self._before:
            self._before[(slot, after)] = self._parse(text, lead=not after)
        return self._assemble(self._before[(slot, after)], [values], self._encode_runs)[0]

    def encode_after(self, slot: str, **values) -> list[int]:  # encode_before(after=True)
        return self.encode_before(slot, True, **values)

    def encode_ids(self, values_list: list[dict]) -> list[list[int]]:
        """The ids of each request's whole prompt (unchecked values; encode_many checks them)."""
        if not self.special_tokens:
            return self._assemble(self.parts, values_list, self._encode_runs)
        texts = [self.render(**values) for values in values_list]  # each starts with prefix_text
        return (self._encode_resumed(texts, *self.resume) if self.resume is not None
                else self.encode_texts(texts))

    @functools.cached_property
    def token_chars(self) -> int:  # the most characters a token stands for (the length bound)
        return token_chars(self.tokenizer)

    def encode(self, truncate: bool = False, **values) -> Encoded:
        return self.encode_many([values], truncate)[0]

    def encode_many(self, values_list: list[dict], truncate: bool = False) -> list[Encoded]:
        """encode() for many requests with one tokenizer call (parallel, off the GIL, when the Rust
        backend is used). Raises the first request's InputError, with `.index` set to it."""
        for i, values in enumerate(values_list):
            for s in self.slots:
                v = values.get(s)
                if not isinstance(v, str):
                    raise _at(InputError(f"{s} must be a string, got {type(v).__name__}"), i)
                if not v.strip():
                    raise _at(InputError(f"empty {s}"), i)
                cap = self.context_limit and self.context_limit * self.token_chars
                if cap and len(v) > cap:  # over the limit whatever it says: not tokenized (a 50 MB
                    if not truncate:  # line took a minute and 5 GB), or cut before truncating
                        raise _at(InputError(f"{s} is {len(v)} characters: over the model's context "
                                             f"limit of {self.context_limit} tokens whatever its text; "
                                             f"shorten it or enable truncation"), i)
                    values_list = [*values_list[:i], {**values, s: v[:cap]}, *values_list[i + 1:]]
        all_ids = self.encode_ids(values_list)
        out = []
        for i, (values, ids) in enumerate(zip(values_list, all_ids)):
            try:
                out.append(self._encoded(values, ids, truncate))
            except InputError as e:
                raise _at(e, i) from None
        return out

    def _encoded(self, values: dict, ids: list[int], truncate: bool) -> Encoded:
        limit = self.context_limit
        if limit and len(ids) > limit:
            if not truncate:
                raise InputError(
                    f"prompt is {len(ids)} tokens, over the model's context limit of {limit} tokens "
                    f"(the {self.slots[-1]} is {len(values[self.slots[-1]])} characters); shorten it or "
                    f"enable truncation")
            return self.truncated(values, limit)
        P = len(self.prefix_ids)
        start = P if ids[:P] == self.prefix_ids else 0
        return Encoded(dict(values), None, ids, start, self.render)

    def truncated(self, values: dict, limit: int) -> Encoded:
        """Cut the last slot's text from the end until the whole prompt is at most `limit` tokens
        (re-tokenized exactly)."""
        s = self.slots[-1]
        v = values[s]
        lo, hi = 0, len(v)  # binary search on characters kept
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.encode_ids([{**values, s: v[:mid]}])[0]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0 or not v[:lo].strip():
            raise InputError(f"the template alone nearly fills the limit of {limit} tokens, so no "
                             f"part of the {s} fits")
        return self.encode(truncate=False, **{**values, s: v[:lo]})


def _at(e: InputError, index: int) -> InputError:
    e.index = index
    return e
