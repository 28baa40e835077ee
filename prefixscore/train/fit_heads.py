"""Fitting N-way label heads (prefixscore.weights.heads runs them) on the frozen model's read-out hidden
state, few-shot prefixes, and the k-fold comparison of prompt and head modes.

    prefixscore fit-head data.csv --template "{query}" --no-chat -o head.safetensors
    prefixscore eval-modes data.csv          # prompt zero/few-shot vs head modes, k-fold
"""
from __future__ import annotations

import copy
import math
import random
import statistics
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, InputError
from ..weights.heads import HeadWeights, classify_with_head, head_scores
from .options import HeadFitOptions as FitOptions


def split_indices(strata: list[int], frac: float, seed: int) -> tuple[list[int], list[int]]:
    """Stratified split -> (train, held out): about `frac` of each stratum held out (none of a
    stratum with one row). Deterministic for a seed."""
    rng = random.Random(seed)
    train, held = [], []
    for s in sorted(set(strata)):
        idx = [i for i, x in enumerate(strata) if x == s]
        rng.shuffle(idx)
        n = min(len(idx) - 1, max(1, round(frac * len(idx)))) if frac > 0 else 0
        held += idx[:n]
        train += idx[n:]
    return sorted(train), sorted(held)


def stratified_folds(strata: list[int], folds: int, seed: int) -> list[int]:
    """Fold id per row: each stratum shuffled and dealt round-robin, continuing where the last
    stratum stopped so the folds' sizes differ by at most one."""
    rng = random.Random(seed)
    fold, k = [0] * len(strata), 0
    for s in sorted(set(strata)):
        idx = [i for i, x in enumerate(strata) if x == s]
        rng.shuffle(idx)
        for i in idx:
            fold[i], k = k % folds, k + 1
    return fold


def _net(H: int, N: int, o: FitOptions) -> nn.Module:
    if o.kind == "linear":
        net = nn.Linear(H, N)
        nn.init.zeros_(net.weight)  # convex problem: start at the uniform prediction
        nn.init.zeros_(net.bias)
        return net
    return nn.Sequential(nn.Linear(H, o.hidden), nn.GELU(), nn.Dropout(o.dropout), nn.Linear(o.hidden, N))


def _loss_acc(net, x, y, hard):
    logits = net(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(-1) == hard).float().mean().item()


def _train(x, y, hard, tr, va, epochs, N, o: FitOptions, log):
    """Minibatch AdamW on standardized features; with a validation set, early stopping on its loss
    (the best epoch's weights are kept). -> (net, mu, sd, history, best epoch)."""
    # Standardize with train statistics (trains well whatever the model's feature scale).
    mu = x[tr].mean(0)
    var = x[tr].var(0, unbiased=False)
    sd = (var + 1e-3 * var.mean() + 1e-12).sqrt()  # floor: a constant feature must not blow up
    z = (x - mu) / sd
    with torch.random.fork_rng(devices=[]):  # seed init and dropout without touching global RNG
        torch.manual_seed(o.seed)
        net = _net(x.shape[1], N, o)
        opt = torch.optim.AdamW(net.parameters(), lr=o.lr, weight_decay=o.weight_decay)
        gen = torch.Generator().manual_seed(o.seed)
        tr_t = torch.tensor(tr)
        best, best_state, best_epoch, stale, hist = math.inf, None, epochs, 0, []
        for epoch in range(1, epochs + 1):
            net.train()
            for b in torch.randperm(len(tr), generator=gen).split(o.batch_size):
                i = tr_t[b]
                loss = F.cross_entropy(net(z[i]), y[i])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            net.eval()
            with torch.no_grad():
                rec = {"epoch": epoch, **dict(zip(("train_loss", "train_acc"), _loss_acc(net, z[tr], y[tr], hard[tr])))}
                if va:
                    rec |= dict(zip(("val_loss", "val_acc"), _loss_acc(net, z[va], y[va], hard[va])))
            hist.append(rec)
            if log:
                log(f"epoch {epoch:3d}  train loss {rec['train_loss']:.4f} acc {rec['train_acc']:.3f}"
                    + (f"  val loss {rec['val_loss']:.4f} acc {rec['val_acc']:.3f}" if va else ""))
            if not va:
                continue
            if rec["val_loss"] < best - 1e-6:
                best, best_state, best_epoch, stale = rec["val_loss"], copy.deepcopy(net.state_dict()), epoch, 0
            else:
                stale += 1
                if stale >= o.patience:
                    if log:
                        log(f"early stop: no better validation loss for {o.patience} epochs; best epoch {best_epoch}")
                    break
        if best_state is not None:
            net.load_state_dict(best_state)
    return net, mu, sd, hist, best_epoch


def fit_head(features: torch.Tensor, targets: torch.Tensor, labels: list[str],
             opts: FitOptions | None = None, log=print) -> tuple[HeadWeights, dict]:
    """Train an N-way head on features [B, H] (Classifier.features). targets: label index [B] (int)
    or label probabilities [B, N] (distillation).

    A stratified validation split picks the number of epochs by early stopping; then (refit, the
    default) the head is trained again on all rows for that many epochs, so no labeled row is left
    out of the final head. Without a validation split it trains for `epochs`. Deterministic for a
    seed on CPU. -> (head in fp32 with the standardization folded in, info: the validation numbers
    come from the selection run)."""
    o = (opts or FitOptions()).check()
    N = len(labels)
    x = features.detach().float().cpu().clone()  # clone: features may be inference tensors
    y = targets.detach().cpu().clone()
    y = y.float() if y.is_floating_point() else y.long()
    hard = y.argmax(-1) if y.is_floating_point() else y
    if x.ndim != 2 or len(x) != len(y) or len(x) == 0:
        raise InputError(f"need features [B, H] and B targets, got {tuple(x.shape)} and {len(y)}")
    if hard.min() < 0 or hard.max() >= N or (y.is_floating_point() and y.shape[1] != N):
        raise InputError(f"targets must index the {N} labels")
    tr, va = split_indices(hard.tolist(), o.val_frac, o.seed)
    if not tr:
        raise InputError("no training rows left after the validation split")
    net, mu, sd, hist, best_epoch = _train(x, y, hard, tr, va, o.epochs, N, o, log)
    info = {"options": asdict(o), "rows": len(x), "train_rows": len(tr), "val_rows": len(va),
            "epochs_run": len(hist), "best_epoch": best_epoch,
            **{k: round(v, 6) for k, v in hist[best_epoch - 1].items() if k != "epoch"}}
    if va and o.refit:
        if log:
            log(f"refit on all {len(x)} rows for {best_epoch} epochs")
        net, mu, sd, hist, _ = _train(x, y, hard, sorted(tr + va), [], best_epoch, N, o, log)
        info |= {"refit_train_loss": round(hist[-1]["train_loss"], 6),
                 "refit_train_acc": round(hist[-1]["train_acc"], 6)}

    # Fold the standardization into the first layer: W (x - mu) / sd + b = (W / sd) x + (b - (W / sd) mu).
    first = net if o.kind == "linear" else net[0]
    with torch.no_grad():
        w = first.weight / sd
        b = first.bias - w @ mu
        if o.kind == "linear":
            head = HeadWeights("linear", list(labels), w, b)
        else:
            head = HeadWeights("mlp", list(labels), w, b, net[3].weight.clone(), net[3].bias.clone())
    return head, info


# ---------------------------------------------------------------- few-shot prefix

def few_shot_template(base_template: str, rows, k: int, labels: list[str], seed: int = 0) -> str:
    """The template with k labeled examples per label between the instruction and the query slot,
    so they are part of the cached prefix. rows: dicts with 'query' and 'label' (read_rows) or
    (query, label) pairs. Examples are picked per label from the distinct queries in sorted order
    with a seeded RNG (independent of the file's row order) and shuffled once; a label with fewer
    than k rows contributes what it has.

    Each example repeats the template's slot line with the label as its answer: for the seed
    prompt (`...\\nquery:{query}`) that is `query:levis 501\\nJeans`; for `query: {query}\\nAnswer:`
    it is `query: levis 501\\nAnswer: Jeans`."""
    from ..prompt import check_template

    check_template(base_template, ("query",))
    if k < 0:
        raise ConfigError("the number of examples per label must be >= 0")
    if k == 0:
        return base_template
    by_label: dict[str, set[str]] = {l: set() for l in labels}
    for r in rows:
        q, l = (r["query"], r["label"]) if isinstance(r, dict) else r
        if l not in by_label:
            raise InputError(f"example label {l!r} is not in the label set ({', '.join(labels)})")
        q = " ".join(q.split())
        if q and "{" not in q and "}" not in q:  # braces could read as a template slot
            by_label[l].add(q)
    rng = random.Random(seed)
    picked = []
    for l in labels:
        pool = sorted(by_label[l])
        picked += [(q, l) for q in rng.sample(pool, min(k, len(pool)))]
    if not picked:
        raise InputError("no usable example rows for the few-shot prefix")
    rng.shuffle(picked)  # no label always last (recency bias)
    cut = base_template.rfind("\n", 0, base_template.index("{query}")) + 1
    instruction, slot = base_template[:cut], base_template[cut:]
    sep = "" if slot[-1:].isspace() else " " if slot.endswith(":") else "\n"
    examples = "\n".join(slot.replace("{query}", q) + sep + l for q, l in picked)
    return f"{instruction}{examples}\n{slot}"


# ---------------------------------------------------------------- comparing modes

def _timed_batch1(fn, queries) -> float:
    """p50 ms of one call per query (batch 1), after one warm-up call."""
    fn(queries[0])
    ts = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q)
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def check_compare_options(labels, folds: int, latency_queries: int) -> None:
    """compare_modes' own checks, cheap enough to run before a model loads."""
    from ..classifier import classifier_labels

    classifier_labels(labels)
    if folds < 2:
        raise ConfigError("folds must be at least 2")
    if latency_queries < 1:
        raise ConfigError("latency_queries must be at least 1: each mode times that many rows")


def _encode_rows(clf, queries: list[str], rows):
    """clf.encode_many of queries[rows]; a bad one is named by its place in the whole set (1-based,
    as `prefixscore eval` names it), not by its place in a fold."""
    try:
        return clf.encode_many([queries[i] for i in rows])
    except InputError as e:
        raise InputError(f"query {rows[e.index] + 1}: {e}") from None


def compare_modes(loaded, queries: list[str], gold: list[str], labels: list[str], template: str,
                  chat=None, head_template: str = "{query}", head_chat: bool = False,
                  shots=(1, 2, 4), folds: int = 5, seed: int = 0, opts: FitOptions | None = None,
                  latency_queries: int = 32, log=print, progress=None, **clf_opts) -> dict:
    """Side by side on one labeled set, k-fold cross-validated (stratified, seeded): every row is
    predicted by a mode that did not see it. Modes: prompt zero-shot; prompt few-shot with k
    examples per label drawn from the other folds; a head on the features of `template` (with the
    instruction); a head on the features of `head_template` (default: the query alone, no chat
    wrapper, so no prefix at all). Heads train on the other folds with their own validation split.

    Latency: 'batched' = the whole set's forward time / rows; 'batch-1 p50' = one query per call
    through Classifier.classify or the head path (head_scores), over `latency_queries` rows.
    clf_opts go to every Classifier (truncate, max_batch_tokens). progress(n): n more rows of the
    whole work done (modes_rows(n, shots) in all), as each pass completes."""
    from ..classifier import Classifier
    from ..rows.report import confusion_report

    check_compare_options(labels, folds, latency_queries)
    unknown = sorted(set(gold) - set(labels))
    if unknown:
        raise InputError(f"gold labels not in the label set: {', '.join(map(repr, unknown))}")
    say = log or (lambda *_: None)
    opts = opts or FitOptions(seed=seed)
    y = torch.tensor([labels.index(g) for g in gold])
    fold = stratified_folds(y.tolist(), folds, seed)
    n, lat_q = len(queries), queries[:latency_queries]
    modes = []

    def add(name, pred, prefix_tokens, secs, p50, **extra):
        rep = confusion_report(gold, pred, labels)
        modes.append({"mode": name, "prefix_tokens": prefix_tokens, "accuracy": rep["accuracy"],
                      "macro_f1": rep["macro_f1"], "ms_per_query_batched": 1e3 * secs / n,
                      "ms_batch1_p50": p50, "confusion": rep["confusion"], **extra})
        say(f"{name}: accuracy {rep['accuracy']:.3f}, macro-F1 {rep['macro_f1']:.3f}")

    for k in (0, *[s for s in shots if s > 0]):
        pred, secs, plens = [None] * n, 0.0, []
        for f in range(folds if k else 1):
            test = [i for i in range(n) if fold[i] == f] if k else list(range(n))
            train = [(queries[i], gold[i]) for i in range(n) if fold[i] != f]
            clf = Classifier(loaded, few_shot_template(template, train, k, labels, seed), labels, chat=chat,
                             **clf_opts)
            plens.append(clf.prefix_len)
            if not modes:  # the process's first forward passes are slow (allocator, thread pools)
                clf.classify_batch(queries[:8])
            t0 = time.perf_counter()
            passes = clf.classify_iter(_encode_rows(clf, queries, test), progress=progress)
            for i, r in zip(test, (r for results in passes for r in results)):
                pred[i] = r.label
            secs += time.perf_counter() - t0
        _encode_rows(clf, queries, range(len(lat_q)))  # the timed rows fit this fold's prefix too
        p50 = _timed_batch1(clf.classify, lat_q)
        add("prompt, zero-shot" if k == 0 else f"prompt, {k}-shot", pred, round(statistics.mean(plens)),
            secs, p50, shots=k)

    for name, tmpl, ch in ((f"head ({opts.kind}), with instruction", template, chat),
                           (f"head ({opts.kind}), no instruction", head_template, head_chat)):
        clf = Classifier(loaded, tmpl, labels, chat=ch, **clf_opts)
        t0 = time.perf_counter()
        x = clf.features(queries)
        secs = time.perf_counter() - t0
        if progress is not None:
            progress(n)
        pred, infos = [None] * n, []
        for f in range(folds):
            train = [i for i in range(n) if fold[i] != f]
            test = [i for i in range(n) if fold[i] == f]
            head, info = fit_head(x[train], y[train], labels, opts, log=None)
            infos.append(info["best_epoch"])
            for i, j in zip(test, head.logits(x[test]).argmax(-1).tolist()):
                pred[i] = labels[j]
        # Latency through the real head path, and a check that it decides like the features did.
        run = head.to(clf.engine.device, clf.engine.dtype)
        p50 = _timed_batch1(lambda q: head_scores(clf, run, [clf.encode(q)]), lat_q)
        via_path = [r.label for r in classify_with_head(clf, run, lat_q)]
        via_feat = [labels[j] for j in head.logits(x[:len(lat_q)]).argmax(-1).tolist()]
        add(name, pred, clf.prefix_len, secs, p50, best_epochs=infos,
            head_path_agrees=via_path == via_feat)
    return {"rows": n, "folds": folds, "seed": seed, "labels": labels, "template": template,
            "head_template": head_template, "head_chat": head_chat, "fit_options": asdict(opts),
            "modes": modes}


def modes_rows(n: int, shots=(1, 2, 4)) -> int:
    """The rows compare_modes runs through the model for n queries: once per prompt mode (each
    few-shot mode over its folds), and once per head mode for its features."""
    return n * (1 + sum(1 for s in shots if s > 0) + 2)


def format_modes(rep: dict) -> str:
    head = f"{'mode':34s}{'prefix':>7s}{'accuracy':>10s}{'macro-F1':>10s}{'ms/q batched':>14s}{'ms batch-1 p50':>16s}"
    lines = [head]
    for m in rep["modes"]:
        lines.append(f"{m['mode']:34s}{m['prefix_tokens']:7d}{m['accuracy']:10.3f}{m['macro_f1']:10.3f}"
                     f"{m['ms_per_query_batched']:14.2f}{m['ms_batch1_p50']:16.2f}")
    return "\n".join(lines)
