"""Per-sample gradients for the DP algorithms.

:func:`per_sample_grads` materialises one gradient per sample (``B × d`` memory);
:func:`per_sample_grads_at_two_points` does so at two parameter points for gradient-difference estimators.
:class:`GhostClipper` forms clipped sums of per-sample gradients and of same-sample gradient differences from
layer activations and output gradients, without per-sample gradients ("ghost clipping"); new layer types
get ghost rules with :func:`register_ghost_rule` (a :class:`GhostRule` subclass per layer family).
"""

from .fields import Fields, as_inputs
from .ghost import ClippedSum, GhostClipper, GhostRule, register_ghost_rule
from .materialized import (
    Grads,
    LossFn,
    clip_dtype,
    per_sample_grads,
    per_sample_grads_at_two_points,
    trainable_parameters,
)

__all__ = [
    "ClippedSum",
    "Fields",
    "GhostClipper",
    "GhostRule",
    "Grads",
    "LossFn",
    "as_inputs",
    "clip_dtype",
    "per_sample_grads",
    "per_sample_grads_at_two_points",
    "register_ghost_rule",
    "trainable_parameters",
]
