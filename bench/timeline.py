"""Where one W1 graph replay's time goes, kernel by kernel (H200, 0.5B shape).

    python -m bench.timeline [--replays 20]

Profiles CUDA graph replays of the W1 forward (bench/synthetic.py's synthetic form, batch 1) with
the torch profiler (CUPTI records the kernels inside a graph) and reports, per kernel kind: count
per replay, median duration, and the median gap from the previous kernel's end to its start
(negative: it started before the previous one ended, as PDL allows). Also the replay's span
against the sum of kernel durations. Writes $OUT/timeline.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from .synthetic import OUT, Synthetic, gpu_times, hf_model, random_suffixes, stats


def kind(name: str) -> str:
    for k in ("_skinny_kernel", "_attn_o_kernel", "_prefix_attn_kernel", "_label_head", "_embed_rope"):
        if k in name:
            return k
    return name[:48]


def timeline(replay, n):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
            torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.start, e.time_range.end) for e in ev]


def summarize(ev, n):
    """Per kernel kind: count per replay, median duration and median gap from the kernel before;
    the replay's span and busy time; and the skinny GEMMs by role (by_position)."""
    per = len(ev) // n
    dur, gap, count = defaultdict(list), defaultdict(list), defaultdict(int)
    spans, busy = [], []
    for r in range(n):
        rep = ev[r * per:(r + 1) * per]
        spans.append(rep[-1][2] - rep[0][1])
        busy.append(sum(e - s for _, s, e in rep))
        for i, (name, s, e) in enumerate(rep):
            k = kind(name)
            dur[k].append(e - s)
            if r == 0:
                count[k] += 1
            if i:
                gap[k].append(s - rep[i - 1][2])
    rows = {k: {"per_replay": count[k], "median_us": statistics.median(dur[k]),
                "total_us": statistics.median(dur[k]) * count[k],
                "median_gap_before_us": statistics.median(gap[k]) if gap[k] else None}
            for k in dur}
    return {"kernels_per_replay": per, "span_us": statistics.median(spans),
            "kernel_busy_us": statistics.median(busy), "kinds": rows,
            "skinny_by_role": by_position(ev, n)}


# The skinny GEMMs after each attention kernel, in a layer's order: attention fused with O (up to
# 64 tokens), or attention alone with O a GEMM of its own
AFTER = {"_attn_o_kernel": ("gate_up", "down"), "_prefix_attn_kernel": ("o", "gate_up", "down")}


def by_position(ev, n):
    """The skinny GEMMs split by their role: qkv launches just before attention, the rest after
    it in a layer's order (AFTER)."""
    per = len(ev) // n
    roles = defaultdict(list)
    for r in range(n):
        rep = ev[r * per:(r + 1) * per]
        after, seen = (), 0
        for i, (name, s, e) in enumerate(rep):
            k = kind(name)
            if k in AFTER:
                after, seen = AFTER[k], 0
            if k != "_skinny_kernel":
                continue
            if i + 1 < per and kind(rep[i + 1][0]) in AFTER:
                role = "qkv"
            else:
                role = after[seen] if seen < len(after) else "other"
                seen += 1
            roles[role].append((e - s, s - rep[i - 1][2] if i else 0.0))
    return {k: {"median_us": statistics.median(d for d, _ in v),
                "median_gap_before_us": statistics.median(g for _, g in v), "n": len(v) // n}
            for k, v in roles.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args(argv)
    hf = hf_model("0.5B")
    ours = Synthetic(hf, max_tokens=16)
    del hf
    replay = ours.replay_fn(random_suffixes(1, seed=9))
    res = {"w1_replay": stats(gpu_times(replay))}
    ev = timeline(replay, a.replays)
    res.update(summarize(ev, a.replays))
    print(json.dumps(res, indent=1), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "timeline.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
