"""Kernels with a torch reference and (on CUDA) a Triton implementation behind the same call."""
# The kernels' switches (Triton or torch, fusions, PDL, batch-invariant mode, launch-config
# overrides) are one frozen KernelOptions per Engine, passed to every entry point (options.py).
from .options import KernelOptions
from .attention import attention, attention_ref
from .label_head import label_head, label_head_ref

__all__ = ["KernelOptions", "attention", "attention_ref", "label_head", "label_head_ref"]
