"""Minimax problems ``min_x max_{y in Y} (1/n) sum_i f(x, y; z_i)`` for the DP minimax algorithms.

The min block ``x`` is a model's trainable parameters; the max block ``y`` is a small tensor over a public
convex set ``Y`` with a Euclidean projection. A problem gives the per-sample loss as a function of the model's
output, so ``grad_y f`` never runs through the model, and the constants that the privacy and step-size rules
need (strong-concavity modulus, diameter of ``Y``, a bound on ``|grad_y f|``).

A problem whose inner maximiser has a public worst-case sensitivity also states it
(:meth:`MinimaxProblem.y_sensitivity`, :class:`YSensitivity`): that is what lets PrivateDiff release ``y`` by
output perturbation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.func import grad, vmap


@dataclass(frozen=True)
class YSensitivity:
    """Public constants that bound how far the inner maximiser moves when one record is replaced.

    For every model output the problem admits (after :meth:`MinimaxProblem.bounded_outputs`), every
    ``y`` in ``Y`` and every two records ``z, z'``:

    - ``gradient_range``: ``||grad_y f(x, y; z) - grad_y f(x, y; z')|| <= gradient_range`` (at most twice a
      bound on ``||grad_y f||``, often much less);
    - ``strong_concavity``: ``mu``, ``(1/n) sum_i f(x, .; z_i)`` is ``mu``-strongly concave on ``Y`` for every
      dataset;
    - ``smoothness``: ``L``, that mean's gradient in ``y`` is ``L``-Lipschitz (sets the solver's step ``1/L``;
      the privacy proof does not use it).

    With ``y*(D) = argmax_{y in Y} (1/n) sum_i f(x, y; z_i)`` at a fixed public ``x``, two datasets of ``n``
    records that differ in record ``i`` have ``||y*(D) - y*(D')|| <= gradient_range / (n mu)``.

    Proof: write ``F, F'`` for the two means, ``y, y'`` for their maximisers and ``g = grad_y f(., z_i') -
    grad_y f(., z_i)``, so ``grad F' = grad F + g / n``. Optimality over the convex ``Y`` gives
    ``<grad F(y), y' - y> <= 0`` and ``<grad F'(y'), y - y'> <= 0``; strong concavity of ``F`` gives
    ``<grad F(y') - grad F(y), y' - y> <= -mu ||y' - y||^2``. Hence ``mu ||y' - y||^2 <= <grad F(y) -
    grad F(y'), y' - y> <= <grad F(y'), y - y'> = <grad F'(y'), y - y'> - <g(y'), y - y'> / n <= ||g(y')||
    ||y - y'|| / n``, and ``||g(y')|| <= gradient_range``. Only ``F`` (one dataset) needs to be strongly
    concave, and replace-one keeps ``n`` public.
    """

    gradient_range: float
    strong_concavity: float
    smoothness: float

    def __post_init__(self) -> None:
        for name in ("gradient_range", "strong_concavity", "smoothness"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be finite and > 0, got {value}")

    def stability(self, n: int) -> float:
        """``gradient_range / (n mu)``: the exact maximiser's replace-one sensitivity over ``n`` records."""
        if not n >= 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        return self.gradient_range / (n * self.strong_concavity)


class MinimaxProblem:
    """Base of the minimax objectives.

    Subclasses implement :meth:`loss` (one sample: ``output`` is the model's output for that sample without
    its batch dimension, ``target`` its target, ``y`` the max block) and :meth:`project`, and set
    ``y_dim`` (``y`` is a vector of that length), ``strong_concavity`` (``mu``: ``f(x, .; z)`` averaged over
    any dataset is ``mu``-strongly concave on ``Y``), ``diameter`` (of ``Y``) and ``y_lipschitz`` (a bound on
    ``||grad_y f(x, y; z)||`` over ``Y`` and every model output the problem admits).
    """

    y_dim: int
    strong_concavity: float
    diameter: float
    y_lipschitz: float

    def loss(self, output: Tensor, target: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def y_sensitivity(self) -> YSensitivity:
        """The public constants of :class:`YSensitivity`; a problem that cannot state them (a ``y`` gradient
        with no public bound, no strong concavity, ``y`` of data-dependent length) raises ``ValueError``."""
        raise ValueError(
            f"{type(self).__name__} states no public worst-case sensitivity of its inner maximiser "
            "(y_sensitivity): y cannot be released by output perturbation; use y_release='ascent'"
        )

    def bounded_outputs(self, outputs: Tensor) -> Tensor:
        """``(B, ...)`` model outputs as the inner maximisation reads them: every value, non-finite ones
        included, mapped into the set on which :meth:`y_sensitivity`'s constants hold (a non-finite output
        becomes a public admissible value, so its record still counts as an admissible record). The default
        leaves outputs unchanged; a problem that implements :meth:`y_sensitivity` overrides it."""
        return outputs

    def project(self, y: Tensor) -> Tensor:
        """The Euclidean projection of ``y`` onto ``Y`` (a new tensor)."""
        raise NotImplementedError

    def initial_y(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """A point of ``Y`` to start from (its projection of zero)."""
        return self.project(torch.zeros(self.y_dim, dtype=dtype))

    def losses(self, outputs: Tensor, targets: Tensor, y: Tensor) -> Tensor:
        """``(B,)`` per-sample losses of a batch of model outputs."""
        return vmap(self.loss, in_dims=(0, 0, None))(outputs, targets, y)

    def objective(self, outputs: Tensor, targets: Tensor, y: Tensor) -> Tensor:
        """The empirical objective: the mean of the per-sample losses."""
        return self.losses(outputs, targets, y).mean()

    def y_grads(self, outputs: Tensor, targets: Tensor, y: Tensor) -> Tensor:
        """``(B, y_dim)`` per-sample gradients ``grad_y f(x, y; z_i)`` from the model's outputs at ``x``."""
        return vmap(grad(self.loss, argnums=2), in_dims=(0, 0, None))(outputs.detach(), targets, y)
