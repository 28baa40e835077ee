"""Offline training (DESIGN.md §8): LoRA adapters fine-tuned through peft, written as a small
safetensors file that prefixscore.weights.loading reads, checks and merges into the weights at load.

    python -m prefixscore.train finetune data.csv -o seed.adapter.safetensors
"""
__all__ = ["finetune", "save_adapter"]


def __getattr__(name):
    # imported on first use (PEP 562): the command line reads train/options.py, a leaf, to build
    # its parsers without the training code and torch
    if name == "finetune":
        from .lora import finetune

        return finetune
    if name == "save_adapter":
        from .write_adapter import save_adapter

        return save_adapter
    raise AttributeError(f"module 'prefixscore.train' has no attribute {name!r}")
