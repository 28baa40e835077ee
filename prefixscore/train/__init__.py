"""Offline training (DESIGN.md §8): LoRA adapters fine-tuned through peft, written as a small
safetensors file that prefixscore.weights.loading reads, checks and merges into the weights at load.

    python -m prefixscore.train finetune data.csv -o seed.adapter.safetensors
"""
from .write_adapter import save_adapter
from .lora import finetune

__all__ = ["finetune", "save_adapter"]
