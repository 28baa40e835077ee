"""Prompt template -> cached prefix tokens + per-request suffix tokens (DESIGN.md §2.1).

The guarantee: the tokens fed to the model are exactly the reference tokens of the whole prompt.
The reference, by default (special_tokens=False), keeps a query from forging chat turns: the
prompt is cut at the template's own special tokens (the chat scaffolding, BOS ...), which stay
control tokens, and each text run between them, slot values included, is tokenized as plain text
(HF `split_special_tokens=True`: `<|im_end|>` typed in a query is ordinary text), plus the tokens
a plain template gets from the tokenizer (BOS). With special_tokens=True the reference is the
tokenizer's tokens of the whole prompt text, as before.

We tokenize per request only the text from a resume point near the end of the prefix text that no
token can cross (Prompt._resume_point, Prompt._run_resume) and check the result starts with the
cached prefix; the split point is chosen at startup (moved back past any token that a probe query
merges across the boundary), and a request that still disagrees is flagged so the engine computes
it without the cache. Every shortcut is checked against the Hugging Face call at startup; one that
disagrees is dropped for the plain (slower, exact) form.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError, InputError

SEED_TEMPLATE = (
    "Analyze the category intent of the given query. Output exactly one label from: Dress, Jeans, "
    "Shirt, Trench Coat, Skirt, T-shirt, Hoodie, Knitwear, Other. Output nothing else\n"
    "query:{query}"
)
SEED_LABELS = ["Dress", "Jeans", "Shirt", "Trench Coat", "Skirt", "T-shirt", "Hoodie", "Knitwear", "Other"]

_SLOT = re.compile(r"\{(\w+)\}")
# Queries chosen to provoke merges across the prefix boundary: letters, digits, spaces, punctuation,
# CJK, emoji, newlines, long runs.
PROBES = ["a", "A", " a", "  x", "1", "2024", "中文", "😀", "!", ".", "-", "'s", "\n", "\tx", "é", "x" * 40, ":", "Q"]


def sentinel(name: str) -> str:
    # Private-use characters: not whitespace, so a chat template's `| trim` keeps them (\x1e was:
    # str.strip() removes it).
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
        n = found.count(s)
        if n != 1:
            raise ConfigError(
                f"template must contain the slot {{{s}}} exactly once (found {n}): {template[:80]!r}"
            )
    extra = sorted(set(found) - set(slots))
    if extra:
        raise ConfigError(f"template has unknown slot(s) {', '.join('{%s}' % e for e in extra)}; "
                          f"allowed: {', '.join('{%s}' % s for s in slots)}")


@dataclass
class Encoded:
    """One request, tokenized: `ids` is the whole prompt; the model computes ids[start:]."""
    values: dict  # slot name -> text (after truncation, if any)
    text: str  # the whole prompt
    ids: list[int]
    start: int  # = len(cached prefix) when the prefix matches, else 0 (computed exactly, no cache)


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
        rendered = self._render_raw({s: sentinel(s) for s in slots})
        pieces = re.split("(" + "|".join(re.escape(sentinel(s)) for s in slots) + ")", rendered)
        if len(pieces) != 2 * len(slots) + 1:
            raise ConfigError("the chat template altered the slot; pass chat=False")
        self.pieces = pieces  # [text0, sentinel, text1, sentinel, text2, ...]
        self.strip = self._edge_strip()
        self.prefix_text = pieces[0]
        self.backend = None  # the HF call first: the reference the Rust backend must match
        texts = [self.prefix_text] + [self.render(**{s: probe for s in slots}) for probe in PROBES]
        prefix_ids, *probed = self.encode_texts(texts)
        split = len(prefix_ids)
        for full in probed:
            split = min(split, common_prefix_len(full, prefix_ids))
        self.prefix_ids = prefix_ids[:split]
        self.backend = rust_backend(tokenizer, texts, not self.chat, [prefix_ids, *probed])
        self.resume = self._resume_point(texts[1:], probed)

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
        # A chat template writes its own special tokens; a plain template gets the tokenizer's (BOS).
        special = not self.chat
        if self.backend is not None:  # no offsets: the fast form (tokenizers >= 0.21), ~20% less
            return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=special)]
        return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    def _resume_point(self, texts: list[str], reference: list[list[int]]):
        """(c, ids of prefix_text[:c]) such that a prompt's ids are those ids followed by the ids of
        its text from char c on: a request then tokenizes ~the query, not the whole instruction
        (75 -> 21 us for the seed prompt). c is where the prefix text's second-to-last pre-token
        starts. A regex pre-tokenizer without look-behind (GPT-2, Llama 3, Qwen) decides every match
        before the last one from the prefix text alone, since a match ends at the first character
        of a different class and looks ahead one at most; and BPE runs per pre-token, so no token
        crosses c whatever the query. Checked on the probes (which also catch tokenizers that add a
        space or a special token at the start of any text); None, whole prompts, if one differs."""
        pre = getattr(self.backend, "pre_tokenizer", None)
        if pre is None:
            return None
        try:
            words = pre.pre_tokenize_str(self.prefix_text)
        except Exception:  # a pre-tokenizer that cannot run alone
            return None
        if len(words) < 3:
            return None
        c = words[-2][1][0]
        special = not self.chat
        head = self.backend.encode_batch_fast([self.prefix_text[:c]], add_special_tokens=special)[0].ids
        if self._encode_resumed(texts, c, head) != reference:
            return None
        return c, head

    def _encode_resumed(self, texts: list[str], c: int, head: list[int]) -> list[list[int]]:
        """Ids of prompts that start with prefix_text: head, then each text from char c on."""
        tails = self.backend.encode_batch_fast([t[c:] for t in texts], add_special_tokens=False)
        return [head + t.ids for t in tails]

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
        texts = [self.render(**values) for values in values_list]  # each starts with prefix_text
        all_ids = (self._encode_resumed(texts, *self.resume) if self.resume is not None
                   else self.encode_texts(texts))
        out = []
        for i, (values, text, ids) in enumerate(zip(values_list, texts, all_ids)):
            try:
                out.append(self._encoded(values, text, ids, truncate))
            except InputError as e:
                raise _at(e, i) from None
        return out

    def _encoded(self, values: dict, text: str, ids: list[int], truncate: bool) -> Encoded:
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
        return Encoded(dict(values), text, ids, start)

    def truncated(self, values: dict, limit: int) -> Encoded:
        """Cut the last slot's text from the end until the whole prompt is at most `limit` tokens
        (re-tokenized exactly)."""
        s = self.slots[-1]
        v = values[s]
        lo, hi = 0, len(v)  # binary search on characters kept
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.encode_text(self.render(**{**values, s: v[:mid]}))) <= limit:
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


def rust_backend(tokenizer, texts: list[str], special: bool, reference: list[list[int]]):
    """The Rust `tokenizers.Tokenizer` behind a fast HF tokenizer, when it gives the same ids as the
    HF call on `texts` (the prefix and the probes): calling it directly skips ~0.1 ms of Python
    wrapping per call and tokenizes a batch in parallel without the GIL. None otherwise (a
    tokenizer that pre-processes text in Python keeps the HF call)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    try:
        fast = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]
    except Exception:  # a backend of another shape: keep the HF call
        return None
    return backend if fast == reference else None


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    if a[:len(b)] == b:  # the usual case, compared at C speed
        return min(len(a), len(b))
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
