"""The Rust tokenizer behind a fast Hugging Face tokenizer, called directly where it gives the HF
call's ids (checked at start-up by prompt.Prompt, which falls back to the HF call otherwise): no
Python wrapping per call, and a batch tokenized in parallel without the GIL."""
from __future__ import annotations


def rust_backend(tokenizer, texts: list[str], special: bool, reference: list[list[int]],
                 split: bool = False):
    """The Rust `tokenizers.Tokenizer` behind a fast HF tokenizer, when it gives the same ids as the
    HF call on `texts` (the prefix and the probes): calling it directly skips ~0.1 ms of Python
    wrapping per call and tokenizes a batch in parallel without the GIL. None otherwise (a
    tokenizer that pre-processes text in Python keeps the HF call). split: a copy of it that reads
    special-token text as plain text (_split_copy; a cached copy is made afresh if it disagrees)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    for fresh in (False, True) if split else (False,):
        try:
            own = _split_copy(backend, fresh) if split else plain(backend)
            fast = [e.ids for e in own.encode_batch_fast(texts, add_special_tokens=special)]
        except Exception:  # a backend of another shape: keep the HF call
            return None
        if fast == reference:
            return own
    return None


def plain(backend):
    """The shared backend, set to parse special tokens: HF's call sets `encode_special_tokens` per
    call (split_special_tokens) and leaves it so, which would change our direct calls."""
    if getattr(backend, "encode_special_tokens", False):
        backend.encode_special_tokens = False
    return backend


_SPLIT_COPIES: dict = {}  # id(backend) -> (backend, its copy); a few, most recent last


def _split_copy(backend, fresh: bool):
    """A copy of `backend` with encode_special_tokens set, made once per backend (Prompts of one
    tokenizer share it; from_str takes ~0.3-1 s): our own object, so no other caller's flag can
    change how it reads a request, nor the other way round."""
    from tokenizers import Tokenizer

    hit = _SPLIT_COPIES.pop(id(backend), None)
    if hit is None or hit[0] is not backend or fresh:
        hit = backend, Tokenizer.from_str(backend.to_str())
        hit[1].encode_special_tokens = True
    _SPLIT_COPIES[id(backend)] = hit
    while len(_SPLIT_COPIES) > 4:
        _SPLIT_COPIES.pop(next(iter(_SPLIT_COPIES)))
    return hit[1]


def second_to_last_word(backend, text: str):
    """Where the second-to-last pre-token of `text` starts (see Prompt._resume_point); None when
    the pre-tokenizer cannot say or there are fewer than three."""
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is None:
        return None
    try:
        words = pre.pre_tokenize_str(text)
    except Exception:  # a pre-tokenizer that cannot run alone
        return None
    return words[-2][1][0] if len(words) >= 3 else None


def token_chars(tokenizer) -> int:
    """The most characters one token of this tokenizer can stand for: its longest vocabulary
    entry (a byte-level entry has a character per byte, so that bounds the text it decodes to)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


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
