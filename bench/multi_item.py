"""W3 multi-item scoring (DESIGN.md §6): one 50-token query, 100 items of 150 tokens, labels yes/no.

    python -m bench.multi_item                      (CUDA; writes $OUT/multi_item.json or bench/results)
    python -m bench.multi_item --shape tiny --device cpu --requests 3 --items 10   (a CPU smoke run)
    python -m bench.multi_item --shape 135M --device cpu --requests 6 --items 20 --ab prune_last_layer=0
    python -m bench.multi_item --ab prune_last_layer=0 attn.BLOCK_NI=64
                                                    (+ an A/B of KernelOptions against the defaults)

Synthetic form: random weights of the Qwen2.5-0.5B shape (config only, no download), bf16, random
token ids; the call is the SGLang-shaped `Scorer.score_ids(query, items)` with apply_softmax=true
semantics (mode softmax over the two label tokens), CUDA graphs captured.
  ours     per layout (packed: the query once per span; alone: a copy per item; auto: packed),
           requests one at a time: the whole call per request (ids in, scores
           out: checks, spans, plan, graph replay, copies back) -> items/s, p50/p99 per request;
           and the batch form, 8 requests per call
  HF       transformers eager in the same run on the same weights: each item's full prompt
           (prefix + query + item), the 100 items of a request as one batch, last-position logits
  check    request 0: our scores vs HF bf16, and both vs HF fp32 (bf16 noise for scale)
  floor    2 x non-embedding params x new tokens / measured bf16 matmul rate (the packed layout's
           tokens: the least work any layout does)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

from prefixscore.weights.model_config import ModelConfig
from prefixscore.weights.loading import from_tensors
from prefixscore.scorer import Scorer

SHAPES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),  # SmolLM2-135M
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True),
}
LABELS = [9693, 2152]  # "yes" / "no": any two ids do for random weights
OUT = Path(os.environ.get("OUT") or "bench/results")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - t)


def summary(ms: list[float], items: int) -> dict:
    return {"p50_ms": statistics.median(ms), "p99_ms": pct(ms, 99), "mean_ms": statistics.mean(ms),
            "items_per_s": items * len(ms) / (sum(ms) / 1e3), "n": len(ms)}


def random_hf(shape, device, dtype, seed=0):
    """A Qwen2 model of the shape with random weights (std 0.02, norms ~1), built on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=4096, rms_norm_eps=1e-6, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in n else p.normal_(0, 0.02)
    return m


def workload(n_requests, prefix, query, items, item_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(100, 30000, (n,), generator=g).tolist()  # noqa: E731
    pre = ids(prefix)
    reqs = [(pre + ids(query), [ids(item_len) for _ in range(items)]) for _ in range(n_requests)]
    return pre, reqs


@torch.no_grad()
def hf_scores(hf, query, items, device):
    ids = torch.tensor([query + it for it in items], device=device)  # equal lengths: no padding
    return hf(input_ids=ids, logits_to_keep=1).logits[:, -1, LABELS].float().softmax(-1).cpu()


def ours_scores(sc, query, items):
    return torch.tensor([[r.scores[l] for l in sc.labels] for r in sc.score_ids(query, items)])


def check(sc, hf, req, device):
    """Request 0 against HF bf16 and HF fp32 (probabilities; decisions where HF's margin is clear)."""
    q, items = req
    ref = hf_scores(hf, q, items, device)
    hf32 = copy.deepcopy(hf).float()
    ref32 = hf_scores(hf32, q, items, device)
    del hf32
    out = {}
    # A clear margin: wider than twice the two HF forms' own distance (bf16 rounding alone moves a
    # probability that far), as bench.gpu's correctness check bounds it.
    noise = 2 * (ref - ref32).abs().max().item()
    for layout in ("packed", "alone"):
        sc.spans.layout = layout
        got = ours_scores(sc, q, items)
        clear = (ref[:, 0] - ref[:, 1]).abs() > noise
        out[layout] = {"max_diff_vs_hf_bf16": (got - ref).abs().max().item(),
                       "max_diff_vs_hf_fp32": (got - ref32).abs().max().item(),
                       "decisions_equal_hf_bf16": int((got.argmax(-1) == ref.argmax(-1)).sum()),
                       "decision_mismatch_clear_margin": int(((got.argmax(-1) != ref.argmax(-1)) & clear).sum())}
    out["hf_bf16_vs_fp32_max_diff"] = noise / 2
    out["items"] = len(items)
    return out


def profile(fn) -> dict:
    """Kernel time of one call by kernel name (torch profiler), and the call's wall and GPU time."""
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        fn()
        torch.cuda.synchronize()
    by = {}
    for e in p.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us and e.device_type.name == "CUDA":
            by[e.key[:80]] = (by.get(e.key[:80], (0, 0))[0] + us, e.count)
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:15]
    total = sum(v[0] for v in by.values())
    return {"kernel_us_total": total, "top": [{"kernel": k, "us": v[0], "count": v[1]} for k, v in top]}


def measure_floors(device):
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = statistics.median(timed(lambda: a @ b, device)[1] for _ in range(10))
    return {"matmul_TFLOPs": 2 * 8192 ** 3 / (ms / 1e3) / 1e12}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5B", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=50, help="timed requests per row (after warm-up)")
    ap.add_argument("--prefix", type=int, default=0, help="pinned prefix tokens (W3 has none)")
    ap.add_argument("--query", type=int, default=50)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--item-len", type=int, default=150)
    ap.add_argument("--per-call", type=int, default=8, help="requests per call in the batch form")
    ap.add_argument("--ab", nargs="*", default=[], metavar="FIELD=V[,FIELD=V]",
                    help="A/B arms: KernelOptions changes (e.g. prune_last_layer=0, "
                    "attn.BLOCK_NI=64), "
                    "each an engine over the same weights beside the defaults, packed, interleaved")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = random_hf(a.shape, device, dtype)
    cfg = ModelConfig.from_hf(hf.config)
    loaded = from_tensors(cfg, hf.state_dict(), None, f"random {a.shape}", device, dtype)
    prefix, reqs = workload(a.requests + 3, a.prefix, a.query, a.items, a.item_len)
    t0 = time.perf_counter()
    sc = Scorer(loaded, label_token_ids=LABELS, prefix_ids=prefix, mode="softmax",
                max_batch_tokens=32768, max_items=max(1024, a.items))
    ready_s = time.perf_counter() - t0
    nonemb = sum(p.numel() for n, p in hf.named_parameters() if "embed" not in n and "lm_head" not in n)
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "shape": a.shape, "dtype": str(dtype), "prefix": a.prefix,
           "query": a.query, "items": a.items, "item_len": a.item_len, "labels": LABELS,
           "ready_s": ready_s, "capture": sc.capture_info, "nonemb_params": nonemb,
           "floors": measure_floors(device), "rows": {}}
    res["check"] = check(sc, hf, reqs[0], device)
    print("check", res["check"], flush=True)

    for layout in ("packed", "alone", "auto"):
        sc.spans.layout = layout
        m = sc.spans.items_per_span(a.query, [a.item_len] * a.items)
        spans = -(-a.items // m)
        tokens = spans * a.query + a.items * a.item_len
        for q, items in reqs[:3]:  # warm-up: Triton compiles, graphs touched
            sc.score_ids(q, items)
        ms = [timed(lambda: sc.score_ids(q, items), device)[1] for q, items in reqs[3:]]
        res["rows"][f"prefixscore {layout}"] = {**summary(ms, a.items), "items_per_span": m,
                                                "tokens_per_request": tokens}
        print(layout, res["rows"][f"prefixscore {layout}"], flush=True)
    if device.type == "cuda":
        sc.spans.layout = "packed"
        res["profile_packed"] = profile(lambda: sc.score_ids(*reqs[3]))
        print("profile", json.dumps(res["profile_packed"])[:1500], flush=True)
    # the batch form: several requests per call (auto layout)
    sc.spans.layout = "auto"
    batches = [reqs[3:][i:i + a.per_call] for i in range(0, a.requests, a.per_call)]
    ms = []
    for b in batches:
        prepared = [sc.prepare_ids(q, items) for q, items in b]
        ms.append(timed(lambda: sc.run(prepared), device)[1] / len(b))
    res["rows"][f"prefixscore auto, {a.per_call} requests/call"] = summary(ms, a.items)
    # host side of one call: checks, spans and plan without the forward
    from prefixscore.spans import plan_items

    q, items = reqs[3]
    host = []
    for _ in range(20):
        t = time.perf_counter()
        prep = sc.prepare_ids(q, items)
        plan_items(sc._groups(prep, 0, False), sc.trie, [])
        host.append(1e3 * (time.perf_counter() - t))
    res["host_prep_ms"] = statistics.median(host)

    for q, items in reqs[:2]:
        hf_scores(hf, q, items, device)
    ms = [timed(lambda: hf_scores(hf, q, items, device), device)[1] for q, items in reqs[3:]]
    res["rows"]["HF eager, full prompt per item (batch of all items)"] = {
        **summary(ms, a.items), "tokens_per_request": a.items * (a.prefix + a.query + a.item_len)}
    if a.ab:
        res["ab"] = ab_options(cfg, hf, prefix, reqs, a.ab, a, device, dtype)
        print("A/B", json.dumps(res["ab"]), flush=True)
    if res["floors"]:
        least = a.query + a.items * a.item_len
        floor_ms = 2 * nonemb * least / (res["floors"]["matmul_TFLOPs"] * 1e12) * 1e3
        res["floor"] = {"ms_per_request": floor_ms, "items_per_s": a.items / floor_ms * 1e3}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "multi_item.json").write_text(json.dumps(res, indent=1, default=str))
    print_table(res)
    print(f"wrote {OUT / 'multi_item.json'}")


def option_changes(spec: str) -> dict:
    """"graph_copies=0,prune_last_layer=0,attn.BLOCK_NI=64" -> {"graph_copies": 0,
    "prune_last_layer": False, "tune": {"attn.BLOCK_NI": 64}}: each value of its KernelOptions
    field's type; role.KEY entries are launch-config overrides (KernelOptions.tune)."""
    import dataclasses

    from prefixscore.kernels.options import KernelOptions

    types = {f.name: type(f.default) for f in dataclasses.fields(KernelOptions)}
    out, tune = {}, {}
    for kv in filter(None, spec.split(",")):
        k, _, v = kv.partition("=")
        if "." in k:
            tune[k] = int(v)
        elif k in types and types[k] in (bool, int):
            out[k] = v not in ("0", "false", "False") if types[k] is bool else int(v)
        else:
            raise SystemExit(f"--ab {spec!r}: {k!r} is not a bool or int KernelOptions field "
                             f"or a role.KEY launch override")
    return {**out, "tune": tune} if tune else out


def ab_options(cfg, hf, prefix, reqs, specs, a, device, dtype) -> dict:
    """W3 packed, one request per call, on engines over the same weights: the default options and
    one arm per spec (option_changes), interleaved request by request; each arm's scores against
    the defaults' (max |diff|)."""
    import dataclasses

    from prefixscore.engine import Engine
    from prefixscore.kernels.options import KernelOptions

    arms = {}
    for spec in ["defaults", *specs]:
        changes = {} if spec == "defaults" else option_changes(spec)
        loaded = from_tensors(cfg, hf.state_dict(), None, f"random {a.shape}", device, dtype)
        loaded.__dict__["engine"] = Engine(loaded, dataclasses.replace(KernelOptions.from_env(), **changes))
        arms[spec] = Scorer(loaded, label_token_ids=LABELS, prefix_ids=prefix, mode="softmax",
                            layout="packed", max_batch_tokens=32768, max_items=max(1024, a.items))
    ms = {c: [] for c in arms}
    for q, items in reqs[:3]:
        for sc in arms.values():
            sc.score_ids(q, items)
    for q, items in reqs[3:]:
        for c, sc in arms.items():
            ms[c].append(timed(lambda: sc.score_ids(q, items), device)[1])
    base = ours_scores(arms["defaults"], *reqs[3])
    return {c: {**summary(ms[c], a.items),
                "max_diff_vs_defaults": (ours_scores(sc, *reqs[3]) - base).abs().max().item()}
            for c, sc in arms.items()}


def print_table(r):
    fl = r.get("floors") or {}
    print(f"\nW3 multi-item on {r['device']} ({r['shape']}, {r['dtype'][6:]}): query {r['query']} tokens, "
          f"{r['items']} items x {r['item_len']} tokens, prefix {r['prefix']}, labels yes/no"
          + (f"; matmul {fl['matmul_TFLOPs']:.0f} TFLOP/s" if fl else ""))
    print(f"{'row':52s} {'items/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'tokens':>7s} {'per span':>8s}")
    for name, v in r["rows"].items():
        print(f"{name:52s} {v['items_per_s']:9.0f} {v['p50_ms']:8.2f} {v['p99_ms']:8.2f} "
              f"{v.get('tokens_per_request', ''):>7} {v.get('items_per_span', ''):>8}")
    if "floor" in r:
        print(f"{'compute floor (2 x params x least tokens / matmul)':52s} {r['floor']['items_per_s']:9.0f} "
              f"{r['floor']['ms_per_request']:8.2f}")
    print(f"host prep of one call (checks, spans, plan): {r['host_prep_ms']:.2f} ms; ready in "
          f"{r['ready_s']:.1f} s (capture {r['capture']})")
    print("check (request 0):", r["check"])
    for name, v in (r.get("ab") or {}).items():
        print(f"A/B {name:48s} {v['items_per_s']:9.0f} {v['p50_ms']:8.2f} {v['p99_ms']:8.2f}   "
              f"max |diff| vs defaults {v['max_diff_vs_defaults']:.2g}")


if __name__ == "__main__":
    main()
