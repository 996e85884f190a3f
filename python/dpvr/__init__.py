"""dpvr: differentially private optimisation with gradient-difference (SPIDER-style) estimators.

The public API is re-exported here; see the subpackages for the layers (ops, privacy, grads, optim, ...).
The algorithms and accounting entry points load on first use, so ``import dpvr`` stays light.
"""

import importlib
from importlib import metadata as _metadata

# The built-in algorithms register themselves (dpvr.registry) from their own modules; torch-free.
from . import algorithms  # noqa: F401
from .ops import (
    NoiseGenerator,
    PredictableNoiseError,
    add_noise,
    backends,
    clip_accumulate,
    clip_accumulate_diff,
    noisy_update,
    per_sample_norms,
)
from .privacy import PaperSigmas

__version__ = _metadata.version("dpvr")  # the one version string lives in pyproject.toml

# Public name -> the module that defines it, imported on first access (PEP 562).
_LAZY = {
    **dict.fromkeys(
        (
            "DIFF2", "DPGD", "DPSGD", "DPSGDA", "DoubleSpider", "PhasedOutputPerturbation", "PrivateDiff",
            "RecursiveSpider",
        ),
        "dpvr.algorithms",
    ),
    **dict.fromkeys(("BudgetExhaustedError", "PrivacyConfig", "RuntimeConfig"), "dpvr.optim"),
    **dict.fromkeys(("Accountant", "PrivacyReport", "account", "calibrate"), "dpvr.privacy"),
    "audit": "dpvr.audit",
    **dict.fromkeys(
        ("PrivateTrainer", "TokenLoss", "fix", "make_private", "make_private_trainer", "pad_collate",
         "recordwise", "validate"),
        "dpvr.trainer",
    ),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        # A subpackage (``dpvr.audit``) is the name itself: once imported, it is the attribute anyway.
        value = module if _LAZY[name] == f"{__name__}.{name}" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dpvr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    *_LAZY,
    "NoiseGenerator",
    "PaperSigmas",
    "PredictableNoiseError",
    "__version__",
    "add_noise",
    "backends",
    "clip_accumulate",
    "clip_accumulate_diff",
    "noisy_update",
    "per_sample_norms",
]
