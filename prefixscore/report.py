"""Accuracy, per-label F1 and the confusion matrix of decisions against gold labels: what
`prefixscore eval`, `eval-modes` and the fine-tuning benches print."""
from __future__ import annotations


def confusion_report(gold: list[str], pred: list[str], labels: list[str]) -> dict:
    idx = {l: i for i, l in enumerate(labels)}
    m = [[0] * len(labels) for _ in labels]
    for g, p in zip(gold, pred):
        m[idx[g]][idx[p]] += 1
    f1s = []
    for i in range(len(labels)):
        tp = m[i][i]
        prec = tp / max(1, sum(m[r][i] for r in range(len(labels))))
        rec = tp / max(1, sum(m[i]))
        f1s.append(0.0 if tp == 0 else 2 * prec * rec / (prec + rec))
    acc = sum(m[i][i] for i in range(len(labels))) / max(1, len(gold))
    return {"n": len(gold), "accuracy": acc, "macro_f1": sum(f1s) / len(f1s),
            "f1": dict(zip(labels, f1s)), "labels": labels, "confusion": m}


def format_confusion(rep: dict) -> str:
    labels = rep["labels"]
    w = max(8, max(len(l) for l in labels) + 1)
    lines = ["gold \\ predicted".ljust(w + 2) + "".join(l[:w].rjust(w) for l in labels)]
    for l, row in zip(labels, rep["confusion"]):
        lines.append(l[: w + 2].ljust(w + 2) + "".join(str(v).rjust(w) for v in row))
    return "\n".join(lines)


def rows_digest(queries: list[str], labels: list[str]) -> str:
    """sha256 of a labeled data set, row order ignored: an adapter records the rows it was trained
    on, so `eval` can say when it is scoring an adapter on its own training data."""
    import hashlib
    import json

    rows = sorted(json.dumps([q, l], ensure_ascii=False) for q, l in zip(queries, labels))
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()
