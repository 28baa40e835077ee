"""Multi-item scoring: one query, many candidate items, the query computed once (DESIGN.md §2.3, §3).

Every item is scored as if alone with the whole prompt `template(query, item)`: the answer is the
label scores at the item's last token. The pinned instruction prefix is shared by every request; on
top of it, the tokens common to all of a request's items (the "query part": template text + query
up to where the item starts) are computed once per span, and each item only adds its own tokens:

    span = [query part ........][item 1 + text after the slot][item 2 + text after ...]...
            own causal range     base = query part, own range = the item; positions restart after
                                 the query part for every item, exactly as if scored alone

That is one flat pass over plain `Plan` fields, so Engine.run and its CUDA graphs run it unchanged;
spans.py says how items are laid out in spans (`layout=`) and why.

Exactness: each item's whole prompt is tokenized as one text, and the query part is only the tokens
that are a prefix of that item's tokens; an item that disagrees (a merge across the slot boundary)
is computed alone from the cached prefix, and one that disagrees with the cached prefix itself is
computed with no cache at all. What the model sees is always the whole prompt's tokens.

`score_request` takes SGLang's `/v1/score` request shape (query, items, label_token_ids or labels,
apply_softmax, item_first) and returns its response shape.
"""
from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict

import numpy as np
import torch

from .depth import within_depth
from .engine import Engine
from .errors import ConfigError, InputError, error_at
from .item_table import ItemTable
from .labels import LabelHead, LabelTrie, check_labels
from .weights.loading import finish_load, obtain
from .overlap import TOKENIZE_FIRST, TOKENIZE_MAX, doubling_spans, run_ahead
from .prompt import Prompt, check_prefix_fits, check_template, sentinel
from .score_run import ScoreRun
from .score_input import SLOTS, Prepared, ScoreCall, ScoreInput, SoftItem, label_key
from .spans import Span, SpanLayout, plan_items, request_spans
from .values import LAYOUTS, SCORE_MODES as MODES, ItemResult, ModelSpec  # noqa: F401 (scorer.LAYOUTS)

DEFAULT_TEMPLATE = ("Decide whether the item is relevant to the query. Answer yes or no.\n"
                    "Query: {query}\nItem: {item}")
DEFAULT_LABELS = ["yes", "no"]
# Label sets named by requests (labels / label_token_ids) keep their head rows in an LRU of this
# many: a client that varies them per request must not grow memory without bound.
REQUEST_HEADS = 8


class Scorer:
    """Scorer(model=None, template=None, labels=None): score many items against one query.

    `template` has a `{query}` and an `{item}` slot (either order) after a fixed instruction; default:
    a yes/no relevance prompt with labels yes/no, on the bundled SmolLM2-135M-Instruct. Give
    `label_token_ids` instead of `labels` to score raw vocabulary tokens. A model without a tokenizer
    (a `LoadedModel` built from weights only) scores token ids only (`score_ids`), with `prefix_ids`
    as the pinned prefix. Options as Classifier's (allow_special_tokens: special-token text in
    the query and the items is parsed as control tokens; default: plain text), plus `mode` (MODES),
    `layout` (LAYOUTS) and `max_items` per request, and `batch_invariant` (Classifier's).

    Items are text, or embeddings of the model's hidden size, one soft token in the item's slot
    (DESIGN.md §9; forms: score_input.item_vector), by id into `item_table` (a path, item_table.py).
    """

    def __init__(self, model=None, template: str | None = None, labels=None, *, label_token_ids=None,
                 device=None, dtype=None, chat: bool | None = None, mode: str = "logprobs",
                 layout: str = "auto", max_items: int = 1024, max_batch_tokens: int = 16384,
                 prefix_ids: list[int] | None = None, graphs: bool = True,
                 allow_special_tokens: bool = False, adapter=None, batch_invariant: bool | None = None,
                 item_table=None, spec: ModelSpec | None = None):
        if spec is None:
            spec = ModelSpec(model, template, labels, device=device, dtype=dtype, chat=chat, mode=mode,
                             max_batch_tokens=max_batch_tokens, adapter=adapter,
                             allow_special_tokens=allow_special_tokens, batch_invariant=batch_invariant)
        elif model is not None or template is not None or labels is not None:
            raise ConfigError("pass spec= or model/template/labels, not both")
        if max_items < 1:
            raise ConfigError("max_items must be positive")
        self.spec, self.mode, self.max_items = spec, spec.mode or "logprobs", max_items
        adapter_file, labels = self._check(spec, label_token_ids, layout)
        if item_table is not None and not isinstance(item_table, ItemTable):
            item_table = ItemTable.load(item_table)
        self.loaded = obtain(spec.model, spec.device, spec.dtype)
        self.item_table = None if item_table is None else item_table.check_model(self.loaded)
        self.adapter_meta = None
        if adapter_file is not None:  # before the prefix and graphs are computed from the weights
            from .weights.adapter import apply_adapter

            self.adapter_meta = apply_adapter(self.loaded, adapter_file, spec.adapter)  # the base only
        finish_load(self.loaded)  # dtype fp8: quantized now, after the adapter merge
        self.engine = Engine.shared(self.loaded, batch_invariant=spec.batch_invariant)  # (Classifier's)
        self.config = self.engine.config
        self.tokenizer = self.loaded.tokenizer
        self._heads: OrderedDict = OrderedDict()  # label-set key -> LabelHead, for requests' label sets
        self._prompt(spec, label_token_ids, prefix_ids)
        # The scorer's own label set is kept for good (its CUDA graphs use its weight).
        self._own_key = self._label_key(labels, label_token_ids, ConfigError)
        self.head = self._build_head(self._own_key, ConfigError)
        self.labels, self.trie = self.head.labels, self.head.trie
        check_prefix_fits(len(self.prefix_ids), self.trie.max_len, self.config.context_limit)
        self.spans = SpanLayout(layout, spec.max_batch_tokens)
        self.prefix_kv = self.engine.prefill(self.prefix_ids)
        self._check_mode(self.mode, self.head)
        if layout == "packed" and self.mode in ("logprobs", "softmax") and len(self.trie.branch_paths()) > 1:
            raise ConfigError("layout 'packed' needs labels that branch at most once after their "
                              "first token; these branch more, so use layout 'alone' or 'auto'")
        self.capture_info = self._capture(graphs) if graphs else {}

    @staticmethod
    def _check(spec: ModelSpec, label_token_ids, layout: str):
        """Every check that needs no model, so a mistake fails before one loads; -> (the adapter
        file or None, the labels checked, None with label_token_ids)."""
        if spec.head is not None or spec.truncate:
            raise ConfigError("a Scorer takes no head and no truncate: it scores label tokens, and "
                              "refuses an over-long request")
        adapter_file, labels, mode = None, spec.label_list, spec.mode or "logprobs"
        if spec.adapter is not None:  # unreadable or unsuitable: an error before the model loads
            from .weights.adapter import open_adapter

            adapter_file = open_adapter(spec.adapter, spec.model)
            if adapter_file.head is not None:
                raise ConfigError(f"{spec.adapter} was fine-tuned with objective 'head': its linear "
                                  f"head, not the label tokens, decides, and a Scorer scores label tokens")
        if labels is not None and label_token_ids is not None:
            raise ConfigError("give labels or label_token_ids, not both")
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
        if label_token_ids is None:
            labels = check_labels(DEFAULT_LABELS if labels is None else labels)
        if spec.template is not None:
            check_template(spec.template, SLOTS)
        return adapter_file, labels

    def _prompt(self, spec: ModelSpec, label_token_ids, prefix_ids) -> None:
        """The template, its Prompt and the pinned prefix; a model without a tokenizer scores
        token ids behind `prefix_ids`."""
        if self.tokenizer is None:
            if spec.template is not None or label_token_ids is None:
                raise ConfigError("this model has no tokenizer: give label_token_ids and no template, "
                                  "and score token ids (score_ids)")
            self.template, self.prompt, self.item_first = None, None, False
            self.prefix_ids = list(prefix_ids or [])
            return
        if prefix_ids is not None:
            raise ConfigError("prefix_ids is for models without a tokenizer; with a template the "
                              "instruction before the slots is the pinned prefix")
        self.template = DEFAULT_TEMPLATE if spec.template is None else spec.template
        self.prompt = Prompt(self.tokenizer, self.template, chat=spec.chat, slots=SLOTS,
                             special_tokens=spec.allow_special_tokens)
        pieces = self.prompt.pieces
        self.item_first = pieces.index(sentinel("item")) < pieces.index(sentinel("query"))
        self.prefix_ids = self.prompt.prefix_ids

    def _capture(self, graphs: bool) -> dict:
        """CUDA graphs of every pass a scorer runs (Engine.capture_scorer): over the pinned prefix
        and over the engine's K/V bank (a long query part's chunks, and the items after them), for
        its own labels, any label set under softmax and SGLang's default mode, embedding items
        included. Items computed without the cached prefix, and label sets over VOCAB_LABELS
        tokens, run eagerly. -> capture_info: the own labels' capture (time, memory), the rest
        under "prefix" and "bank"."""
        own = self.mode != "vocab_probs"
        info = self.engine.capture_scorer(self.prefix_kv, self.head.weight if own else None,
                                          self.mode != "logits", self.spec.max_batch_tokens)
        return {**info.get("prefix", {}).get("own", {}), **info}

    @property
    def layout(self) -> str:
        return self.spans.layout

    @property
    def max_batch_tokens(self) -> int:
        return self.spans.max_batch_tokens

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    def _head(self, labels, label_token_ids, err=ConfigError, single: bool = False) -> LabelHead:
        """Label trie and head rows: the scorer's own, or a request's from an LRU of REQUEST_HEADS
        label sets. Text labels are tokenized as they follow the prompt; single=True demands one
        token each (a score request)."""
        key = self._label_key(labels, label_token_ids, err)
        if key == self._own_key:
            head = self.head
        else:
            head = self._heads.pop(key, None)  # put back last: the most recently used
            if head is None:
                head = self._build_head(key, err)
            self._heads[key] = head
            if len(self._heads) > REQUEST_HEADS:
                self._heads.popitem(last=False)
        if single and key[0] == "text" and not head.single_tokens:
            l, p = next((l, p) for l, p in zip(head.labels, head.trie.paths) if len(p) > 1)
            raise err(f"labels must be single tokens in a score request (scores are per label token, "
                      f"like label_token_ids); {l!r} is {len(p)} tokens")
        return head

    def _label_key(self, labels, label_token_ids, err) -> tuple:
        return label_key(labels, label_token_ids, self.config.vocab_size, err)

    def _build_head(self, key, err) -> LabelHead:
        tok = self.tokenizer
        if key[0] == "ids":
            # A padded vocabulary (Qwen: 151936 rows, ~151665 tokens) has ids with no token.
            names = tok.convert_ids_to_tokens(list(key[1])) if tok else [None] * len(key[1])
            names = [str(i) if n is None else n for i, n in zip(key[1], names)]
            trie = LabelTrie(names, [[i] for i in key[1]], getattr(tok, "eos_token_id", None))
        elif tok is None:
            raise err("this scorer has no tokenizer: give label_token_ids, not labels")
        else:
            context = self.prompt.render(query="x", item="x")
            try:
                trie = LabelTrie.build(tok, list(key[1]), context, self.prompt.encode_text)
            except ConfigError as e:
                raise err(str(e)) from None
        return LabelHead(trie.labels, trie, self.engine.label_weight(trie.columns))

    def _check_mode(self, mode: str, head: LabelHead, err=ConfigError) -> None:
        if mode == "logits" and not head.trie.first_distinct:
            raise err("mode 'logits' needs labels whose first tokens differ; these share a first "
                      "token, so use mode 'logprobs' or 'softmax'")
        if mode == "vocab_probs" and not head.single_tokens:
            l, p = next((l, p) for l, p in zip(head.labels, head.trie.paths) if len(p) > 1)
            raise err(f"probabilities under the full vocabulary (mode 'vocab_probs', SGLang "
                      f"apply_softmax=false) need single-token labels, and {l!r} is {len(p)} tokens; "
                      f"use mode 'softmax' (apply_softmax=true) or label_token_ids")

    # ------------------------------------------------------------ public API

    def score(self, query: str, items, depth=None) -> list[ItemResult]:
        """Label scores for every item, as if each were scored alone with the whole prompt.
        depth: score only the first items, an int or a depth.DepthControl (a latency target: it
        gives the depth and is told the call's latency); the rest come back scored=False."""
        if depth is None:
            return self.score_batch([(query, items)])[0]
        items = self.input.check_text(query, items)
        done = within_depth(depth, items, lambda first: self.score_batch([(query, first)])[0])
        return done + [ItemResult(it.given if isinstance(it, SoftItem) else it, None, {}, scored=False)
                       for it in items[len(done):]]

    def score_batch(self, requests, progress=None) -> list[list[ItemResult]]:
        """Many (query, items) requests (tuples or {"query", "items"} dicts) in shared flat passes,
        the requests tokenized on a worker thread ahead of the engine (as Classifier.classify_batch).
        A malformed request fails before any pass runs; an item over the context limit, once the
        tokenizer reaches it. Of several requests, errors name the request ("request 3: ...")."""
        if isinstance(requests, (str, dict)) or not isinstance(requests, (list, tuple)):
            raise InputError("score_batch takes a list of (query, items) requests")

        def named(k):  # of several requests, an error names its request
            return error_at(f"request {k + 1}" if len(requests) > 1 else None)

        checked = []
        for k, r in enumerate(requests):
            with named(k):
                if isinstance(r, dict):
                    q, items = r.get("query"), r.get("items")
                elif isinstance(r, (list, tuple)) and len(r) == 2:
                    q, items = r
                else:
                    raise InputError("a request is (query, items) or {\"query\", \"items\"}")
                checked.append((q, self._check_text(q, items)))

        def prepare(lo, hi):  # on the worker thread
            out = []
            for k in range(lo, hi):
                with named(k):
                    out.append(self.prepare(*checked[k]))
            return out

        spans = doubling_spans((len(items) for _, items in checked), TOKENIZE_FIRST, TOKENIZE_MAX)
        if len(spans) <= 1:  # one tokenizer call (or none): nothing to overlap, no thread
            return self.run(prepare(0, len(checked)), progress=progress)
        with contextlib.closing(run_ahead(prepare, spans)) as chunks:
            return self.run(itertools.chain.from_iterable(chunks), progress=progress)

    def score_ids(self, query_ids, items_ids, item_first: bool = False) -> list[ItemResult]:
        """Score token sequences as given: query_ids + item_ids per item (item_ids + query_ids with
        item_first), no template, like SGLang's token-id requests. The pinned prefix is reused
        when a sequence starts with it."""
        return self.run([self.prepare_ids(query_ids, items_ids, item_first)])[0]

    def score_request(self, req: dict) -> dict:
        """SGLang `/v1/score`: {"query", "items", "label_token_ids" | "labels", "apply_softmax",
        "item_first"} -> {"scores": [[score per label] per item], "labels", "model", "usage", ...}.

        apply_softmax=true: softmax over the label tokens; false (SGLang's default): each label
        token's probability under the full next-token distribution. Text query/items fill the
        template, whose slot order is the order (item_first, if given, must agree with it);
        token-id query/items are scored as given, query + item or item + query. Labels default to
        the scorer's own. usage.prompt_tokens: the tokens computed (after the pinned prefix)."""
        return self.score_call(self.input.parse(req))

    # ------------------------------------------------------------ requests -> token spans

    # Checks and tokenization: ScoreInput's (score_input.py), which a server's front end runs too.
    def _check_text(self, query, items) -> list:  # the checks that need no tokenizer call
        return self.input.check_text(query, items)

    def prepare(self, query: str, items) -> Prepared:  # a request, tokenized (ScoreInput.prepare)
        return self.input.prepare(query, items)

    def prepare_ids(self, query_ids, items_ids, item_first: bool = False) -> Prepared:
        return self.input.prepare_ids(query_ids, items_ids, item_first)

    def _groups(self, prep: Prepared, branch: int, one_per_span: bool) -> list[Span]:
        return request_spans(self.spans, prep, self.prefix_ids, self.prefix_kv, self.engine.bare,
                             branch, one_per_span)

    # ------------------------------------------------------------ spans -> passes -> scores

    def run(self, prepared, mode: str | None = None, head: LabelHead | None = None,
            progress=None, computed: list | None = None) -> list[list[ItemResult]]:
        """Score prepared requests (see prepare / prepare_ids) in as few flat passes as fit.
        `prepared` is any iterable (score_batch's is tokenized ahead on a worker thread): a pass is
        launched as soon as the span after it does not fit, and planned while the one before runs.
        computed: a list that gets, per request, the prompt tokens its spans compute (after the
        pinned prefix; a query part once per span)."""
        mode, head = mode or self.mode, head or self.head
        branches = head.trie.branch_paths() if mode in ("logprobs", "softmax") else []
        branch = sum(len(p) for p in branches)
        requests, scores, decisions = [], [], []

        def groups():  # each request's spans, their items numbered across requests
            for prep in prepared:
                n = len(scores)
                requests.append(prep)
                scores.extend([None] * len(prep.full))
                decisions.extend([None] * len(prep.full))
                spans = self._groups(prep, branch, len(branches) > 1)
                if computed is not None:
                    computed.append(sum(len(g.shared) + sum(map(len, g.tails)) for g in spans))
                for g in spans:
                    g.slots = [n + s for s in g.slots]
                    yield g

        def collect(batch, pending):
            s, d = pending()
            slots = [i for g in batch for i in g.slots]
            for i, si, di in zip(slots, s, d):
                scores[i], decisions[i] = si, di
            if progress is not None:
                progress(len(slots))

        # One pass in flight while the host plans the next (eager passes are queued without a sync).
        last = None
        for batch in self.spans.passes(groups(), branch):
            pending = self._launch_pass(batch, mode, head, branches)
            if last is not None:
                collect(*last)
            last = (batch, pending)
        if last is not None:
            collect(*last)
        out, i = [], 0
        for prep in requests:
            out.append([ItemResult(it, head.labels[decisions[i + j]],
                                   dict(zip(head.labels, scores[i + j])))
                        for j, it in enumerate(prep.items)])
            i += len(prep.items)
        return out

    @torch.inference_mode()
    def _launch_pass(self, groups: list[Span], mode: str, head: LabelHead, branches):
        """Queue one flat pass; returns a function that waits for it -> (scores, decisions) lists."""
        plan = plan_items(groups, head.trie, branches)
        kv, trie = groups[0].kv, head.trie
        if mode == "vocab_probs":
            probs = self.engine.vocab_probs(plan, kv, [p[0] for p in trie.paths])
            return lambda: (probs.tolist(), probs.argmax(-1).tolist())
        pending = self.engine.launch(plan, kv, head.weight, mode != "logits",  # a graph if captured
                                     trie.columns)

        def collect():
            s, best = pending()
            if mode == "logits":
                label_scores, decision = trie.assemble_logits(s, best)
            else:
                label_scores, decision = trie.assemble(s, best, plan.batch)
            label_scores = np.asarray(label_scores)
            if mode == "softmax":
                label_scores = np.exp(label_scores)
            return label_scores.tolist(), np.asarray(decision).tolist()

        return collect

    # ------------------------------------------------------------ a score request in two halves

    @property
    def input(self) -> ScoreInput:
        """The request side: checks and tokenization (score_input.py), no device work. A server's
        front end builds the same from the engine's Ready and sends the engine token ids."""
        return ScoreInput(self.prompt, self.item_first, self.config.vocab_size,
                          self.config.context_limit - self.trie.max_len, self.max_items,
                          self.config.hidden_size, self.item_table)

    def score_call(self, call: ScoreCall) -> dict:
        """score_request's second half: a parsed request (ScoreInput.parse, here or in a server's
        front end) -> SGLang's response. The request's label set is built here (an LRU of
        REQUEST_HEADS), its labels checked to be single tokens and to suit the mode."""
        head, mode = self.call_head(call)
        computed = []
        results = self.run([call.prep], mode, head, computed=computed)[0]
        n = computed[0]  # the tokens computed: the pinned prefix is not, the query part once a span
        return {"scores": [[r.scores[l] for l in head.labels] for r in results],
                "labels": head.labels, "model": self.loaded.name, "object": "scoring",
                "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}

    def call_head(self, call: ScoreCall) -> tuple[LabelHead, str]:
        """A parsed request's label head and mode (InputError for a label set it cannot score)."""
        if call.labels is None and call.label_token_ids is None:
            head = self.head
        else:
            head = self._head(call.labels, call.label_token_ids, InputError, single=True)
        mode = "softmax" if call.apply_softmax else "vocab_probs"
        self._check_mode(mode, head, InputError)
        return head, mode

    def begin(self, call: ScoreCall, depth: int | None = None, tokens: int | None = None):
        """A parsed request to run a pass at a time (score_run.ScoreRun: the engine loop's way,
        its long query part in chunks under a pass budget of `tokens`): score_call's answer, step
        by step."""
        return ScoreRun(self, call, depth, tokens)
