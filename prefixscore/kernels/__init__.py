"""Kernels with a torch reference and (on CUDA) a Triton implementation behind the same call."""
import os as _os

USE_TRITON = True  # False: torch references on CUDA too (the plain-graph baseline in bench/)
FUSE_NORMS = True  # False: RMSNorm as its own kernel, not in the next GEMM's epilogue (bench/ A/B)
FUSE_ATTN_O = True  # False: attention and the O GEMM as two kernels at small T (bench/ A/B)
PDL = True  # False: plain launches, no overlap of a kernel with the one before (kernels/pdl.py; A/B)
EARLY_WEIGHTS = True  # False: no weight loads before the PDL wait (kernels/pdl.py early(); A/B)
# Which kernels let the next one launch right after their PDL wait instead of after their main
# loop (kernels/pdl.py trigger): 0 none, 1 gate/up, 2 + attention + O, 3 + QKV and down.
TRIGGER_AT_WAIT = 3
GU_PRE_KB = 64  # gate/up: weight KB per program loaded before the PDL wait (kernels/gemm_triton.py)
HEAD_ONE_TILE = True  # False: the label head's two looped passes even for one small program (A/B)
IN_TILE = True  # False: attention + O scans the in-batch key ranges in loops, not one tile (A/B)
TRIGGER = True  # False: no kernel lets the next one launch before it ends (kernels/pdl.py; A/B)
# Batch-invariant scores (issue 23): every kernel runs the launch config of INVARIANT_ROWS rows
# whatever the batch, over as many row tiles as it needs, and attention reduces each row's
# in-batch keys from its own request's start, so a query's scores are bitwise the same alone and
# inside any batch (on CUDA; the CPU path is torch's). Off: configs follow T (faster at large T).
BATCH_INVARIANT = _os.environ.get("PREFIXSCORE_BATCH_INVARIANT", "") not in ("", "0")
INVARIANT_ROWS = 16  # (every T <= 16 already shares one config per kernel: today's latency path)
# bench/ A/B only: launch-config overrides by kernel role, {"gu.num_stages": 4, ...}; roles qkv,
# gu (gate/up), down (the residual GEMM), linear (plain), attn_o; 0 leaves the config's own value.
TUNE: dict = {}
from .attention import attention, attention_ref
from .label_head import label_head, label_head_ref

__all__ = ["attention", "attention_ref", "label_head", "label_head_ref"]
