"""Noise calibration to a target ``(epsilon, delta)``: jointly over all streams, or the papers' closed forms.

``calibration="tight"`` (default) finds the smallest noise the accountant allows, with the privacy budget
split between streams by ``shares``: at the optimal RDP order of the calibrated run, stream ``s`` spends
``shares[s]`` of the total RDP (equal shares by default). The search works order by order. At a design order
``alpha``, dp_accounting's conversion (``compute_epsilon``) leaves an RDP budget ``E(alpha) = epsilon -
conv(alpha)``; each release gets its share of it, and its noise multiplier follows from dp_accounting's RDP of
that release at that single order (in closed form for unsampled Gaussians and RDP curves, by a secant search
in log-log space for sampled ones). A golden-section search picks the design order with the least noise; the
design order then moves to the optimal order of the mechanism designed there until the two agree, so that the
shares hold where the run's epsilon is decided and the run spends exactly ``epsilon``. (They can differ
because dp_accounting's bounds at fractional orders interpolate or over-estimate the integer-order ones.)
If the grid has no exact fixed point, a last common rescaling of all streams closes the gap. Only single-order
RDP evaluations on a few dozen orders are needed, which keeps a four-stream, 10^4-step calibration within
tens of milliseconds.

With ``accountant="pld"`` the RDP design at its best order fixes the ratios between streams (for an epsilon
below what RDP's conversion can certify at delta, they are designed just above that floor) and the PLD
accountant then sets their common scale (:func:`dpvr.privacy.pld.calibration.pld_scale`: a secant search on
a coarse loss grid, a Richardson extrapolation to the accountant's grid and a confirmation there, where the
run spends between ``(1 - 1e-3) epsilon`` and ``epsilon`` as the accountant composes it). The confirmation
is the accountant's own composition of the run (:func:`~dpvr.privacy.pld.composition.pld_epsilon`), and its
cached result is what the budget guard and the report of the run recorded release by release then read: no
report can exceed the target a calibration met.

``shares="auto"`` chooses the split that minimises the error proxy of :mod:`dpvr.privacy.allocation` (the
papers' variance terms, from public quantities only: the plan and ``dimensions={stream: length}``). At the
optimum each stream's share of the budget is its share of the proxy, corrected by the log-log slope of its RDP
in the noise (``-2`` for an unsampled Gaussian); a damped fixed-point iteration (the geometric mean of the
current shares and that target) solves it, each pass a full joint calibration.

``calibration="paper"`` returns the plan's ``paper_noise`` (e.g. DIFF2's Proposition 4.1 with its ``u``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from . import _checks
from ._roots import secant_root as _secant_root
from .allocation import proxy_weights
from .backends import RDP
from .mechanism import Mechanism, Release
from .relations import DEFAULT_ORDERS, accountant_backend, require_supported


class MechanismFactory(Protocol):
    """Anything with stream names that maps noise multipliers to a :class:`Mechanism` (every plan is one)."""

    streams: tuple[str, ...]

    def __call__(self, noise: Mapping[str, float]) -> Mechanism: ...


def calibrate(
    factory: MechanismFactory,
    epsilon: float,
    delta: float,
    shares: Mapping[str, float] | str | None = None,
    accountant: str = "rdp",
    calibration: str = "tight",
    dimensions: Mapping[str, int] | None = None,
    units: Mapping[str, float] | None = None,
    **paper_options: Any,
) -> dict[str, float]:
    """Noise multiplier of every stream so that the run is ``(epsilon, delta)``-DP.

    ``shares`` (tight only) maps each stream to its part of the RDP budget; they are normalised to sum to
    one. ``shares="auto"`` minimises :func:`dpvr.privacy.allocation.proxy` instead, which needs the length
    of every stream's released vector, ``dimensions={stream: d}`` (the algorithm's public shapes; ignored
    otherwise), and optionally ``units={stream: u}``, the public radius or sensitivity a stream's noise
    multiplier is relative to, relative to the other streams' (default 1). ``paper_options`` go to the
    plan's ``paper_noise`` (e.g. ``u`` for DIFF2, ``gaussian`` for the phased framework).

    Args:
        factory: the run's plan (``noise -> mechanism``), e.g. ``DPSGDPlan(steps=..., sample_rate=...)``.
        epsilon: the target ``epsilon``.
        delta: the target ``delta``.
        shares: ``{stream: weight}``, ``"auto"`` or ``None`` (equal shares).
        accountant: ``"rdp"`` or ``"pld"``.
        calibration: ``"tight"`` (joint, numerical) or ``"paper"`` (the paper's closed form).
        dimensions: each stream's released length, for ``shares="auto"``.
        units: each stream's public unit relative to the others', for ``shares="auto"``.
        **paper_options: keyword arguments of the plan's ``paper_noise``.

    Returns:
        ``{stream: noise multiplier}``, in dpvr's convention (noise std over one record's L2 bound).

    Raises:
        ValueError: invalid ``epsilon``, ``delta``, ``shares``, ``calibration`` or options; a plan without
            streams, or with a stream that has no releases; ``delta`` not above the plan's failure
            probability; ``calibration="paper"`` for a plan without a closed form.
        RuntimeError: the search for the noise did not converge.

    Guarantee:
        With ``calibration="tight"`` the run with the returned noise spends at most ``epsilon`` at ``delta``
        as ``accountant`` prices it. ``calibration="paper"`` returns the paper's formula, which may spend
        more or less (check it with :func:`account`).
    """
    epsilon = _checks.positive("epsilon", epsilon)
    delta = _checks.delta(delta)
    backend = accountant_backend(accountant)
    if calibration == "paper":
        if shares is not None:
            raise ValueError("shares apply to calibration='tight'; the paper fixes its own split")
        paper = getattr(factory, "paper_noise", None)
        if paper is None:
            raise ValueError(f"{type(factory).__name__} has no closed-form paper calibration")
        return paper(epsilon, delta, **paper_options)
    if calibration != "tight":
        raise ValueError(f"calibration must be 'tight' or 'paper', got {calibration!r}")
    if paper_options:
        raise ValueError(f"unexpected options for calibration='tight': {sorted(paper_options)}")
    names = tuple(factory.streams)
    if not names:
        raise ValueError("the mechanism has no noise streams to calibrate")
    if shares == "auto":
        proxy = proxy_weights(factory, dimensions, units)  # type: ignore[arg-type]  # a plan, or refused there
        weights = _shares(names, None)
    else:
        proxy = None
        weights = _shares(names, shares)
    probe = factory({name: 1.0 for name in names})
    target_delta = delta - probe.failure_probability
    if target_delta <= 0:
        raise ValueError(f"delta ({delta}) must exceed the failure probability ({probe.failure_probability})")
    require_supported(probe.event, accountant, probe.neighbouring)
    idle = [s.name for s in probe.streams if s.count == 0]
    if idle:
        raise ValueError(f"streams {idle} have no releases; nothing to calibrate for them")
    # The backend calibrates from the RDP design: RDP's is the design itself; PLD's keeps its ratios between
    # streams and finds their common scale (see the module documentation).
    return backend.calibrate(_Design(factory, probe, weights, target_delta, proxy), epsilon, target_delta)


class _Design:
    """The RDP design of one calibration (:class:`~dpvr.privacy.relations.Design`): ``design(epsilon, exact)``
    is :func:`_solve` at the calibration's shares (or its proxy's) and delta."""

    def __init__(
        self,
        factory: MechanismFactory,
        probe: Mechanism,
        weights: dict[str, float],
        delta: float,
        proxy: Mapping[str, float] | None,
    ) -> None:
        self.factory, self.probe, self.weights, self.delta, self.proxy = factory, probe, weights, delta, proxy

    @property
    def floor(self) -> float:
        return _rdp_floor(self.delta)

    def __call__(self, epsilon: float, exact: bool) -> dict[str, float]:
        return _solve(self.probe, self.weights, epsilon, self.delta, self.proxy, exact=exact)


# The proxy is flat at its minimum: shares within 0.1% of it leave it within about 1e-6 of the optimum.
_AUTO_PASSES, _AUTO_TOLERANCE = 20, 1e-3


def _solve(
    probe: Mechanism,
    weights: dict[str, float],
    epsilon: float,
    delta: float,
    proxy: Mapping[str, float] | None,
    exact: bool,
) -> dict[str, float]:
    """The joint calibration at ``weights``; given ``proxy`` weights, at the shares minimising the proxy.
    ``exact=False`` settles for the ratios between streams (see :meth:`_Solver.solve`)."""
    solver = _Solver(probe, weights, epsilon, delta, exact)
    noise = solver.solve()
    if proxy is None:
        return noise
    for _ in range(_AUTO_PASSES):
        # Stationarity (see dpvr.privacy.allocation): share_s ∝ W_s z_s^2 * 2 / g_s, g_s the RDP's
        # log-log slope in z_s.
        slopes = solver.slopes()
        target = {n: proxy[n] * noise[n] ** 2 * 2.0 / slopes[n] for n in weights}
        moved = {n: math.sqrt(weights[n] * target[n]) for n in weights}
        total = math.fsum(moved.values())
        moved = {n: v / total for n, v in moved.items()}
        if max(abs(math.log(moved[n] / weights[n])) for n in weights) < _AUTO_TOLERANCE:
            break
        weights = moved
        solver = _Solver(probe, weights, epsilon, delta, exact)
        noise = solver.solve()
    return noise


def _shares(names: tuple[str, ...], shares: Mapping[str, float] | str | None) -> dict[str, float]:
    if shares is None:
        return {name: 1.0 / len(names) for name in names}
    if isinstance(shares, str):
        raise ValueError(f"shares must be {{stream: weight}}, 'auto' or None, got {shares!r}")
    missing = [n for n in names if n not in shares]
    unknown = [n for n in shares if n not in names]
    if missing or unknown:
        raise ValueError(
            f"shares must give exactly the streams {names}; missing {missing}, unknown {unknown}"
        )
    values = {n: _checks.positive(f"share of stream {n!r}", shares[n]) for n in names}
    total = math.fsum(values.values())
    return {n: v / total for n, v in values.items()}


def _rdp_function(release: Release, neighbouring: str) -> Callable[[float, tuple[float, ...]], np.ndarray]:
    """``(z, orders) -> RDP of all of the release's occurrences`` via dp_accounting's RDP accountant.

    A release the RDP accountant cannot price (Poisson sampling under replace-one, random allocation) is
    measured on its RDP stand-in (:meth:`~dpvr.privacy.rdp.RdpBackend.proxy`): only on the PLD path,
    where RDP fixes just the ratios between streams.
    """
    relation = neighbouring
    if RDP.unsupported_reason(release.step_event(), neighbouring) is not None:
        relation = RDP.proxy(release.step_event(), neighbouring)[1]

    def transform(event):
        if relation != neighbouring or RDP.unsupported_reason(event, neighbouring) is not None:
            event = RDP.proxy(event, neighbouring)[0]
        return RDP.rewrite(event, relation)

    def rdp(z: float, orders: tuple[float, ...]) -> np.ndarray:
        acc = RDP.make(relation, orders=orders)
        return release.count * acc.compose(transform(release.step_event(z))).rdp

    return rdp


def _conversion(order: float, delta: float) -> float:
    """epsilon minus RDP at ``order`` in dp_accounting's conversion (an RDP of 100 avoids its KL branch)."""
    return float(rdp_privacy_accountant.compute_epsilon([order], [100.0], delta)[0]) - 100.0


def _rdp_floor(delta: float) -> float:
    """The epsilon below which the RDP conversion certifies nothing at ``delta``, whatever the noise."""
    return min(_conversion(a, delta) for a in DEFAULT_ORDERS)


class _Solver:
    """Order-by-order solution of the tight calibration (see the module documentation)."""

    def __init__(
        self,
        probe: Mechanism,
        weights: Mapping[str, float],
        epsilon: float,
        delta: float,
        exact: bool = True,
    ) -> None:
        self.releases = probe.releases
        self.epsilon, self.delta, self.exact = epsilon, delta, exact
        self.orders = DEFAULT_ORDERS
        self.budget = np.array([epsilon - _conversion(a, delta) for a in self.orders])
        self.weight = [math.fsum(weights[n] for n in r.names) for r in self.releases]
        self.part_weights = [{n: weights[n] / w for n in r.names} for r, w in zip(self.releases, self.weight)]
        self.rdp = [_rdp_function(r, probe.neighbouring) for r in self.releases]
        # Unsampled releases (plain Gaussians, RDP curves) have RDP exactly proportional to 1/z^2.
        self.unit = [
            f(1.0, self.orders) if r.sampling.scheme == "full" else None
            for f, r in zip(self.rdp, self.releases)
        ]
        # Releases alike in event, count and weight (PrivateDiff's checkpoint and difference rounds) get the
        # same noise: each is solved once, at the first of its kind.
        kinds = [(repr(r.step_event(1.0)), r.count, w) for r, w in zip(self.releases, self.weight)]
        self.first = [kinds.index(kind) for kind in kinds]
        self.guess = [0.0] * len(self.releases)
        self.cache: dict[int, list[float]] = {}
        self.solution: tuple[list[float], int] = ([], 0)  # (log z per release, order index), set by solve

    def _log_z(self, j: int, i: int) -> float:
        """log of release ``j``'s noise multiplier when it spends its share of the budget at order ``i``."""
        target = self.weight[j] * self.budget[i]
        if self.unit[j] is not None:
            return 0.5 * math.log(max(self.unit[j][i], 1e-300) / target)
        order = (self.orders[i],)

        def gap(lz: float) -> float:
            value = float(self.rdp[j](math.exp(lz), order)[0])
            return math.log(min(max(value, 1e-300), 1e300)) - math.log(target)

        lz, _ = _secant_root(gap, self.guess[j], tol=1e-11 if self.exact else 1e-6)
        self.guess[j] = lz
        return lz

    def _at(self, i: int) -> list[float]:
        if i not in self.cache:
            solved: list[float] = []
            for j, first in enumerate(self.first):
                solved.append(self._log_z(j, i) if first == j else solved[first])
            self.cache[i] = solved
        return self.cache[i]

    def _objective(self, i: int) -> float:
        if self.budget[i] <= 0:
            return math.inf
        return math.fsum(w * lz for w, lz in zip(self.weight, self._at(i)))

    def _best_order(self) -> int:
        feasible = [i for i in range(len(self.orders)) if self.budget[i] > 0]
        if not feasible:
            raise ValueError(
                f"epsilon={self.epsilon} is below what the RDP accountant certifies at delta={self.delta} "
                f"with any noise ({_rdp_floor(self.delta):.4g}); the PLD accountant has no such floor"
            )
        lo, hi = feasible[0], feasible[-1]
        # Golden-section search over the order index; the noise is unimodal in the order.
        ratio = (math.sqrt(5) - 1) / 2
        while hi - lo > 3:
            a = hi - round(ratio * (hi - lo))
            b = lo + round(ratio * (hi - lo))
            if a >= b:
                a, b = (lo + hi) // 2, (lo + hi) // 2 + 1
            if self._objective(a) <= self._objective(b):
                hi = b
            else:
                lo = a
        return min(range(lo, hi + 1), key=self._objective)

    def _window(self, i: int) -> list[int]:
        """Orders that may be optimal for the mechanism designed at order ``i``.

        Its neighbours on the grid, and the integer orders within a factor 1.5: dp_accounting's bounds at
        fractional orders interpolate (sampling without replacement) or over-estimate (Poisson sampling)
        the integer ones, so an integer order is often optimal even when the design order is not.
        """
        alpha = self.orders[i]
        near = range(max(0, i - 4), min(len(self.orders), i + 5))
        integers = (k for k, a in enumerate(self.orders) if a == int(a) and alpha / 1.5 <= a <= alpha * 1.5)
        return sorted({*near, *integers})

    def _epsilon_and_order(self, log_z: list[float], window: list[int]) -> tuple[float, int]:
        orders = tuple(self.orders[k] for k in window)
        curves: dict[int, np.ndarray] = {}
        total = np.zeros(len(orders))
        for j, first in enumerate(self.first):
            if first != j and log_z[j] == log_z[first]:
                total = total + curves[first]
            else:
                curves[j] = self.rdp[j](math.exp(log_z[j]), orders)
                total = total + curves[j]
        eps, order = rdp_privacy_accountant.compute_epsilon(orders, total, self.delta)
        return float(eps), self.orders.index(order)

    def solve(self) -> dict[str, float]:
        """The noise of every stream. Inexact (``exact=False``), the design at the best order: right ratios
        between streams, and a spend near epsilon, which the PLD path rescales anyway."""
        i = self._best_order()
        if not self.exact:
            self.solution = (list(self._at(i)), i)
            return self._noise(self.solution[0])
        # Move the design order to the optimal order of the mechanism designed there, until they agree:
        # there the shares hold at the mechanism's own optimal order and it spends exactly epsilon.
        visited: set[int] = set()
        while i not in visited:
            visited.add(i)
            optimal = self._epsilon_and_order(self._at(i), self._window(i))[1]
            if self.budget[optimal] <= 0 or optimal == i:
                break
            i = optimal
        log_z = list(self._at(i))
        window = self._window(i)
        spent = self._epsilon_and_order(log_z, window)[0]
        if spent < self.epsilon * (1 - 1e-6):
            # No exact fixed point on the grid: scale every stream down on a common scale.
            def gap(log_c: float) -> float:
                eps = self._epsilon_and_order([lz + log_c for lz in log_z], window)[0]
                return math.log(eps) - math.log(self.epsilon)

            shift, _ = _secant_root(gap, 0.0)
            log_z = [lz + shift for lz in log_z]
        self.solution = (log_z, self._epsilon_and_order(log_z, window)[1])
        return self._noise(log_z)

    def _noise(self, log_z: list[float]) -> dict[str, float]:
        noise: dict[str, float] = {}
        for j in range(len(self.releases)):
            # A group's members split its precision 1/z^2 in proportion to their shares; the factor
            # 1 + 1e-9 keeps round-off on the private side of the target.
            for name, part in self.part_weights[j].items():
                noise[name] = math.exp(log_z[j]) / math.sqrt(part) * (1 + 1e-9)
        return noise

    def slopes(self, step: float = 1e-2) -> dict[str, float]:
        """``-d log RDP / d log z`` of each stream's release at the solution and its optimal order (2 for an
        unsampled Gaussian); the members of a group share their release's."""
        log_z, i = self.solution
        order = (self.orders[i],)
        slopes: dict[str, float] = {}
        for j, release in enumerate(self.releases):
            if self.unit[j] is not None:
                slope = 2.0
            else:
                up, down = (float(self.rdp[j](math.exp(log_z[j] + h), order)[0]) for h in (step, -step))
                slope = (math.log(down) - math.log(up)) / (2 * step)
            slopes.update(dict.fromkeys(release.names, slope))
        return slopes


__all__ = ["MechanismFactory", "calibrate"]
