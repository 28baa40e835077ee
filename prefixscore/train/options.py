"""The training commands' options as plain values, a leaf that imports no torch: a trained head's
fitting options (fit_heads.py), an item encoder's (item_fit.py), LoRA's defaults (lora.py), and an
item map's kinds and poolings (item_encoder.py), so the command line builds its parsers, and
answers an option error, without importing what trains."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..values import HEAD_KINDS

POOLINGS = ("prompt", "mean", "last")  # an item encoder's hidden state read (item_encoder.py)
MAP_KINDS = ("linear", "mlp")  # an item encoder's map
# Measured on one fold of intent_dev (SmolLM2-135M, "{query}" no chat): lr 2e-3 peaked at epoch 4
LORA_DEFAULTS = dict(lr=2e-3, epochs=6, patience=2, batch_size=16, dropout=0.0, label_smoothing=0.0,
                     weight_decay=0.0, refit=False)


@dataclass
class HeadFitOptions:
    kind: str = "linear"
    hidden: int = 256  # MLP width
    epochs: int = 200
    patience: int = 20  # epochs without a better validation loss before stopping
    lr: float = 1e-3
    weight_decay: float = 1.0  # AdamW's decoupled decay: strong, there are few rows per feature
    batch_size: int = 32
    val_frac: float = 0.2
    dropout: float = 0.1  # MLP only
    refit: bool = True  # after early stopping, train again on train + validation rows
    seed: int = 0

    def check(self) -> "HeadFitOptions":
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"unknown head kind {self.kind!r}: use {' or '.join(HEAD_KINDS)}")
        if not 0 <= self.val_frac < 1:
            raise ConfigError("val_frac must be in [0, 1)")
        if min(self.epochs, self.batch_size, self.hidden) < 1 or self.patience < 1 or self.lr <= 0:
            raise ConfigError("epochs, patience, batch_size, hidden and lr must be positive")
        return self


@dataclass(frozen=True)
class ItemFitOptions:
    pooling: str = "prompt"
    kind: str = "linear"
    width: int = 512
    rank: int = 0  # the linear part's rank (0: full)
    epochs: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.0
    tau: float = 1.0  # listwise temperature, in units of the teacher's mean within-query std
    listwise: float = 0.0  # weight of the listwise KL
    pointwise: float = 1.0  # weight of the squared error, in units of that std squared
    val_fraction: float = 0.1
    seed: int = 0

    def check(self) -> "ItemFitOptions":
        if min(self.epochs, self.width) < 1 or min(self.lr, self.tau) <= 0 or \
                min(self.pointwise, self.listwise, self.rank) < 0:
            raise ConfigError("epochs, lr, tau and width must be positive; pointwise, listwise, rank >= 0")
        if not 0 <= self.val_fraction < 1 or self.weight_decay < 0:
            raise ConfigError("val_fraction must be in [0, 1) and weight_decay >= 0")
        return self
