"""Two classifiers of one model on the GPU (issue 22): one classify alone, both one after the other,
both in one fused pass over a bank of their prefixes (many.decide_many, graphs), p50 of the whole
call; and the fused pass's decisions against each classifier alone.

    device run, carry [".whl", ".carry"]:  python -m bench.many_gpu     (writes $OUT/many_gpu.json)
"""
import json
import os
import statistics
import time

from bench.gpu import real_form_model
from prefixscore import Classifier
from prefixscore.many import decide_many

GENDER = dict(template="Who is this product for? Answer women, men, kids or unisex.\nquery: {query}",
              labels=["women", "men", "kids", "unisex"])


def p50(fn, n=400, warm=50):
    for _ in range(warm):
        fn()
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(xs)


def main():
    folder = real_form_model() if not os.path.exists("/tmp/q05/config.json") else "/tmp/q05"
    m = Classifier.many({"category": {}, "gender": GENDER}, model=str(folder), device="cuda")
    a, b = m["category"], m["gender"]
    q = "red linen summer dress for women"
    ea, eb = a.encode(q), b.encode(q)
    res = {"one_ms": p50(lambda: a.decide_encoded([ea])),
           "two_in_turn_ms": p50(lambda: (a.decide_encoded([ea]), b.decide_encoded([eb]))),
           "two_fused_ms": p50(lambda: decide_many([a, b], [[ea], [eb]]))}
    res["fused_over_one"] = res["two_fused_ms"] / res["one_ms"]
    res["in_turn_over_one"] = res["two_in_turn_ms"] / res["one_ms"]
    qs = [q, "levis 501", "kids hoodie", "连衣裙", "oversized knit sweater men"] * 4
    enc = [a.encode_many(qs), b.encode_many(qs)]
    fused = decide_many([a, b], enc)
    res["same_decisions"] = [f[0] == c.decide_encoded(e)[0] for c, e, f in zip((a, b), enc, fused)]
    print(json.dumps(res, indent=1), flush=True)
    with open(os.path.join(os.environ.get("OUT", "bench/results"), "many_gpu_fused.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
