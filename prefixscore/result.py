"""What a classification answers: a leaf type that the classifier, the label heads and the fused
many-classifier path all build (so none of them imports another for it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


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
    label: str  # the decision: label-constrained greedy choice (argmax in logits / vocab_probs)
    scores: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)
