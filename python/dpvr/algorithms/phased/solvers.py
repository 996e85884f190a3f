"""Built-in base solvers: accelerated SVRG (loopless Katyusha) and variance-reduced extragradient.

Both are loopless: the reference point of the variance-reduced estimator is refreshed by a coin flip with
probability ``p = batch / m`` per iteration, which costs one pass over the chunk. That pass yields the exact
operator at the reference point, so the certificate of :meth:`PhaseProblem.certify` comes with it at no
extra cost. Each solver stops at the first reference point whose certificate meets ``phase.target``, and
otherwise returns its best certificate once ``max_passes`` passes' worth of gradient evaluations are spent.

The stopping time, and so the number of gradient evaluations, depends on the data. The phased framework does
not release it; a caller who publishes it (or the running time) steps outside the privacy guarantee.
"""

from __future__ import annotations

import math

import numpy as np

from .problem import PhaseProblem, SolverResult


def _check(name: str, value: float, *, upper: float | None = None) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0 and (upper is None or value < upper)):
        bound = f" and < {upper}" if upper is not None else ""
        raise ValueError(f"{name} must be a finite number > 0{bound}, got {value!r}")
    return value


class _Loopless:
    """Shared parts: batch size and budget. Randomness comes from ``phase.rng`` (see :class:`BaseSolver`)."""

    def __init__(self, batch_size: int | None, max_passes: float) -> None:
        if batch_size is not None and (
            isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1
        ):
            raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
        self.batch_size = batch_size
        self.max_passes = _check("max_passes", max_passes)

    def _batch(self, phase: PhaseProblem) -> int:
        # With p = b/m an iteration costs 3b evaluations on average and the iteration count falls like
        # 1/sqrt(b), so small batches spend fewer evaluations and large ones fewer Python-level steps.
        return min(phase.m, self.batch_size or math.ceil(phase.m**0.25))

    def _budget(self, phase: PhaseProblem) -> int:
        return phase.grad_evals + math.ceil(self.max_passes * phase.m)


class KatyushaSolver(_Loopless):
    """Loopless Katyusha (Kovalev, Horvath and Richtarik 2020): accelerated SVRG for strongly convex sums.

    Minimises ``Phi = (1/m) sum f_i + P + R`` over ``X`` (a minimisation phase: ``dim_y == 0``), with the
    smooth public parts ``P`` and ``R`` evaluated exactly and only the data part variance-reduced. With
    ``sigma = mu/L``: ``theta1 = min(sqrt(2 sigma/(3p)), 1/2)``, ``theta2 = 1/2``,
    ``eta = theta2/((1 + theta2) theta1)`` and the z-step
    ``Pi((eta sigma x + z - (eta/L) g)/(1 + eta sigma))``.
    Complexity ``O((m + sqrt(m kappa)) log(1/target))`` gradient evaluations for ``kappa = L/mu``.
    """

    def __init__(self, *, batch_size: int | None = None, max_passes: float = 200.0) -> None:
        super().__init__(batch_size, max_passes)

    def solve(self, phase: PhaseProblem, start: np.ndarray) -> SolverResult:
        if phase.dim_y:
            raise ValueError("KatyushaSolver minimises; use VRExtragradientSolver for a saddle problem")
        b, budget = self._batch(phase), self._budget(phase)
        mu = phase.moduli[0]
        lip = phase.smoothness + phase.rho[0]
        p = b / phase.m
        sigma = mu / lip
        theta1 = min(math.sqrt(2 * sigma / (3 * p)), 0.5)
        theta2 = 0.5
        eta = theta2 / ((1 + theta2) * theta1)
        step, shrink = eta / lip, 1.0 / (1.0 + eta * sigma)

        w = phase.project(np.array(start, dtype=np.float64))
        y, z = w.copy(), w.copy()
        full = phase.full_operator(w)
        best = SolverResult(w, phase.certify(w, full))
        while best.radius > phase.target and phase.grad_evals < budget:
            x = theta1 * z + theta2 * w + (1 - theta1 - theta2) * y
            batch = phase.rng.integers(phase.m, size=b)
            g = (
                full
                + phase.sample_operator(x, batch)
                - phase.sample_operator(w, batch)
                + phase.public_operator(x)
                + phase.regulariser_operator(x)
            )
            z_next = phase.project(shrink * (eta * sigma * x + z - step * g))
            y_next = x + theta1 * (z_next - z)
            if phase.rng.random() < p:
                # x, y, z stay convex combinations of points of X, so the new reference point is feasible.
                w = y
                full = phase.full_operator(w)
                radius = phase.certify(w, full)
                if radius < best.radius:
                    best = SolverResult(w, radius)
            y, z = y_next, z_next
        return best


class VRExtragradientSolver(_Loopless):
    """Loopless variance-reduced extragradient (Alacaoglu and Malitsky 2022) for SC-SC saddle problems.

    Solves the variational inequality ``0 in F(z) + grad R(z) + N_{X x Y}(z)`` of the phase, ``F`` the data
    operator plus ``P``'s and ``R`` the added quadratic regulariser, handled by its prox (so a large phase
    regulariser does not shrink the step). With ``alpha = 1 - p`` and ``tau = gamma sqrt(p) / L``::

        zbar = alpha z + (1 - alpha) w
        z_half = prox(zbar - tau F(w))
        z = prox(zbar - tau (F(w) + F_B(z_half) - F_B(w)))

    Works for minimisation phases too (``F`` is then a gradient).
    """

    def __init__(
        self, *, batch_size: int | None = None, max_passes: float = 500.0, gamma: float = 0.95
    ) -> None:
        super().__init__(batch_size, max_passes)
        self.gamma = _check("gamma", gamma, upper=1.0)

    def solve(self, phase: PhaseProblem, start: np.ndarray) -> SolverResult:
        b, budget = self._batch(phase), self._budget(phase)
        p = b / phase.m
        # A constant data operator with no public part has smoothness 0: any step converges (the prox
        # contracts by 1/(1 + tau mu)), and the largest modulus keeps it finite.
        lip = phase.smoothness or max(phase.moduli)
        tau = self.gamma * math.sqrt(p) / lip
        alpha = 1 - p

        w = phase.project(np.array(start, dtype=np.float64))
        z = w.copy()
        full = phase.full_operator(w)
        best = SolverResult(w, phase.certify(w, full))
        op_w = full + phase.public_operator(w)
        while best.radius > phase.target and phase.grad_evals < budget:
            zbar = alpha * z + (1 - alpha) * w
            z_half = phase.prox(zbar - tau * op_w, tau)
            batch = phase.rng.integers(phase.m, size=b)
            estimate = (
                full
                + phase.sample_operator(z_half, batch)
                - phase.sample_operator(w, batch)
                + phase.public_operator(z_half)
            )
            z = phase.prox(zbar - tau * estimate, tau)
            if phase.rng.random() < p:
                w = z
                full = phase.full_operator(w)
                op_w = full + phase.public_operator(w)
                radius = phase.certify(w, full)
                if radius < best.radius:
                    best = SolverResult(w, radius)
        return best


__all__ = ["KatyushaSolver", "VRExtragradientSolver"]
