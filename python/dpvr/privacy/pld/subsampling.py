"""Privacy loss distribution of the Gaussian mechanism on fixed-size batches drawn without replacement.

dp_accounting has a ``SampledWithoutReplacementDpEvent`` but only its RDP accountant prices it, with the
generic bound of Wang, Balle and Kasiviswanathan (2019), which is loose for Gaussians. This module builds
the tight PLD of one such release under replace-one, in dpvr's units (noise multiplier ``z`` = noise std
over the bound ``C`` on one record's contribution to the released sum; a replaced record moves the sum by
up to ``2C``), in a form dp_accounting composes.

Derivation. Let ``D, D'`` differ in record ``i`` (``x_i`` replaced by ``x_i'``), ``B`` a uniform ``b``-subset
of ``n`` records and ``q = b/n``. Pair every batch that holds ``i``, ``{i} + S`` (``|S| = b - 1``), with the
``n - b`` batches ``S + {j}``, ``j`` outside ``S + {i}``; each batch without ``i`` is hit ``b`` times, so a
uniform pair ``(S, j)`` gives both batch laws. Writing ``s`` for the sum over ``S`` and ``u, a, a'`` for the
contributions of ``x_j, x_i, x_i'`` (all of norm at most ``C``)::

    M(D)  = E_(S,j) [ (1-q) N(s + u, z^2) + q N(s + a,  z^2) ]
    M(D') = E_(S,j) [ (1-q) N(s + u, z^2) + q N(s + a', z^2) ]

The hockey-stick divergence ``H_g(P||Q) = sup_E P(E) - g Q(E)`` is jointly convex, so it suffices to bound
each pair in the brackets. For ``g' = 1 + q(g - 1) >= 1`` the advanced joint convexity of Balle, Barthe and
Gaboardi (2018, Theorem 2) with ``b = g'/g`` gives::

    H_g'((1-q)A + qB, (1-q)A + qB') = q H_g(B || (1-b)A + bB') <= q max(H_g(B||A), H_g(B||B')) <= q h_g

where ``h_g = H_g(N(2C, z^2) || N(0, z^2))``: every two of ``u, a, a'`` are at most ``2C`` apart. The bound
is attained by ``u = a' = -C, a = C`` (every other record at ``-C``), i.e. by the pair ``X = (1-q) N(0) +
q N(2C)`` against ``Y = N(0)``: one step's privacy profile for ``eps >= 0`` is exactly that of ``(X, Y)``,
dp_accounting's Poisson "remove" pair at sensitivity ``2C``. For ``g < 1``, ``H_g(P||Q) = 1 - g + g
H_(1/g)(Q||P)`` and the swapped pair is of the same form, so the bound there is the profile of ``(Y, X)``
(the "add" pair), attained by ``u = a = C, a' = -C``.

Composition. A pair that dominates each step for *every* ``g >= 0`` dominates the adaptive composition
(Zhu, Dong and Wang 2022, Theorem 10). Under replace-one the adversary can make one step look like
``(X, Y)`` and the next like ``(Y, X)`` for the *same* ordered ``(D, D')`` (Lebeda, Regehr, Kamath and Steinke
2024 show that worst-case pairs of one step need not compose), so composing the two directions separately
and taking the larger epsilon, as dp_accounting does for Poisson add/remove, would be unsound here. The pair
we compose has profile ``max(profile(X, Y), profile(Y, X))`` for every ``g``: the convex envelope of
``min(f, f^-1)`` for the trade-off function ``f`` of ``(X, Y)`` (the symmetrisation of Dong, Roth and Su
2022, Theorem 6, whose subsampling theorem is exactly this setting), which is a valid trade-off function, so
such a pair exists, dominates each step, and is tight for one step. Its privacy loss law is ``(X, Y)``'s on
losses ``> 0``, ``(Y, X)``'s on losses ``< 0``, and an atom at ``0`` that fills the gap (both profiles equal
the total variation at ``eps = 0``).

Numerics. Both directions come from dp_accounting's pessimistic (connect-the-dots) discretisation of the
Poisson pair at sensitivity ``2C``, whose profiles upper-bound the exact ones at every ``eps`` in both signs.
The glued PMF takes the remove PMF above ``0``, the add PMF below ``0`` and an atom at ``0`` equal to the
add PMF's mass at or above ``0`` minus the remove PMF's mass above ``0``: its profile equals the remove
profile for ``eps >= 0`` and the add profile plus ``c e^eps`` for ``eps < 0``, with ``c`` the difference of
the two discretised profiles at ``0``; a negative ``c`` (rounding) is moved into the infinity mass. A PMF
whose profile dominates at every real ``eps`` keeps dominating after composition, because a composed profile
is the expectation of one factor's profile under the other's loss law.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_mechanism
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.stats import norm

from .. import _checks
from .adapter import dense_parts, directions
from .numerics import connect_dots_pmf

#: Width of the privacy-loss grid, dp_accounting's PLDAccountant default: PLDs compose only on one grid.
PLD_DISCRETIZATION = 1e-4


def _dense(pmf: pld_pmf.PLDPmf) -> tuple[np.ndarray, np.ndarray, float]:
    """``(losses as grid indices, probabilities, infinity mass)`` of a dp_accounting PMF."""
    lower, probs, infinity = dense_parts(pmf)  # dp_accounting has no public accessor (the adapter reads it)
    probs = np.asarray(probs, dtype=float)
    return np.arange(lower, lower + probs.size), probs, infinity


def _gaussian_loss(noise: float, sensitivity: float, sampling_prob: float, remove: bool):
    kinds = privacy_loss_mechanism.AdjacencyType
    return privacy_loss_mechanism.GaussianPrivacyLoss(
        noise, sensitivity=sensitivity, sampling_prob=sampling_prob,
        adjacency_type=kinds.REMOVE if remove else kinds.ADD,
    )


def gaussian_loss_width(noise: float, sensitivity: float, sampling_prob: float = 1.0) -> float:
    """The widest loss range of :func:`gaussian_pld`'s two directions: what its grid must span."""
    widest = 0.0
    for remove in (True, False) if sampling_prob < 1 else (True,):
        bounds = _gaussian_loss(noise, sensitivity, sampling_prob, remove).connect_dots_bounds()
        widest = max(widest, bounds.epsilon_upper - bounds.epsilon_lower)
    return widest


def _gaussian_pmf(
    noise: float, sensitivity: float, sampling_prob: float, remove: bool, interval: float
) -> pld_pmf.PLDPmf:
    """One direction of dp_accounting's pessimistic connect-the-dots PMF of a (Poisson-subsampled) Gaussian,
    as ``privacy_loss_distribution.from_gaussian_mechanism`` builds it (same loss, tails and grid), from the
    hockey-stick curve of :func:`_gaussian_deltas`: the same PMF, point for point."""
    lower, upper, deltas = _gaussian_deltas(noise, sensitivity, sampling_prob, remove, interval)
    return connect_dots_pmf(interval, lower, upper, deltas)


def _gaussian_deltas(
    noise: float, sensitivity: float, sampling_prob: float, remove: bool, interval: float
) -> tuple[int, int, np.ndarray]:
    """``(lower, upper, deltas)``: one direction's hockey-stick divergence at every loss ``k * interval``,
    ``lower <= k <= upper``, equal to the bit to dp_accounting's ``get_delta_for_epsilon`` on that grid.

    dp_accounting inverts the privacy loss point by point in Python; the grid has ``range / interval``
    points, 10^5 to 10^6 at the low noise of a large budget, where that loop takes seconds. The
    inverse is closed-form (``x = -s/2 - sd^2 l / s`` before subsampling, ``l = log(1 + (e^eps - 1)/q)`` for
    remove and ``-log(1 + (e^-eps - 1)/q)`` for add), so it vectorises; it is evaluated with dp_accounting's
    float operations in its order, because the connect-the-dots PMF divides differences of deltas by
    ``e^interval - 1``: an ulp of delta moves a probability by ``1e4`` ulp at the default grid, and epsilon
    with it, in either direction.
    """
    loss = _gaussian_loss(noise, sensitivity, sampling_prob, remove)
    bounds = loss.connect_dots_bounds()
    lower = math.floor(bounds.epsilon_lower / interval)
    upper = math.ceil(bounds.epsilon_upper / interval)
    eps = np.arange(lower, upper + 1) * interval
    q, s = sampling_prob, sensitivity
    deltas = np.zeros_like(eps)
    if q == 1:
        inside = np.ones_like(eps, dtype=bool)
        unsampled = eps  # dp_accounting inverts either direction's own loss without subsampling
    else:
        # The unsampled loss log(a e^b + c), a = 1/q, c = 1 - 1/q < 0, b = +-eps, in dp_accounting's order of
        # float operations (common.log_a_times_exp_b_plus_c and its _log_sub).
        a, c = 1 / q, 1 - 1 / q
        b = eps if remove else -eps
        with np.errstate(divide="ignore", invalid="ignore"):
            d = b + np.log(a)
            unsampled = d + np.log1p(-np.exp(np.log(-c) - d))
        unsampled[b == 0] = np.log(a + c)
        inside = eps > math.log1p(-q) if remove else eps < -math.log1p(-q)
        if remove:
            deltas[~inside] = -np.expm1(eps[~inside])
        unsampled = unsampled if remove else -unsampled
        # dp_accounting takes a loss within math.isclose of the sampled loss's end as that end itself.
        end = math.log(1 - q) if remove else -math.log(1 - q)
        at_end = np.abs(eps - end) <= 1e-9 * np.maximum(np.abs(eps), abs(end))
        unsampled[at_end] = -math.inf if remove else math.inf
    with np.errstate(invalid="ignore", over="ignore"):
        x = -0.5 * s - unsampled[inside] * (noise**2) / s
    if not remove:
        x = s + x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        deltas[inside] = loss.mu_upper_cdf(x) - np.exp(eps[inside] + loss.mu_lower_log_cdf(x))
    return lower, upper, np.clip(deltas, 0, 1)


def gaussian_pld(
    noise_multiplier: float,
    sensitivity: float,
    sampling_prob: float = 1.0,
    interval: float = PLD_DISCRETIZATION,
) -> pld_lib.PrivacyLossDistribution:
    """dp_accounting's ``from_gaussian_mechanism(noise_multiplier, sensitivity, sampling_prob=...)``
    (add/remove, pessimistic, connect-the-dots), built by :func:`_gaussian_pmf`: the same PLD (to float
    round-off), several times faster, most of all at low noise."""
    remove = _gaussian_pmf(noise_multiplier, sensitivity, sampling_prob, True, interval)
    if sampling_prob == 1:
        return pld_lib.PrivacyLossDistribution(remove)
    return pld_lib.PrivacyLossDistribution(
        remove, _gaussian_pmf(noise_multiplier, sensitivity, sampling_prob, False, interval)
    )


def wor_gaussian_pld(
    noise_multiplier: float,
    dataset_size: int,
    batch_size: int,
    value_discretization_interval: float = PLD_DISCRETIZATION,
) -> pld_lib.PrivacyLossDistribution:
    """Pessimistic PLD of one Gaussian release on ``batch_size`` of ``dataset_size`` records drawn without
    replacement, under replace-one, with dpvr's noise multiplier (see the module docstring).

    The PLD is symmetric (one PMF serves both orders of a neighbouring pair) and composes with
    dp_accounting's PLDs on the same grid. A release without noise is not DP and has no PLD: the noise
    multiplier must be positive.
    """
    n = _checks.count("dataset_size", dataset_size, minimum=1)
    b = _checks.count("batch_size", batch_size, minimum=0)
    if b > n:
        raise ValueError(f"batch_size ({b}) must not exceed dataset_size ({n})")
    z = _checks.positive("noise_multiplier", noise_multiplier)
    d = _checks.positive("value_discretization_interval", value_discretization_interval)
    if b == 0:  # nothing is released
        return pld_lib.identity(d)
    if b == n:  # every record is used: the plain Gaussian, shifted by 2C
        return gaussian_pld(z, 2.0, 1.0, d)
    sampled = gaussian_pld(z, 2.0, b / n, d)
    remove, add = directions(sampled)
    r_loss, r_prob, r_inf = _dense(remove)
    a_loss, a_prob, a_inf = _dense(add)
    above, below = r_loss >= 1, a_loss <= -1
    atom = float(a_prob[~below].sum() + a_inf - r_prob[above].sum() - r_inf)
    # c = remove profile minus add profile at eps = 0 (equal before rounding); a deficit goes to infinity.
    gap = float(remove.get_delta_for_epsilon(0.0) - add.get_delta_for_epsilon(0.0))
    if atom < 0:  # rounding only: raising the atom to 0 raises the eps < 0 profile and lowers c
        gap += atom
        atom = 0.0
    infinity = r_inf + max(0.0, -gap)
    losses = np.concatenate([a_loss[below], [0], r_loss[above]])
    probs = np.concatenate([a_prob[below], [atom], r_prob[above]])
    keep = probs > 0
    pmf = pld_pmf.create_pmf(
        dict(zip(losses[keep].tolist(), probs[keep].tolist())), d, infinity, pessimistic_estimate=True
    )
    return pld_lib.PrivacyLossDistribution(pmf)


def wor_gaussian_delta(epsilon: float, noise_multiplier: float, dataset_size: int, batch_size: int) -> float:
    """Exact hockey-stick divergence of one such release at ``epsilon`` (any sign), in closed form.

    For ``eps >= 0`` it is ``q h(eps')`` with ``eps' = log(1 + (e^eps - 1)/q)`` and ``h`` the profile of
    ``N(2C, z^2)`` against ``N(0, z^2)`` (the module docstring); for ``eps < 0`` it is ``1 - e^eps +
    e^eps delta(-eps)``. This is an independent reference for :func:`wor_gaussian_pld` and for tests.
    """
    q = batch_size / _checks.count("dataset_size", dataset_size, minimum=max(1, batch_size))
    mu = 2.0 / _checks.positive("noise_multiplier", noise_multiplier)

    def gaussian(e: float) -> float:
        return float(norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2))

    e = abs(epsilon)
    positive = q * gaussian(math.log1p(math.expm1(e) / q))
    return positive if epsilon >= 0 else 1 - math.exp(epsilon) + math.exp(epsilon) * positive


__all__ = ["PLD_DISCRETIZATION", "gaussian_pld", "wor_gaussian_delta", "wor_gaussian_pld"]
