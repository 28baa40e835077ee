"""Flat batch plan (batch.py) against a per-token Python reference of the layout, on random batches:
the one-request path and the many-request path."""
import random

import pytest
import torch

from prefixscore.batch import plan_classify
from prefixscore.labels import LabelTrie


def reference(suffixes, starts, paths, allowed):
    cols = {k: [] for k in ("tokens", "positions", "base_start", "base_end", "own_start")}
    rows, r0 = [], 0
    for s, p in zip(suffixes, starts):
        n = len(s)
        for j, t in enumerate(s):
            for k, v in zip(cols, (t, p + j, r0, r0, r0)):
                cols[k].append(v)
        rows.append(r0 + n - 1)
        at = r0 + n
        for path in paths:
            for j, t in enumerate(path):
                for k, v in zip(cols, (t, p + n + j, r0, r0 + n, at)):
                    cols[k].append(v)
            at += len(path)
            rows.append(at - 1)
        r0 = at
    return cols, rows, allowed.repeat(len(suffixes), 1)


@pytest.mark.parametrize("branches", [True, False])
@pytest.mark.parametrize("B", [1, 2, 7, 64])
def test_plan_matches_reference(smol_tokenizer, B, branches):
    labels = ["Dress", "Jeans", "T-shirt", "Trench Coat", "Hoodie", "Hat"]
    encode = lambda t: smol_tokenizer(t, add_special_tokens=False)["input_ids"]
    trie = LabelTrie.build(smol_tokenizer, labels, "query: x", encode)
    rng = random.Random(B)
    for _ in range(5):
        suffixes = [[rng.randrange(50000) for _ in range(rng.randint(1, 40))] for _ in range(B)]
        starts = [rng.choice([0, 17, 73]) for _ in range(B)]
        plan = plan_classify(suffixes, starts, trie, branches=branches)
        paths = trie.branch_paths() if branches else []
        cols, rows, allowed = reference(suffixes, starts, paths, trie.allowed)
        for k, want in cols.items():
            assert getattr(plan, k).tolist() == want, k
        assert plan.rows.tolist() == rows
        assert torch.equal(plan.allowed, allowed)
        assert plan.seg_offsets.tolist()[-1] == plan.num_tokens and plan.batch == B
