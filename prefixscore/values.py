"""The library's plain values, a leaf that every layer may import: ModelSpec (what to load and how to
prompt it) going in, Result and ItemResult (what a classification or a scored item answers) coming
out.

ModelSpec is one frozen value every entry point takes: Classifier and Scorer (their keyword
arguments build one), the command line (its model and prompt flags, cli/common.model_spec), the
server (EngineConfig.spec, handed to the engine process at spawn) and Ray; so the options are
spelled out here once, and checked here once. Result and ItemResult live here so that the
classifier, the label heads and the fused many-classifier path can all build them without
importing one another."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import asdict, dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """None means the component's default: the bundled model (SmolLM2-135M-Instruct), the seed
    prompt and labels for a Classifier (a Scorer's own relevance prompt and yes/no), cuda when
    available, bf16 on GPU and fp32 on CPU, the chat template when the tokenizer has one, and for
    template, labels and chat an adapter's or head's own."""
    model: object = None  # HF folder, .gguf file, hub name, or a LoadedModel to share weights
    template: str | None = None
    labels: tuple[str, ...] | None = None
    device: str | None = None
    dtype: str | None = None  # float32, bfloat16, fp8
    chat: bool | None = None
    mode: str | None = None  # the component's MODES; None: logprobs
    truncate: bool = False  # cut over-long queries instead of refusing them
    max_batch_tokens: int = 16384
    head: str | None = None  # a trained label head file (prefixscore fit-head)
    adapter: str | None = None  # a LoRA adapter file (prefixscore finetune), or "seed"
    allow_special_tokens: bool = False  # parse special-token text in a query as control tokens
    batch_invariant: bool | None = None  # kernels in batch-invariant mode; None: the environment's

    def __post_init__(self):
        if isinstance(self.labels, list):  # a list is the natural way to write them
            object.__setattr__(self, "labels", tuple(self.labels))
        if not isinstance(self.truncate, bool) or not (self.chat is None or isinstance(self.chat, bool)):
            raise ConfigError(f"truncate and chat are true or false (chat may be None), got "
                              f"truncate={self.truncate!r}, chat={self.chat!r}")
        if not isinstance(self.allow_special_tokens, bool):
            raise ConfigError(f"allow_special_tokens is true or false, got {self.allow_special_tokens!r}")
        if not (self.batch_invariant is None or isinstance(self.batch_invariant, bool)):
            raise ConfigError(f"batch_invariant is true, false or None, got {self.batch_invariant!r}")
        mbt = self.max_batch_tokens
        if not isinstance(mbt, numbers.Integral) or isinstance(mbt, bool) or mbt < 1:  # numpy ints too
            raise ConfigError(f"max_batch_tokens must be a positive integer, got {mbt!r}")

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    @property
    def label_list(self) -> list[str] | None:
        return None if self.labels is None else list(self.labels)


@dataclass
class Result:
    query: str
    label: str
    scores: dict[str, float]  # log-probabilities (mode "logprobs") or raw first-token logits

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ItemResult:
    item: str | list[int]  # the item as given (text, or token ids)
    label: str | None  # the decision: label-constrained greedy choice (argmax in logits / vocab_probs)
    scores: dict[str, float]
    scored: bool = True  # False: past the depth the caller allowed (Scorer.score(depth=)): no label

    def to_dict(self) -> dict:
        return asdict(self)
