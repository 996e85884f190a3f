"""What a base solver is given and what it must return ("bring your own algorithm").

Every phase of the phased framework hands its solver one :class:`PhaseProblem`: the finite-sum saddle
problem on that phase's chunk of the data with an added quadratic regulariser,

    min_{x in X} max_{y in Y}  Phi(x, y) = (1/m) sum_{i in chunk} f(x, y; xi_i) + P(x, y)
                                          + (rho_x/2) ||x - c_x||^2 - (rho_y/2) ||y - c_y||^2,

and a target radius. A minimisation problem is the case without ``y`` (``dim_y == 0``). Points are flat
vectors ``z = (x, y)``; the operator of the problem is ``(grad_x Phi, -grad_y Phi)``, which is strongly
monotone with moduli ``(mu_x, mu_y)`` blockwise.

The solver returns a :class:`SolverResult`: a point and a **certificate**, a number ``r`` with

    sqrt(mu_x ||x - x*||^2 + mu_y ||y - y*||^2) <= r

for the exact regularised solution ``(x*, y*)``, which must hold surely (not in expectation, not with high
probability). :meth:`PhaseProblem.certify` computes the standard one: if ``w`` is the minimal-norm element of
``F(z) + N_{X x Y}(z)`` (the operator plus the normal cone of the domain, i.e. the gradient mapping at ``z``),
strong monotonicity and Cauchy-Schwarz give ``r = sqrt(||w_x||^2/mu_x + ||w_y||^2/mu_y)``; for
minimisation this is ``||x - x*|| <= ||w||/mu``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ...optim.gradients import finite_records
from ...problems import Domain, FiniteSumProblem

# The certificate can be tight (isotropic problems attain it), so rounding in the residual could leave it a
# few ulps below the true distance; this relative margin covers that.
_ROUNDING = 1 + 1e-9


class CertificateError(RuntimeError):
    """A base solver did not certify the accuracy the privacy guarantee needs; nothing was released."""


@dataclass(frozen=True)
class SolverResult:
    """A base solver's answer: ``point`` (flat ``(x, y)``) and its certified weighted ``radius``."""

    point: np.ndarray
    radius: float


class BaseSolver(Protocol):
    """A base solver for the regularised phase problems ("bring your own algorithm").

    ``solve`` gets the phase problem and a public starting point and returns a point with a certificate
    (see the module documentation). It reads the data only through ``phase``'s operator methods, which count
    the per-sample gradient evaluations. The certificate must hold for every realisation of the solver's
    randomness; a solver that cannot reach ``phase.target`` within its budget returns its best certificate
    and the framework refuses to release anything.

    Randomness must come from ``phase.rng`` and no state may be carried from one call to the next: the
    framework seeds each phase independently of the data, which is what lets parallel composition ignore the
    solver. (A generator carried across phases would be advanced by a data-dependent number of draws, so one
    chunk's data would reach the next phase's output through it.)
    """

    def solve(self, phase: PhaseProblem, start: np.ndarray) -> SolverResult: ...


class PhaseProblem:
    """One phase's regularised problem on its chunk (see the module documentation).

    Attributes: ``rows`` (the chunk's sample indices), ``m`` (its size), ``rho`` and ``centre`` (the added
    regulariser, per block and as a flat point), ``moduli`` (``(mu_x, mu_y)`` of the regularised problem),
    ``smoothness`` (Lipschitz constant of ``sample_operator`` plus ``public_operator``, without the
    regulariser), ``target`` (the certificate the framework requires), ``rng`` (the solver's only source of
    randomness, seeded independently of the data) and ``grad_evals`` (per-sample gradient evaluations so
    far).
    """

    def __init__(
        self,
        problem: FiniteSumProblem,
        rows: np.ndarray,
        rho: tuple[float, float],
        centre: np.ndarray,
        target: float,
        rng: np.random.Generator,
        nonfinite: str = "zero",
    ) -> None:
        self._problem = problem
        self.nonfinite = nonfinite
        self.rows = np.asarray(rows, dtype=np.int64)
        self.rows.setflags(write=False)
        self.m = int(self.rows.size)
        self.dim_x, self.dim_y = int(problem.dim_x), int(problem.dim_y)
        self.rho = (float(rho[0]), float(rho[1]) if self.dim_y else 0.0)
        self.centre = np.asarray(centre, dtype=np.float64)
        self.moduli = (
            problem.moduli[0] + self.rho[0],
            problem.moduli[1] + self.rho[1] if self.dim_y else 0.0,
        )
        self.smoothness = float(problem.smoothness + problem.public_smoothness)
        self.target = float(target)
        self.rng = rng
        self.grad_evals = 0
        self._rho_vec = np.concatenate([np.full(self.dim_x, self.rho[0]), np.full(self.dim_y, self.rho[1])])

    @property
    def dim(self) -> int:
        return self.dim_x + self.dim_y

    @property
    def blocks(self) -> tuple[slice, ...]:
        """Slices of ``x`` (and ``y``) in a flat point."""
        x = slice(0, self.dim_x)
        return (x, slice(self.dim_x, self.dim)) if self.dim_y else (x,)

    def _domains(self) -> tuple[Domain, ...]:
        return (self._problem.domain_x, self._problem.domain_y)[: len(self.blocks)]

    def sample_operator(self, z: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """Mean data operator over the chunk positions ``batch`` (indices into ``rows``)."""
        batch = np.asarray(batch)
        self.grad_evals += int(batch.size)
        return self._finite(self._problem.sample_operator(z, self.rows[batch])).mean(axis=0)

    def full_operator(self, z: np.ndarray) -> np.ndarray:
        """Mean data operator over the whole chunk (``m`` gradient evaluations)."""
        self.grad_evals += self.m
        return self._finite(self._problem.sample_operator(z, self.rows)).mean(axis=0)

    def _finite(self, operators: np.ndarray) -> np.ndarray:
        """Per-sample operators under the non-finite policy: a non-finite row is zero, or an error."""
        finite, _ = finite_records(torch.from_numpy(operators), self.nonfinite, "phased solver")
        return finite.numpy()

    def public_operator(self, z: np.ndarray) -> np.ndarray:
        """Operator of the public part ``P`` (no data, not counted)."""
        return self._problem.public_operator(z)

    def regulariser_operator(self, z: np.ndarray) -> np.ndarray:
        """Operator of the added regulariser, ``rho * (z - centre)`` blockwise."""
        return self._rho_vec * (z - self.centre)

    def project(self, v: np.ndarray) -> np.ndarray:
        """Projection onto ``X x Y``."""
        out = np.empty_like(v)
        for block, domain in zip(self.blocks, self._domains()):
            out[block] = domain.project(v[block])
        return out

    def prox(self, v: np.ndarray, step: float) -> np.ndarray:
        """``argmin_u step * R(u) + ||u - v||^2 / 2`` over ``X x Y``, ``R`` the added regulariser.

        The regulariser is an isotropic quadratic in each block, so the constrained minimiser is the
        projection of the unconstrained one.
        """
        return self.project((v + step * self._rho_vec * self.centre) / (1 + step * self._rho_vec))

    def certify(self, z: np.ndarray, data_operator: np.ndarray | None = None) -> float:
        """The certified weighted radius at ``z`` (a point of ``X x Y``): ``sqrt(sum_b ||w_b||^2 / mu_b)``.

        ``data_operator`` is :meth:`full_operator` at ``z`` if the caller has it (else it is computed).
        """
        if data_operator is None:
            data_operator = self.full_operator(z)
        g = data_operator + self.public_operator(z) + self.regulariser_operator(z)
        total = 0.0
        for block, domain, mu in zip(self.blocks, self._domains(), self.moduli):
            w = domain.residual(z[block], g[block])
            total += float(w @ w) / mu
        return math.sqrt(total) * _ROUNDING


def split_rows(n: int, phases: int) -> Sequence[np.ndarray]:
    """The deterministic partition of ``range(n)`` into ``phases`` contiguous chunks of near-equal size."""
    return np.array_split(np.arange(n), phases)


__all__ = [
    "BaseSolver",
    "CertificateError",
    "PhaseProblem",
    "SolverResult",
    "split_rows",
]
