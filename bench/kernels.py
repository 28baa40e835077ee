"""Triton kernels vs their torch references on the GPU: correctness, then timing.

    python -m bench.kernels            # correctness + timing of the shape heuristics
    python -m bench.kernels --sweep    # also time a grid of launch configs per shape (tuning aid)
    python -m bench.kernels --only attn_o --sweep   # one part: attention, attn_o, label_head

Times (microseconds, median):
  eager  triton.testing.do_bench of one call: kernel time, or the Python launch cost when that is
         larger (small shapes), with the L2 flushed before each call
  graph  one CUDA graph holding many back-to-back launches, replayed: the per-kernel GPU time as
         the engine sees it (warm L2; also proves the kernel is capturable)
Writes $OUT/kernels.json (./kernels.json without OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.testing

from prefixscore.kernels.attention import attention_ref
from prefixscore.kernels.attention_triton import attention_triton, attn_config
from prefixscore.kernels.label_head import label_head_ref
from prefixscore.kernels.label_head_triton import head_config, label_head_triton

DEV = "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
HBM_BYTES_PER_S = 4.3e12  # measured on the H200 (DESIGN.md section 1)
MODELS = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-7b": (28, 4, 128)}  # Hq, Hkv, D


# ---------------------------------------------------------------- inputs

def plan(lengths, gen, branched=False):
    """Visibility ranges for requests of the given lengths laid out back to back.

    Plain: own range = the request. Branched: the first half is the query (own = request start),
    the rest splits into branches that see the query as their base range and themselves causally,
    like label-trie branches or multi-item scoring.
    """
    bs, be, own, offs = [], [], [], [0]
    for L in lengths:
        s = offs[-1]
        q = max(1, L // 2) if branched and L >= 3 else L
        bs += [0] * q
        be += [0] * q
        own += [s] * q
        b = s + q
        while b < s + L:
            blen = min(s + L - b, int(torch.randint(1, 5, (1,), generator=gen)))
            bs += [s] * blen
            be += [s + q] * blen
            own += [b] * blen
            b += blen
        offs.append(s + L)
    i32 = dict(dtype=torch.int32, device=DEV)
    return (torch.tensor(bs, **i32), torch.tensor(be, **i32), torch.tensor(own, **i32),
            torch.tensor(offs))


def multi_item_plan(query_len, item_lens):
    """One multi-item scoring span: [query part (own causal)][item 1][item 2]..., each item seeing
    the query part as its base range and itself causally."""
    q = query_len
    bs, be, own = [0] * q, [0] * q, [0] * q
    t = q
    for L in item_lens:
        bs += [0] * L
        be += [q] * L
        own += [t] * L
        t += L
    i32 = dict(dtype=torch.int32, device=DEV)
    return (torch.tensor(bs, **i32), torch.tensor(be, **i32), torch.tensor(own, **i32),
            torch.tensor([0, t]))


def attn_inputs(Hq, Hkv, D, P, lengths, dtype, seed, branched=False, multi=None):
    """multi=(query_len, item_lens): one multi-item span instead of `lengths` (ignored then)."""
    if multi is not None:
        lengths = [multi[0] + sum(multi[1])]
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    # q/k/v as views of one fused projection output (strided like the model's), prefix K/V cache
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(DEV, dtype)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    pk, pv = torch.randn(2, P, Hkv, D, generator=gen).to(DEV, dtype)
    bs, be, own, offs = plan(lengths, gen, branched) if multi is None else multi_item_plan(*multi)
    return (q, k, v, pk, pv, bs, be, own, D ** -0.5), offs


def head_inputs(T, H, N, R, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).to(DEV, dtype)
    rows = (torch.randperm(T, generator=gen)[:R]).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen)).to(DEV, dtype)
    weight = (torch.randn(N, H, generator=gen) * H ** -0.5).to(DEV, dtype)
    allowed = torch.rand(R, N, generator=gen) < 0.7
    allowed[:, 0] = True
    return hidden, rows, norm_w, 1e-6, weight, allowed.to(DEV)


# ---------------------------------------------------------------- timing

def eager_us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fn, launches=50, reps=20):
    """Per-launch time from replaying one graph of `launches` calls; None if capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # compile / warm up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(launches):
                fn()
    except Exception as e:  # e.g. the attention reference builds tensors from host lists
        torch.cuda.synchronize()
        print(f"      (not capturable: {type(e).__name__})")
        return None
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(times)


def fmt(x, w=9):
    return f"{x:{w}.1f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"


# ---------------------------------------------------------------- correctness

def check_attention(results):
    print("\n== attention: correctness vs attention_ref (random plans, strided q/k/v) ==")
    cases = [  # model, P, request lengths, branched
        ("qwen2.5-0.5b", 48, [8], False),
        ("qwen2.5-0.5b", 0, [5, 17, 3], True),
        ("qwen2.5-0.5b", 600, [8] * 64, True),
        ("qwen2.5-7b", 48, [8] * 512, False),
        ("qwen2.5-7b", 1, [30, 2, 64, 9], True),
        ("qwen2.5-7b", 600, [8] * 1024, True),
        ("qwen2.5-0.5b", 48, [8] * 4096, True),
    ]
    # multi-item spans (query part + items, base = query part), as (query_len, item lengths)
    multi_cases = [
        ("qwen2.5-0.5b", 48, (50, [150] * 10)),
        ("qwen2.5-0.5b", 0, (7, [3, 150, 1, 40, 77])),
        ("qwen2.5-7b", 48, (50, [150] * 10)),
    ]
    cases = [c + (None,) for c in cases] + [(m, P, [mi[0] + sum(mi[1])], True, mi)
                                             for m, P, mi in multi_cases]
    seed = 0
    for dtype in (torch.bfloat16, torch.float32):
        for model, P, lengths, branched, multi in cases:
            seed += 1
            Hq, Hkv, D = MODELS[model]
            args, offs = attn_inputs(Hq, Hkv, D, P, lengths, dtype, seed, branched, multi)
            ref = attention_ref(*args, seg_offsets=offs).float()
            out = torch.full_like(args[0], float("nan"))
            attention_triton(*args, out=out)
            written = not out.isnan().any().item()
            err = (out.float() - ref).abs()
            tol = TOL[dtype]
            ok = written and bool((err <= tol + tol * ref.abs()).all())
            # the same through a CUDA graph, output poisoned before the replay
            g_out = torch.full_like(out, float("nan"))
            g = torch.cuda.CUDAGraph()
            attention_triton(*args, out=g_out)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                attention_triton(*args, out=g_out)
            g_out.fill_(float("nan"))
            g.replay()
            g_ok = torch.equal(g_out, out)
            T = sum(lengths)
            kind = "multi" if multi else "branched" if branched else "plain"
            print(f"  {model:13s} {str(dtype)[6:]:8s} P={P:4d} T={T:6d} {kind:8s} "
                  f"max_err={err.max().item():.2e} {'ok' if ok else 'FAIL'} graph={'ok' if g_ok else 'FAIL'}")
            results.append(dict(kind="check", kernel="attention", model=model, dtype=str(dtype), P=P,
                                T=T, branched=branched, multi=multi is not None,
                                max_err=err.max().item(), ok=ok, graph_ok=g_ok))


def check_label_head(results):
    print("\n== label head: correctness vs label_head_ref ==")
    seed = 100
    for dtype in (torch.bfloat16, torch.float32):
        for H in (896, 3584):
            for N, R in ((9, 1), (64, 4096), (300, 70)):
                for logprobs in (True, False):
                    seed += 1
                    args = head_inputs(max(8 * R, 16), H, N, R, dtype, seed)
                    ref_s, ref_b = label_head_ref(*args, logprobs)
                    s = torch.full((R, N), float("nan"), device=DEV)
                    b = torch.full((R,), -1, dtype=torch.int64, device=DEV)
                    label_head_triton(*args, logprobs, out_scores=s, out_best=b)
                    allowed = args[-1]
                    tol = TOL[dtype]
                    written = not s.isnan().any().item() and bool((b >= 0).all())
                    err = (s[allowed] - ref_s[allowed]).abs()
                    ok = written and bool((err <= tol + tol * ref_s[allowed].abs()).all())
                    ok &= torch.equal(torch.isneginf(s), ~allowed)
                    # argmax: exact in fp32; bf16 may flip near-ties within the tolerance
                    picked = ref_s.gather(1, b.clamp(min=0)[:, None])[:, 0]
                    mism = int((b != ref_b).sum())
                    ok &= mism == 0 if dtype == torch.float32 else bool(
                        (picked >= ref_s.max(1).values - 2 * tol).all())
                    print(f"  {str(dtype)[6:]:8s} H={H:5d} N={N:3d} R={R:5d} logprobs={logprobs!s:5s} "
                          f"max_err={err.max().item():.2e} argmax_diff={mism} {'ok' if ok else 'FAIL'}")
                    results.append(dict(kind="check", kernel="label_head", dtype=str(dtype), H=H, N=N,
                                        R=R, logprobs=logprobs, max_err=err.max().item(),
                                        argmax_mismatch=mism, ok=ok))


# ---------------------------------------------------------------- timing

def attn_sweep_configs(D, P):
    for bm in (16, 32, 64, 128):
        for nw in (4, 8):
            for bn in (64, 128) if P >= 128 and D <= 128 else (64 if D <= 128 else 32,):
                for bni in (32, 64):
                    if bm * D <= 16384:
                        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_NI=bni, num_warps=nw)


def bench_attention(results, sweep):
    print("\n== attention timing (bf16, plain plans of 8-token requests) ==")
    print(f"  {'model':13s} {'P':>4s} {'T':>6s} {'config':>22s} {'eager':>9s} {'graph':>9s} "
          f"{'ref':>9s} {'GB/s':>7s} {'floor':>7s}")
    shapes = [(m, 48, T) for m in MODELS for T in (8, 64, 512, 4096, 32768)]
    shapes += [(m, 600, 8) for m in MODELS]
    for model, P, T in shapes:
        Hq, Hkv, D = MODELS[model]
        args, offs = attn_inputs(Hq, Hkv, D, P, [8] * (T // 8), torch.bfloat16, seed=T + P)
        out = torch.empty_like(args[0])
        cfg = attn_config(T, Hq // Hkv, Hkv, D, torch.bfloat16, args[0].device)
        t_eager = eager_us(lambda: attention_triton(*args, out=out))
        t_graph = graph_us(lambda: attention_triton(*args, out=out))
        t_ref = eager_us(lambda: attention_ref(*args, seg_offsets=offs))
        # bytes moved at least once: q, k, v, out, prefix K/V
        nbytes = 2 * (2 * T * Hq * D + 2 * T * Hkv * D + 2 * P * Hkv * D)
        gbs = nbytes / (t_graph * 1e-6) / 1e9 if t_graph else None
        floor = nbytes / HBM_BYTES_PER_S * 1e6
        cfg_s = f"M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} NI{cfg['BLOCK_NI']} w{cfg['num_warps']}"
        print(f"  {model:13s} {P:4d} {T:6d} {cfg_s:>22s} {fmt(t_eager)} {fmt(t_graph)} {fmt(t_ref)} "
              f"{fmt(gbs, 7)} {fmt(floor, 7)}")
        rec = dict(kind="time", kernel="attention", model=model, P=P, T=T, config=cfg,
                   eager_us=t_eager, graph_us=t_graph, ref_us=t_ref, bytes=nbytes, floor_us=floor)
        if sweep:
            rec["sweep"] = sweep_attention(args, out, D, P)
        results.append(rec)
    bench_attention_multi_item(results, sweep)


def bench_attention_o(results, sweep):
    """Attention fused with O + residual (attention_o_triton) vs the two kernels it replaces."""
    from prefixscore.kernels.attention_o_triton import attention_o_residual_small, attn_o_config
    from prefixscore.kernels.gemm_triton import linear_residual_small

    print("\n== attention + O projection + residual, fused vs two kernels (bf16, graph us) ==")
    hidden = {"qwen2.5-0.5b": 896, "qwen2.5-7b": 3584}
    for model, P, T in [(m, P, T) for m in MODELS for P, T in ((48, 8), (73, 16), (48, 64))]:
        Hq, Hkv, D = MODELS[model]
        N = hidden[model]
        args, _ = attn_inputs(Hq, Hkv, D, P, [T], torch.bfloat16, seed=T + P)
        gen = torch.Generator().manual_seed(1)
        wo = (torch.randn(N, Hq * D, generator=gen) / (Hq * D) ** 0.5).to(DEV, torch.bfloat16)
        r = torch.randn(T, N, generator=gen).to(DEV, torch.bfloat16)
        o = torch.empty_like(args[0])

        def two():
            attention_triton(*args, out=o)
            return linear_residual_small(o.view(T, -1), wo, None, r)

        fused, ref = attention_o_residual_small(*args, wo, r)[0], two()[0]
        err = (fused.float() - ref.float()).abs().max().item()
        cfg = attn_o_config(T, Hq, N, D, torch.bfloat16, wo.device)
        t_fused = graph_us(lambda: attention_o_residual_small(*args, wo, r))
        t_two = graph_us(two)
        print(f"  {model:13s} P{P:4d} T{T:3d}  fused {fmt(t_fused)}  two kernels {fmt(t_two)}  "
              f"max|diff| {err:.3g}  {cfg}")
        rec = dict(kind="time", kernel="attention_o", model=model, P=P, T=T, config=cfg,
                   fused_graph_us=t_fused, two_kernels_graph_us=t_two, max_abs_diff=err)
        if sweep and T <= 16:
            timed = []
            for bn in (32, 64, 128):
                for hpp in (h for h in (1, 2, 7) if Hq % h == 0):
                    c = dict(BLOCK_N=bn, HPP=hpp)
                    t = graph_us(lambda: attention_o_residual_small(*args, wo, r, config=c),
                                 launches=20, reps=10)
                    if t is not None:
                        timed.append((t, c))
            timed.sort(key=lambda x: x[0])
            for t, c in timed[:3]:
                print(f"      sweep {t:8.1f} us  {c}")
            rec["sweep"] = [dict(us=t, config=c) for t, c in timed]
        results.append(rec)


def sweep_attention(args, out, D, P):
    """Time each candidate launch config in a CUDA graph; print the best three; fastest first."""
    timed = []
    for c in attn_sweep_configs(D, P):
        t = graph_us(lambda: attention_triton(*args, out=out, config=c), launches=20, reps=10)
        if t is not None:
            timed.append((t, c))
    timed.sort(key=lambda x: x[0])
    for t, c in timed[:3]:
        print(f"      sweep {t:8.1f} us  {c}")
    return [dict(us=t, config=c) for t, c in timed]


def bench_attention_multi_item(results, sweep):
    """One multi-item span: 50-token query part + 100 items x 150 tokens (T = 15050), 0.5B heads.
    Useful key pairs per token ~ P + 50 + 75; no reference timing (its [T, T] scores need tens of
    GB). `pairs` = in-batch (query, key) pairs the visibility actually allows, for a GB/s-free view
    of the cost: a kernel that scanned [span start, t] per block would touch ~T^2 / 2 instead."""
    print("\n== attention timing (bf16, multi-item: 1 span, 50-token query + 100 items x 150) ==")
    print(f"  {'model':13s} {'P':>4s} {'T':>6s} {'config':>22s} {'eager':>9s} {'graph':>9s} "
          f"{'Mpairs':>8s}")
    model = "qwen2.5-0.5b"
    Hq, Hkv, D = MODELS[model]
    multi = (50, [150] * 100)
    for P in (0, 48):
        args, _ = attn_inputs(Hq, Hkv, D, P, None, torch.bfloat16, seed=7 + P, multi=multi)
        T = args[0].shape[0]
        out = torch.empty_like(args[0])
        cfg = attn_config(T, Hq // Hkv, Hkv, D, torch.bfloat16, args[0].device)
        t_eager = eager_us(lambda: attention_triton(*args, out=out))
        t_graph = graph_us(lambda: attention_triton(*args, out=out))
        qlen, items = multi
        pairs = qlen * (qlen + 1) // 2 + sum(L * qlen + L * (L + 1) // 2 for L in items)
        cfg_s = f"M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} NI{cfg['BLOCK_NI']} w{cfg['num_warps']}"
        print(f"  {model:13s} {P:4d} {T:6d} {cfg_s:>22s} {fmt(t_eager)} {fmt(t_graph)} "
              f"{pairs / 1e6:8.2f}")
        rec = dict(kind="time", kernel="attention", plan="multi_item", model=model, P=P, T=T,
                   query_len=qlen, n_items=len(items), item_len=items[0], config=cfg,
                   eager_us=t_eager, graph_us=t_graph, visible_pairs=pairs)
        if sweep:
            rec["sweep"] = sweep_attention(args, out, D, P)
        results.append(rec)


def head_sweep_configs(N):
    bn = max(16, triton.next_power_of_2(N))
    for br in (16, 32, 64):
        for bk in (64, 128, 256, 512):
            for nw in (4, 8):
                if br * bn <= 16384 and bk * bn <= 32768:
                    yield dict(BLOCK_R=br, BLOCK_K=bk, num_warps=nw)


def bench_label_head(results, sweep):
    print("\n== label head timing (bf16, logprobs) ==")
    print(f"  {'H':>5s} {'N':>3s} {'R':>5s} {'config':>18s} {'eager':>9s} {'graph':>9s} {'ref':>9s} "
          f"{'ref_graph':>9s} {'floor':>7s}")
    for H in (896, 3584):
        for N in (9, 64):
            for R in (1, 64, 4096):
                args = head_inputs(8 * R, H, N, R, torch.bfloat16, seed=H + N + R)
                s = torch.empty((R, N), device=DEV)
                b = torch.empty((R,), dtype=torch.int64, device=DEV)
                cfg = head_config(R, N, H, args[0].device)

                def run(c=None, args=args, s=s, b=b):
                    return label_head_triton(*args, True, out_scores=s, out_best=b, config=c)

                def ref(args=args):
                    return label_head_ref(*args, True)

                t_eager, t_graph = eager_us(run), graph_us(run)
                t_ref, t_ref_graph = eager_us(ref), graph_us(ref)
                nbytes = 2 * (R * H + N * H + H) + R * N * 5 + R * 16
                floor = nbytes / HBM_BYTES_PER_S * 1e6
                cfg_s = f"R{cfg['BLOCK_R']} N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']}"
                print(f"  {H:5d} {N:3d} {R:5d} {cfg_s:>18s} {fmt(t_eager)} {fmt(t_graph)} {fmt(t_ref)} "
                      f"{fmt(t_ref_graph)} {fmt(floor, 7)}")
                rec = dict(kind="time", kernel="label_head", H=H, N=N, R=R, config=cfg, eager_us=t_eager,
                           graph_us=t_graph, ref_us=t_ref, ref_graph_us=t_ref_graph, bytes=nbytes,
                           floor_us=floor)
                if sweep:
                    timed = []
                    for c in head_sweep_configs(N):
                        t = graph_us(lambda: run(c), launches=20, reps=10)
                        if t is not None:
                            timed.append((t, c))
                    timed.sort(key=lambda x: x[0])
                    rec["sweep"] = [dict(us=t, config=c) for t, c in timed]
                    for t, c in timed[:3]:
                        print(f"      sweep {t:8.1f} us  {c}")
                results.append(rec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs per shape")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--only", choices=["attention", "attn_o", "label_head"], default=None)
    a = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    results = []
    if not a.skip_check and a.only is None:
        check_attention(results)
        check_label_head(results)
    if a.only in (None, "attention"):
        bench_attention(results, a.sweep)
    if a.only in (None, "attn_o"):
        bench_attention_o(results, a.sweep)
    if a.only in (None, "label_head"):
        bench_label_head(results, a.sweep)
    bad = [r for r in results if r["kind"] == "check" and not (r["ok"] and r.get("graph_ok", True))]
    print(f"\ncorrectness: {'all ok' if not bad else f'{len(bad)} FAILED'}")
    path = os.path.join(os.environ.get("OUT", "."), "kernels.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, results=results), f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
