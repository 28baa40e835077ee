"""Ranking at scale (issue 34): W3 (text items) beside W6 (embedding items) in one run, in process.

    python -m bench.ranking -- --model /tmp/q05 --device cuda                (the H200 run)
    python -m bench.ranking --requests 2 --items 10 --repeats 2              (a CPU smoke run)

  W3 text   Scorer.score_batch(requests): --requests requests of a ~50-token query and --items
            items of ~150 tokens, built from real queries (tests/data/intent_dev.csv), the W3
            yes/no prompt (bench.overlap's), mode softmax
  W3 ids    Scorer.run(prepared): the same requests tokenized beforehand (the engine's share)
  W6 vec    the same queries, each item one embedding (a soft token): float32 vectors at the
            scale of the model's token embeddings, through score_batch
  W6 id     the same vectors as {"id"} items into an item table (safetensors, bf16)
  one       W3 text and W6 vec one request at a time (Scorer.score): p50 / p99 per request
  timeline  (CUDA) one batch call of W3 text and of W3 ids under the torch profiler: wall time,
            GPU busy time (union of kernels), idle gaps (the host work the GPU waited on)
Each batch form runs --repeats times interleaved after a warm-up (median items/s). Check: request
0's W6 scores against transformers' inputs_embeds on the same sequences (fp32, the first 16
items), and W6 vec == W6 id. Writes $OUT/ranking.json (bench/results without OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.overlap import W3_TEMPLATE, interleaved, model_flags, queries, sync, texts_of

OUT = Path(os.environ.get("OUT") or "bench/results")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def one_at_a_time(fn, reqs, device, rounds):
    ms = []
    for r in range(rounds):
        for q, items in reqs:
            sync(device)
            t = time.perf_counter()
            fn(q, items)
            sync(device)
            ms.append(1e3 * (time.perf_counter() - t))
    n = len(reqs[0][1])
    return {"p50_ms": statistics.median(ms), "p99_ms": pct(ms, 99),
            "items_per_s": n * len(ms) / (sum(ms) / 1e3), "n": len(ms)}


def busy_timeline(fn) -> dict:
    """Where one call's time goes on the GPU (torch profiler, CUDA): its wall time, the time the
    GPU runs a kernel (the union of kernel intervals), and the idle gaps between them (count,
    total, the longest five with their offsets from the first kernel): idle is host work the GPU
    waited on (tokenizing, planning, launching, collecting)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = [(e.time_range.start, e.time_range.end) for e in p.events()
             if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    return busy_of(spans, wall)


def busy_of(spans, wall: float) -> dict:
    """busy_timeline's arithmetic: kernel intervals (us) and the call's wall time (s)."""
    if not spans:
        return {"wall_ms": 1e3 * wall, "kernels": 0}
    spans = sorted(spans)
    merged = [list(spans[0])]
    for a, b in spans[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    busy = sum(b - a for a, b in merged) / 1e3
    gaps = sorted((((merged[i + 1][0] - merged[i][1]) / 1e3, (merged[i][1] - merged[0][0]) / 1e3)
                   for i in range(len(merged) - 1)), reverse=True)
    return {"wall_ms": 1e3 * wall, "kernels": len(spans),
            "gpu_span_ms": (merged[-1][1] - merged[0][0]) / 1e3, "gpu_busy_ms": busy,
            "busy_of_wall": busy / (1e3 * wall), "idle_gaps": len(gaps),
            "idle_ms": sum(g for g, _ in gaps),
            "longest_gaps": [{"ms": g, "at_ms": at} for g, at in gaps[:5]]}


def check_against_hf(sc, query, vectors, path):
    """Our W6 scores of the first items vs transformers fp32 with inputs_embeds (max |diff|)."""
    import torch
    from transformers import AutoModelForCausalLM

    if path is None or not os.path.isdir(path):
        return None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prep = sc.prepare(query, vectors)
    ours = sc.score(query, vectors)
    cols = [p[0] for p in sc.trie.paths]
    worst = 0.0
    with torch.no_grad():
        for ids, v, r in zip(prep.full, prep.soft, ours):
            t = torch.tensor(ids)
            emb = hf.get_input_embeddings()(t.clamp(min=0))
            emb[t < 0] = v
            logits = hf(inputs_embeds=emb[None]).logits[0, -1, cols].float()
            ref = logits.softmax(-1).tolist()
            worst = max(worst, max(abs(r.scores[l] - x) for l, x in zip(sc.labels, ref)))
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="requests per batch call")
    ap.add_argument("--items", type=int, default=100, help="items per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="one-at-a-time passes over the requests")
    ap.add_argument("model_flags", nargs=argparse.REMAINDER, help="-- --model PATH --device cuda ...")
    a = ap.parse_args(argv)
    m, _ = model_flags(a.model_flags)

    import torch

    from prefixscore import Scorer
    from prefixscore.item_table import write_table

    sc = Scorer(m.model, W3_TEMPLATE, ["yes", "no"], mode="softmax", device=m.device, dtype=m.dtype)
    device, tok = sc.engine.device, sc.tokenizer
    qs = queries()
    reqs = [(texts_of(tok, qs, 50, 1, 97 * k)[0], texts_of(tok, qs, 150, a.items, 13 * k))
            for k in range(a.requests)]
    prepared = [sc.prepare(q, items) for q, items in reqs]
    H = sc.config.hidden_size
    scale = sc.loaded.model.embed_tokens.weight.float().std().item()
    g = torch.Generator().manual_seed(0)
    vecs = (torch.randn(a.requests * a.items, H, generator=g) * scale).bfloat16()
    ids = [f"item-{i}" for i in range(len(vecs))]
    table = Path(tempfile.mkdtemp()) / "items.safetensors"
    from prefixscore.weights.loading import base_hash
    write_table(table, ids, vecs, {"base_model": base_hash(sc.loaded)})
    sc_t = Scorer(sc.loaded, W3_TEMPLATE, ["yes", "no"], mode="softmax", item_table=table)
    vec_reqs = [(q, list(vecs[k * a.items:(k + 1) * a.items].float())) for k, (q, _) in enumerate(reqs)]
    id_reqs = [(q, [{"id": i} for i in ids[k * a.items:(k + 1) * a.items]]) for k, (q, _) in enumerate(reqs)]
    n = a.requests * a.items
    out = {"device": str(device), "model": sc.loaded.name, "requests": a.requests, "items": a.items,
           "tokens_per_w3_item": statistics.mean(len(f) - len(p.shared) for p in prepared for f in p.full),
           "tokens_per_w6_item": len(sc.prepare(*vec_reqs[0]).full[0]) - len(prepared[0].shared)}
    out["batch"] = interleaved({"w3_text": lambda: sc.score_batch(reqs),
                                "w3_ids": lambda: sc.run(prepared),
                                "w6_vec": lambda: sc.score_batch(vec_reqs),
                                "w6_id": lambda: sc_t.score_batch(id_reqs)}, n, device, a.repeats)
    same = [[r.scores for r in res] for res in sc.score_batch(vec_reqs[:1])]
    out["w6_vec_equals_id"] = same == [[r.scores for r in res] for res in sc_t.score_batch(id_reqs[:1])]
    out["one"] = {"w3_text": one_at_a_time(sc.score, reqs, device, a.rounds),
                  "w6_vec": one_at_a_time(sc.score, vec_reqs, device, a.rounds)}
    if device.type == "cuda":  # one batch call of each W3 form: the GPU's busy time and gaps
        out["timeline"] = {"w3_text": busy_timeline(lambda: sc.score_batch(reqs)),
                           "w3_ids": busy_timeline(lambda: sc.run(prepared))}
        print("timeline", json.dumps(out["timeline"]), flush=True)
    path = m.model if m.model and os.path.isdir(m.model) else getattr(sc.loaded, "path", None)
    out["w6_max_abs_vs_hf_fp32"] = check_against_hf(sc, vec_reqs[0][0], vec_reqs[0][1][:16], path)

    b, o = out["batch"], out["one"]
    print(f"{'form':8s} {'batch items/s':>14s} {'one: items/s':>13s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for k in ("w3_text", "w3_ids", "w6_vec", "w6_id"):
        row = o.get(k)
        extra = f"{row['items_per_s']:13.0f} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f}" if row else ""
        print(f"{k:8s} {b[k]['median_per_s']:14.0f} {extra}")
    print(f"targets (H200, 0.5B shape): W3 text >= 5,500 items/s, W6 >= 20,000 items/s; "
          f"W6 vec == id: {out['w6_vec_equals_id']}; W6 vs HF fp32: {out['w6_max_abs_vs_hf_fp32']}")
    OUT.mkdir(parents=True, exist_ok=True)
    name = "ranking.json" if device.type == "cuda" else "ranking_cpu.json"
    (OUT / name).write_text(json.dumps(out, indent=1))
    print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
