"""LoRA fine-tuning through peft, offline (DESIGN.md §8): a Hugging Face model built from the same
weights the engine loads, LoRA on every attention and MLP projection, trained on exactly the token
ids the engine computes (Prompt.encode_many for the prompt, LabelTrie.build for the label tokens).

objective "label": next-token cross-entropy on the label's tokens after the prompt, so decisions
    keep their meaning (label-constrained greedy decoding, the engine's default).
objective "head": a linear N-way head on the final-normed hidden state of the prompt's last token
    (the engine's read-out row), trained jointly with the LoRA weights.
Validation accuracy is the engine's decision rule computed on the peft model (trie_decisions).
"""
from __future__ import annotations

import copy
import importlib.util
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ConfigError, InputError, ModelLoadError
from ..weights.adapter import ADAPTER_OBJECTIVES, Adapter
from .data import read_data
from .options import LORA_DEFAULTS as DEFAULTS

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_folder(model) -> Path:
    """The Hugging Face folder holding the weights the engine loads for `model`: for a GGUF file (the
    bundled model included) the safetensors copy the first load converts, else the folder itself."""
    from ..weights.loading import converted_folder, load, resolve

    path = resolve(_model_path(model))
    if path.is_file() and path.suffix == ".gguf":
        folder = converted_folder(path)
        if not (folder / "model.safetensors").is_file():
            load(path, "cpu", torch.float32)  # converts once and caches the folder
        if not (folder / "model.safetensors").is_file():
            raise ModelLoadError(f"{path}: fine-tuning reads the converted safetensors copy, which "
                                 f"could not be written under {folder.parent} (set PREFIXSCORE_CACHE)")
        return folder
    if not path.is_dir():
        raise ModelLoadError(f"{path}: expected a folder with config.json or a .gguf file")
    return path


def _model_path(model):
    """A path or None; a LoadedModel stands for the files it was loaded from (training needs the
    Hugging Face model and fp32 weights, so it is loaded afresh)."""
    from ..weights.loading import LoadedModel

    return model.name if isinstance(model, LoadedModel) else model


def _children(trie) -> dict:
    kids: dict = {}
    for p in trie.paths:
        for d in range(len(p)):
            k = kids.setdefault(tuple(p[:d]), [])
            if p[d] not in k:
                k.append(p[d])
    return {n: sorted(k) for n, k in kids.items()}  # token order: argmax ties as the engine's


def _pad(seqs, device, pad=0):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):  # right padding: positions 0.. as the engine's, padding masked
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def _device(module) -> torch.device:
    return next(module.parameters()).device


def _hidden(body, seqs, first_needed):
    """Final-normed hidden states of right-padded seqs -> (h [B, L - c, H], c): position j of a
    sequence is h[:, j - c]. The rows' common prefix (the template's instruction, usually most of
    the tokens) runs once, as batch 1, and its K/V are shared by the batch: the same values as
    running every row whole, at a fraction of the cost; gradients flow back through the shared K/V.
    first_needed: the first position any caller reads (the shared part stops before it)."""
    c = min(common_prefix(seqs), first_needed)
    dev = _device(body)
    if len(seqs) == 1 or c < 8:
        ids, mask = _pad(seqs, dev)
        return body(input_ids=ids, attention_mask=mask).last_hidden_state, 0
    from transformers import DynamicCache

    key = _cache_kwarg(body)
    out = body(input_ids=torch.tensor([seqs[0][:c]], device=dev), use_cache=True)
    shared = getattr(out, "cache", None) or out.past_key_values
    cache = DynamicCache(config=body.config)
    for i, layer in enumerate(shared.layers):
        cache.update(layer.keys.expand(len(seqs), -1, -1, -1), layer.values.expand(len(seqs), -1, -1, -1), i)
    ids, mask = _pad([s[c:] for s in seqs], dev)
    mask = torch.cat([torch.ones(len(seqs), c, dtype=mask.dtype, device=dev), mask], 1)
    pos = torch.arange(c, c + ids.shape[1], device=dev).expand(len(seqs), -1)
    return body(input_ids=ids, attention_mask=mask, position_ids=pos, **{key: cache}).last_hidden_state, c


def _first(prompts) -> int:
    return min(len(p) for p in prompts) - 1  # the read-out position of the shortest prompt


def common_prefix(seqs) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return n


def _cache_kwarg(body) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


@torch.no_grad()
def trie_decisions(body, lm_head, prompts, trie, batch=16):
    """Label-constrained scores [n, L] (the engine's logprobs: restricted log-softmax summed over the
    branching nodes) and greedy decisions [n], from a HF model body + vocabulary head."""
    kids = _children(trie)
    nodes = [n for n in trie.nodes if n]
    maximal = [n for n in nodes if not any(m != n and m[:len(n)] == n for m in nodes)] or [()]
    scores, best = [], []
    for b0 in range(0, len(prompts), batch):
        chunk = prompts[b0:b0 + batch]
        h, c = _hidden(body, [p + list(n) for p in chunk for n in maximal], _first(chunk))
        for qi, p in enumerate(chunk):
            logp = {}  # node -> restricted log-softmax over its children (scored nodes only)
            for mi, n in enumerate(maximal):
                row = h[qi * len(maximal) + mi]
                for d in range(len(n) + 1):
                    node = n[:d]
                    if node not in logp and (d == 0 or len(kids[node]) > 1):
                        lg = lm_head(row[len(p) - 1 + d - c]).float()[kids[node]]
                        logp[node] = dict(zip(kids[node], (lg - torch.logsumexp(lg, 0)).tolist()))
            s = [sum(logp[tuple(path[:d])][path[d]] for d in range(len(path)) if tuple(path[:d]) in logp)
                 for path in trie.paths]
            node = ()
            while list(node) not in trie.paths:  # greedy walk down the trie
                k = kids[node]
                node = node + ((max(k, key=lambda t: logp[node][t]) if len(k) > 1 else k[0]),)
            scores.append(s)
            best.append(trie.paths.index(list(node)))
    return torch.tensor(scores), best


@torch.no_grad()
def head_decisions(body, head, prompts, batch=16):
    out = []
    for b0 in range(0, len(prompts), batch):
        chunk = prompts[b0:b0 + batch]
        h, c = _hidden(body, chunk, _first(chunk))
        last = h[torch.arange(len(chunk)), torch.tensor([len(p) - 1 - c for p in chunk])]
        out.append(torch.log_softmax(head(last.to(head.weight.dtype)).float(), -1).cpu())
    scores = torch.cat(out)
    return scores, scores.argmax(-1).tolist()


def _batch_loss(body, lm_head, head, prompts, paths, gold, smoothing=0.0):
    """Mean cross-entropy of a batch: over the label tokens (full vocabulary, "label") or over the
    N labels at the read-out row ("head"). The vocabulary head runs only on the rows that need it."""
    if head is None:
        seqs = [p + path[:-1] for p, path in zip(prompts, paths)]  # the last token is only a target
        h, c = _hidden(body, seqs, _first(prompts))
        rows = [(i, len(p) - 1 + d - c) for i, (p, path) in enumerate(zip(prompts, paths)) for d in range(len(path))]
        sel = h[torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])]
        target = torch.tensor([t for path in paths for t in path], device=h.device)
        return F.cross_entropy(lm_head(sel).float(), target, label_smoothing=smoothing)
    h, c = _hidden(body, prompts, _first(prompts))
    last = h[torch.arange(len(prompts)), torch.tensor([len(p) - 1 - c for p in prompts])]
    logits = head(last.to(head.weight.dtype)).float()  # the head is fp32 over bf16 features on a GPU
    return F.cross_entropy(logits, torch.tensor(gold, device=h.device), label_smoothing=smoothing)


def finetune(data, *, model=None, template=None, labels=None, chat=None, objective="label", rank=8,
             alpha=16, lr=None, epochs=None, seed=0, val_fraction=0.2, patience=None, batch_size=None,
             teacher=None, progress=True, output=None, query_column="query", label_column="label",
             input_format="auto", log=None, dropout=None, label_smoothing=None,
             weight_decay=None, refit=None, save_dtype=torch.float32, device=None, dtype=None) -> Adapter:
    """Fine-tune LoRA adapters (and a head, objective "head") for a labeled data set -> Adapter
    (adapter.Adapter; written to `output` too when given). data: CSV/JSONL path with query and
    label columns, or (query, label) pairs. model: None (bundled), a HF folder or a .gguf file.
    teacher: a Classifier whose decisions replace the labels (then data needs only queries).
    device: "cpu", "cuda", "cuda:N" (default: cuda when available); dtype: the frozen base weights'
    (default fp32 on CPU, bf16 on a GPU; the LoRA weights and a head are fp32 either way).
    Deterministic for a seed on CPU. Early stopping on validation accuracy (then loss)."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("fine-tuning needs peft: pip install 'prefixscore[train]'")

    from .fit_heads import split_indices
    from ..labels import LabelTrie, check_labels
    from ..weights.loading import base_hash, load, resolve_device, resolve_dtype, wants_fp8
    from ..rows.report import row_keys, rows_digest
    from ..prompt import SEED_LABELS, SEED_TEMPLATE, Prompt, check_template
    from .write_adapter import from_peft, save_adapter

    lr = DEFAULTS["lr"] if lr is None else lr
    epochs = DEFAULTS["epochs"] if epochs is None else epochs
    patience = DEFAULTS["patience"] if patience is None else patience
    batch_size = DEFAULTS["batch_size"] if batch_size is None else batch_size
    dropout = DEFAULTS["dropout"] if dropout is None else dropout
    label_smoothing = DEFAULTS["label_smoothing"] if label_smoothing is None else label_smoothing
    weight_decay = DEFAULTS["weight_decay"] if weight_decay is None else weight_decay
    refit = DEFAULTS["refit"] if refit is None else refit
    if objective not in ADAPTER_OBJECTIVES:
        raise ConfigError(f"unknown objective {objective!r}: use {' or '.join(ADAPTER_OBJECTIVES)}")
    if min(rank, epochs, patience, batch_size) < 1 or lr <= 0 or alpha <= 0 or not 0 <= val_fraction < 1:
        raise ConfigError("rank, epochs, patience, batch_size, lr and alpha must be positive and "
                          "val_fraction in [0, 1)")
    if not (0 <= dropout < 1 and 0 <= label_smoothing < 1 and weight_decay >= 0):
        raise ConfigError("dropout and label_smoothing must be in [0, 1) and weight_decay >= 0")
    template = SEED_TEMPLATE if template is None else template
    labels = check_labels(SEED_LABELS if labels is None else labels)
    if len(labels) < 2:
        raise ConfigError("a classifier needs at least two labels")
    check_template(template, ("query",))
    queries, gold = read_data(data, labels, query_column, label_column, input_format, teacher is None)
    if output is not None:
        from ..rows.writer import check_output

        check_output(str(output))
    say = log or (lambda m: print(m, file=sys.stderr))
    t0 = time.perf_counter()

    dev = resolve_device(device)
    if wants_fp8(dtype):
        raise ConfigError("fine-tuning runs in bf16 or fp32 (--dtype fp8 is for inference: the "
                          "adapter it trains serves on an fp8 base as on any other)")
    dtype = resolve_dtype(dtype, dev)  # fp32 on CPU, bf16 on a GPU (the LoRA weights stay fp32)
    loaded = load(_model_path(model), dev, dtype)
    ident, tok, name = base_hash(loaded), loaded.tokenizer, loaded.name
    prompt = Prompt(tok, template, chat=chat)
    trie = LabelTrie.build(tok, labels, prompt.render(query="x"), prompt.encode_text)
    prompts = [e.ids for e in prompt.encode_many([{"query": q} for q in queries])]
    if teacher is not None:  # distillation: the teacher's decisions are the targets
        if list(teacher.labels) != labels:
            raise ConfigError(f"the teacher's labels {teacher.labels} differ from {labels}")
        gold = [labels.index(r.label) for r in teacher.classify_batch(queries)]
        if len(set(gold)) < 2:
            raise InputError(f"the teacher labels every row {labels[gold[0]]!r}: nothing to learn")
    del loaded  # the engine's copy; training runs on the HF model below

    folder = hf_folder(model)
    tr, va = split_indices(gold, val_fraction, seed)
    spec = _Spec(folder, rank, alpha, dropout, objective, len(labels), lr, batch_size, label_smoothing,
                 weight_decay, seed, dev, dtype)
    net, head, hist, best, best_epoch = _fit(spec, prompts, gold, trie, tr, va, epochs, patience,
                                             progress, say)
    refit_hist = None
    if refit and va:  # the validation rows carry information too: train again on every row
        del net, head
        say(f"refit on all {len(tr) + len(va)} rows for {best_epoch} epochs (the best on validation)")
        net, head, refit_hist, _, _ = _fit(spec, prompts, gold, trie, sorted(tr + va), [], best_epoch,
                                           patience, progress, say)
    training = {"rows": len(queries), "train_rows": len(tr), "val_rows": len(va), "seed": seed,
                "lr": lr, "epochs": epochs, "patience": patience, "batch_size": batch_size,
                "dropout": dropout, "label_smoothing": label_smoothing, "weight_decay": weight_decay,
                "epochs_run": len(hist), "best_epoch": best_epoch or len(hist), "history": hist,
                "refit": refit_hist is not None, **({"refit_history": refit_hist} if refit_hist else {}),
                "seconds": round(time.perf_counter() - t0, 1), "teacher": teacher is not None,
                "data_sha256": rows_digest(queries, [labels[g] for g in gold]),
                "row_keys": row_keys(queries, [labels[g] for g in gold]),
                **({"val_acc": best[0], "val_loss": best[1]} if va else {})}
    meta = {"base_hash": ident, "base_model": name, "template": template, "chat": prompt.chat,
            "labels": labels, "objective": objective, "rank": rank, "alpha": float(alpha),
            "training": training}
    hd = ({"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}
          if head is not None else None)
    adapter = from_peft(net, meta, hd)
    if output is not None:
        save_adapter(output, adapter, save_dtype)
        val = f", val accuracy {best[0]:.3f} (epoch {best_epoch})" if va else ""
        say(f"saved {output}: {objective} adapter, rank {rank}, {len(labels)} labels, "
            f"{training['train_rows']} training rows, {training['seconds']:.0f} s{val}")
    return adapter


@dataclass(frozen=True)
class _Spec:
    """What a training run is, apart from its rows and epochs."""
    folder: Path
    rank: int
    alpha: float
    dropout: float
    objective: str
    num_labels: int
    lr: float
    batch_size: int
    smoothing: float
    weight_decay: float
    seed: int
    device: torch.device
    dtype: torch.dtype


def _fit(spec: _Spec, prompts, gold, trie, tr, va, epochs, patience, progress, say):
    """LoRA (and a head) trained on rows `tr` from a fresh, seeded start -> (peft model, head or
    None, history, (best val accuracy, its loss), best epoch). With validation rows `va`: early
    stopping on validation accuracy (then loss), the best epoch's weights kept."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from ..rows.progress import Bar

    cuda = [spec.device] if spec.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # seeded init and order, the global RNGs untouched
        torch.manual_seed(spec.seed)
        base = AutoModelForCausalLM.from_pretrained(spec.folder, dtype=spec.dtype).to(spec.device)
        cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                         target_modules=TARGETS)
        with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5
            warnings.simplefilter("ignore", FutureWarning)
            net = get_peft_model(base, cfg)
        inner = net.get_base_model()
        body, lm_head = inner.model, inner.lm_head
        head = None
        if spec.objective == "head":  # zero init: training starts at the uniform prediction
            head = torch.nn.Linear(inner.config.hidden_size, spec.num_labels, device=spec.device)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
        params = [p for p in net.parameters() if p.requires_grad]
        groups = [{"params": params, "lr": spec.lr}]
        if head is not None:  # the head starts from zero on unit-scale features: a faster rate
            groups.append({"params": list(head.parameters()), "lr": spec.lr * 10})
        opt = torch.optim.AdamW(groups, weight_decay=spec.weight_decay)
        steps = epochs * math.ceil(len(tr) / spec.batch_size)
        sched = torch.optim.lr_scheduler.LambdaLR(  # short warm-up, then linear decay to zero
            opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * max(0.0, 1 - s / steps))
        gen = torch.Generator().manual_seed(spec.seed)
        trainable = lambda: {k: v.detach().clone() for k, v in net.state_dict().items() if "lora_" in k}

        def evaluate():
            net.eval()
            p = [prompts[i] for i in va]
            if head is None:
                scores, best = trie_decisions(body, lm_head, p, trie)
            else:
                scores, best = head_decisions(body, head, p)
            g = [gold[i] for i in va]
            acc = sum(b == y for b, y in zip(best, g)) / len(va)
            loss = -scores[torch.arange(len(va)), torch.tensor(g)].mean().item()
            return acc, loss

        best = (-1.0, math.inf)
        best_state, best_head, best_epoch, stale, hist = None, None, 0, 0, []
        with Bar(steps, "step", "fine-tune", disable=not progress) as bar:
            for epoch in range(1, epochs + 1):
                t_epoch = time.perf_counter()
                net.train()
                order = torch.tensor(tr)[torch.randperm(len(tr), generator=gen)]
                total = 0.0
                for b in order.split(spec.batch_size):
                    idx = b.tolist()
                    loss = _batch_loss(body, lm_head, head, [prompts[i] for i in idx],
                                       [trie.paths[gold[i]] for i in idx], [gold[i] for i in idx],
                                       spec.smoothing)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    total += loss.item() * len(idx)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
                rec = {"epoch": epoch, "train_loss": round(total / len(tr), 5),
                       "train_seconds": round(time.perf_counter() - t_epoch, 2)}
                if va:
                    acc, vloss = evaluate()
                    rec |= {"val_acc": round(acc, 5), "val_loss": round(vloss, 5)}
                    bar.set_postfix(loss=f"{rec['train_loss']:.3f}", val_acc=f"{acc:.3f}")
                    if (acc, -vloss) > (best[0], -best[1]):
                        best, best_state, best_epoch, stale = (acc, vloss), trainable(), epoch, 0
                        best_head = copy.deepcopy(head.state_dict()) if head is not None else None
                    else:
                        stale += 1
                hist.append(rec)
                if va and stale >= patience:
                    say(f"early stop after epoch {epoch}: no better validation accuracy for "
                        f"{patience} epochs")
                    break
        if best_state is not None:  # keep the best epoch's weights
            net.load_state_dict(best_state, strict=False)
            if head is not None:
                head.load_state_dict(best_head)
    return net, head, hist, best, best_epoch or len(hist)
