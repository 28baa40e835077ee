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
from .options import option

# A Scorer's modes (scorer.py), here so the command line lists them without importing torch:
# logprobs:    log-probability of each label under label-constrained decoding (as Classifier)
# softmax:     exp(logprobs): probabilities over the labels (= SGLang apply_softmax=true)
# logits:      raw first-token logits (labels must start with distinct tokens)
# vocab_probs: each label token's probability under the full next-token distribution
#              (= SGLang apply_softmax=false); single-token labels; reads the vocab head, but
#              only at the read-out rows
SCORE_MODES = ("logprobs", "softmax", "logits", "vocab_probs")
LAYOUTS = ("auto", "packed", "alone")

# What a trained head (weights/heads.py) and an adapter's objective (weights/adapter.py) may be.
HEAD_KINDS = ("linear", "mlp")
ADAPTER_OBJECTIVES = ("label", "head")

# A pass's new tokens at most (max_batch_tokens) by device. A CPU pass of 16,384 tokens of the
# bundled model took 7.9 s (2 cores), which is how long a Ctrl-C waited. bench/stop.py, the bundled
# model with the seed adapter on 2 cores: with passes of 1,024 tokens a SIGINT exited within 1.3 s
# (3 signals), with 2,048 within 2.3 s; the rates were 40 and 44 rows/s (36 and 34 in another
# run): 1,024 keeps Ctrl-C under 2 s.
GPU_BATCH_TOKENS, CPU_BATCH_TOKENS = 16384, 1024


@dataclass(frozen=True)
class ModelSpec:
    """None means the component's default: the bundled model (SmolLM2-135M-Instruct), the seed
    prompt and labels for a Classifier (a Scorer's own relevance prompt and yes/no), cuda when
    available, bf16 on GPU and fp32 on CPU, the chat template when the tokenizer has one, and for
    template, labels and chat an adapter's or head's own."""
    # The fields but template and labels are options (options.py): the command line's model and
    # prompt flags (cli/common.model_args), the TOML keys and Ray's, derived from these.
    model: object = option(None, "HF folder, .gguf file, or Hugging Face hub name org/name[@revision] "
                           "(or org/name/FILE.gguf), downloaded into the hub cache unless "
                           "HF_HUB_OFFLINE=1 (default: bundled SmolLM2-135M-Instruct)",
                           type=str)  # (in Python also a LoadedModel, to share its weights)
    template: str | None = None
    labels: tuple[str, ...] | None = None
    device: str | None = option(None, "cpu, cuda, cuda:N (default: cuda if available)", type=str)
    dtype: str | None = option(None, "float32 / bfloat16 / fp8 (e4m3 weights, Hopper) (default: bf16 "
                               "on GPU, fp32 on CPU; fp8 for an FP8 checkpoint on Hopper)", type=str)
    chat: bool | None = option(None, "wrap the template in the model's chat template (default: if it "
                               "has one)", switch="both")
    mode: str | None = option(None, "scores: label log-probs (default) or raw first-token logits "
                              "(fastest)", choices=["logprobs", "logits"], flag_default="logprobs",
                              record=True)
    truncate: bool = option(False, "cut queries that exceed the context instead of failing", record=True)
    max_batch_tokens: int = option(GPU_BATCH_TOKENS, f"max new tokens per forward pass (default: "
                                   f"{GPU_BATCH_TOKENS} on a GPU, {CPU_BATCH_TOKENS} on a CPU, where a "
                                   f"pass of {GPU_BATCH_TOKENS} tokens took 8 s and Ctrl-C waits for "
                                   f"the pass in flight)", flag="batch-tokens", type=int, flag_default=None,
                                   record=True)
    head: str | None = option(None, "trained head (prefixscore fit-head); its template, labels and chat "
                              "flag are the defaults", type=str)
    adapter: str | None = option(None, "LoRA adapter (prefixscore finetune), merged into the weights at "
                                 "load; its template, labels and chat flag are the defaults. 'seed': "
                                 "the shipped one, which classify, eval and serve use by default on "
                                 "the bundled model", type=str)
    allow_special_tokens: bool = option(False, "parse special-token text such as <|im_end|> inside "
                                        "queries as control tokens (default: plain text)", record=True)
    batch_invariant: bool | None = option(None, "scores bitwise the same whatever a query is batched "
                                          "with (CUDA kernels in one launch config for every batch "
                                          "size; slower at large batches)", switch="on")

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
