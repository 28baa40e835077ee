"""prefixscore: which of N labels does this causal LM pick, behind a cached instruction prefix."""
from .classifier import Classifier, Result
from .errors import ConfigError, InputError, ModelLoadError, PrefixScoreError
from .weights.loading import load as load_model
from .scorer import ItemResult, Scorer

__all__ = ["Classifier", "Result", "Scorer", "ItemResult", "load_model", "finetune", "PrefixScoreError",
           "ConfigError", "InputError", "ModelLoadError"]
__version__ = "0.1.0"


def __getattr__(name):
    # prefixscore.finetune without importing training code (peft, the loops) into every process
    # that only classifies: the serving path never loads prefixscore.train.
    if name == "finetune":
        from .train import finetune

        return finetune
    raise AttributeError(f"module 'prefixscore' has no attribute {name!r}")
