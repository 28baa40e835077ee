"""prefixscore: which of N labels does this causal LM pick, behind a cached instruction prefix."""
from .classifier import Classifier, Result
from .errors import ConfigError, InputError, ModelLoadError, PrefixScoreError
from .loading import load as load_model
from .scorer import ItemResult, Scorer

__all__ = ["Classifier", "Result", "Scorer", "ItemResult", "load_model", "PrefixScoreError", "ConfigError", "InputError",
           "ModelLoadError"]
__version__ = "0.1.0"
