"""The kernels' switches as one frozen value (issue 30): KernelOptions.

An Engine fixes its options once (Engine(loaded, options); None: KernelOptions.from_env()), carries
them in the model's Context to every layer, and each kernel entry point takes them as an argument.
Nothing reads a switch from a module at call time and nothing flips one: two engines of a process
may run different kernels (bench/ builds one engine per A/B arm), and a CUDA graph replays the
kernels of the options its engine captured it with. The environment gives defaults only.

A leaf module (no kernel imports), so every kernel module can import it without a cycle.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Roles of the launch-config overrides (tune): the skinny GEMM's qkv, gu (gate/up), down (the
# residual GEMM), linear (plain), attn_o (attention + O), attn (attention alone, past the fused
# kernel).
TUNE_ROLES = ("qkv", "gu", "down", "attn_o", "linear", "attn")


@dataclass(frozen=True)
class KernelOptions:
    use_triton: bool = True  # False: torch references on CUDA too (the plain-graph baseline in bench/)
    fuse_norms: bool = True  # False: RMSNorm as its own kernel, not in the next GEMM's epilogue (A/B)
    fuse_attn_o: bool = True  # False: attention and the O GEMM as two kernels at small T (A/B)
    pdl: bool = True  # False: plain launches, no overlap of a kernel with the one before (pdl.py; A/B)
    early_weights: bool = True  # False: no weight loads before the PDL wait (pdl.early(); A/B)
    # Which kernels let the next one launch right after their PDL wait instead of after their main
    # loop (pdl.trigger): 0 none, 1 gate/up, 2 + attention + O, 3 + QKV and down.
    trigger_at_wait: int = 3
    gu_pre_kb: int = 64  # gate/up: weight KB per program loaded before the PDL wait (gemm_config.py)
    head_one_tile: bool = True  # False: the label head's two looped passes even for one small program
    in_tile: bool = True  # False: attention + O scans the in-batch key ranges in loops, not one tile
    trigger: bool = True  # False: no kernel lets the next one launch before it ends (pdl.py; A/B)
    # Batch-invariant scores (issue 23): every GEMM sums each row's K splits of its invariant_rows
    # config in one order whatever the batch (past invariant_rows rows in wide tiles that run
    # their splits in turn: gemm_config.wide_config), the sums of squares go in fixed chunks,
    # attention and the label head run one config over row tiles, and attention reduces each
    # row's in-batch keys from its own request's start, so a query's scores are bitwise the same
    # alone and inside any batch (on CUDA; the CPU path is torch's). Off: configs follow T (faster
    # at large T). Default: PREFIXSCORE_BATCH_INVARIANT (from_env).
    batch_invariant: bool = False
    invariant_rows: int = 16  # (every T <= 16 already shares one config per kernel: the latency path)
    # bench/ A/B only: launch-config overrides by role (TUNE_ROLES), (("gu.num_stages", 4), ...);
    # a dict is accepted and kept as sorted pairs; 0 leaves the config's own value.
    tune: tuple = ()
    # The engine's small buckets copy their input in and their output out inside the CUDA graph
    # (engine.GRAPH_COPY_MAX_BYTES); False: every bucket copies around the replay (bench/ A/B).
    graph_copies: bool = True
    # An eager pass runs its last layer for the read-out rows only (Engine.prune; False: for every
    # row, the A/B baseline in bench.multi_item --ab).
    prune_last_layer: bool = True
    # e4m3 weights multiplied in fp16 at T <= 64 (QKV and gate/up, x scaled by its rstd first; down,
    # x scaled by a power of two that a bound on gate/up's weights gives): one conversion per two
    # weights instead of three (gemm_triton.py, F16). Off until bench.fp8_gpu measures it against
    # today's bf16 dot (fidelity and W1/W4, same run).
    fp8_fp16: bool = False

    def __post_init__(self):
        tune = tuple(sorted(dict(self.tune).items()))  # (a key given twice: its last value)
        for key, _ in tune:
            role, dot, name = key.partition(".")
            if not (dot and name and role in TUNE_ROLES):
                raise ValueError(f"tune: {key!r} is not role.key with role one of {', '.join(TUNE_ROLES)}")
        object.__setattr__(self, "tune", tune)  # (frozen: hashable, never changed in place)

    @classmethod
    def from_env(cls, environ: Mapping | None = None, **changes) -> "KernelOptions":
        """The defaults with the environment's settings (PREFIXSCORE_BATCH_INVARIANT=1: batch-
        invariant mode), then `changes` (field=value) over them."""
        env = os.environ if environ is None else environ
        kw = {"batch_invariant": env.get("PREFIXSCORE_BATCH_INVARIANT", "") not in ("", "0")}
        return cls(**{**kw, **changes})


# Batch-invariant attention's row tile (attention_triton.invariant_attn_config), which the fused
# attention + O kernel matches up to that many rows (attention.attention_o).
INVARIANT_ATTN_ROWS = 16

DEFAULTS = KernelOptions()  # the documented values, without the environment (tests, bench, AOT)


def use_triton(x, options: KernelOptions) -> bool:
    """Whether the Triton kernels take this tensor's op: on CUDA, unless the options say torch's."""
    return x.is_cuda and options.use_triton
