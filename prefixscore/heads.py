"""Trained N-way label heads: read the frozen model's final-normed hidden state at the read-out
position (Classifier.features) and apply a head trained for the task, with or without the long
instruction in front of the query.

    prefixscore fit-head data.csv --template "{query}" --no-chat -o head.safetensors
    prefixscore eval-modes data.csv          # prompt zero/few-shot vs head modes, k-fold

A linear head runs through the same fused label-head path as the label tokens: it is just another
N-row projection (weight [N, H]) with every row allowed, plus a bias. Feature standardization is
folded into the saved weights, so nothing but the projection runs at inference.

The head file is safetensors (no pickle): the weights plus metadata naming the model, template,
chat flag and labels it was trained with; load_head refuses to run it against anything else.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, InputError, ModelLoadError

FORMAT = "prefixscore-head"
VERSION = "1"
KINDS = ("linear", "mlp")


# ---------------------------------------------------------------- the head and its file

@dataclass
class HeadWeights:
    """The head as the engine runs it, on normed features x [B, H]:
    linear  logits = x @ weight.T + bias                                  (weight [N, H])
    mlp     logits = gelu(x @ weight.T + bias) @ out_weight.T + out_bias  (weight [M, H], out [N, M])"""
    kind: str
    labels: list[str]
    weight: torch.Tensor
    bias: torch.Tensor
    out_weight: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)  # model / template / chat / training (from the file)

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @functools.cached_property
    def host_bias(self) -> torch.Tensor:
        """fp32 CPU copy of the bias: Engine.run returns the kernel's logits on the host."""
        return self.bias.detach().float().cpu()

    def tensors(self) -> dict[str, torch.Tensor]:
        t = {"weight": self.weight, "bias": self.bias}
        if self.kind == "mlp":
            t |= {"out_weight": self.out_weight, "out_bias": self.out_bias}
        return t

    def to(self, device=None, dtype=None) -> "HeadWeights":
        moved = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in self.tensors().items()}
        return HeadWeights(self.kind, self.labels, meta=self.meta, **moved)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, N] from normed features in torch (the MLP path; the linear one's reference)."""
        x = x.to(self.weight.dtype)
        z = F.linear(x, self.weight, self.bias)
        if self.kind == "mlp":
            z = F.linear(F.gelu(z), self.out_weight, self.out_bias)
        return z.float()


def model_identity(loaded) -> dict:
    """What the head's input depends on: the model's shape and a sample of its weights.

    The signature is fp32 values from fixed places (embedding, output head, first/middle/last layer,
    norms), compared with a tolerance that lets the same weights load in fp32, bf16 or fp16 but
    not a different model or a fine-tune. The path is recorded for messages only, so a moved or
    copied model still matches."""
    m, c = loaded.model, loaded.model.config
    V, L = c.vocab_size, c.num_layers
    rows = torch.tensor([V // 3, V // 2, (2 * V) // 3])
    parts = [
        m.embed_tokens.weight[rows.to(m.embed_tokens.weight.device), :32],
        loaded.lm_head[rows.to(loaded.lm_head.device), :32],
        m.layers[0].self_attn.o_proj.weight[:2, :32],  # (q/k/v and gate/up get fused at load)
        m.layers[L // 2].self_attn.o_proj.weight[:2, :32],
        m.layers[L - 1].mlp.down_proj.weight[:2, :32],
        m.layers[0].input_layernorm.weight[:32],
        m.norm.weight[:64],
    ]
    sig = torch.cat([p.detach().float().cpu().reshape(-1) for p in parts])
    return {"model": loaded.name, "hidden_size": c.hidden_size, "num_layers": L, "vocab_size": V,
            "signature": sig}


def _same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    # 2^-7 relative: above bf16 rounding (2^-9) of the same fp32 values, below any real training.
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=2 ** -7, atol=1e-6))


def save_head(path, head: HeadWeights, clf, training: dict | None = None) -> None:
    """Write the head with the identity of `clf` (model, template, chat flag, labels) it was trained on."""
    from safetensors.torch import save

    from .io import cannot_write

    if list(head.labels) != list(clf.labels):
        raise ConfigError("the head's labels differ from the classifier's")
    ident = model_identity(clf.loaded)
    meta = {
        "format": FORMAT, "version": VERSION, "kind": head.kind,
        "labels": json.dumps(list(head.labels), ensure_ascii=False),
        "template": clf.prompt.template, "chat": json.dumps(clf.prompt.chat),
        "model": ident["model"], "hidden_size": str(ident["hidden_size"]),
        "num_layers": str(ident["num_layers"]), "vocab_size": str(ident["vocab_size"]),
        "training": json.dumps(training or {}, ensure_ascii=False),
    }
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in head.tensors().items()}
    tensors["model_signature"] = ident["signature"]
    data = save(tensors, metadata=meta)  # in memory: save_file's I/O errors are SafetensorErrors
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise cannot_write(path, e) from None


def read_head(path) -> HeadWeights:
    """The head file as written (CPU, fp32), metadata parsed into head.meta; no compatibility check."""
    from .loading import read_tagged

    meta, tensors = read_tagged(path, "head", FORMAT, VERSION, "fit the head again")
    try:
        kind, labels = meta["kind"], json.loads(meta["labels"])
        parsed = {"template": meta["template"], "chat": json.loads(meta["chat"]), "model": meta["model"],
                  "hidden_size": int(meta["hidden_size"]), "num_layers": int(meta["num_layers"]),
                  "vocab_size": int(meta["vocab_size"]), "training": json.loads(meta.get("training", "{}")),
                  "signature": tensors.pop("model_signature")}
        head = HeadWeights(kind, labels, **tensors, meta=parsed)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: damaged head file ({type(e).__name__}: {e})") from None
    N, H = len(labels), parsed["hidden_size"]
    if kind == "mlp" and (head.out_weight is None or head.out_bias is None):
        raise ModelLoadError(f"{path}: damaged head file (an mlp head without out_weight and out_bias)")
    out_rows = head.out_weight.shape[0] if kind == "mlp" else head.weight.shape[0]
    if kind not in KINDS or head.weight.ndim != 2 or head.weight.shape[1] != H or out_rows != N:
        raise ModelLoadError(f"{path}: damaged head file (kind {kind!r}, weight "
                             f"{tuple(head.weight.shape)} for {N} labels, hidden size {H})")
    return head


def check_head(head: HeadWeights, clf, path="head") -> None:
    """Refuse a head trained for another model, template, chat flag or label list (ConfigError)."""
    m = head.meta
    ident = model_identity(clf.loaded)
    if (m["hidden_size"], m["num_layers"], m["vocab_size"]) != (
            ident["hidden_size"], ident["num_layers"], ident["vocab_size"]) \
            or not _same_weights(m["signature"], ident["signature"]):
        raise ConfigError(f"{path} was trained on another model ({m['model']}, hidden size "
                          f"{m['hidden_size']}); this classifier runs {ident['model']} (hidden size "
                          f"{ident['hidden_size']}): load that model or fit a head for this one")
    if m["template"] != clf.prompt.template or m["chat"] != clf.prompt.chat:
        raise ConfigError(f"{path} was trained with template {m['template']!r} (chat={m['chat']}); "
                          f"this classifier uses {clf.prompt.template!r} (chat={clf.prompt.chat}): "
                          f"pass the same template and chat flag, or fit a head for this one")
    if list(head.labels) != list(clf.labels):
        raise ConfigError(f"{path} was trained for the labels {head.labels}; this classifier has "
                          f"{clf.labels} (same labels in the same order are needed)")


def load_head(path, clf) -> HeadWeights:
    """read_head + check_head against `clf`, weights moved to the model's device and dtype."""
    head = read_head(path)
    check_head(head, clf, path)
    return head.to(clf.engine.device, clf.engine.dtype)


@torch.inference_mode()
def head_scores(clf, head: HeadWeights, batch, logprobs: bool = True):
    """Run pre-tokenized requests (Classifier.encode) through the model and the head ->
    (scores [B, N] fp32 on the CPU: log-softmax over the N labels, or raw logits; best [B]).

    Linear: Engine.run, i.e. the fused label-head kernel (and, on the GPU, a CUDA graph captured for
    (prefix, head.weight, logprobs=False)) with the head's rows as the projection and every row
    allowed; the bias is added to the N logits on the host. MLP: normed read-out rows, MLP in torch."""
    from .batch import plan_classify
    from .kernels.label_head import rms_norm

    eng = clf.engine
    plan = plan_classify([e.ids[e.start:] for e in batch], [e.start for e in batch], clf.trie,
                         branches=False)
    prefix = clf.prefix_kv if batch[0].start > 0 else eng.no_prefix
    if head.kind == "linear":
        plan.allowed = torch.ones(plan.batch, head.num_labels, dtype=torch.bool)
        logits, _ = eng.run(plan, prefix, head.weight, logprobs=False)
        logits = logits.float().cpu() + head.host_bias
    else:
        h, plan = eng.hidden(plan, prefix)
        logits = head.logits(rms_norm(h[plan.rows], eng.model.norm.weight, eng.model.norm.eps)).cpu()
    best = logits.argmax(-1)
    return (torch.log_softmax(logits, -1) if logprobs else logits), best


def classify_with_head(clf, head: HeadWeights, queries: list[str], logprobs: bool = True):
    """Results for queries through `head` (what Classifier(..., head=...) returns), in batches that
    follow the classifier's token budget."""
    from .classifier import Result

    encoded = clf.encode_many(queries)
    out = [None] * len(encoded)
    for chunk in clf._chunks(encoded):
        scores, best = head_scores(clf, head, [encoded[i] for i in chunk], logprobs)
        for i, s, b in zip(chunk, scores.cpu().tolist(), best.cpu().tolist()):
            out[i] = Result(encoded[i].values["query"], head.labels[b], dict(zip(head.labels, s)))
    return out


# ---------------------------------------------------------------- training

@dataclass
class FitOptions:
    kind: str = "linear"
    hidden: int = 256  # MLP width
    epochs: int = 200
    patience: int = 20  # epochs without a better validation loss before stopping
    lr: float = 1e-3
    weight_decay: float = 1.0  # AdamW's decoupled decay: strong, there are few rows per feature
    batch_size: int = 32
    val_frac: float = 0.2
    dropout: float = 0.1  # MLP only
    refit: bool = True  # after early stopping, train again on train + validation rows
    seed: int = 0

    def check(self) -> "FitOptions":
        if self.kind not in KINDS:
            raise ConfigError(f"unknown head kind {self.kind!r}: use {' or '.join(KINDS)}")
        if not 0 <= self.val_frac < 1:
            raise ConfigError("val_frac must be in [0, 1)")
        if min(self.epochs, self.batch_size, self.hidden) < 1 or self.patience < 1 or self.lr <= 0:
            raise ConfigError("epochs, patience, batch_size, hidden and lr must be positive")
        return self


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
    from .prompt import check_template

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
    from .classifier import classifier_labels

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
                  latency_queries: int = 32, log=print, **clf_opts) -> dict:
    """Side by side on one labeled set, k-fold cross-validated (stratified, seeded): every row is
    predicted by a mode that did not see it. Modes: prompt zero-shot; prompt few-shot with k
    examples per label drawn from the other folds; a head on the features of `template` (with the
    instruction); a head on the features of `head_template` (default: the query alone, no chat
    wrapper, so no prefix at all). Heads train on the other folds with their own validation split.

    Latency: 'batched' = the whole set's forward time / rows; 'batch-1 p50' = one query per call
    through Classifier.classify or the head path (head_scores), over `latency_queries` rows.
    clf_opts go to every Classifier (truncate, max_batch_tokens)."""
    from .classifier import Classifier
    from .cli import confusion_report

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
            for i, r in zip(test, clf.classify_encoded(_encode_rows(clf, queries, test))):
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


def format_modes(rep: dict) -> str:
    head = f"{'mode':34s}{'prefix':>7s}{'accuracy':>10s}{'macro-F1':>10s}{'ms/q batched':>14s}{'ms batch-1 p50':>16s}"
    lines = [head]
    for m in rep["modes"]:
        lines.append(f"{m['mode']:34s}{m['prefix_tokens']:7d}{m['accuracy']:10.3f}{m['macro_f1']:10.3f}"
                     f"{m['ms_per_query_batched']:14.2f}{m['ms_batch1_p50']:16.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line

def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _shots(text: str) -> list[int]:
    try:
        ks = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--shots takes comma-separated integers, got {text!r}") from None
    if any(k < 0 for k in ks):
        raise ConfigError("--shots must be >= 0")
    return ks


def _fit_options(a) -> FitOptions:
    return FitOptions(kind=a.kind, hidden=a.hidden, epochs=a.epochs, patience=a.patience, lr=a.lr,
                      weight_decay=a.weight_decay, batch_size=a.batch_size, val_frac=a.val_frac,
                      refit=a.refit, seed=a.seed).check()


def _labeled(path, fmt, column, label_column, labels) -> tuple[list[str], list[str]]:
    from .io import read_rows

    rows = read_rows(path, fmt, (column, label_column))
    unknown = sorted({r[label_column] for r in rows} - set(labels))
    if unknown:
        raise InputError(f"{path}: labels not in the label set: {', '.join(map(repr, unknown))} "
                         f"(the label set: {', '.join(labels)}; pass --labels to change it)")
    return [r[column] for r in rows], [r[label_column] for r in rows]


def cmd_fit_head(a) -> int:
    from .cli import make_classifier, run_batches
    from .io import labels_option, template_option
    from .classifier import Classifier
    from .io import check_output, read_rows
    from .prompt import SEED_LABELS, SEED_TEMPLATE

    opts = _fit_options(a)
    if a.soft and not a.teacher:
        raise ConfigError("--soft fits the teacher's label distribution: it needs --teacher")
    check_output(a.output)
    labels = labels_option(a) or SEED_LABELS
    if a.teacher:  # unlabeled queries: the prompted model's decisions are the targets
        queries = [r[a.column] for r in read_rows(a.data, a.input_format, (a.column,))]
    else:
        queries, gold = _labeled(a.data, a.input_format, a.column, a.label_column, labels)
    template = template_option(a)
    if a.examples:
        ex_q, ex_l = _labeled(a.examples, "auto", a.column, a.label_column, labels)
        template = few_shot_template(template or SEED_TEMPLATE, list(zip(ex_q, ex_l)), a.shots, labels, a.seed)
    a.template, a.template_file = template, None
    clf = make_classifier(a)
    if a.teacher:
        tt = a.teacher_template
        if a.teacher_template_file:
            from .io import read_text

            tt = read_text(a.teacher_template_file, "teacher template").rstrip("\n")
        teacher = Classifier(clf.loaded, tt, labels, chat=a.teacher_chat, truncate=a.truncate,
                             max_batch_tokens=a.batch_tokens)
        _err(f"teacher: prompt mode, prefix {teacher.prefix_len} tokens; labeling {len(queries)} queries")
        results, _ = run_batches(teacher, queries)
        # scores are log-probabilities under label-constrained decoding: softmax = that distribution
        scores = torch.tensor([[r.scores[l] for l in labels] for r in results])
        targets = scores.softmax(-1) if a.soft else torch.tensor([labels.index(r.label) for r in results])
        _err("teacher decisions: " + ", ".join(f"{l}: {c}" for l, c in
                                                Counter(r.label for r in results).most_common()))
    else:
        targets = torch.tensor([labels.index(g) for g in gold])
    _err(f"reading the hidden state of {len(queries)} queries (prefix {clf.prefix_len} tokens)")
    t0 = time.perf_counter()
    x = clf.features(queries)
    _err(f"done in {time.perf_counter() - t0:.1f} s; training a {opts.kind} head")
    head, info = fit_head(x, targets, labels, opts, log=print)
    info |= {"source": ("teacher-soft" if a.soft else "teacher") if a.teacher else "labels",
             "data": a.data}
    save_head(a.output, head, clf, info)
    what = "val" if info["val_rows"] else "train"
    print(f"saved {a.output}: {opts.kind} head, {len(labels)} labels, epoch {info['best_epoch']}, "
          f"{what} accuracy {info[what + '_acc']:.3f}" + (" (agreement with the teacher)" if a.teacher else ""))
    return 0


def cmd_eval_modes(a) -> int:
    from .io import labels_option, template_option
    from .io import Output, check_output
    from .loading import obtain
    from .prompt import SEED_LABELS, SEED_TEMPLATE

    labels = labels_option(a) or SEED_LABELS
    shots, opts, template = _shots(a.shots), _fit_options(a), template_option(a) or SEED_TEMPLATE
    check_compare_options(labels, a.folds, a.latency_queries)  # all before the model loads
    check_output(a.json)
    queries, gold = _labeled(a.data, a.input_format, a.column, a.label_column, labels)
    loaded = obtain(a.model, a.device, a.dtype)
    rep = compare_modes(loaded, queries, gold, labels, template, chat=a.chat,
                        head_template=a.head_template, head_chat=a.head_chat, shots=shots,
                        folds=a.folds, seed=a.seed, opts=opts,
                        latency_queries=a.latency_queries, log=_err, truncate=a.truncate,
                        max_batch_tokens=a.batch_tokens)
    print(format_confusion_all(rep))
    if a.json:
        with Output(a.json) as f:
            f.write(json.dumps(rep, indent=1))
    return 0


def format_confusion_all(rep: dict) -> str:
    from .cli import format_confusion

    out = [f"{rep['rows']} rows, {rep['folds']}-fold cross-validation (seed {rep['seed']})",
           format_modes(rep)]
    for m in rep["modes"]:
        out += ["", m["mode"], format_confusion({"labels": rep["labels"], "confusion": m["confusion"]})]
    return "\n".join(out)


def _fit_args(p) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--kind", default="linear", choices=KINDS, help="linear (default) or a small MLP")
    g.add_argument("--hidden", type=int, default=256, help="MLP width")
    g.add_argument("--epochs", type=int, default=200, help="at most this many epochs")
    g.add_argument("--patience", type=int, default=20, help="early stopping: epochs without a better val loss")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--weight-decay", type=float, default=1.0, help="AdamW decoupled weight decay")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--val-frac", type=float, default=0.2, help="stratified validation share (0: none)")
    g.add_argument("--refit", default=True, action=argparse.BooleanOptionalAction,
                   help="after early stopping, train again on all rows for the best epoch count")
    g.add_argument("--seed", type=int, default=0, help="split, initialization and example choice")


def add_command(sub, model_args) -> None:
    p = sub.add_parser("fit-head", help="train an N-way head on the model's read-out hidden state")
    p.add_argument("data", help="CSV or JSONL with a query column and (unless --teacher) a label column")
    p.add_argument("-o", "--output", required=True, help="head file to write (.safetensors)")
    p.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl"])
    p.add_argument("--column", default="query")
    p.add_argument("--label-column", default="label")
    p.add_argument("--teacher", action="store_true",
                   help="targets = the prompted model's decisions on the (unlabeled) queries")
    p.add_argument("--teacher-template", default=None, help="the teacher's prompt (default: the seed prompt)")
    p.add_argument("--teacher-template-file", default=None)
    p.add_argument("--teacher-chat", default=None, action=argparse.BooleanOptionalAction,
                   help="wrap the teacher's prompt in the chat template (default: if the model has one)")
    p.add_argument("--soft", action="store_true", help="with --teacher: fit the teacher's label distribution")
    p.add_argument("--examples", default=None, help="labeled CSV/JSONL: put a few-shot block in the template")
    p.add_argument("--shots", type=int, default=2, help="examples per label with --examples")
    _fit_args(p)
    model_args(p)
    p.set_defaults(func=cmd_fit_head)

    e = sub.add_parser("eval-modes", help="prompt zero/few-shot vs trained heads with and without "
                                          "the instruction, k-fold on one labeled file")
    e.add_argument("data", help="CSV or JSONL with query and label columns")
    e.add_argument("--input-format", default="auto", choices=["auto", "csv", "jsonl"])
    e.add_argument("--column", default="query")
    e.add_argument("--label-column", default="label")
    e.add_argument("--folds", type=int, default=5)
    e.add_argument("--shots", default="1,2,4", help="few-shot examples per label to try")
    e.add_argument("--head-template", default="{query}", help="template of the no-instruction head mode")
    e.add_argument("--head-chat", default=False, action=argparse.BooleanOptionalAction,
                   help="wrap the no-instruction template in the chat template (default: no)")
    e.add_argument("--latency-queries", type=int, default=32, help="rows timed one at a time per mode")
    e.add_argument("--json", default=None, help="also write the report as JSON")
    _fit_args(e)
    model_args(e)
    e.set_defaults(func=cmd_eval_modes)
