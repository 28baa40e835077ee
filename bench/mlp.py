"""The MLP block at few tokens on the GPU: gate/up and down as one kernel (gemm_triton EPI 3) vs two.

    python -m bench.mlp [--T 8 16 32]

Qwen2.5-0.5B shape (hidden 896, intermediate 4864), bf16: residual + down(silu(gate) * up) of
rms_norm(x). Rows: `two kernels` = gate_up_silu_small then linear_residual_small (the path before
EPI 3); `one kernel` = mlp_small with its heuristic config; then one knob changed at a time; and
`two launches` = EPI 3 with the reduction as its own launch instead of the grid barrier. µs per
call inside a CUDA graph of 50 calls cycling through weight copies (HBM, not L2: bench/gemm.py).
Each row is checked against the torch reference first. Writes $OUT/mlp.json.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from prefixscore.kernels.gemm import gate_up_silu_ref, linear_ref
from prefixscore.kernels.gemm_triton import gate_up_silu_small, linear_residual_small, mlp_small

from .gemm import DEV, DT, HBM, ROTATE_BYTES, check, graph_us

H, I = 896, 4864
VARIANTS = {  # name: (config override, fused)
    "one kernel": ({}, None),
    "no W_down preload": ({"PRELOAD": False}, None),
    "down rows 64": ({"BLOCK_H": 64}, None),
    "down rows 256": ({"BLOCK_H": 256}, None),
    "reduce 4 cols": ({"RED_N": 4}, None),
    "reduce 16 cols": ({"RED_N": 16}, None),
    "reduce 32 partials/step": ({"BLOCK_P": 32}, None),
    "reduce 128 partials/step": ({"BLOCK_P": 128}, None),
    "8 warps": ({"num_warps": 8}, None),
    "2 stages": ({"num_stages": 2}, None),
    "4 stages": ({"num_stages": 4}, None),
    "two launches": ({}, False),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", nargs="*", type=int, default=[8, 16, 32])
    a = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    copies = -(-ROTATE_BYTES // (3 * H * I * 2))
    ws = [((torch.randn(2 * I, H, generator=gen, device=DEV) / H ** 0.5).to(DT),
           (torch.randn(H, I, generator=gen, device=DEV) / I ** 0.5).to(DT)) for _ in range(copies)]
    floor = 3 * H * I * 2 / HBM * 1e6
    rows = []
    print(f"{torch.cuda.get_device_name()}; weight floor {floor:.2f} µs")
    print(f"{'T':>3} {'variant':26s} {'µs':>7s} {'err':>5s}")
    for T in a.T:
        x = torch.randn(T, H, generator=gen, device=DEV).to(DT)
        ssq = x.float().pow(2).sum(1)[None].contiguous()
        eps = 1e-6
        h = (x.float() * torch.rsqrt(ssq[0] / H + eps)[:, None]).to(DT)

        def ref(w):
            return x + linear_ref(gate_up_silu_ref(h, w[0]), w[1])

        def two(w):
            return linear_residual_small(gate_up_silu_small(x, w[0], norm=(eps, ssq)), w[1], None, x)[0]

        calls = {"two kernels": two}
        for name, (cfg, fused) in VARIANTS.items():
            calls[name] = (lambda c, f: lambda w: mlp_small(x, w[0], w[1], x, norm=(eps, ssq),
                                                             config=c, fused=f)[0])(cfg, fused)
        for name, fn in calls.items():
            rec = dict(T=T, variant=name, floor_us=floor)
            try:
                rec["err"] = check(fn(ws[0]), ref(ws[0]))
                rec["graph_us"] = graph_us(fn, ws)
                print(f"{T:3d} {name:26s} {rec['graph_us']:7.2f} {rec['err']:5.2f}", flush=True)
            except Exception as ex:  # noqa: BLE001 (a config out of resources: recorded, not fatal)
                rec["error"] = repr(ex)[:300]
                print(f"{T:3d} {name:26s} ERROR {rec['error']}", flush=True)
            rows.append(rec)
    out = os.path.join(os.environ.get("OUT", "bench/results"), "mlp.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), floor_us=floor, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
