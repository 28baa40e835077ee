"""What a classify request answers (Answer), and the helpers every route uses on answers and
queries: probabilities from scores, a query's name in errors, the Unicode check. The pair cache
that answers repeated queries and items: cache.py."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Answer:
    results: list[tuple[str, str, list[float], bool]]  # per query: (query as seen, label, scores, cached)
    labels: list[str]
    classifier: str  # the served classifier that answered
    prompt_tokens: int  # every query's whole prompt, the cached prefix included
    cached_tokens: int  # of them, not computed: the cached prefix, and whole prompts the cache answered
    batch_size: int
    queue_s: float
    tokenize_s: float
    forward_s: float
    total_s: float


def label_probs(scores: list[float]) -> tuple[list[float], list[float]]:
    """Softmax and log-softmax of one row of label scores. Either mode's scores give the labels'
    probabilities: log-probabilities are already normalized (softmax returns their exp), and mode
    logits needs labels with distinct first tokens, whose first-token softmax is the label's."""
    m = max(scores)
    ex = [math.exp(x - m) for x in scores]
    total = sum(ex)
    log_total = math.log(total)
    return [e / total for e in ex], [x - m - log_total for x in scores]


def query_name(i: int, n: int, field: str = "query") -> str:
    """How an error names query i of a request of n queries: its JSON index, as in items[i]."""
    return f"{field}[{i}]" if n > 1 else field


def is_unicode(text: str) -> bool:
    """False for a lone surrogate: valid in JSON ("\\ud800") and in a Python str, not in UTF-8,
    and a tokenizer raises on it."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def merge_rows(encoded, hits, job, labels, first: int = 0):
    """Per query (text, label, scores, cached) from the cache's hits and the engine's rows (the
    misses' in order, from row `first`), and fresh: {query index: (label index, scores)} of the
    engine's, to store."""
    # rows are as wide as the engine's most labels; a classifier's fill the first columns
    scores = None if job is None else job.scores if job.scores.shape[1] == len(labels) else \
        job.scores[:, :len(labels)]
    rows = iter(range(first, first + len(encoded)))
    results, fresh = [], {}
    for i, (e, h) in enumerate(zip(encoded, hits)):
        if h is None:
            r = next(rows)
            h = fresh[i] = (job.best[r], scores[r].tolist())
            results.append((e.values["query"], labels[h[0]], h[1], False))
        else:
            results.append((e.values["query"], labels[h[0]], h[1], True))
    return results, fresh
