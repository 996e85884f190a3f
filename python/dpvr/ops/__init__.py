"""Typed, zero-copy wrappers over the native kernels (layer ``ops``: imports nothing above it)."""

from .. import _C
from .ghost import NORM_FORMS, IndexTerm, clip_factors, ghost_norms
from .kernels import (
    NONFINITE_POLICIES,
    add_noise,
    check_nonfinite,
    clip_accumulate,
    clip_accumulate_diff,
    noisy_update,
    per_sample_norms,
    philox_words,
)
from .memory import keep_freed_memory
from .noise import NoiseGenerator, NoiseKey, PredictableNoiseError
from .threads import torch_threads

NonFiniteError = _C.NonFiniteError  # a non-finite per-sample value under nonfinite="raise"


def backends() -> dict[str, bool]:
    """Which native backends this build has and can use now."""
    return {
        "cpu": True,
        "cuda_compiled": bool(_C.cuda_compiled()),
        "cuda_available": bool(_C.cuda_available()),
    }


__all__ = [
    "NONFINITE_POLICIES",
    "NORM_FORMS",
    "IndexTerm",
    "NoiseGenerator",
    "NoiseKey",
    "NonFiniteError",
    "PredictableNoiseError",
    "add_noise",
    "backends",
    "check_nonfinite",
    "clip_accumulate",
    "clip_accumulate_diff",
    "clip_factors",
    "ghost_norms",
    "keep_freed_memory",
    "noisy_update",
    "per_sample_norms",
    "philox_words",
    "torch_threads",
]
