"""Two classifiers of one model on the GPU (issue 22): one classify alone, both one after the other,
both in one fused pass over a bank of their prefixes (many.decide_many, graphs). Per variant: the
whole call's wall time (p50, p99) and the GPU time of its graph replays (CUDA events, as bench/gpu.py
times W1); the kernels of one eager forward of each (where the fused pass's time goes); and the
fused pass's decisions against each classifier alone on 20 queries.

    device run, carry [".whl", ".carry"]:  python -m bench.many_gpu     (writes $OUT/many_gpu_fused.json)
"""
import json
import os

import torch

from bench.gpu import gpu_times, real_form_model, stats, wall_times
from prefixscore import Classifier
from prefixscore.batch import plan_classify
from prefixscore.many import bank_of, decide_many

GENDER = dict(template="Who is this product for? Answer women, men, kids or unisex.\nquery: {query}",
              labels=["women", "men", "kids", "unisex"])


def replay(engine, kv, weight, plan):
    """The graph replay of a plan (its bucket's graph, input as last written) as a function."""
    g = engine.graphs[(id(kv), id(weight), True)]
    graph = g.graphs[g.bucket_of[plan.num_tokens]]
    return graph.replay, g.bucket_of[plan.num_tokens]


def kernels(engine, plan, kv, weight):
    """Kernel names, counts and GPU us of one eager forward (a cloned weight: no graph)."""
    from torch.profiler import ProfilerActivity, profile

    w = weight.clone()
    for _ in range(3):
        engine.run(plan, kv, w, True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.run(plan, kv, w, True)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0)
        if t > 0:
            rows[e.key[:80]] = {"count": e.count, "us": round(t, 1)}
    top = sorted(rows.items(), key=lambda kv: -kv[1]["us"])
    return {"gpu_us_total": round(sum(r["us"] for _, r in top), 1), "top": top[:12]}


def main():
    folder = real_form_model() if not os.path.exists("/tmp/q05/config.json") else "/tmp/q05"
    m = Classifier.many({"category": {}, "gender": GENDER}, model=str(folder), device="cuda")
    a, b = m["category"], m["gender"]
    q = "red linen summer dress for women"
    ea, eb = a.encode(q), b.encode(q)
    decide_many([a, b], [[ea], [eb]])  # the bank and its graphs
    bank = bank_of([a, b])
    pa = plan_classify([ea.ids[ea.start:]], [ea.start], a.trie)
    pf, _ = next(iter(bank.layouts.values()))
    res = {}
    for name, fn in [("one", lambda: a.decide_encoded([ea])),
                     ("two_in_turn", lambda: (a.decide_encoded([ea]), b.decide_encoded([eb]))),
                     ("two_fused", lambda: decide_many([a, b], [[ea], [eb]]))]:
        res[name] = {"call": stats(wall_times(fn, 1000, 100))}
    a.decide_encoded([ea])
    one, tb_one = replay(a.engine, a.prefix_kv, a.weight, pa)
    res["one"]["gpu"] = stats(gpu_times(one))
    res["one"]["bucket"] = tb_one
    decide_many([a, b], [[ea], [eb]])
    fused, tb_fused = replay(a.engine, bank.kv, bank.weight, pf)
    res["two_fused"]["gpu"] = stats(gpu_times(fused))
    res["two_fused"]["bucket"] = tb_fused
    res["two_fused"]["tokens"] = pf.num_tokens
    res["one"]["tokens"] = pa.num_tokens
    res["kernels_one"] = kernels(a.engine, pa, a.prefix_kv, a.weight)
    res["kernels_fused"] = kernels(a.engine, pf, bank.kv, bank.weight)
    one_ms = res["one"]["call"]["p50_ms"]
    res["fused_over_one_call"] = res["two_fused"]["call"]["p50_ms"] / one_ms
    res["in_turn_over_one_call"] = res["two_in_turn"]["call"]["p50_ms"] / one_ms
    res["fused_over_one_gpu"] = res["two_fused"]["gpu"]["p50_ms"] / res["one"]["gpu"]["p50_ms"]
    qs = [q, "levis 501", "kids hoodie", "连衣裙", "oversized knit sweater men"] * 4
    enc = [a.encode_many(qs), b.encode_many(qs)]
    fused_out = decide_many([a, b], enc)
    res["same_decisions"] = [f[0] == c.decide_encoded(e)[0] for c, e, f in zip((a, b), enc, fused_out)]
    ones = [decide_many([a, b], [[x], [y]]) for x, y in zip(*enc)]
    res["same_decisions_one_each"] = [[o[k][0][0] for o in ones] == c.decide_encoded(e)[0]
                                      for k, (c, e) in enumerate(zip((a, b), enc))]
    print(f"{'variant':<12} {'call p50':>9} {'call p99':>9} {'gpu p50':>8}")
    for k in ("one", "two_in_turn", "two_fused"):
        g = res[k].get("gpu", {}).get("p50_ms", float("nan"))
        print(f"{k:<12} {res[k]['call']['p50_ms']:9.3f} {res[k]['call']['p99_ms']:9.3f} {g:8.3f}")
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("kernels")}, indent=1))
    for k in ("kernels_one", "kernels_fused"):
        print(k, res[k]["gpu_us_total"], *res[k]["top"], sep="\n  ")
    with open(os.path.join(os.environ.get("OUT", "bench/results"), "many_gpu_fused.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
