"""prefixscore: which of N labels does this causal LM pick, behind a cached instruction prefix."""
from .errors import ConfigError, InputError, ModelLoadError, PrefixScoreError

__all__ = ["Classifier", "Result", "Scorer", "ItemResult", "load_model", "finetune", "PrefixScoreError",
           "ConfigError", "InputError", "ModelLoadError"]
__version__ = "0.1.0"

# The public names that need torch are imported on first use (PEP 562), so `import prefixscore`
# and the command line's --help, --version and option errors do not pay torch's ~1 s import;
# finetune also keeps training code (peft, the loops) out of every process that only classifies.
_LAZY = {"Classifier": ".classifier", "Result": ".values", "Scorer": ".scorer", "ItemResult": ".values",
         "load_model": ".weights.loading:load", "finetune": ".train:finetune"}


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'prefixscore' has no attribute {name!r}")
    import importlib

    module, _, attr = where.partition(":")
    value = getattr(importlib.import_module(module, __name__), attr or name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
