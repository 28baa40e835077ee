"""Accuracy, per-label precision, recall and F1, and the confusion matrix of decisions against gold
labels: what `prefixscore eval`, `eval-modes` and the fine-tuning benches print."""
from __future__ import annotations


def confusion_report(gold: list[str], pred: list[str], labels: list[str]) -> dict:
    """Rows of the confusion matrix are gold labels, columns predictions. Per label: precision (of
    the rows predicted as it, the share that are), recall (of its gold rows, the share predicted as
    it), F1 and support (its gold rows); a ratio with nothing to count is 0, as scikit-learn's
    zero_division=0."""
    idx = {l: i for i, l in enumerate(labels)}
    m = [[0] * len(labels) for _ in labels]
    for g, p in zip(gold, pred):
        m[idx[g]][idx[p]] += 1
    per = {}
    for i, l in enumerate(labels):
        tp = m[i][i]
        prec = tp / max(1, sum(m[r][i] for r in range(len(labels))))
        rec = tp / max(1, sum(m[i]))
        f1 = 0.0 if tp == 0 else 2 * prec * rec / (prec + rec)
        per[l] = {"precision": prec, "recall": rec, "f1": f1, "support": sum(m[i])}
    f1s = [per[l]["f1"] for l in labels]
    acc = sum(m[i][i] for i in range(len(labels))) / max(1, len(gold))
    return {"n": len(gold), "accuracy": acc, "macro_f1": sum(f1s) / len(f1s),
            "f1": dict(zip(labels, f1s)), "per_label": per, "labels": labels, "confusion": m}


def format_confusion(rep: dict) -> str:
    labels = rep["labels"]
    w = max(8, max(len(l) for l in labels) + 1)
    lines = ["gold \\ predicted".ljust(w + 2) + "".join(l[:w].rjust(w) for l in labels)]
    for l, row in zip(labels, rep["confusion"]):
        lines.append(l[: w + 2].ljust(w + 2) + "".join(str(v).rjust(w) for v in row))
    return "\n".join(lines)


def format_per_label(rep: dict) -> str:
    w = max(8, max(len(l) for l in rep["labels"]) + 2)
    lines = ["label".ljust(w) + "precision  recall      F1  support"]
    for l in rep["labels"]:
        r = rep["per_label"][l]
        lines.append(l.ljust(w) + f"{r['precision']:9.3f}  {r['recall']:6.3f}  {r['f1']:6.3f}  {r['support']:7d}")
    return "\n".join(lines)


def rows_digest(queries: list[str], labels: list[str]) -> str:
    """sha256 of a labeled data set, row order ignored: an adapter records the rows it was trained
    on, so `eval` can say when it is scoring an adapter on its own training data."""
    import hashlib
    import json

    rows = sorted(json.dumps([q, l], ensure_ascii=False) for q, l in zip(queries, labels))
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def row_keys(queries: list[str], labels: list[str]) -> list[str]:
    """A short hash of each labeled row (48 bits of its sha256: no collision in sight for data sets
    of this size): an adapter records its training rows' keys, sorted, so `eval` can say how many
    of the rows it scores the adapter has seen (the shipped adapter has seen intent_dev among
    others, which one digest of the whole set could not tell)."""
    return sorted({_row_key(q, l) for q, l in zip(queries, labels)})


def _row_key(query: str, label: str) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps([query, label], ensure_ascii=False).encode()).hexdigest()[:12]


def trained_on(training: dict, queries: list[str], labels: list[str]) -> int:
    """How many of these labeled rows an adapter's training record says it was trained on (its
    row keys; an adapter made before them records only the whole set's digest: all or none)."""
    if "row_keys" in training:
        keys = set(training["row_keys"])
        return sum(_row_key(q, l) in keys for q, l in zip(queries, labels))
    return len(queries) if training.get("data_sha256") == rows_digest(queries, labels) else 0
