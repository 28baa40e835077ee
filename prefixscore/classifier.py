"""Classifier: the public API for "which of N labels does this LLM pick for this text?"."""
from __future__ import annotations

import contextlib
import itertools

import torch

from .batch import plan_classify
from .engine import Engine
from .kernels.label_head import rms_norm
from .errors import ConfigError, InputError, numbered
from .labels import LabelTrie, check_labels
from .weights.loading import finish_load, obtain
from .overlap import (TOKENIZE_FIRST, TOKENIZE_MAX, collector_paused, doubling_spans, passes_in_order,
                      run_ahead)
from .values import ModelSpec, Result
from .prompt import SEED_LABELS, SEED_TEMPLATE, Encoded, Prompt, check_prefix_fits, check_template

MODES = ("logprobs", "logits")
# The first flat batch's token budget, doubling up to max_batch_tokens: the engine's first batches
# are short, so the tokenizer (a few us per query) runs ahead of the engine from the start.
FIRST_BATCH_TOKENS = 1024


def classifier_labels(labels) -> list[str]:
    """check_labels, plus the classifier's own rule: with one label there is nothing to choose (it
    would always win with score 0). Not in check_labels: a Scorer may score a single label token."""
    labels = check_labels(labels)
    if len(labels) < 2:
        raise ConfigError(f"a classifier needs at least two labels to choose from, got {labels}")
    return labels


class Classifier:
    """Classifier(model=None, template=None, labels=None): None means the bundled SmolLM2-135M-Instruct,
    the seed prompt and the nine seed labels. `model` is a HF folder or a .gguf file (or an already
    loaded `LoadedModel` to share weights between classifiers).

    allow_special_tokens: parse special-token text inside a query (`<|im_end|>` becomes the control
    token, as in the template). Default False: a query is plain text, so it cannot forge chat turns.
    adapter: a LoRA adapter file (prefixscore finetune), merged into the weights
    once at load (objective "head": its trained head decides, as head= would) (same kernels and graphs as the base model); its template, labels and chat flag
    are the defaults, and another base model, template or label set is refused.
    batch_invariant: True runs every kernel in batch-invariant mode (KernelOptions.batch_invariant):
    on CUDA a query's scores are then bitwise the same alone and inside any batch, at a cost at large
    batches (BENCHMARKS.md). A setting of the model's engine, which the classifiers and scorers of
    one loaded model (Classifier.many's) share: asking it for the other setting is a ConfigError.
    None (default): the shared engine's, else the environment's (PREFIXSCORE_BATCH_INVARIANT=1
    turns it on). No effect on CPU (torch's kernels).
    """

    def __init__(self, model=None, template: str | None = None, labels=None, *, device=None,
                 dtype=None, chat: bool | None = None, mode: str = "logprobs", truncate: bool = False,
                 max_batch_tokens: int = 16384, graphs: bool = True, head=None,
                 allow_special_tokens: bool = False, adapter=None, batch_invariant: bool | None = None,
                 spec: ModelSpec | None = None):
        if spec is None:
            spec = ModelSpec(model, template, labels, device=device, dtype=dtype, chat=chat, mode=mode,
                             truncate=truncate, max_batch_tokens=max_batch_tokens, head=head,
                             adapter=adapter, allow_special_tokens=allow_special_tokens,
                             batch_invariant=batch_invariant)
        elif model is not None or template is not None or labels is not None:
            raise ConfigError("pass spec= or model/template/labels, not both")
        spec, adapter_file, head_file = self._files(spec)
        self.spec = spec
        self.loaded = obtain(spec.model, spec.device, spec.dtype)
        self.engine = Engine.shared(self.loaded, batch_invariant=spec.batch_invariant)
        tok = self.loaded.tokenizer
        self.prompt = Prompt(tok, spec.template, chat=spec.chat, special_tokens=spec.allow_special_tokens)
        self.adapter_meta = None  # a merged adapter's metadata (template, labels, training)
        if adapter_file is not None:  # before the prefix and graphs are computed from the weights
            head_file = self._merge(adapter_file) or head_file
        self.labels, self.mode, self.truncate = list(spec.labels), spec.mode, spec.truncate
        self.trie = LabelTrie.build(tok, self.labels, self.prompt.render(query="x"), self.prompt.encode_text)
        # Branch tokens follow the suffix, so the prompt itself must leave room for them.
        limit = self.engine.config.context_limit
        self.prompt.context_limit = limit - self.trie.max_len
        check_prefix_fits(self.prefix_len, self.trie.max_len, limit)
        self.head = None
        if head_file is not None:  # refuse a head trained for another model, template or labels
            from .weights.heads import check_head

            if adapter_file is None:  # an adapter's head was checked with the adapter, unmerged
                check_head(head_file, self, spec.head)
            self.head = head_file.to(self.engine.device, self.engine.dtype)
        if self.mode == "logits" and not self.trie.first_distinct and self.head is None:
            raise ConfigError("mode 'logits' needs labels whose first tokens differ; these share a "
                              "first token, so use mode 'logprobs'")
        self.max_batch_tokens = spec.max_batch_tokens
        finish_load(self.loaded)  # dtype fp8: quantized now, after the adapter merge and checks
        self.prefix_kv = self.engine.prefill(self.prompt.prefix_ids)
        self.weight = self.engine.label_weight(self.trie.columns)
        # A linear head is an N-row projection like the label rows: graphs capture it instead.
        linear = self.head is not None and self.head.kind == "linear"
        weight, logprobs = (self.head.weight, False) if linear else (self.weight, self.mode == "logprobs")
        self.capture_info = self.engine.capture(self.prefix_kv, weight, logprobs,
                                                spec.max_batch_tokens) if graphs else {}

    @staticmethod
    def _files(spec: ModelSpec):
        """-> (spec with every default filled in, adapter file, head file): an adapter's or a
        head's template, labels and chat flag are the defaults, then the seed prompt's. Every check
        that needs no model runs here, so a mistake fails before loading one."""
        adapter_file = head_file = None
        fill = {}
        if spec.adapter is not None:  # a LoRA adapter (prefixscore finetune), merged into the weights
            from .weights.adapter import open_adapter

            adapter_file = open_adapter(spec.adapter, spec.model)
            if spec.head is not None:
                raise ConfigError(f"pass an adapter or a head, not both: {spec.adapter} brings its own "
                                  f"decision rule (objective {adapter_file.meta['objective']!r})")
            fill = {k: adapter_file.meta[k] for k in ("template", "labels", "chat")}
        if spec.head is not None:  # a trained head (weights/heads.py): template, labels, chat default to its own
            from .weights.heads import read_head

            head_file = read_head(spec.head)  # unreadable file: ModelLoadError before loading a model
            fill = {"template": head_file.meta["template"], "labels": head_file.labels,
                    "chat": head_file.meta["chat"]}
        fill = {"template": SEED_TEMPLATE, "labels": SEED_LABELS, "chat": None, **fill}
        template, labels, chat = (fill[k] if getattr(spec, k) is None else getattr(spec, k)
                                  for k in ("template", "labels", "chat"))
        mode = "logprobs" if spec.mode is None else spec.mode
        check_template(template, ("query",))
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        spec = spec.replace(template=template, labels=tuple(classifier_labels(labels)), chat=chat, mode=mode)
        return spec, adapter_file, head_file

    def _merge(self, adapter_file):
        """Check the adapter against this model, template and labels and merge it into the weights;
        -> its linear head for objective "head" (which then decides), else None."""
        from .weights.adapter import apply_adapter

        self.adapter_meta = apply_adapter(self.loaded, adapter_file, self.spec.adapter,
                                          (self.spec.template, self.spec.label_list, self.prompt.chat))
        return adapter_file.head_weights() if adapter_file.head is not None else None

    @classmethod
    def many(cls, classifiers: dict, model=None, *, device=None, dtype=None,
             **common) -> dict:
        """Several classifiers over one loaded model: {name: {template=, labels=, ...}} -> {name:
        Classifier} (a many.Classifiers: a dict that also asks them together, `classify(query)`
        -> {name: Result}, in one fused forward pass). The weights are loaded once and shared, and
        so is the engine with its CUDA graph memory; each classifier keeps its own pinned prefix,
        label rows and graphs (see `memory`). `common` options apply to every classifier unless
        its own dict sets them. Adapters merge into the weights, so they cannot be shared: use
        one model per adapter."""
        if not isinstance(classifiers, dict) or not classifiers:
            raise ConfigError("Classifier.many takes a non-empty dict {name: {template=..., "
                              "labels=..., ...}}")
        for name, spec in classifiers.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"a classifier name is a non-empty string, got {name!r}")
            if not isinstance(spec, dict):
                raise ConfigError(f"classifier {name!r}: options are a dict, got {type(spec).__name__}")
            if "model" in spec or "adapter" in {**common, **spec}:
                raise ConfigError(f"classifier {name!r}: the classifiers of Classifier.many share "
                                  f"one model; model= and adapter= are not per classifier")
        loaded = obtain(model, device, dtype)
        from .many import Classifiers

        return Classifiers({name: cls(loaded, **{**common, **spec}) for name, spec in classifiers.items()})

    @property
    def memory(self) -> dict[str, int]:
        """Bytes this classifier adds to its model: the pinned prefix's K/V, the label rows, and
        (GPU) its graphs' static buffers and the growth of the shared graph pool at its capture.
        Compare with `model_bytes`, the weights every classifier of the model shares."""
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.prefix_kv)
        graphs = int(self.capture_info.get("graph_mem_mb", 0) * 2**20)
        return {"prefix_kv": kv, "label_rows": self.weight.numel() * self.weight.element_size(),
                "graphs": graphs, "model_bytes": self.engine.weight_bytes()}

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
        with collector_paused():  # every result kept until the end: no full scans of them all
            return [r for batch in self.classify_batch_iter(queries, progress) for r in batch]

    def classify_batch_iter(self, queries, progress=None):
        """classify_batch batch by batch, for streaming (the CLI writes each as it comes): yields
        each flat batch's results in input order, while a worker thread tokenizes the queries ahead
        of the engine. Errors name the query, 1-based when there are several ("query 37: ...").
        A query that is not a non-empty string fails here, before any batch runs; one that only
        tokenizing can fault (over the context limit, without truncate) fails where its batch is
        reached, after the batches before it were yielded (classify_batch: before it returns)."""
        if isinstance(queries, str):
            raise InputError("classify_batch takes a list of strings; use classify() for one")
        queries = list(queries)
        if len(queries) <= TOKENIZE_FIRST:  # one tokenizer call: nothing to overlap, no thread
            return self.classify_iter(self._encode_numbered(queries), progress)
        for i, q in enumerate(queries):  # before any batch runs: what fails without tokenizing
            if not isinstance(q, str) or not q.strip():
                with numbered(i):
                    self.encode_many([q])  # raises Prompt's own message
        return self._classify_stream(queries, progress)

    def _encode_numbered(self, queries: list[str]) -> list[Encoded]:
        """encode_many; of several queries, a bad one is named 1-based ("query 3: empty query")."""
        if len(queries) == 1:
            return self.encode_many(queries)
        with numbered(0):
            return self.encode_many(queries)

    def _classify_stream(self, queries: list[str], progress):
        def encode(lo, hi):  # on the worker thread
            with numbered(lo):
                return list(enumerate(self.encode_many(queries[lo:hi]), lo))

        spans = doubling_spans(itertools.repeat(1, len(queries)), TOKENIZE_FIRST, TOKENIZE_MAX)
        with contextlib.closing(run_ahead(encode, spans)) as chunks:
            yield from self._in_order(self._batches(itertools.chain.from_iterable(chunks)), progress)

    def _in_order(self, batches, progress):
        """Run each batch of (index, Encoded) pairs; yield the results each completes, in order
        (on a GPU the next pass queued behind the one collected: overlap.passes_in_order). A
        negative index is a request answered before (classify_lists' skip): it runs, for its
        pass's sake, and its result is dropped."""
        def answer(batch, decided):
            pairs = zip((i for i, _ in batch), self._results([e for _, e in batch], *decided))
            return pairs if batch[0][0] >= 0 else [(i, r) for i, r in pairs if i >= 0]  # (indices ascend)

        return passes_in_order(batches, lambda batch: self._launch([e for _, e in batch]), answer,
                               self.engine.queues, progress)

    def _batches(self, stream):
        """Flat batches (lists of (index, Encoded)) from a stream of tokenized requests, in its
        order: greedy under a token budget that starts at FIRST_BATCH_TOKENS and doubles up to
        max_batch_tokens, so the engine starts after a few queries are tokenized. A batch holds one
        prefix: requests without the cached prefix (rare) gather apart and run when theirs is full
        or after the cached batch that passes them, so results wait for one batch at most. Decided
        by the input alone: a given input always runs in the same batches (on the GPU the last bits
        of a score depend on the batch's size)."""
        branch = self._branch_tokens()
        budget = min(FIRST_BATCH_TOKENS, self.max_batch_tokens)
        cached, size, exact, exact_size = [], 0, [], 0
        for i, e in stream:
            n = len(e.ids) - e.start + branch
            if e.start == 0:
                if exact and exact_size + n > self.max_batch_tokens:
                    yield exact
                    exact, exact_size = [], 0
                exact.append((i, e))
                exact_size += n
                continue
            if cached and size + n > budget:
                yield cached
                if exact:
                    yield exact
                cached, size, exact, exact_size = [], 0, [], 0
                budget = min(2 * budget, self.max_batch_tokens)
            cached.append((i, e))
            size += n
        if cached:
            yield cached
        if exact:
            yield exact

    def _branch_tokens(self) -> int:
        """Flat tokens the label trie's branch paths add to every request (logprobs mode)."""
        if self.mode != "logprobs" or self.head is not None:
            return 0
        return sum(len(p) for p in self.trie.branch_paths())

    def classify_encoded(self, encoded: list[Encoded], progress=None) -> list[Result]:
        """Run pre-tokenized requests (see encode) in as few flat batches as fit max_batch_tokens."""
        if len(encoded) == 1 and progress is None:  # the latency path (classify, the server)
            return self._run(encoded)
        return [r for batch in self.classify_iter(encoded, progress) for r in batch]

    def classify_iter(self, encoded: list[Encoded], progress=None):
        """classify_encoded batch by batch, for streaming: yields the results that each flat batch
        completes, in input order. Requests without the cached prefix (rare: a query that merges into
        the prefix) run in passes of their own, each when the passes reach its first request."""
        yield from self.classify_lists([encoded], progress)

    def classify_lists(self, lists, progress=None, skip: int = 0, stop=None):
        """classify_iter over a stream of lists of Encoded (the CLI's chunks), each as if it were
        its own call: a list's flat batches are cut from it alone (a resumed job cuts a file in the
        same chunks, and a row's last bits depend on its batch), and run in the order of their
        first request, so results come out as early as they can (the CLI writes them as they do:
        a pass without the cached prefix runs where its first request is, not after every pass
        with it, which held back all results behind that request). What one call adds: on a GPU the
        next list's first pass is queued before the last pass of the one before is collected.
        Yields the results each pass completes, in order across the lists.

        skip: the first list's first `skip` requests were answered before (a resume of a chunk a
        stop cut short): its passes are cut as ever, those holding only such requests do not run,
        and the others' results for them are dropped (the same pass, so the same bits).
        stop(): asked before each pass and list; once true, none more starts and the stream ends
        (a pass whose results wait for a later one's yields nothing, so a caller could not stop
        between those)."""
        stop = stop or (lambda: False)

        def batches():
            base = -skip  # the first list's answered requests have negative indices
            for encoded in lists:
                for chunk in sorted(self._chunks(encoded)):  # (by first index: they are disjoint)
                    if stop():
                        return
                    if base + chunk[-1] >= 0:  # (a pass's indices ascend)
                        yield [(base + i, encoded[i]) for i in chunk]
                base += len(encoded)
                if stop():  # before the next list is taken (and the one after it read)
                    return

        return self._in_order(batches(), progress)

    def _chunks(self, encoded):
        """Group request indices by prefix use (cached / exact) and by a token budget per batch."""
        branch = self._branch_tokens()
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
        in fp32: the input of a trained N-way head (weights/heads.py)."""
        encoded = self._encode_numbered(list(queries))
        out = torch.empty(len(encoded), self.engine.config.hidden_size)
        for chunk in self._chunks(encoded):
            batch = [encoded[i] for i in chunk]
            plan = plan_classify([e.ids[e.start:] for e in batch], [e.start for e in batch],
                                 self.trie, branches=False)
            prefix = self.prefix_kv if batch[0].start > 0 else self.engine.no_prefix
            h, _ = self.engine.hidden(plan, prefix, read=True)
            norm = self.engine.model.norm
            out[chunk] = rms_norm(h, norm.weight, norm.eps).float().cpu()
        return out

    def _run(self, batch: list[Encoded]) -> list[Result]:
        return self._results(batch, *self._decide(batch))

    def _results(self, batch: list[Encoded], decision, label_scores) -> list[Result]:
        return [Result(e.values["query"], self.labels[d], dict(zip(self.labels, s)))
                for e, d, s in zip(batch, decision, label_scores)]

    def decide_encoded(self, encoded: list[Encoded]) -> tuple[list[int], list[list[float]]]:
        """classify_encoded's answers as label indices and score rows (in label order), in input
        order, without Result objects: the server's engine loop, where a few microseconds per
        request are a share of the engine's rate."""
        if len(encoded) == 1:
            return self._decide(encoded)
        best, scores = [0] * len(encoded), [None] * len(encoded)
        for chunk in self._chunks(encoded):
            d, s = self._decide([encoded[i] for i in chunk])
            for i, di, si in zip(chunk, d, s):
                best[i], scores[i] = di, si
        return best, scores

    def _decide(self, batch: list[Encoded]) -> tuple[list[int], list[list[float]]]:
        """One flat batch: per request the label index and the label scores."""
        return self._launch(batch)()

    def _assemble(self, scores, best, n: int, logprobs: bool):
        label_scores, decision = (self.trie.assemble(scores, best, n) if logprobs
                                  else self.trie.assemble_logits(scores, best))
        return decision.tolist(), label_scores.tolist()

    def decide_after(self, kv, suffix: list[int]) -> tuple[list[int], list[list[float]]]:
        """decide_encoded's answer of one prompt whose first tokens' K/V is kv (a list per layer,
        engine.QueryKV.view: the classifier's pinned prefix, then more) and whose last tokens are
        `suffix`: its label index and score row (score_run.PromptRun's last pass)."""
        logprobs = self.mode == "logprobs"
        plan = plan_classify([suffix], [kv[0][0].shape[0]], self.trie, branches=logprobs)
        return self._answers(self.engine.launch(plan, kv, self.weight, logprobs), 1, logprobs)()

    def launch_encoded(self, encoded: list[Encoded]):
        """decide_encoded in two halves (the engine loop's pass): planned and queued now; the
        returned finish() waits for it and returns what decide_encoded returns. On CUDA the GPU
        runs it while the caller plans the next. Requests that make more than one flat batch
        (past max_batch_tokens, or some without the cached prefix) run now, batch by batch."""
        chunks = self._chunks(encoded)
        if len(next(chunks)) < len(encoded):
            answer = self.decide_encoded(encoded)
            return lambda: answer
        return self._launch(encoded)

    def _launch(self, batch: list[Encoded]):
        """_decide in two halves: plan and queue the batch's pass now; the returned finish() waits
        for it and returns what _decide returns (a CPU pass and a head's scores have finished by
        then; on CUDA a graph replay or an eager pass may still run)."""
        logprobs = self.mode == "logprobs"
        if self.head is not None:
            from .weights.heads import head_scores

            scores, best = head_scores(self, self.head, batch, logprobs)
            answer = best.tolist(), scores.tolist()
            return lambda: answer
        collect = self.engine.launch(*self._plan(batch, logprobs), self.weight, logprobs)
        return self._answers(collect, len(batch), logprobs)

    def _answers(self, collect, n: int, logprobs: bool):
        """A launched pass's collect() -> finish(): (label indices, score rows) of its n requests."""
        if logprobs and n == 1:  # the latency path

            def one():
                o, d = self.trie.assemble_one(*collect())
                return [d], [o]

            return one
        return lambda: self._assemble(*collect(), n, logprobs)

    def _plan(self, batch: list[Encoded], logprobs: bool):
        """(the batch's flat plan, the prefix KV it reads: the cached one, or none)."""
        plan = plan_classify([e.ids[e.start:] for e in batch], [e.start for e in batch], self.trie,
                             branches=logprobs)
        return plan, self.prefix_kv if batch[0].start > 0 else self.engine.no_prefix
