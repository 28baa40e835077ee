"""The persistent block kernel (issue 35) against the four kernels it is made of, on the GPU.

    python -m bench.layer [--tokens 1,8,16] [--quick] [--sweep] [--tune JSON]
                                                   (CUDA; writes $OUT/layer.json or bench/results)

Qwen2.5-0.5B's block (random bf16 weights, a 40-token pinned prefix), T tokens: the four skinny
kernels (kernels/gemm_triton.py, kernels/attention_o_triton.py) against kernels/layer_triton.py
in launch variants: one launch of the four phases (three grid barriers), two launches of two,
four launches of one (no barrier: what the phases' own code costs), at 1 or 2 programs per SM and
4 or 8 warps (KernelOptions.tune layer.per_sm / layer.num_warps). Each variant: bitwise against
the four kernels, then 24 blocks in one CUDA graph, µs per block (median of 50 replays, bench.kernels).
--tune: one launch under KernelOptions.tune overrides (roles qkv, attn_o, gu, down, layer;
layer.uncap 1 keeps each phase's own kernel's config, more units than programs). Then each phase
alone, PDL off: its kernel against the persistent phase in a launch of its own. Then the default
launch's phases (%globaltimer in every program): each phase's share of the critical path and how
far apart programs finish it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from bench.kernels import graph_us
from prefixscore.kernels.options import KernelOptions
from prefixscore.kernels.triton_util import barrier_stalled

HID, INTER, HQ, HKV, D, P, EPS = 896, 4864, 14, 2, 64, 40, 1e-6
LAUNCHES = {1: ((0, 3),), 2: ((0, 1), (2, 3)), 4: ((0, 0), (1, 1), (2, 2), (3, 3))}
PHASES = ("QKV", "attention + O", "gate/up", "down")
# --sweep: the one-launch variants worth timing (each a KernelOptions.tune). Why each: the sm_90
# build of the default launch preloads 2 of down's 5 K-steps before its barrier (its own kernel: all
# 4 of 4, at 10 splits); rotated dealing lets the programs idle in one phase load the next one's
# weights during it (as PDL's co-resident kernels do), which pays where adjacent phases' units fit
# the grid together (QKV 126 + attention 98 at 128 columns + gate/up 152 ... down 112 at 4 splits);
# the trigger lets the next block's programs start loading as this one's down phase runs.
SWEEP = (
    {"down.PRE": 4},
    {"down.BLOCK_K": 64, "down.PRE": 8},
    {"layer.rotate": 1},
    {"layer.rotate": 1, "attn_o.BLOCK_N": 128, "down.SPLIT": 4, "down.PRE": 8},
    {"layer.trigger": 1},
    {"layer.trigger": 1, "layer.rotate": 1, "attn_o.BLOCK_N": 128, "down.SPLIT": 4, "down.PRE": 8},
    {"attn_o.BLOCK_N": 128},
    {"layer.uncap": 1},
    {"layer.coop": 1},
)


def block(T, seed):
    """Random inputs and weights of one block, T tokens of one request after the prefix."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, scale=0.5):
        return (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x = r(T, HID)
    pos = torch.arange(P, P + T, device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    emb = torch.cat([pos.float()[:, None] * inv[None]] * 2, -1)
    z = torch.zeros(T, dtype=torch.int32, device="cuda")
    return dict(x=x, ssq=x.float().square().sum(-1)[None].contiguous(),
                wqkv=r((HQ + 2 * HKV) * D, HID, scale=0.025), bqkv=r((HQ + 2 * HKV) * D),
                cos=emb.cos().bfloat16(), sin=emb.sin().bfloat16(), pk=r(P, HKV, D), pv=r(P, HKV, D),
                z=z, wo=r(HID, HQ * D, scale=0.025), wgu=r(2 * INTER, HID, scale=0.025),
                wd=r(HID, INTER, scale=0.01))


def four_phases(b, options=KernelOptions()):
    """The four kernels as four calls, each reading what the ones before left in `st`."""
    from prefixscore.kernels.attention_o_triton import attention_o_residual_small
    from prefixscore.kernels.gemm_triton import gate_up_silu_small, linear_residual_small, qkv_rope_small

    st = {}

    def qkv():
        st["qkv"] = qkv_rope_small(b["x"], b["wqkv"], b["bqkv"], b["cos"], b["sin"], HQ, HKV, D,
                                   norm=(EPS, b["ssq"]), options=options)

    def attn_o():
        st["x1"] = attention_o_residual_small(*st["qkv"], b["pk"], b["pv"], b["z"], b["z"], b["z"],
                                              D ** -0.5, b["wo"], b["x"], options=options)

    def gate_up():
        st["h"] = gate_up_silu_small(st["x1"][0], b["wgu"], None, norm=(EPS, st["x1"][1]), options=options)

    def down():
        st["x2"] = linear_residual_small(st["h"], b["wd"], None, st["x1"][0], options=options)

    return (qkv, attn_o, gate_up, down), st


def four(b):
    calls, st = four_phases(b)
    for c in calls:
        c()
    return st["x2"]


def isolated(b):
    """Each phase alone, 24 launches of it in one graph with PDL off (every launch waits for the
    one before to end): the four kernels' own time against the persistent kernel's phase in a
    launch of its own (same inputs), µs per launch."""
    off = KernelOptions(pdl=False)
    calls, _ = four_phases(b, off)
    for c in calls:
        c()
    _, _, out = persistent(b, LAUNCHES[1], off)
    rows = {}
    for p, (name, c) in enumerate(zip(PHASES, calls)):
        phase = lambda: persistent(b, ((p, p),), off, out=out)  # noqa: E731
        rows[name] = {"kernel_us": graph_us(c, launches=24, reps=50),
                      "phase_us": graph_us(phase, launches=24, reps=50)}
    return rows


def phase_times(b, options, runs=20):
    """Where one launch of the four phases spends its time (%globaltimer per program, eager): per
    phase, from the last program done with the phase before (the first to start, for phase 0) to
    the last one done with this one -- the grid's critical path through it, barrier included --
    and how far apart the programs finish it (ns; medians over `runs` launches)."""
    times = torch.zeros((2 * torch.cuda.get_device_properties(0).multi_processor_count, 5),
                        dtype=torch.int64, device="cuda")
    crit, spread = [[] for _ in range(4)], [[] for _ in range(4)]
    for _ in range(runs):
        times.zero_()
        persistent(b, LAUNCHES[1], options, times=times)
        t = times[times[:, 0] > 0].cpu().double()
        for p in range(4):
            before = t[:, 0].min() if p == 0 else t[:, p].max()
            crit[p].append((t[:, p + 1].max() - before).item())
            spread[p].append((t[:, p + 1].max() - t[:, p + 1].min()).item())
    return {n: {"critical_us": statistics.median(c) / 1e3, "finish_spread_us": statistics.median(s) / 1e3}
            for n, c, s in zip(PHASES, crit, spread)}


def persistent(b, launches, options, times=None, out=None):
    """The block through layer_small in one launch per (first, last) of `launches` -> x2, its ssq
    and the intermediates; times: the programs' %globaltimer stamps (layer_small's); out: the
    intermediates of a run of the phases before the first launched."""
    from prefixscore.kernels.layer_triton import layer_small

    for ph in launches:
        x2, s2, out = layer_small(b["x"], b["ssq"], b["wqkv"], b["bqkv"], b["cos"], b["sin"], None, None,
                                  EPS, b["pk"], b["pv"], b["z"], b["z"], b["z"], D ** -0.5, b["wo"],
                                  b["wgu"], None, b["wd"], None, EPS, HQ, HKV, D, phases=ph, out=out,
                                  options=options, times=times)
    return x2, s2, out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,16")
    ap.add_argument("--quick", action="store_true",
                    help="the default launch only (2 programs of 4 warps an SM)")
    ap.add_argument("--sweep", action="store_true", help="--tune with each of SWEEP")
    ap.add_argument("--tune", action="append", default=[],
                    help='one launch under KernelOptions.tune overrides, JSON (repeatable): {"down.SPLIT": 10}')
    a = ap.parse_args(argv)
    if a.sweep:
        a.tune += [json.dumps(t) for t in SWEEP]
    res = {"device": torch.cuda.get_device_name(), "shape": "Qwen2.5-0.5B block", "prefix": P, "rows": {}}
    for T in map(int, a.tokens.split(",")):
        b = block(T, seed=T)
        want, _ = four(b)
        rows = {"four kernels": {"us_per_block": graph_us(lambda: four(b), launches=24, reps=50)}}
        print(f"T={T:2d} {'four kernels':32s} {rows['four kernels']['us_per_block']:6.2f} µs", flush=True)
        for per_sm in (2,) if a.quick else (1, 2):
            for warps in (4,) if a.quick else (4, 8):
                for n, launches in LAUNCHES.items():
                    key = f"per_sm={per_sm},warps={warps},launches={n}"
                    opt = KernelOptions(tune={"layer.per_sm": per_sm, "layer.num_warps": warps})
                    try:
                        got, _, _ = persistent(b, launches, opt)
                    except AssertionError as e:  # the grid does not fit at once
                        rows[key] = {"error": str(e)}
                        print(f"T={T:2d} {key:32s} {e}", flush=True)
                        continue
                    diff = (got.float() - want.float()).abs().max().item()
                    us = graph_us(lambda: persistent(b, launches, opt), launches=24, reps=50)
                    rows[key] = {"us_per_block": us, "bitwise": bool(torch.equal(got, want)), "max_diff": diff}
                    print(f"T={T:2d} {key:32s} {us or float('nan'):6.2f} µs  bitwise {rows[key]['bitwise']} "
                          f"(max |diff| {diff:.1e})", flush=True)
        for t in a.tune:
            opt = KernelOptions(tune=json.loads(t))
            try:
                got, _, _ = persistent(b, LAUNCHES[1], opt)
            except Exception as e:  # a config the kernel refuses (grid, registers): note it, go on
                rows[f"tune {t}"] = {"error": repr(e)[:300]}
                print(f"T={T:2d} tune {t} failed: {rows[f'tune {t}']['error']}", flush=True)
                continue
            diff = (got.float() - want.float()).abs().max().item()
            us = graph_us(lambda: persistent(b, LAUNCHES[1], opt), launches=24, reps=50)
            rows[f"tune {t}"] = {"us_per_block": us, "max_diff": diff}
            print(f"T={T:2d} tune {t:27s} {us or float('nan'):6.2f} µs  (max |diff| {diff:.1e}, "
                  f"barrier gave up: {barrier_stalled(torch.device('cuda'))})", flush=True)
        rows["phases alone, no PDL"] = isolated(b)
        for name, v in rows["phases alone, no PDL"].items():
            print(f"T={T:2d} alone {name:14s} kernel {v['kernel_us']:6.2f} µs, persistent phase "
                  f"{v['phase_us']:6.2f} µs", flush=True)
        rows["phases, one launch"] = phase_times(b, KernelOptions())
        for name, v in rows["phases, one launch"].items():
            print(f"T={T:2d} phase {name:14s} critical {v['critical_us']:6.2f} µs, programs finish "
                  f"{v['finish_spread_us']:5.2f} µs apart", flush=True)
        res["rows"][T] = rows
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'layer.json'}")


if __name__ == "__main__":
    main()
