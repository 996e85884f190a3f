"""The finite-sum saddle problem that the phased output-perturbation framework privatises.

The framework (:mod:`dpvr.algorithms.phased`) reads a problem only through this protocol; the concrete
problems live in :mod:`dpvr.objectives`, and users may bring their own.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import numpy as np

from .domains import Domain


@runtime_checkable
class FiniteSumProblem(Protocol):
    """A finite-sum problem ``min_x max_y (1/n) sum_i f(x, y; xi_i) + P(x, y)`` over ``X x Y``.

    ``f(., .; xi)`` is the per-sample loss (convex-concave) and ``P`` a public, data-independent smooth
    convex-concave part (a ridge term, a fixed coupling). The phased framework's privacy rests on:

    - ``lipschitz`` (L): every ``f(., .; xi)`` is L-Lipschitz jointly in ``(x, y)`` on ``X x Y``. Only the
      per-sample part needs it: ``P`` is common to neighbouring datasets and cancels in the stability proof;
    - ``moduli`` ``(mu_x, mu_y)``: the strong convexity in ``x`` and strong concavity in ``y`` of
      ``(1/n) sum_i f + P`` for *every* dataset (0 where there is none);
    - ``n``: the public dataset size (replace-one neighbours).

    ``smoothness`` (the Lipschitz constant of each sample's operator ``(grad_x f, -grad_y f)``) and
    ``public_smoothness`` (that of ``P``'s) only size the solvers' steps. ``dim_y == 0`` is a minimisation
    problem; its ``domain_y`` is ignored.
    """

    n: int
    dim_x: int
    dim_y: int
    lipschitz: float
    smoothness: float
    public_smoothness: float
    moduli: tuple[float, float]
    domain_x: Domain
    domain_y: Domain

    def sample_operator(self, z: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per-sample operators ``(grad_x f, -grad_y f)(z; xi_i)``, ``i`` in ``rows``; shape (rows, dim)."""
        ...

    def public_operator(self, z: np.ndarray) -> np.ndarray:
        """``(grad_x P, -grad_y P)(z)``, shape ``(dim,)``."""
        ...


def check_problem(problem: FiniteSumProblem) -> None:
    """Raise ``ValueError`` naming the attribute if ``problem`` does not describe a usable finite sum."""
    if not isinstance(problem, FiniteSumProblem):
        raise ValueError(f"problem must implement FiniteSumProblem, got {type(problem).__name__}")
    for name in ("n", "dim_x"):
        value = getattr(problem, name)
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"problem.{name} must be an integer >= 1, got {value!r}")
    if isinstance(problem.dim_y, bool) or int(problem.dim_y) != problem.dim_y or problem.dim_y < 0:
        raise ValueError(f"problem.dim_y must be an integer >= 0, got {problem.dim_y!r}")
    if not (math.isfinite(problem.lipschitz) and problem.lipschitz > 0):
        raise ValueError(f"problem.lipschitz must be a finite number > 0, got {problem.lipschitz!r}")
    for name in ("smoothness", "public_smoothness"):
        value = getattr(problem, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"problem.{name} must be a finite number >= 0, got {value!r}")
    if len(problem.moduli) != 2 or not all(math.isfinite(m) and m >= 0 for m in problem.moduli):
        raise ValueError(f"problem.moduli must be two finite numbers >= 0, got {problem.moduli!r}")
