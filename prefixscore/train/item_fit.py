"""Fitting an item encoder by distillation from the text scorer (issue 34, DESIGN.md §9).

Teacher: the Scorer's score of (query, item text) in its template, as a margin (ranking.margin).
Student: the same prompt with the item's soft token (item_encoder.ItemMap of the item's cached
features) in the slot, through a Hugging Face model of the same frozen weights (inputs_embeds), so
gradients reach the map only. A training step is one query and its candidates: the prompt before
the slot runs once without gradients and its K/V is shared by the candidates; each candidate adds
its soft token and the prompt after the slot (the chat scaffolding: a handful of tokens).

Loss per query: the squared error of the student's margins against the teacher's (weight
`pointwise`), in units of the teacher's mean within-query spread, plus, with weight `listwise`
(default 0), the KL between the softmax over candidates of the teacher's and the student's margins
(temperature tau, in the same units). Adam, linear decay, the epoch with the best validation
agreement kept (validation queries split off the training ones). Agreement is measured through
the Scorer itself (the product path: embedding items in its slot).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import ranking
from .options import ItemFitOptions as FitOptions
from .item_encoder import ItemEncoder, ItemMap, embedding_norm, item_features


def label_columns(scorer) -> list[int]:
    """The label tokens a soft token's score reads: one each (as a score request's labels)."""
    paths = scorer.trie.paths
    if any(len(p) != 1 for p in paths) or len(paths) < 2:
        raise ConfigError(f"an item encoder is fitted for two or more single-token labels; "
                          f"{scorer.labels} tokenize to {paths}")
    return [p[0] for p in paths]


def student_margin(logits: torch.Tensor) -> torch.Tensor:
    """ranking.margin of label logits [B, N] (the first label's log-odds), differentiably."""
    if logits.shape[1] == 2:
        return logits[:, 0] - logits[:, 1]
    return logits[:, 0] - torch.logsumexp(logits[:, 1:], -1)


class Student:
    """The frozen Hugging Face model scoring soft tokens in a scorer's template."""

    def __init__(self, scorer, model=None):
        from transformers import AutoModelForCausalLM

        from .lora import hf_folder

        self.scorer = scorer
        self.device = scorer.engine.device
        hf = AutoModelForCausalLM.from_pretrained(hf_folder(model), dtype=torch.float32)
        hf = hf.to(self.device).eval()
        for p in hf.parameters():
            p.requires_grad_(False)
        self.body = hf.model
        self.head = hf.lm_head.weight[torch.tensor(label_columns(scorer), device=self.device)].clone()
        self._parts: dict = {}  # query -> (ids before the slot, ids after it)
        self._prefix, self._kv = None, {}  # the pinned prefix's K/V; per query the rest's

    def parts(self, query: str) -> tuple[list[int], list[int]]:
        if query not in self._parts:
            p = self.scorer.prompt
            self._parts[query] = (p.encode_before("item", query=query), p.encode_after("item", query=query))
        return self._parts[query]

    @torch.no_grad()
    def _before_kv(self, before: list[int]) -> list:
        """K/V [1, kv heads, len(before), d] per layer of the prompt before the slot: the pinned
        prefix's computed once, the rest per query, kept (a few hundred KB a query)."""
        from transformers import DynamicCache

        from .lora import _cache_kwarg

        body, dev, key = self.body, self.device, _cache_kwarg(self.body)
        prefix = list(self.scorer.prefix_ids)
        P = len(prefix) if before[:len(prefix)] == prefix and len(before) > len(prefix) else 0
        if P and self._prefix is None:
            out = body(input_ids=torch.tensor([prefix], device=dev), use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            self._prefix = [(l.keys, l.values) for l in cache.layers]
        rest = self._kv.get(tuple(before))
        if rest is None:
            cache = DynamicCache(config=body.config)
            for i, (k, v) in enumerate(self._prefix if P else []):
                cache.update(k, v, i)
            out = body(input_ids=torch.tensor([before[P:]], device=dev), use_cache=True, **{key: cache},
                       position_ids=torch.arange(P, len(before), device=dev)[None])
            cache = getattr(out, "cache", None) or out.past_key_values
            rest = self._kv[tuple(before)] = [(l.keys[:, :, P:], l.values[:, :, P:]) for l in cache.layers]
        if not P:
            return rest
        return [(torch.cat([pk, k], 2), torch.cat([pv, v], 2)) for (pk, pv), (k, v) in zip(self._prefix, rest)]

    def margins(self, query: str, soft: torch.Tensor) -> torch.Tensor:
        """Margins [B] of the soft tokens soft [B, H] as items of `query` (differentiable in soft)."""
        from transformers import DynamicCache

        from .lora import _cache_kwarg

        before, after = self.parts(query)
        B, body, dev = soft.shape[0], self.body, self.device
        cache = DynamicCache(config=body.config)
        for i, (k, v) in enumerate(self._before_kv(before)):
            cache.update(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1), i)
        tail = body.embed_tokens(torch.tensor(after, device=dev)).expand(B, -1, -1)
        x = torch.cat([soft.to(dev)[:, None].to(tail.dtype), tail], 1)
        pos = torch.arange(len(before), len(before) + x.shape[1], device=dev).expand(B, -1)
        h = body(inputs_embeds=x, position_ids=pos, use_cache=False,
                 **{_cache_kwarg(body): cache}).last_hidden_state
        return student_margin(h[:, -1] @ self.head.T).float().cpu()


def scorer_margins(scorer, queries, vectors_per_query) -> list[np.ndarray]:
    """The product path: each query's soft tokens scored as embedding items by the Scorer."""
    out = scorer.score_batch([(q, list(v)) for q, v in zip(queries, vectors_per_query)])
    return [np.array([ranking.margin(r.scores, scorer.labels) for r in rs]) for rs in out]


def fit(scorer, feats: torch.Tensor, queries, cands, teacher, opts: FitOptions, model=None,
        log=print, progress: bool = True) -> tuple[ItemMap, dict]:
    """Train a map on `queries` (cands[i]: item indices into feats [I, 2H]; teacher[i]: their
    margins) -> (the map of the best epoch on the validation queries, history)."""
    from ..rows.progress import Bar

    opts.check()
    H = scorer.config.hidden_size
    tr, va = ranking.split(len(queries), opts.val_fraction, opts.seed)
    if not tr:
        raise ConfigError("no training queries left after the validation split")
    spread = float(np.mean([np.std(t) for t in teacher]))  # the teacher's within-query scale
    spread = spread if spread > 0 else 1.0
    tau = opts.tau * spread
    scale = embedding_norm(scorer.loaded) / float(feats[:, :H].norm(dim=-1).median())
    torch.manual_seed(opts.seed)
    seen = sorted({i for c in cands for i in c})  # the standardization: of the items trained on
    m = ItemMap(H, opts.kind, opts.width, scale, feats[seen].mean(0), feats[seen].std(0).clamp_min(1e-6),
                opts.rank)
    student = Student(scorer, model)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)
    steps = opts.epochs * len(tr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) * max(0.0, 1 - s / steps))
    gen = torch.Generator().manual_seed(opts.seed)

    def soft(idx):
        return m(feats[idx])

    def validate():
        with torch.no_grad():
            s = [student.margins(queries[i], soft(cands[i])).numpy() for i in va]
        return ranking.agreement(s, [teacher[i] for i in va])

    hist, best, best_state = [], None, None
    if va:
        best = {"epoch": 0, **validate()}
        best_state = {k: v.clone() for k, v in m.state_dict().items()}
        hist.append(best)
        log(f"epoch 0 (untrained): val NDCG@10 {best['ndcg@10']:.3f}, Spearman {best['spearman']:.3f}")
    with Bar(steps, "step", "fit-item-encoder", disable=not progress) as bar:
        for epoch in range(1, opts.epochs + 1):
            t0, total = time.perf_counter(), 0.0
            for i in torch.tensor(tr)[torch.randperm(len(tr), generator=gen)].tolist():
                t = torch.tensor(teacher[i], dtype=torch.float32)
                s = student.margins(queries[i], soft(cands[i]))  # (on the CPU, as the map)
                loss = opts.listwise * F.kl_div(F.log_softmax(s / tau, 0), F.log_softmax(t / tau, 0),
                                                log_target=True, reduction="sum") \
                    + opts.pointwise * ((s - t) ** 2).mean() / spread ** 2
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                total += loss.item()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            rec = {"epoch": epoch, "train_loss": round(total / len(tr), 5),
                   "seconds": round(time.perf_counter() - t0, 1)}
            if va:
                rec |= validate()
                if rec["ndcg@10"] + rec["spearman"] > best["ndcg@10"] + best["spearman"]:
                    best, best_state = rec, {k: v.clone() for k, v in m.state_dict().items()}
                log(f"epoch {epoch}: loss {rec['train_loss']:.4f}, val NDCG@10 {rec['ndcg@10']:.3f}, "
                    f"Spearman {rec['spearman']:.3f} ({rec['seconds']:.0f} s)")
            hist.append(rec)
    if best_state is not None:
        m.load_state_dict(best_state)
    return m, {"history": hist, "best_epoch": best["epoch"] if best else opts.epochs,
               "train_queries": len(tr), "val_queries": len(va), "tau": round(tau, 5),
               "teacher_spread": round(spread, 5)}



# ---------------------------------------------------------------- the whole fit, as the command runs it

def fit_item_encoder(cat: ranking.Catalogue, queries: list[str], *, eval_queries=None,
                     query_labels=None, eval_labels=None, model=None, template=None, labels=None,
                     chat=None, device=None, candidates: int = 20, heldout_items: float = 0.2,
                     eval_fraction: float = 0.2, opts: FitOptions = FitOptions(), log=print,
                     progress: bool = True, scorer=None) -> tuple[ItemEncoder, dict]:
    """Build the ranking set (training queries' candidates from the catalogue less `heldout_items`
    of its items; held-out queries' from the same items, and from the held-out items alone), score it
    with the text scorer, fit a map, and measure it against the untrained map through the Scorer.
    eval_queries: the held-out queries (else `eval_fraction` of `queries`). -> (encoder, report)."""
    from ..rows.progress import Bar
    from ..scorer import Scorer
    from ..weights.loading import base_hash

    opts.check()
    if not 0 <= heldout_items < 1 or not 0 < eval_fraction < 1 or candidates < 2:
        raise ConfigError("heldout_items must be in [0, 1), eval_fraction in (0, 1), candidates >= 2")
    if eval_queries is None:
        keep, held = ranking.split(len(queries), eval_fraction, opts.seed)
        eval_queries = [queries[i] for i in held]
        eval_labels = [query_labels[i] for i in held] if query_labels else None
        query_labels = [query_labels[i] for i in keep] if query_labels else None
        queries = [queries[i] for i in keep]
    if not queries or not eval_queries:
        raise ConfigError("too few queries to hold some out: give more, or --eval-queries")
    t_all = time.perf_counter()
    scorer = scorer or Scorer(model, template, labels, chat=chat, device=device)
    label_columns(scorer)
    sets, item_held = _ranking_sets(cat, queries, query_labels, eval_queries, eval_labels,
                                    candidates, heldout_items, opts.seed)
    pairs = sum(len(q) for q, _ in sets.values()) * candidates
    log(f"teacher: scoring {pairs} (query, item text) pairs with {scorer.loaded.name}")
    t0 = time.perf_counter()
    with Bar(pairs, "pair", "teacher", disable=not progress) as bar:
        teacher = {k: ranking.teacher_margins(scorer, q, [[cat.texts[i] for i in c] for c in cs],
                                              bar.update) for k, (q, cs) in sets.items()}
    timing = {"teacher": time.perf_counter() - t0}
    t0 = time.perf_counter()
    feats = item_features(scorer.loaded, cat.texts, opts.pooling, prompt=scorer.prompt)
    timing["features"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    q, cs = sets["train"]
    m, info = fit(scorer, feats, q, cs, teacher["train"], opts, model, log, progress)
    timing["fit"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    untrained = ItemMap(m.hidden, m.kind, m.width, float(m.scale_init), m.mu, m.sd, m.rank)
    maps = {"trained": m, "untrained": untrained}
    report = {name: evaluate(scorer, maps, feats, q, cs, teacher[name])
              for name, (q, cs) in sets.items() if name != "train"}
    timing["evaluate"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - t_all
    info |= {"options": dataclasses.asdict(opts), "candidates": candidates, "items": len(cat.ids),
             "heldout_items": len(item_held), "eval_queries": len(eval_queries),
             "seconds": {k: round(v, 1) for k, v in timing.items()}, "agreement": report}
    meta = {"base_model": base_hash(scorer.loaded), "base_name": str(scorer.loaded.name),
            "template": scorer.template, "chat": scorer.prompt.chat, "labels": list(scorer.labels),
            "training": info}
    return ItemEncoder(m.eval(), opts.pooling, meta=meta), info


def _ranking_sets(cat, queries, query_labels, eval_queries, eval_labels, candidates: int,
                  heldout_items: float, seed: int):
    """fit_item_encoder's ranking sets {name: (queries, candidate lists)}: training queries over
    the catalogue less the held-out items, held-out queries over the same items and (if enough)
    over the held-out items alone -> (sets, the held-out items)."""
    item_keep, item_held = ranking.split(len(cat.ids), heldout_items, seed)

    def lists(qs, labels, pool, k):
        return qs, ranking.candidates(qs, cat, pool, candidates, query_labels=labels, seed=seed + k)

    sets = {"train": lists(queries, query_labels, item_keep, 1),
            "heldout_queries": lists(eval_queries, eval_labels, item_keep, 2)}
    if len(item_held) >= candidates:
        sets["heldout_queries_new_items"] = lists(eval_queries, eval_labels, item_held, 3)
    return sets, item_held


def evaluate(scorer, maps: dict, feats, queries, cands, teacher) -> dict:
    """Agreement with the teacher of each map's soft tokens scored by the Scorer, and of a random
    order (the floor)."""
    out = {}
    for name, m in maps.items():
        with torch.no_grad():
            vecs = m(feats)
        student = scorer_margins(scorer, queries, [[vecs[i] for i in c] for c in cands])
        out[name] = ranking.agreement(student, teacher)
    out["random_order"] = ranking.random_order(teacher)
    return out
