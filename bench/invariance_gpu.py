"""Which kernels make a query's scores depend on its batch (issue 23 item 5), op by op on the GPU.

Each op's output for 16 probe rows, computed alone (T = 16) and inside larger inputs (the probe
rows at an offset among random rows): T = 32 and 64 on the skinny kernels, 128 .. 4096 on the
large-T path (cuBLAS, or FP8 x FP8). Reported per case: output elements whose bits differ, and the
largest difference. Pinned variants run the alone case with the launch config of the larger T
(BLOCK_T, BLOCK_N, SPLIT), or only its SPLIT and BLOCK_N, to separate what matters: the K split
(summation order), the column tile, or the MMA instruction the row tile selects. Shapes: Qwen2.5-
0.5B's QKV (1152 x 896), down (896 x 4864) and gate/up (9728 x 896), bf16 and e4m3 weights. Then
attention (and attention + O) of one request alone and among others.

Then the whole forward with batch-invariant mode off and on (KernelOptions.batch_invariant, an
engine each), the 0.5B shape, same weights: 500 queries alone vs inside batches of 64 / 1,024 /
4,096 (differing score rows; target 0), W1's GPU time and the batch sweep's requests/s (W2 = 4,096; target: on costs <=
10% of off's W2 rate, else it stays a switch).

    device run:  python -m bench.invariance_gpu [--e2e-only]   (writes $OUT/invariance_gpu.json)
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from bench.synthetic import OUT
from prefixscore.kernels import fp8 as F8
from prefixscore.kernels.gemm_config import _finish_config, gemm_config
from prefixscore.kernels.gemm_triton import linear_small
from prefixscore.kernels.options import DEFAULTS, KernelOptions

# The op cases run the default kernels (batch-invariant mode off: what varies with the batch).

PROBE = 16
SHAPES = {"qkv": (1152, 896), "down": (896, 4864), "gate_up": (9728, 896)}


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()
    return {"differing": int((a.view(torch.int16) != b.view(torch.int16)).sum()),
            "max_abs": float(d.max())}


def config_of(T, N, K, w_elem):
    cfg = gemm_config(T, N, K, 0, torch.bfloat16, torch.device("cuda"))
    return _finish_config(cfg, K, torch.bfloat16, 0, N * K * w_elem, w_elem)


def skinny_cases(w, probe, N, K, w_elem) -> dict:
    out = {}
    alone = linear_small(probe, w)
    for T in (32, 64):
        big = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        at = T // 2 - 3  # an offset inside the row tile, not aligned to 16
        big[at:at + PROBE] = probe
        got = linear_small(big, w)[at:at + PROBE]
        cfg = config_of(T, N, K, w_elem)
        pinned = linear_small(probe, w, config=cfg)
        part = {k: cfg[k] for k in ("SPLIT", "BLOCK_N", "BLOCK_K")}
        split_only = linear_small(probe, w, config=part)
        out[T] = {"default": diff(got, alone), "config": {k: cfg[k] for k in ("BLOCK_T", "BLOCK_N",
                                                                                "BLOCK_K", "SPLIT")},
                  "alone_config_of_T": diff(got, pinned), "alone_split_and_tile_of_T": diff(got, split_only)}
    return out


def large_cases(w, probe, K) -> dict:
    """The large-T path (F.linear / FP8 x FP8) against itself at T = 16 and against the skinny
    kernel alone."""
    lin = (lambda x: F8.linear(x, w, options=DEFAULTS)) if F8.is_fp8(w) else (lambda x: F.linear(x, w))
    alone_large = lin(probe)
    alone_skinny = linear_small(probe, w)
    out = {"large_alone_vs_skinny_alone": diff(alone_large, alone_skinny)}
    for T in (128, 1024, 4096):
        big = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        at = T // 3
        big[at:at + PROBE] = probe
        got = lin(big)[at:at + PROBE]
        out[T] = diff(got, alone_large)
    return out


def attention_cases() -> dict:
    """Attention (and attention fused with O, T <= 64) of one 16-token request over a 73-token
    pinned prefix, alone and inside batches of other requests (the probe's rows compared): the
    in-batch keys are tiled from each row block's range, which its neighbours move."""
    from prefixscore.batch import plan_classify
    from prefixscore.kernels.attention import attention_o
    from prefixscore.kernels.attention_triton import attention_triton
    from prefixscore.labels import LabelTrie

    trie = LabelTrie(["a", "b"], [[5], [6]], None)
    P, Hq, Hkv, D, N = 73, 14, 2, 64, 896
    g = torch.Generator().manual_seed(3)
    pk, pv = (torch.randn(P, Hkv, D, generator=g).cuda().to(torch.bfloat16) for _ in range(2))
    wo = (torch.randn(N, Hq * D, generator=g) / (Hq * D) ** 0.5).cuda().to(torch.bfloat16)
    probe = [list(range(100, 116))]
    qkv_probe = torch.randn(16, (Hq + 2 * Hkv) * D, generator=g).cuda().to(torch.bfloat16)

    def run(suffixes, at):
        plan = plan_classify(suffixes, [P] * len(suffixes), trie).to("cuda")
        T = plan.num_tokens
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
        qkv[at:at + 16] = qkv_probe
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        r = torch.zeros(T, N, device="cuda", dtype=torch.bfloat16)
        a = attention_triton(q, k, v, pk, pv, plan.base_start, plan.base_end, plan.own_start, D ** -0.5)
        o = attention_o(q, k, v, pk, pv, plan.base_start, plan.base_end, plan.own_start, D ** -0.5, wo,
                        r, options=DEFAULTS)[0] if T <= 64 else None
        return a[at:at + 16], (None if o is None else o[at:at + 16])

    alone_a, alone_o = run(probe, 0)
    out = {}
    for n_before, n_after, lengths in ((1, 1, 7), (2, 0, 11), (3, 5, 9), (40, 40, 15), (200, 55, 16)):
        sfx = [list(range(200, 200 + lengths))] * n_before + probe + [list(range(300, 300 + lengths))] * n_after
        a, o = run(sfx, n_before * lengths)
        out[f"{n_before}+probe+{n_after} x {lengths} tokens"] = {
            "attention": diff(a, alone_a), "attention_o": None if o is None else diff(o, alone_o)}
    return out


def end_to_end() -> dict:
    """Batch-invariant mode off and on over the same 0.5B weights (bench.fp8_gpu's measures): an
    engine per mode, its options fixed at its making."""
    from bench.fp8_gpu import invariance, sweep
    from bench.synthetic import Synthetic, gpu_times, hf_model, random_suffixes, stats

    hf, out = hf_model("0.5B"), {}
    one = random_suffixes(1, seed=9)
    for name, mode in (("off", False), ("on", True)):
        opts = KernelOptions(batch_invariant=mode)
        ours = Synthetic(hf, max_tokens=8192, options=opts)
        r = out[name] = {"w1_gpu": stats(gpu_times(ours.replay_fn(one)))}
        r["sweep"] = sweep(ours, [1, 16, 64, 256, 1024, 4096])
        r["invariance"] = invariance(ours)
        print("batch-invariant", name, json.dumps(r), flush=True)
        del ours
        torch.cuda.empty_cache()
    print(f"\n{'mode':<5} {'W1 gpu p50':>10} {'W2 req/s':>9} {'W2 cost':>8} {'differing 64/1024/4096':>24}")
    off = out["off"]["sweep"][4096]["req_per_s"]
    for m in ("off", "on"):
        r = out[m]
        r["w2_cost"] = 1 - r["sweep"][4096]["req_per_s"] / off
        d = "/".join(str(r["invariance"][b]["queries_differing"]) for b in (64, 1024, 4096))
        print(f"{m:<5} {r['w1_gpu']['p50_ms']:>10.3f} {r['sweep'][4096]['req_per_s']:>9.0f} "
              f"{r['w2_cost']:>8.1%} {d:>24}")
    print("targets: 0 differing queries; W2 cost <= 10% to be on by default")
    return out


def main():
    import sys

    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    OUT.mkdir(parents=True, exist_ok=True)
    res["end_to_end"] = end_to_end()
    (OUT / "invariance_gpu.json").write_text(json.dumps(res, indent=1))
    if "--e2e-only" in sys.argv:
        return
    for wname, quant in (("bf16", False), ("fp8", True)):
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            w = F8.Fp8Weight.quantize(w) if quant else w
            probe = torch.randn(PROBE, K, device="cuda", dtype=torch.bfloat16)
            r = res[f"{wname} {name}"] = {"skinny": skinny_cases(w, probe, N, K, 1 if quant else 2),
                                          "large": large_cases(w, probe, K)}
            print(wname, name, json.dumps(r), flush=True)
    res["attention"] = attention_cases()
    print("attention", json.dumps(res["attention"]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "invariance_gpu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
