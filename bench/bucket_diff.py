"""Does one request score the same in two buckets? Every kernel call's real rows, bitwise (GPU).

    python -m bench.bucket_diff [--large 16]

One W1 request (0.5B shape, random weights, 8 tokens) replayed in the graphs of the 8-token bucket
and of `--large`, then run eagerly as 8 tokens and as `large` (padded as GraphRunner pads), with
each kernel entry point of model.py wrapped to record its output. Prints and writes
$OUT/bucket_diff.json: whether the prefill repeats bitwise, the two max score differences, and the
first kernel calls whose real rows differ (call index, kernel, output index, max |diff|). The
sixth session found the norm prologue's sum order this way (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import prefixscore.model as M
from prefixscore.batch import plan_classify
from prefixscore.model import Context

from .gpu import PREFIX, SUFFIX, Synthetic, hf_model, random_suffixes

KERNELS = ["embed_rope", "qkv_rope", "attention_o", "gate_up_silu", "linear_residual"]


def record(calls: list) -> None:
    """Wrap model.py's kernel entry points so each call appends (name, output) to `calls`."""
    for name in KERNELS:
        def wrapped(*args, _fn=getattr(M, name), _name=name, **kw):
            out = _fn(*args, **kw)
            calls.append((_name, out))
            return out

        setattr(M, name, wrapped)


def eager(s: Synthetic, plan, Tb: int, calls: list):
    """The plan's forward with its T tokens padded to Tb as GraphRunner pads -> (calls, scores)."""
    T, R = plan.num_tokens, plan.rows.shape[0]
    dev = torch.device("cuda")

    def padded(x, tail):
        return torch.cat([x.to(torch.int64), torch.as_tensor(tail, dtype=torch.int64)]).to(dev)

    pad = [0] * (Tb - T)
    own = padded(plan.own_start, list(range(T, Tb))).int()  # padding tokens see only themselves
    ctx = Context(s.prefix, padded(plan.base_start, pad).int(), padded(plan.base_end, pad).int(), own)
    allowed = torch.cat([plan.allowed, torch.ones(Tb - R, plan.allowed.shape[1], dtype=torch.bool)])
    calls.clear()
    scores, _ = s.engine.forward_scores(padded(plan.tokens, pad), padded(plan.positions, pad), ctx,
                                        padded(plan.rows, [0] * (Tb - R)), allowed.to(dev), s.weight,
                                        True)
    torch.cuda.synchronize()
    return list(calls), scores[:R].cpu()


def tensors(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in tensors(x)]
    return [out] if torch.is_tensor(out) else []


def first_diffs(calls_a, calls_b, T: int) -> list:
    diffs = []
    for i, ((name, out_a), (_, out_b)) in enumerate(zip(calls_a, calls_b)):
        for j, (x, y) in enumerate(zip(tensors(out_a), tensors(out_b))):
            if x.dim() == 2 and x.shape[0] != T and x.shape[1] == T:  # sums of squares [tiles, T]
                x, y = x[:, :T], y[:, :T]
            else:
                x, y = x[:T], y[:T]
            if x.shape != y.shape:
                diffs.append((i, name, j, "shape", list(x.shape), list(y.shape)))
            elif not torch.equal(x, y):
                diffs.append((i, name, j, (x.float() - y.float()).abs().max().item()))
    return diffs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--large", type=int, default=16, help="the other bucket (tokens, > 8)")
    a = ap.parse_args()
    s = Synthetic(hf_model("0.5B"), max_tokens=a.large)
    again = s.engine.prefill(s.prefix_ids)
    res = {"prefill_bitwise_repeat": all(torch.equal(k, k2) and torch.equal(v, v2)
                                         for (k, v), (k2, v2) in zip(s.prefix, again))}
    plan = plan_classify(random_suffixes(1, seed=9), [PREFIX], s.trie)
    T = plan.num_tokens  # SUFFIX: single-token labels, no branches
    scores = {}
    for Tb in (SUFFIX, a.large):
        s.runner.bucket_of[T] = Tb
        scores[Tb] = s.runner.run(plan)[0]
    res["T"], res["large"] = T, a.large
    res["graph_maxdiff"] = (scores[SUFFIX] - scores[a.large]).abs().max().item()
    calls: list = []
    record(calls)
    calls_a, sa = eager(s, plan, SUFFIX, calls)
    calls_b, sb = eager(s, plan, a.large, calls)
    res["eager_maxdiff"] = (sa - sb).abs().max().item()
    diffs = first_diffs(calls_a, calls_b, T)
    res["first_diffs"], res["n_diffs"], res["n_calls"] = diffs[:12], len(diffs), len(calls_a)
    print(json.dumps(res, indent=1))
    with open(os.path.join(os.environ.get("OUT") or "bench/results", "bucket_diff.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
