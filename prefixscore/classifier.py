"""Classifier: the public API for "which of N labels does this LLM pick for this text?"."""
from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass

import torch

from .batch import plan_classify
from .engine import Engine
from .kernels.label_head import rms_norm
from .errors import ConfigError, InputError
from .labels import LabelTrie, check_labels
from .loading import obtain
from .prompt import SEED_LABELS, SEED_TEMPLATE, Encoded, Prompt, check_prefix_fits, check_template

MODES = ("logprobs", "logits")


def classifier_labels(labels) -> list[str]:
    """check_labels, plus the classifier's own rule: with one label there is nothing to choose (it
    would always win with score 0). Not in check_labels: a Scorer may score a single label token."""
    labels = check_labels(labels)
    if len(labels) < 2:
        raise ConfigError(f"a classifier needs at least two labels to choose from, got {labels}")
    return labels


@dataclass
class Result:
    query: str
    label: str
    scores: dict[str, float]  # log-probabilities (mode "logprobs") or raw first-token logits

    def to_dict(self) -> dict:
        return asdict(self)


class Classifier:
    """Classifier(model=None, template=None, labels=None): None means the bundled SmolLM2-135M-Instruct,
    the seed prompt and the nine seed labels. `model` is a HF folder or a .gguf file (or an already
    loaded `LoadedModel` to share weights between classifiers)."""

    def __init__(self, model=None, template: str | None = None, labels=None, *, device=None,
                 dtype=None, chat: bool | None = None, mode: str = "logprobs", truncate: bool = False,
                 max_batch_tokens: int = 16384, graphs: bool = True, head=None):
        head_file = None
        if head is not None:  # a trained head (heads.py): template, labels, chat default to its own
            from .heads import read_head

            head_file = read_head(head)  # unreadable file: ModelLoadError before loading a model
            template = head_file.meta["template"] if template is None else template
            labels = head_file.labels if labels is None else labels
            chat = head_file.meta["chat"] if chat is None else chat
        template = SEED_TEMPLATE if template is None else template
        labels = classifier_labels(SEED_LABELS if labels is None else labels)
        check_template(template, ("query",))  # fail fast, before loading a model
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        if not isinstance(truncate, bool) or not (chat is None or isinstance(chat, bool)):
            raise ConfigError(f"truncate and chat are true or false (chat may be None), got "
                              f"truncate={truncate!r}, chat={chat!r}")
        if not isinstance(max_batch_tokens, numbers.Integral) or max_batch_tokens < 1:  # numpy ints too
            raise ConfigError(f"max_batch_tokens must be a positive integer, got {max_batch_tokens!r}")
        self.loaded = obtain(model, device, dtype)
        self.engine = Engine(self.loaded)
        tok = self.loaded.tokenizer
        self.prompt = Prompt(tok, template, chat=chat)
        self.trie = LabelTrie.build(tok, labels, self.prompt.render(query="x"), self.prompt.encode_text)
        # Branch tokens follow the suffix, so the prompt itself must leave room for them.
        limit = self.engine.config.context_limit
        self.prompt.context_limit = limit - self.trie.max_len
        check_prefix_fits(self.prefix_len, self.trie.max_len, limit)
        self.labels, self.mode, self.truncate = labels, mode, truncate
        self.head = None
        if head_file is not None:  # refuse a head trained for another model, template or labels
            from .heads import check_head

            check_head(head_file, self, head)
            self.head = head_file.to(self.engine.device, self.engine.dtype)
        if mode == "logits" and not self.trie.first_distinct and self.head is None:
            raise ConfigError("mode 'logits' needs labels whose first tokens differ; these share a "
                              "first token, so use mode 'logprobs'")
        self.max_batch_tokens = max_batch_tokens
        self.prefix_kv = self.engine.prefill(self.prompt.prefix_ids)
        self.weight = self.engine.label_weight(self.trie.columns)
        # A linear head is an N-row projection like the label rows: graphs capture it instead.
        linear = self.head is not None and self.head.kind == "linear"
        weight, logprobs = (self.head.weight, False) if linear else (self.weight, mode == "logprobs")
        self.capture_info = self.engine.capture(self.prefix_kv, weight, logprobs,
                                                max_batch_tokens) if graphs else {}

    @property
    def prefix_len(self) -> int:
        return len(self.prompt.prefix_ids)

    def encode(self, query: str) -> Encoded:
        return self.prompt.encode(truncate=self.truncate, query=query)

    def encode_many(self, queries: list[str]) -> list[Encoded]:
        """encode() for many queries in one tokenizer call. An InputError carries `.index`, the
        position of the first bad query."""
        return self.prompt.encode_many([{"query": q} for q in queries], self.truncate)

    def classify(self, query: str) -> Result:
        return self.classify_encoded([self.encode(query)])[0]

    def classify_batch(self, queries, progress=None) -> list[Result]:
        if isinstance(queries, str):
            raise InputError("classify_batch takes a list of strings; use classify() for one")
        return self.classify_encoded(self._encode_numbered(list(queries)), progress)

    def _encode_numbered(self, queries: list[str]) -> list[Encoded]:
        """encode_many; of several queries, a bad one is named 1-based ("query 3: empty query")."""
        try:
            return self.encode_many(queries)
        except InputError as e:
            if len(queries) > 1:
                raise InputError(f"query {e.index + 1}: {e}") from None
            raise

    def classify_encoded(self, encoded: list[Encoded], progress=None) -> list[Result]:
        """Run pre-tokenized requests (see encode) in as few flat batches as fit max_batch_tokens."""
        if len(encoded) == 1 and progress is None:  # the latency path (classify, the server)
            return self._run(encoded)
        return [r for batch in self.classify_iter(encoded, progress) for r in batch]

    def classify_iter(self, encoded: list[Encoded], progress=None):
        """classify_encoded batch by batch, for streaming: yields the results that each flat batch
        completes, in input order. Requests with the cached prefix run before those without it (rare:
        a query that merges into the prefix), so one of those holds back the results after it."""
        done, ready = {}, 0
        for chunk in self._chunks(encoded):
            done.update(zip(chunk, self._run([encoded[i] for i in chunk])))
            if progress is not None:
                progress(len(chunk))
            batch = []
            while ready in done:
                batch.append(done.pop(ready))
                ready += 1
            if batch:
                yield batch

    def _chunks(self, encoded):
        """Group request indices by prefix use (cached / exact) and by a token budget per batch."""
        branches = self.mode == "logprobs" and self.head is None
        branch = sum(len(p) for p in self.trie.branch_paths()) if branches else 0
        for cached in (True, False):
            chunk, size = [], 0
            for i, e in enumerate(encoded):
                if (e.start > 0) != cached:
                    continue
                n = len(e.ids) - e.start + branch
                if chunk and size + n > self.max_batch_tokens:
                    yield chunk
                    chunk, size = [], 0
                chunk.append(i)
                size += n
            if chunk:
                yield chunk

    @torch.inference_mode()
    def features(self, queries: list[str]) -> torch.Tensor:
        """Final-normed hidden state at each query's read-out position (the root row), [B, hidden]
        in fp32: the input of a trained N-way head (heads.py)."""
        encoded = self._encode_numbered(list(queries))
        out = torch.empty(len(encoded), self.engine.config.hidden_size)
        for chunk in self._chunks(encoded):
            batch = [encoded[i] for i in chunk]
            plan = plan_classify([e.ids[e.start:] for e in batch], [e.start for e in batch],
                                 self.trie, branches=False)
            prefix = self.prefix_kv if batch[0].start > 0 else self.engine.no_prefix
            h, plan = self.engine.hidden(plan, prefix)
            norm = self.engine.model.norm
            out[chunk] = rms_norm(h[plan.rows], norm.weight, norm.eps).float().cpu()
        return out

    def _run(self, batch: list[Encoded]) -> list[Result]:
        logprobs = self.mode == "logprobs"
        if self.head is not None:
            from .heads import head_scores

            scores, best = head_scores(self, self.head, batch, logprobs)
            return [Result(e.values["query"], self.labels[d], dict(zip(self.labels, s)))
                    for e, d, s in zip(batch, best.tolist(), scores.tolist())]
        plan = plan_classify([e.ids[e.start:] for e in batch], [e.start for e in batch], self.trie,
                             branches=logprobs)
        prefix = self.prefix_kv if batch[0].start > 0 else self.engine.no_prefix
        scores, best = self.engine.run(plan, prefix, self.weight, logprobs)
        if logprobs and len(batch) == 1:  # the latency path
            one, d = self.trie.assemble_one(scores, best)
            label_scores, decision = [one], [d]
        else:
            label_scores, decision = (self.trie.assemble(scores, best, len(batch)) if logprobs
                                      else self.trie.assemble_logits(scores, best))
            label_scores, decision = label_scores.tolist(), decision.tolist()
        return [Result(e.values["query"], self.labels[d], dict(zip(self.labels, s)))
                for e, d, s in zip(batch, decision, label_scores)]
