"""GPU correctness + latency/throughput for the DESIGN.md §6 workloads, with peers and floors, in one run.

    python -m bench.gpu [--quick] [--skip-7b]      (on a CUDA machine; writes $OUT or bench/results)
    python -m bench.latency [...]      the same, without the W2 batch sweep (--part latency)
    python -m bench.throughput [...]   correctness and the W2 batch sweep only (--part throughput)
    python -m bench.gpu --ab [SWITCH[=V/V..][,...][;...]] [--profile]   W1 replay with kernel
                                       switches (KernelOptions fields; an engine per arm) in every
                                       combination (on/off, or the values given; default PDL),
                                       twice each; role.key=V/V: a launch-config override
                                       (KernelOptions.tune); ';' separates groups

Synthetic form: random weights of the Qwen2.5-0.5B / -7B shapes (config only), bf16, a 48-token
prefix of fixed ids, 8-token suffixes of random ids, 9 single-token labels.
  correctness  ours (pinned prefix, flat batch, graphs, Triton) vs HF on the full 56-token prompt:
               decisions and label log-probs, 500 random requests per shape
  W1           batch 1: GPU time of one graph replay (CUDA events), and the whole engine call
  W2           4096 requests at once: requests/s
  W4           W1 on the 7B shape
  buckets      one request of 1, 2, 4, 8, 16 tokens: graph replay GPU time and weight TB/s (the
               share of the copy rate)
  peers        HF eager full prompt; HF eager with the prefix KV reused; our engine with plain torch
               kernels in one CUDA graph ("plain graph"); vLLM / SGLang when importable
  floors       weight bytes / measured copy bandwidth; 2*params*tokens / measured bf16 matmul rate
Real form (W1b): the whole `Classifier.classify(query)` call on a 0.5B-shape model with the SmolLM2
tokenizer (carried in .carry/), the seed prompt in its chat template, queries from intent_dev.csv.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from prefixscore.batch import plan_classify
from prefixscore.graphs import GRAPH_MAX_TOKENS
from prefixscore.kernels.options import TUNE_ROLES, KernelOptions

# (the synthetic form and the timing helpers are bench/synthetic.py's; other workloads import
# them from here too)
from .synthetic import (OUT, PREFIX, SUFFIX, Synthetic, gpu_times, hf_model, hf_reference,  # noqa: F401
                        random_suffixes, stats, wall_times)
from .timeline import summarize, timeline


def measure_floors():
    x = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = statistics.median(gpu_times(lambda: y.copy_(x), 20, 3))
    bw = 2 * x.numel() * 2 / (ms / 1e3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(gpu_times(lambda: a @ b, 10, 3))
    flops = 2 * 8192**3 / (ms / 1e3)
    del x, y, a, b
    return {"copy_TBps": bw / 1e12, "matmul_TFLOPs": flops / 1e12}


def correctness(hf, ours, n=500):
    sfx = random_suffixes(n, seed=123)
    ref = hf_reference(hf, ours.prefix_ids, sfx)
    got, dec = ours.classify_ids(sfx)
    got, dec = torch.from_numpy(got).float(), torch.from_numpy(dec)
    diff = (got - ref).abs().max().item()
    # bf16 itself: HF bf16 and ours, each against HF in fp32 on the first 100 requests
    hf32 = copy.deepcopy(hf).float()
    ref32 = hf_reference(hf32, ours.prefix_ids, sfx[:100])
    del hf32
    torch.cuda.empty_cache()
    ref_dec = ref.argmax(-1)
    top2 = ref.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    mismatch = (dec != ref_dec)
    # bf16 tolerance, as the GPU test defines it (tests/test_scorer.py): twice HF bf16's own
    # distance from HF fp32, measured here, and never below 0.05 (bf16 noise in a log-prob ~1e-2).
    # Closer calls than that are ties at this precision.
    hf_err = (ref[:100] - ref32).abs().max().item()
    tol = max(5e-2, 2 * hf_err)
    clear = margin > tol
    return {"n": n, "max_abs_score_diff": diff, "decision_agree": int((~mismatch).sum()),
            "tolerance": tol, "mismatch_on_clear_margin": int((mismatch & clear).sum()),
            "near_ties": int((~clear).sum()), "ok": bool(diff < tol and not (mismatch & clear).any()),
            "hf_bf16_vs_fp32_max_diff": hf_err,
            "ours_bf16_vs_fp32_max_diff": (got[:100] - ref32).abs().max().item(),
            "hf_bf16_decisions_vs_fp32": int((ref[:100].argmax(-1) == ref32.argmax(-1)).sum()),
            "ours_decisions_vs_fp32": int((dec[:100] == ref32.argmax(-1)).sum())}


@torch.no_grad()
def hf_peers(hf, prefix_ids, iters=100, compiled=False):
    sfx = random_suffixes(1, seed=5)[0]
    ids = torch.tensor([prefix_ids + sfx], device="cuda")
    res = {"hf_eager_full_prompt": stats(gpu_times(lambda: hf(input_ids=ids, logits_to_keep=1), iters, 5))}
    try:
        pre = hf(input_ids=ids[:, :PREFIX], use_cache=True).past_key_values
        s = ids[:, PREFIX:]

        def reuse():
            hf(input_ids=s, past_key_values=copy.deepcopy(pre), use_cache=True, logits_to_keep=1)

        res["hf_eager_prefix_reused"] = stats(gpu_times(reuse, iters, 5))
    except Exception as e:  # API differences across transformers versions
        res["hf_eager_prefix_reused"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    if compiled:
        # HF under torch.compile with CUDA graphs (mode reduce-overhead), full fixed-shape prompt:
        # the strongest plain-HF configuration for a one-shot prompt (a static KV cache only helps
        # decoding, which this workload never does).
        try:
            t0 = time.perf_counter()
            fwd = torch.compile(lambda x: hf(input_ids=x, logits_to_keep=1).logits, mode="reduce-overhead")
            for _ in range(3):
                fwd(ids)
            res["hf_compile_s"] = time.perf_counter() - t0
            res["hf_compiled_full_prompt"] = stats(gpu_times(lambda: fwd(ids), iters, 5))
        except Exception as e:
            res["hf_compiled_full_prompt"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return res


def host_profile(fn, n=300):
    """Where the host time of a call goes (cProfile, top functions by own time)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    return s.getvalue()[-3500:]


def w1_graph(engine, prefix, weight, tokens=SUFFIX):
    """The graph a W1 request (one SUFFIX-token suffix; or `tokens` in all) replays, in the
    engine's runner captured for (prefix, weight)."""
    runner = engine.graphs[(id(prefix), id(weight), True)]
    return runner.graphs[next(b for b in runner.buckets if b >= tokens)]


def variant_graph(ours, suffix, keep=None, batch=1, **switches):
    """W1 replay of an engine over the same weights and pinned prefix whose KernelOptions are
    ours' with `switches` changed (Synthetic.arm; use_triton=False: torch reference kernels, the
    plain graph), captured anew. keep: a list that gets (graph, its engine) to profile it later
    (the engine holds the graph's buffers). batch: that many copies of the request in one replay
    (another token bucket)."""
    engine = ours.arm(**switches)
    engine.capture(ours.prefix, ours.weight, True, max(16, batch * SUFFIX))
    plan = plan_classify([suffix] * batch, [PREFIX] * batch, ours.trie)
    engine.run(plan, ours.prefix, ours.weight, True)
    g = w1_graph(engine, ours.prefix, ours.weight, batch * SUFFIX)
    if keep is not None:
        keep.append((g, engine))
    return stats(gpu_times(g.replay))


def copies_ab(ours, suffixes, calls=600):
    """The engine call with the H2D/D2H copies inside the bucket's graph (the default) and around it
    (KernelOptions.graph_copies off: another engine over the same weights), one call of each in
    turn (the host's speed drifts within a run: BENCHMARKS.md), and each graph's replay: {mode:
    {"engine_call": stats, "gpu_replay": stats}}."""
    outside = ours.arm(graph_copies=False)
    outside.capture(ours.prefix, ours.weight, True, 16)
    modes = {"inside": ours.engine, "outside": outside}
    times = {m: [] for m in modes}
    for i in range(calls + 20):
        for m, engine in modes.items():
            t = time.perf_counter()
            plan = plan_classify(suffixes, [PREFIX] * len(suffixes), ours.trie)
            ours.trie.assemble(*engine.run(plan, ours.prefix, ours.weight, True), len(suffixes))
            if i >= 20:  # warm-up calls
                times[m].append(1e3 * (time.perf_counter() - t))
    out = {}
    for m, engine in modes.items():
        g = w1_graph(engine, ours.prefix, ours.weight)
        out[m] = {"engine_call": stats(times[m]), "gpu_replay": stats(gpu_times(g.replay))}
    return out


def profile_kernels(ours, suffix):
    """Kernel names, counts and GPU µs of one eager forward (what the graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    plan = plan_classify([suffix], [PREFIX], ours.trie)
    for _ in range(3):
        ours.engine.run(plan, ours.prefix, ours.weight.clone(), True)  # eager (no graph for clone)
    w = ours.weight.clone()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours.engine.run(plan, ours.prefix, w, True)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if t > 0:
                rows[e.key[:90]] = {"count": e.count, "us": t}
    top = sorted(rows.items(), key=lambda kv: -kv[1]["us"])
    return {"kernels_total": sum(r["count"] for _, r in top), "gpu_us_total": sum(r["us"] for _, r in top),
            "top": top[:25]}


def bucket_rows(ours, floors) -> dict:
    """One request of T suffix tokens per latency bucket (T = 1..16): the graph replay's GPU time
    and the weight bytes it streams per second, against the copy rate (issue 35: W1 at 56% of
    it; buckets 2-16 no slower than today)."""
    ids = torch.randint(100, 30000, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    out = {}
    for T in (1, 2, 4, 8, 16):
        s = stats(gpu_times(ours.replay_fn([ids[:T]])))
        tbps = ours.nonemb_params * 2 / (s["p50_ms"] / 1e3) / 1e12
        out[T] = {**s, "weight_TBps": tbps, "of_copy_rate": tbps / floors["copy_TBps"]}
        print(f"bucket {T:>2} replay {s['p50_ms']:.4f} ms "
              f"({100 * out[T]['of_copy_rate']:.0f}% of the copy rate)", flush=True)
    return out


def run_shape(shape, floors, batches, quick, latency=True):
    """Correctness, then (latency) the one-request rows, peers and profile, then the batch sweep."""
    hf = hf_model(shape)
    ours = Synthetic(hf)
    res = {"shape": shape, "capture": ours.capture, "nonemb_params": ours.nonemb_params}
    res["correctness"] = correctness(hf, ours, 200 if quick else 500)
    print(shape, "correctness", res["correctness"], flush=True)
    floor_ms = ours.nonemb_params * 2 / (floors["copy_TBps"] * 1e12) * 1e3
    res["weight_floor_ms"] = floor_ms
    if latency:
        res["w1_buckets"] = bucket_rows(ours, floors)
        one_request_rows(res, hf, ours)
    res["sweep"] = sweep(ours, floors, floor_ms, shape, batches)
    if shape == "0.5B" and latency and not quick:  # last: torch.compile's own CUDA graphs come after ours
        res.update(hf_peers(hf, ours.prefix_ids, compiled=True))
    del hf, ours
    torch.cuda.empty_cache()
    return res


def one_request_rows(res, hf, ours):
    one = random_suffixes(1, seed=9)
    res["w1_gpu_replay"] = stats(gpu_times(ours.replay_fn(one)))
    res["w1_engine_call"] = stats(wall_times(lambda: ours.classify_ids(one)))
    res["w1_host_profile"] = host_profile(lambda: ours.classify_ids(one))
    res["plain_graph"] = variant_graph(ours, one[0], use_triton=False)
    # the same graph with each RMSNorm as its own kernel instead of the next GEMM's prologue
    res["w1_norms_unfused"] = variant_graph(ours, one[0], fuse_norms=False)
    # ... and with attention and the O GEMM as two kernels
    res["w1_attn_o_unfused"] = variant_graph(ours, one[0], fuse_attn_o=False)
    # ... and with plain launches instead of programmatic dependent launch (kernels/pdl.py)
    res["w1_pdl_off"] = variant_graph(ours, one[0], pdl=False)
    # the engine call with the copies inside the graph and around it (KernelOptions.graph_copies)
    res["w1_copies_ab"] = copies_ab(ours, one)
    res.update(hf_peers(hf, ours.prefix_ids))
    # Profiled last: a profiler session leaves CUPTI hooked in, and every host-side row timed after
    # it read slower in the one run that profiled first (engine call 0.98 ms, 0.65 in other runs).
    res["w1_timeline"] = summarize(timeline(ours.replay_fn(one), 20), 20)
    res["profile_w1"] = profile_kernels(ours, one[0])


def sweep(ours, floors, floor_ms, shape, batches):
    out = {}
    for B in batches:
        sfx = random_suffixes(B, seed=B)
        ms = statistics.median(gpu_times(ours.replay_fn(sfx), 30 if B > 256 else 100, 5))
        call = statistics.median(wall_times(lambda: ours.classify_ids(sfx), 10 if B > 256 else 50, 3))
        flop_floor = 2 * ours.nonemb_params * B * SUFFIX / (floors["matmul_TFLOPs"] * 1e12) * 1e3
        out[B] = {"gpu_ms": ms, "call_ms": call, "req_per_s_gpu": B / ms * 1e3,
                  "req_per_s_call": B / call * 1e3, "floor_ms": max(floor_ms, flop_floor)}
        print(shape, "batch", B, out[B], flush=True)
    return out


def ab_rows(shapes, switches=(("PDL", (False, True)),), profile=False, groups=None, batch=1):
    """--ab: W1 graph replay of each shape with every combination of kernel switch values
    ((name, values) pairs: a KernelOptions field, or role.key, a launch-config override), each
    arm an engine of its own over one loaded model,
    captured and timed twice (in turn); profile: then each first capture's kernel timeline
    (bench.timeline; profiling slows what is timed after it, so it comes last). groups: several
    such switch lists, each its own set of combinations, on one loaded model; batch: requests per
    replay (1: W1; 4: the 32-token bucket). The first capture
    of a process has read 0.01-0.02 ms below every later one, variants and their repeats alike
    on the H200, so an unchanged capture goes first and is reported apart."""
    out = {}
    for shape in shapes:
        hf = hf_model(shape)
        ours = Synthetic(hf, max_tokens=max(16, batch * SUFFIX))
        one = random_suffixes(1, seed=9)[0]
        rows = {"first capture, defaults": variant_graph(ours, one, batch=batch)}
        print(f"{shape:5s} {'first capture, defaults':40s} p50 {rows['first capture, defaults']['p50_ms']:.4f}",
              flush=True)
        graphs = []
        for sw in groups or [switches]:
            rows.update(_ab_group(shape, ours, one, sw, graphs, batch))
        if profile:
            for key, g, _engine in graphs:  # (the engine keeps the graph's buffers alive)
                key += " timeline"
                rows[key] = summarize(timeline(g.replay, 20), 20)
                print(shape, key, {k: round(v, 2) for k, v in rows[key].items() if isinstance(v, float)},
                      {k: round(v["median_us"], 2) for k, v in rows[key]["skinny_by_role"].items()},
                      round(rows[key]["kinds"].get("_attn_o_kernel", {}).get("median_us", 0), 2), flush=True)
        out[shape] = rows
        del hf, ours, graphs
        torch.cuda.empty_cache()
    return out


def _ab_group(shape, ours, one, switches, graphs, batch):
    """One group's combinations, twice each in turn; graphs gets (key, first capture's graph)."""
    import itertools

    names = [n for n, _ in switches]
    combos = list(itertools.product(*(v for _, v in switches)))
    label = lambda combo: ",".join(f"{s.lower()}={m}" for s, m in zip(names, combo))  # noqa: E731
    rows = {}
    for again in ("", " again"):
        for combo in combos:
            key = label(combo) + again
            keep = None if again else []
            try:
                rows[key] = variant_graph(ours, one, keep=keep, batch=batch, **dict(zip(names, combo)))
            except Exception as e:  # e.g. a launch config the kernel refuses: note it, go on
                rows[key] = {"error": repr(e)[:300]}
                print(f"{shape:5s} {key:40s} failed: {rows[key]['error']}", flush=True)
                continue
            if keep:
                graphs.append((key, *keep[0]))
            print(f"{shape:5s} {key:40s} p50 {rows[key]['p50_ms']:.4f} p99 {rows[key]['p99_ms']:.4f}",
                  flush=True)
    return rows


def real_form_model(folder=Path("/tmp/q05"), carry=Path(".carry")):
    """A HF folder: random Qwen2.5-0.5B-shape weights (SmolLM2's vocabulary) + the carried
    SmolLM2 tokenizer files. Also for bench.http/bench.host on the GPU machine:
    python -c 'from bench.gpu import real_form_model; real_form_model()'"""
    hf = hf_model("0.5B", vocab=49152)
    hf.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (carry / f).exists():
            (folder / f).write_bytes((carry / f).read_bytes())
    return folder


def real_form(quick):
    """W1b: the whole classify(query) call, tokenizer and all, on a 0.5B-shape random model."""
    carry = Path(".carry")
    if not (carry / "tokenizer.json").exists():
        return {"skipped": "no .carry/tokenizer.json"}
    from prefixscore import Classifier

    folder = real_form_model()
    t0 = time.perf_counter()
    clf = Classifier(str(folder), device="cuda")
    ready = time.perf_counter() - t0
    import csv

    with open(Path(__file__).resolve().parents[1] / "tests" / "data" / "intent_dev.csv", newline="") as f:
        qs = [r["query"] for r in csv.DictReader(f)]
    it = iter(qs * 10)
    call = wall_times(lambda: clf.classify(next(it)), 100 if quick else 400, 20)
    batch = wall_times(lambda: clf.classify_batch(qs[:64]), 20, 3)
    return {"ready_s": ready, "prefix_tokens": clf.prefix_len, "capture": clf.capture_info,
            "classify_call": stats(call), "classify_batch64_ms": stats(batch)}


def peers_available():
    out = {}
    for name in ("vllm", "sglang"):
        try:
            __import__(name)
            out[name] = "importable (adapter not run in this script)"
        except ImportError:
            out[name] = "not installed"
    return out


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results["shapes"]:
        bs = sorted(int(b) for b in r["sweep"])
        ax.plot(bs, [r["sweep"][b]["gpu_ms"] for b in bs], "o-", label=f"prefixscore {r['shape']} (graph replay)")
        ax.plot(bs, [r["sweep"][b]["floor_ms"] for b in bs], "--", label=f"floor {r['shape']} (weights / FLOPs)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("requests per batch (8 new tokens each)")
    ax.set_ylabel("GPU time per batch (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SWITCHES = {f.name for f in dataclasses.fields(KernelOptions) if isinstance(f.default, (bool, int))}


def _ab_switches(ap, group):
    """One --ab group: NAME (a bool: off, on) or NAME=v1/v2/... (ints), comma-separated; NAME is a
    KernelOptions field (either case: PDL, fuse_norms) or role.key (a KernelOptions.tune override,
    e.g. gu.num_stages=0/4: 0 = the config's)."""
    switches = []
    for spec in group.split(","):
        name, _, vals = spec.partition("=")
        role, dot, key = name.partition(".")
        if dot:
            if role not in TUNE_ROLES or not key or not vals:
                ap.error(f"--ab: {name!r}: role.key=V/V.. with role one of {', '.join(TUNE_ROLES)}")
        elif name.lower() not in SWITCHES:
            ap.error(f"--ab: no kernel switch {name!r}: one of {', '.join(sorted(SWITCHES))}")
        try:
            values = [int(v) for v in vals.split("/")] if vals else [False, True]
        except ValueError:
            ap.error(f"--ab: {spec!r}: values are integers separated by /")
        switches.append((name, values))
    return switches


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--part", choices=("all", "latency", "throughput"), default="all",
                    help="latency: W1/W4 rows, peers, profile; throughput: the W2 batch sweep")
    ap.add_argument("--ab", nargs="?", const="PDL", default=None, metavar="SWITCH[=V/V..][,...][;...]",
                    help="only the W1 A/B rows: KernelOptions fields (PDL, FUSE_NORMS, EARLY_WEIGHTS, "
                         "..., either case) or launch-config overrides (gu.num_stages=0/4) in every "
                         "combination, an engine per arm; ';' separates groups run one after another "
                         "on one model; or COPIES: the engine call with the graph copies inside and around")
    ap.add_argument("--profile", action="store_true", help="with --ab: each variant's kernel timeline")
    ap.add_argument("--ab-shapes", nargs="*", default=None, help="with --ab: these shapes (default "
                    "0.5B and, without --skip-7b, 7B)")
    ap.add_argument("--ab-batch", type=int, default=1, metavar="N",
                    help="with --ab: N copies of the W1 request per replay (4: the 32-token bucket; "
                         f"at most {GRAPH_MAX_TOKENS // SUFFIX}, the largest graph)")
    a = ap.parse_args(argv)
    if not 1 <= a.ab_batch * SUFFIX <= GRAPH_MAX_TOKENS:
        ap.error(f"--ab-batch: 1 to {GRAPH_MAX_TOKENS // SUFFIX} requests (the largest graph holds "
                 f"{GRAPH_MAX_TOKENS} tokens, {SUFFIX} a request)")
    OUT.mkdir(parents=True, exist_ok=True)
    if a.ab == "COPIES":
        hf = hf_model("0.5B")
        ours = Synthetic(hf, max_tokens=16)
        res = {f"round {i}": copies_ab(ours, random_suffixes(1, seed=9)) for i in range(3)}
        for k, r in res.items():
            print(k, {m: (round(v["engine_call"]["p50_ms"], 4), round(v["gpu_replay"]["p50_ms"], 4))
                      for m, v in r.items()}, flush=True)
        (OUT / "gpu_ab_copies.json").write_text(json.dumps(res, indent=1))
        return
    if a.ab:
        groups = [_ab_switches(ap, g) for g in a.ab.split(";")]
        res = ab_rows(a.ab_shapes or ["0.5B"] + ([] if a.skip_7b else ["7B"]), profile=a.profile,
                      groups=groups, batch=a.ab_batch)
        (OUT / "gpu_ab.json").write_text(json.dumps(res, indent=1))
        return
    latency, throughput = a.part in ("all", "latency"), a.part in ("all", "throughput")
    name = "gpu" if a.part == "all" else a.part
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "floors": measure_floors(),
               "peers": peers_available(), "part": a.part, "shapes": []}
    print(results["floors"], flush=True)
    if latency:
        results["real_form"] = real_form(a.quick)
        print("real form", results["real_form"], flush=True)
    for shape in ["0.5B"] + ([] if a.skip_7b else ["7B"]):
        batches = ([1, 4, 16, 64, 256, 1024, 4096] if shape == "0.5B" else [1, 16, 256]) if throughput else []
        results["shapes"].append(run_shape(shape, results["floors"], batches, a.quick, latency))
        (OUT / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    if throughput:
        plot(results, OUT / ("gpu_latency.png" if name == "gpu" else f"{name}.png"))
    print_table(results)


def print_table(r):
    print(f"\n{r['device']}  torch {r['torch']}  copy {r['floors']['copy_TBps']:.2f} TB/s  "
          f"matmul {r['floors']['matmul_TFLOPs']:.0f} TFLOP/s")
    for s in r["shapes"]:
        print(f"\n== {s['shape']}  (non-embedding params {s['nonemb_params'] / 1e6:.0f}M)  correctness: {s['correctness']}")
        print(f"{'row':34s} {'p50 ms':>9s} {'p99 ms':>9s}")
        rows = [("weight-read floor", {"p50_ms": s["weight_floor_ms"], "p99_ms": float('nan')}),
                ("prefixscore GPU (graph replay)", s.get("w1_gpu_replay", {"skipped": 1})),
                ("same, RMSNorm as its own kernels", s.get("w1_norms_unfused", {"skipped": 1})),
                ("same, attention and O unfused", s.get("w1_attn_o_unfused", {"skipped": 1})),
                ("same, no PDL (plain launches)", s.get("w1_pdl_off", {"skipped": 1})),
                ("prefixscore engine call (ids)", s.get("w1_engine_call", {"skipped": 1})),
                ("same, copies around the graph", (s.get("w1_copies_ab") or {}).get("outside", {}).get(
                    "engine_call", {"skipped": 1})),
                ("plain torch kernels, one graph", s.get("plain_graph", {"skipped": 1})),
                ("HF eager, full prompt", s.get("hf_eager_full_prompt", {"skipped": 1})),
                ("HF eager, prefix KV reused", s.get("hf_eager_prefix_reused", {"skipped": 1})),
                ("HF torch.compile (graphs), full", s.get("hf_compiled_full_prompt", {"skipped": 1}))]
        for name, v in rows:
            if "p50_ms" in v:
                print(f"{name:34s} {v['p50_ms']:9.3f} {v['p99_ms']:9.3f}")
            else:
                print(f"{name:34s} {str(v)[:60]}")
        if "profile_w1" in s:
            print(f"kernels per forward: {s['profile_w1']['kernels_total']}, GPU µs (eager, profiled): "
                  f"{s['profile_w1']['gpu_us_total']:.0f}")
        for T, v in (s.get("w1_buckets") or {}).items():
            print(f"bucket {T:>2} tokens: replay {v['p50_ms']:.3f} ms, weights {v['weight_TBps']:.2f} TB/s "
                  f"({100 * v['of_copy_rate']:.0f}% of the copy rate)")
        print(f"{'batch':>6s} {'gpu ms':>8s} {'call ms':>8s} {'req/s gpu':>10s} {'req/s call':>11s} {'floor ms':>9s}")
        for b, v in s["sweep"].items():
            print(f"{b:>6} {v['gpu_ms']:8.3f} {v['call_ms']:8.3f} {v['req_per_s_gpu']:10.0f} "
                  f"{v['req_per_s_call']:11.0f} {v['floor_ms']:9.3f}")
    rf = r.get("real_form", {})
    if "classify_call" in rf:
        print(f"\nreal form: classify(query) p50 {rf['classify_call']['p50_ms']:.3f} ms p99 "
              f"{rf['classify_call']['p99_ms']:.3f} ms; batch 64 p50 {rf['classify_batch64_ms']['p50_ms']:.2f} ms; "
              f"capture {rf['capture']}")
    print("peers:", r["peers"])


if __name__ == "__main__":
    main()
