"""dpvr: differentially private optimisation with gradient-difference (SPIDER-style) estimators.

The public API is re-exported here; see the subpackages for the layers (ops, privacy, grads, optim, ...).
"""

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

__version__ = "0.1.0"

__all__ = [
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
