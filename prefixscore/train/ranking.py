"""A ranking set for fitting and judging item encoders (issue 34, DESIGN.md §9): queries, each with
a list of candidate items from a catalogue, and the text scorer's score of every pair, which the
soft-token score is to rank as (the teacher). Plus the two agreement measures reported:

  NDCG@10   the student's order of a query's candidates, gains graded from the teacher's margins
            (0 for the query's worst candidate, 1 for its best, linear in the margin between), so a
            list where the teacher barely separates its items counts as much as a sharp one and a
            random order scores well below 1 (random_ndcg says how far);
  Spearman  rank correlation of the student's and the teacher's scores over a query's candidates.
Both are means over queries. A score is the log-odds of the first label (yes): with two labels the
margin logprob(yes) - logprob(no); with more, logprob(first) - log(1 - P(first)).

Candidates mix what a retriever would bring (items sharing the most character trigrams with the
query, and items of the query's label where both files have a label column) with random items, so
each list holds relevant and irrelevant ones.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

K = 10  # NDCG@K


@dataclass
class Catalogue:
    ids: list[str]
    texts: list[str]
    labels: list[str] | None = None  # an optional label/category per item (candidate choice only)


def read_catalogue(path, fmt="auto", id_column="id", text_column="text", label_column=None) -> Catalogue:
    """A catalogue file (CSV, JSONL or Parquet) with an id and a text column, and a label column
    where it has one (label_column: its name, or None); InputError naming the file for a missing
    column, an empty value or a repeated id."""
    from ..rows.io import read_rows

    path, cols = str(path), (id_column, text_column)
    if fmt == "txt" or (fmt == "auto" and path.lower().endswith((".txt", ".text"))):
        raise InputError(f"{path}: a catalogue is CSV, JSONL or Parquet with columns {id_column} "
                         f"and {text_column}")
    rows = read_rows(path, fmt, cols)
    labels = None
    if label_column:
        try:
            labels = [r[label_column] for r in read_rows(path, fmt, cols + (label_column,))]
        except InputError:  # no such column (or a blank in it): candidates are chosen without it
            pass
    ids, seen = [r[id_column] for r in rows], set()
    for i in ids:
        if i in seen:
            raise InputError(f"{path}: id {i!r} appears more than once")
        seen.add(i)
    return Catalogue(ids, [r[text_column] for r in rows], labels)


def read_queries(path, column="query", label_column=None) -> tuple[list[str], list[str] | None]:
    """Queries (txt, CSV, JSONL or Parquet), and their labels where the file has label_column."""
    from ..rows.io import read_rows

    path = str(path)
    if label_column:
        try:
            rows = read_rows(path, "auto", (column, label_column))
            return [r[column] for r in rows], [r[label_column] for r in rows]
        except InputError:
            pass
    return [r[column] for r in read_rows(path, "auto", (column,))], None


def trigrams(text: str) -> set[str]:
    t = f" {' '.join(text.lower().split())} "
    return {t[i:i + 3] for i in range(len(t) - 2)} | {c for c in t if ord(c) > 0x2e80}  # CJK chars alone


def candidates(queries, cat: Catalogue, pool, n=20, query_labels=None, seed=0) -> list[list[int]]:
    """Per query, `n` distinct item indices from `pool` (indices into cat): the items with the most
    trigrams in common (40%, at most 8), random items of the query's label (30%, at most 6; when
    both have labels), random items for the rest; shuffled. Deterministic for a seed."""
    rng = random.Random(seed)
    lexical, same_label = min(8, round(0.4 * n)), min(6, round(0.3 * n))
    pool = list(pool)
    if len(pool) < n:
        raise InputError(f"{len(pool)} items to choose candidates from, fewer than {n} a query")
    grams = {i: trigrams(cat.texts[i]) for i in pool}
    by_label: dict = {}
    if cat.labels is not None and query_labels is not None:
        for i in pool:
            by_label.setdefault(cat.labels[i], []).append(i)
    out = []
    for k, q in enumerate(queries):
        g = trigrams(q)
        sims = sorted(pool, key=lambda i: (-len(g & grams[i]) / math.sqrt(len(grams[i]) + 1), i))
        pick = list(dict.fromkeys(sims[:lexical]))
        if by_label and query_labels[k] in by_label:
            same = [i for i in by_label[query_labels[k]] if i not in pick]
            pick += rng.sample(same, min(same_label, len(same)))
        rest = [i for i in pool if i not in set(pick)]
        pick += rng.sample(rest, n - len(pick))
        rng.shuffle(pick)
        out.append(pick)
    return out


def split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(kept, held out) indices of n rows, `fraction` held out at random."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = int(round(n * fraction))
    return sorted(order[cut:]), sorted(order[:cut])


def margin(scores: dict, labels: list[str]) -> float:
    """The log-odds of the first label from a result's label log-probabilities."""
    lp = scores[labels[0]]
    if len(labels) == 2:
        return lp - scores[labels[1]]
    return lp - math.log(max(1e-12, -math.expm1(lp)))


def teacher_margins(scorer, queries, texts_per_query, progress=None) -> list[np.ndarray]:
    """The text scorer's margin (see margin) for every (query, candidate text) pair."""
    out = scorer.score_batch(list(zip(queries, texts_per_query)), progress=progress)
    return [np.array([margin(r.scores, scorer.labels) for r in rs]) for rs in out]


# ---------------------------------------------------------------- agreement measures

def ndcg(student, teacher, k: int = K, gains: str = "graded") -> float:
    """NDCG@k of the student's order with gains graded from the teacher's scores (see the module);
    gains="p": the teacher's P(first label) itself, which hardly tells orders apart when the teacher
    barely separates its items (reported beside the graded one, for comparison)."""
    s, t = np.asarray(student, float), np.asarray(teacher, float)
    span = t.max() - t.min()
    if gains == "p":
        gain = 1.0 / (1.0 + np.exp(-t))
    else:
        gain = (t - t.min()) / span if span > 0 else np.ones_like(t)
    disc = 1.0 / np.log2(np.arange(2, min(k, len(t)) + 2))
    order = np.lexsort((np.arange(len(s)), -s))[:k]  # ties: the earlier candidate first
    ideal = np.sort(gain)[::-1][:k]
    return float((gain[order] * disc).sum() / (ideal * disc).sum())


def spearman(a, b) -> float:
    ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / den) if den > 0 else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share theirs)."""
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x), dtype=float)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    return np.bincount(inv, weights=r)[inv] / counts[inv] if (counts > 1).any() else r


def agreement(student_lists, teacher_lists, k: int = K) -> dict:
    """Mean NDCG@k and Spearman over queries (each a list of candidate scores), and the NDCG@k with
    P(first label) gains."""
    pairs = list(zip(student_lists, teacher_lists))
    return {f"ndcg@{k}": _mean(ndcg(s, t, k) for s, t in pairs),
            "spearman": _mean(spearman(s, t) for s, t in pairs),
            f"ndcg@{k}_p": _mean(ndcg(s, t, k, "p") for s, t in pairs), "queries": len(pairs)}


def random_order(teacher_lists, k: int = K, draws: int = 20, seed: int = 0) -> dict:
    """The agreement of a random order (the floor the measures start from), averaged over draws."""
    rng = np.random.default_rng(seed)
    draws = [[rng.random(len(t)) for t in teacher_lists] for _ in range(draws)]
    runs = [agreement(d, teacher_lists, k) for d in draws]
    return {key: _mean(r[key] for r in runs) for key in runs[0] if key != "queries"}


def random_ndcg(teacher_lists, k: int = K, draws: int = 20, seed: int = 0) -> float:
    """The expected NDCG@k of a random order."""
    return random_order(teacher_lists, k, draws, seed)[f"ndcg@{k}"]


def _mean(xs) -> float:
    return round(float(np.mean(list(xs))), 4)
