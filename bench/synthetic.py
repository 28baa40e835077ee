"""What the GPU workloads share (bench.gpu, bench.timeline, bench.fp8_gpu, bench.invariance_gpu):
the synthetic form's model (random weights of the Qwen2.5-0.5B / -7B shapes) and engine, driven by
token ids, and the timing helpers. Kernel switches are an engine's KernelOptions, fixed when it is
made: an A/B arm is another engine over the same weights (Synthetic.arm), never a flipped global.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from prefixscore.batch import plan_classify
from prefixscore.engine import Engine
from prefixscore.kernels.options import KernelOptions
from prefixscore.labels import LabelTrie
from prefixscore.weights.loading import from_tensors
from prefixscore.weights.model_config import ModelConfig

SHAPES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
PREFIX, SUFFIX, LABELS = 48, 8, list(range(1000, 1009))
OUT = Path(os.environ.get("OUT") or "bench/results")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def stats(ms):
    return {"p50_ms": statistics.median(ms), "p99_ms": pct(ms, 99), "n": len(ms)}


def gpu_times(fn, iters=300, warmup=20, warm_s=0.3):
    """Per-iteration GPU time (ms) of fn() with CUDA events, after warmup calls and at least
    warm_s seconds of calls (added to rule out a GPU clock that drops while idle; it changed no
    W1 reading: 0.5975 ms before, 0.5987 after, bench/results/timeline*.json)."""
    t0 = time.perf_counter()
    n = 0
    while n < warmup or time.perf_counter() - t0 < warm_s:
        fn()
        n += 1
        if n % 50 == 0:
            torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def wall_times(fn, iters=300, warmup=20):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t))
    return out


def hf_model(shape, vocab=None, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SHAPES[shape])
    if vocab:
        kw["vocab_size"] = vocab
    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=4096, rms_norm_eps=1e-6, **kw)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # init on the GPU; std 0.02 like HF, norms around 1
        for n, p in m.named_parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else (p.uniform_(0.8, 1.2) if "norm" in n else p.normal_(0, 0.02))
    return m


class Synthetic:
    """Our engine on an in-memory HF model's weights, driven by token ids. options: the engine's
    KernelOptions (None: the environment's defaults); an A/B arm is another engine over the same
    weights (arm)."""

    def __init__(self, hf, max_tokens=32768, fp8=False, options: KernelOptions | None = None):
        cfg = ModelConfig.from_hf(hf.config)
        self.loaded = from_tensors(cfg, hf.state_dict(), None, "random", torch.device("cuda"), torch.bfloat16)
        if fp8:  # e4m3 linear weights, per-row scales (kernels/fp8.py), as dtype="fp8" loads them
            self.loaded.model.quantize_fp8()
        self.engine = Engine(self.loaded, options)
        self.trie = LabelTrie([str(t) for t in LABELS], [[t] for t in LABELS], None)
        self.prefix_ids = prefix_ids()
        self._pin(max_tokens)
        p = sum(x.numel() for n, x in hf.named_parameters() if "embed" not in n and "lm_head" not in n)
        self.nonemb_params = p

    def classify_ids(self, suffixes):
        plan = plan_classify(suffixes, [PREFIX] * len(suffixes), self.trie)
        scores, best = self.engine.run(plan, self.prefix, self.weight, True)
        return self.trie.assemble(scores, best, len(suffixes))

    def replay_fn(self, suffixes):
        """Load the plan into the static buffers once; return a function that only replays."""
        self.classify_ids(suffixes)
        T = sum(map(len, suffixes))  # (single-token labels: no branch tokens in the plan)
        if T > self.runner.max_tokens:  # eager beyond the graphs: time the whole engine call
            return lambda: self.classify_ids(suffixes)
        g = self.runner.graphs[next(b for b in self.runner.buckets if b >= T)]
        return g.replay

    def arm(self, **switches) -> Engine:
        """An engine over the same weights whose KernelOptions are this one's with `switches`
        changed: a field (either case: PDL or pdl) = value, or role.key = value, a launch-config
        override (KernelOptions.tune; 0: the config's own value)."""
        tune, changes = dict(self.engine.options.tune), {}
        for name, value in switches.items():
            if "." in name:
                tune[name] = value
            else:
                changes[name.lower()] = value
        return Engine(self.loaded, dataclasses.replace(self.engine.options, tune=tune, **changes))

    def variant(self, max_tokens=32768, **switches) -> "Synthetic":
        """This model under an arm's engine (the same weights, arm's switches), with its own pinned
        prefix (prefilled by that engine) and graphs: a peer for fidelity and timing alike."""
        v = copy.copy(self)
        v.engine = self.arm(**switches)
        v._pin(max_tokens)
        return v

    def _pin(self, max_tokens):
        """The engine's pinned prefix, label rows and graphs up to max_tokens."""
        self.prefix = self.engine.prefill(self.prefix_ids)
        self.weight = self.engine.label_weight(self.trie.columns)
        self.capture = self.engine.capture(self.prefix, self.weight, True, max_tokens)
        self.runner = self.engine.graphs[(id(self.prefix), id(self.weight), True)]


def prefix_ids() -> list:
    """The synthetic form's pinned prefix (the same in every run)."""
    return torch.randint(100, 30000, (PREFIX,), generator=torch.Generator().manual_seed(1)).tolist()


def random_suffixes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (n, SUFFIX), generator=g).tolist()


@torch.no_grad()
def hf_reference(hf, prefix_ids, suffixes, batch=100):
    out = []
    for i in range(0, len(suffixes), batch):
        ids = torch.tensor([prefix_ids + s for s in suffixes[i:i + batch]], device="cuda")
        lg = hf(input_ids=ids, logits_to_keep=1).logits[:, -1, LABELS].float()
        out.append(torch.log_softmax(lg, -1).cpu())
    return torch.cat(out)
