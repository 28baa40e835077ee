"""Several classifiers of one model in one flat forward pass (Classifier.many's fused path).

At batch 1 a forward is bound by reading the weights, so two classifiers asked for the same query
cost two weight reads when run one after the other (about twice one). Here their requests
share one pass: the pinned prefixes are concatenated into one bank, each token sees only its own
classifier's slice of it (Context.prefix_range, kernels/attention.py), and the label rows of every
classifier form one head whose columns each read-out row may choose among only its own
(batch.concat_plans). Scores and decisions equal those of the classifiers run alone: the same
keys with the same positions reach every token, and the head's masked softmax sees only its own
labels (tests/test_many.py).

On a GPU a bank captures CUDA graphs for the latency buckets (up to GRAPH_TOKENS flat tokens, the
engine's graph pool shared with the classifiers' own graphs); larger batches run eagerly.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import torch

from .batch import concat_plans, plan_classify

# Flat tokens up to which a bank's plans replay CUDA graphs: a few requests per classifier (each
# ~10-20 suffix tokens plus label branches); past it a batch is throughput work, run eagerly.
GRAPH_TOKENS = 256
# Layouts a bank keeps for one request per classifier (suffix lengths x first positions): a few
# hundred in practice, each a small plan.
MAX_LAYOUTS = 4096


class Bank:
    """The concatenated prefixes and label rows of some classifiers over one engine."""

    def __init__(self, clfs: list):
        self.clfs = clfs
        self.engine = engine = clfs[0].engine
        lens = [c.prefix_len for c in clfs]
        self.kv_at = [sum(lens[:i]) for i in range(len(clfs))]
        self.kv_len = lens
        self.kv = [(torch.cat([c.prefix_kv[layer][0] for c in clfs]).contiguous(),
                    torch.cat([c.prefix_kv[layer][1] for c in clfs]).contiguous())
                   for layer in range(engine.config.num_layers)]
        widths = [c.weight.shape[0] for c in clfs]
        self.col_at = [sum(widths[:i]) for i in range(len(clfs))]
        self.weight = torch.cat([c.weight for c in clfs]).contiguous()
        self.logprobs = clfs[0].mode == "logprobs"
        self.paths = [tuple(map(tuple, c.trie.branch_paths())) if self.logprobs else () for c in clfs]
        # one request per classifier (the latency path): layout -> (plan, read-out slices)
        self.layouts: dict[tuple, tuple] = {}
        self.capture_info = engine.capture(self.kv, self.weight, self.logprobs, GRAPH_TOKENS,
                                           ranges=True) if any(c.capture_info for c in clfs) else {}


def fusable(clfs: list) -> bool:
    """One pass needs one engine, one scoring mode, and no trained head (its own projection)."""
    return (len({id(c.engine) for c in clfs}) == 1 and len({c.mode for c in clfs}) == 1
            and all(c.head is None for c in clfs))


def fused_tokens(clfs: list, groups: dict) -> int:
    """Flat tokens of a fused plan of groups ({classifier index: requests}): each request's new
    tokens and its classifier's label branches."""
    branch = {k: clfs[k]._branch_tokens() for k in groups}
    return sum(len(e.ids) - e.start + branch[k] for k, b in groups.items() for e in b)


def bank_of(clfs: list) -> Bank | None:
    """The bank of these classifiers, built once and kept on their engine; None when they cannot
    share a pass (fusable), also remembered."""
    banks = clfs[0].engine.__dict__.setdefault("banks", {})
    key = tuple(id(c) for c in clfs)
    if key not in banks:
        banks[key] = Bank(clfs) if fusable(clfs) else None
    return banks[key]


def decide_many(clfs: list, batches: list[list]) -> list[tuple[list[int], list[list[float]]]]:
    """batches[c]: classifier c's requests (Encoded) -> per classifier (label indices, score rows),
    as clfs[c].decide_encoded(batches[c]) returns them, from one flat forward pass. Classifiers
    that cannot share a pass (fusable) run one after the other."""
    bank = bank_of(clfs)
    if bank is None:
        return [c.decide_encoded(b) if b else ([], []) for c, b in zip(clfs, batches)]
    live = [i for i, b in enumerate(batches) if b]
    out: list = [([], [])] * len(clfs)
    if not live:
        return out
    if bank.logprobs and all(len(batches[i]) == 1 for i in live):
        return _decide_ones(bank, batches, live, out)
    plan, parts = _fused_plan(bank, batches, live)
    scores, best = bank.engine.run(plan, bank.kv, bank.weight, bank.logprobs)  # a graph if captured
    for i, p, (r, n, lo, w) in parts:
        s, b = scores[r:r + n, lo:lo + w].contiguous(), best[r:r + n] - lo  # (engine.run: fp32, CPU)
        trie = clfs[i].trie
        label_scores, decision = (trie.assemble(s, b, p.batch) if bank.logprobs
                                  else trie.assemble_logits(s, b))
        out[i] = (decision.tolist(), label_scores.tolist())
    return out


def _decide_ones(bank: Bank, batches: list[list], live: list[int], out: list) -> list:
    """One request per classifier, the latency path: the plan of each layout is built once (as
    plan_classify keeps one request's layout), so a call only strings the tokens together and the
    graph runner's input image for the layout takes them (engine.GraphRunner.run)."""
    enc = [batches[i][0] for i in live]
    key = tuple((i, len(e.ids) - e.start, e.start) for i, e in zip(live, enc))
    entry = bank.layouts.get(key)
    if entry is None:
        plan, parts = _fused_plan(bank, batches, live)
        entry = (dataclasses.replace(plan, layout=key), parts)
        if len(bank.layouts) < MAX_LAYOUTS:
            bank.layouts[key] = entry
    plan, parts = copy.copy(entry[0]), entry[1]  # (shallow: only the tokens change)
    plan.tokens = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(
        itertools.chain(e.ids[e.start:], *bank.paths[i]) for i, e in zip(live, enc)), np.int64,
        plan.num_tokens))
    scores, best = bank.engine.run(plan, bank.kv, bank.weight, True)
    scores, best = scores.numpy(), best.numpy()  # (numpy slices: ~20x cheaper than a tensor's)
    for i, _, (r, n, lo, w) in parts:
        one, d = bank.clfs[i].trie.assemble_one(scores[r:r + n, lo:lo + w], best[r:r + n] - lo)
        out[i] = ([d], [one])
    return out


def _fused_plan(bank: Bank, batches: list[list], live: list[int]):
    """The flat plan of the live classifiers' requests over the bank, and per classifier
    (index, its plan, (first read-out row, rows, first label column, label columns))."""
    plans, starts, ends, parts = [], [], [], []
    r = 0
    for i in live:
        c, b = bank.clfs[i], batches[i]
        p = plan_classify([e.ids[e.start:] for e in b], [e.start for e in b], c.trie,
                          branches=bank.logprobs)
        plans.append(p)
        parts.append((i, p, (r, p.rows.shape[0], bank.col_at[i], c.weight.shape[0])))
        r += p.rows.shape[0]
        # A request whose prompt did not keep the prefix's tokens (start 0) sees no pinned key.
        cached = b[0].start > 0
        lo = bank.kv_at[i]
        starts.append(torch.full((p.num_tokens,), lo, dtype=torch.int32))
        ends.append(torch.full((p.num_tokens,), lo + (bank.kv_len[i] if cached else 0), dtype=torch.int32))
        if any((e.start > 0) != cached for e in b):  # mixed: per request
            at = 0
            for e, n in zip(b, _spans(p)):
                ends[-1][at:at + n] = lo + (bank.kv_len[i] if e.start > 0 else 0)
                at += n
    plan = concat_plans(plans, [bank.col_at[i] for i in live], bank.weight.shape[0],
                        (torch.cat(starts), torch.cat(ends)))
    return plan, parts


def _spans(plan) -> list[int]:
    """Tokens per request of a plan, in order."""
    return (plan.seg_offsets[1:] - plan.seg_offsets[:-1]).tolist()


class Classifiers(dict):
    """{name: Classifier} over one model, as Classifier.many returns them, also asked together:
    `classify(query)` -> {name: Result} and `classify_batch(queries)` -> [{name: Result}], with the
    classifiers' requests in one flat forward pass (decide_many over a bank of every classifier)
    while they fit its graphs (GRAPH_TOKENS flat tokens), else each classifier's own batches in
    turn. `names` picks some classifiers (default all, in this dict's order)."""

    def classify(self, query: str, names=None) -> dict:
        return self.classify_batch([query], names)[0]

    def classify_batch(self, queries, names=None) -> list[dict]:
        from .values import Result
        from .errors import ConfigError, InputError

        if isinstance(queries, str):
            raise InputError("classify_batch takes a list of strings; use classify() for one")
        names = list(self) if names is None else list(names)
        unknown = [n for n in names if n not in self]
        if unknown or not names:
            raise ConfigError(f"unknown classifier {unknown[0]!r}: these are {', '.join(self)}"
                              if unknown else "names is empty: name at least one classifier")
        clfs, order = list(self.values()), list(self)
        groups = {order.index(n): self[n]._encode_numbered(list(queries)) for n in names}
        if len(groups) > 1 and fusable(clfs) and fused_tokens(clfs, groups) <= GRAPH_TOKENS:
            out = decide_many(clfs, [groups.get(i, []) for i in range(len(clfs))])
            answers = {i: out[i] for i in groups}
        else:
            answers = {i: clfs[i].decide_encoded(enc) for i, enc in groups.items()}
        rows = [{} for _ in queries]
        for i, (best, scores) in answers.items():  # (in names' order)
            labels = clfs[i].labels
            for row, e, d, s in zip(rows, groups[i], best, scores):
                row[order[i]] = Result(e.values["query"], labels[d], dict(zip(labels, s)))
        return rows
