"""Privacy loss distribution of the Gaussian mechanism under random allocation (balls-in-bins batches).

The event is :class:`~dpvr.privacy.random_allocation.RandomAllocationDpEvent`; this module prices it.

Random allocation: an epoch has ``t`` steps and every record is used in exactly one of them, chosen uniformly
at random and independently of the other records (Chua et al. 2025, "Balls-and-bins sampling for DP-SGD";
Feldman and Shenfeld 2025, "Privacy amplification by random allocation", the ``k = 1`` case). Batch sizes
vary (binomial, mean ``n / t``); each step releases the sum of its records' contributions (each of L2 norm at
most ``C``) plus ``N(0, (z C)^2 I)``, ``z`` the noise multiplier.

Neighbouring relation: add/remove only. Because each record picks its step independently, removing a record
leaves the others' law unchanged, and Chua et al. show that the pair

    P = (1/t) sum_j N(e_j, z^2 I_t),    Q = N(0, z^2 I_t)

(in units of ``C``; ``e_j`` the ``j``-th unit vector) dominates one epoch of adaptively chosen steps (their
adaptive batch linear queries; Feldman and Shenfeld reduce the general case to the same pair): "remove"
(``D`` against ``D`` minus a record) is bounded by ``(P, Q)`` and "add" by ``(Q, P)``. Under add/remove the
direction of a pair is fixed for the whole run, so the two directions compose separately (Zhu, Dong and Wang
2022, Theorem 10), as dp_accounting composes Poisson subsampling; epochs draw independent allocations and
compose adaptively. Replace-one has no such pair here (the replaced record's two values share one random
step), so it is refused, as fixed-size sampling is refused under add/remove.

The PLD (Feldman and Shenfeld 2026, "Efficient privacy loss accounting for subsampling and random
allocation"): with ``l_j = x_j / z^2 - 1 / (2 z^2)`` the one-step Gaussian privacy loss of coordinate ``j``,
the loss of the pair is ``L = log((1/t) sum_j exp(l_j))``. Under ``Q`` the ``l_j`` are i.i.d.
``N(-mu^2/2, mu^2)`` with ``mu = 1/z``, so ``S = e^L`` is a sum of ``t`` i.i.d. log-normals
``W_j = e^(l_j)/t``, and ``dP/dQ = S``. The remove PMF is the law of ``L`` under ``P``, i.e.
``P(L in B) = E_Q[S 1(L in B)]``; the add PMF is the law of ``-L`` under ``Q``. Both follow from the law
of ``log S`` under ``Q``, computed here by repeated doubling: the log of a sum of two independent partial
sums is the log-sum-exp of their logs.

Numerics. Both directions are functions of the law of ``S`` under ``Q``: the remove profile is
``E_Q[(S - e^eps)_+]`` and the add profile ``E_Q[(1 - e^eps S)_+]``, both convex in ``S``, the first
increasing and the second decreasing. A law ``S'`` that dominates ``S`` in the increasing convex order
therefore bounds every remove profile from above, one that dominates it in the decreasing convex order every
add profile, and both orders survive sums of independent terms (the doubling) and products of independent
likelihood ratios (the composition of epochs, which dp_accounting then does exactly on its loss grid). dpvr
computes such laws on geometric grids ``s_i = e^(i g)`` by repeated doubling (``t`` in binary), in two passes
that differ only in the tails:

- every value that falls between two grid points (a one-step ``W_j``, or the sum of two partial sums) is
  split between its two neighbours with the probabilities that keep its mean. A mean-preserving spread
  dominates in both orders at once, and unlike rounding up (or down) it does not shift the losses: each split
  adds at most ``(s (e^g - 1))^2 / 4`` to the variance of ``S``, an error of second order in ``g`` that does
  not accumulate as a bias over the ``log2 t`` levels or over epochs;
- *remove* pass: a one-step loss above ``mu^2/2 + 8 mu`` (``P``'s eight standard deviations) is given
  infinite loss, with its exact ``P``-mass ``E_Q[S 1(...)]``, and one below ``-mu^2/2 - 12 mu`` is raised to
  the lowest grid point; *add* pass: one above ``-mu^2/2 + 8 mu`` is lowered to the top grid point, ``W_j``
  below ``e^(-mu^2/2 - 12 mu) / t`` is split between ``0`` and the lowest grid point (mean-preserving, mass
  ``~1e-33``), and a partial sum with a zero part is lowered to ``0``. The ends of a partial sum's law that
  hold below ``1e-25`` in all are raised to its first kept point or to the infinite loss (remove), lowered to
  ``0`` or to its last kept point (add).

The grid adapts to a target relative ``precision`` (:data:`PRECISION`). A split of partial sums of ``m`` of
the ``t`` terms (each present ``t / m`` times in ``S``) adds at most ``(m + c^2) (e^g - 1)^2 / (4 t)`` to
``Var S = c^2 / t`` (``c^2 = e^(mu^2) - 1``), so with ``n`` splits in all, ``e^g - 1 = sqrt(4 precision c^2 /
(n (m + c^2)))`` keeps the variance of ``S`` within a factor ``1 + precision`` of the exact one, whatever
``t`` and the number of epochs: coarse grids for the wide one-step laws, fine ones for the narrow laws of
large partial sums. Each grid is a power-of-two multiple of dp_accounting's loss grid (a finer one holds the
coarser points exactly) and is coarsened where a law would need more than :data:`_MAX_POINTS` points (the
bound then holds all the same, less tightly); the doubling costs ``O(_MAX_POINTS^2)`` per level at most. At a
noise multiplier below ``1 / 25`` random allocation gains about ``log t`` on a loss of ``mu^2 / 2 > 300``;
the epoch is then priced as one Gaussian release, which dominates it (joint convexity), and whose PLD needs
no values ``e^L`` beyond floating point.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.special import ndtr

from .. import _checks
from .subsampling import PLD_DISCRETIZATION, gaussian_pld

#: Target relative precision of an epoch's PLD: the variance of ``S`` (of the privacy loss, to first order)
#: may exceed the exact one by this fraction (module docs); an epsilon is over-stated by about half of it.
PRECISION = 1e-3
_TAIL_SDS = 8.0  # one-step losses above this many standard deviations go to the tails (mass ~1e-15)
_LOW_SDS = 12.0  # and below this many (mass ~1e-33, so that zero partial sums are negligible)
_NEGLIGIBLE = 1e-25  # mass and P-mass moved off each end of a law at each step, at most
_MAX_POINTS = 4096  # grid points of one law: bounds the doubling's cost (module docs)
_MAX_STEP = 0.05  # the coarsest grid the precision target may choose
_GAUSSIAN_MU = 25.0  # mu = 1/z above which an epoch is priced as one Gaussian release (module docs)


@dataclass
class _Law:
    """The law of a partial sum ``S'`` under ``Q`` on the grid of width ``unit`` PLD intervals: point
    ``start + i`` (value ``e^((start + i) unit interval)``) holds ``Q``-mass ``mass[i]``; ``zero`` is the mass
    of ``S' = 0``, ``atom`` that of ``S' = +inf`` (remove pass), whose ``P``-mass ``E_Q[S 1(S' = inf)]`` is
    ``atom_weight``."""

    start: int
    unit: int
    mass: np.ndarray
    zero: float = 0.0
    atom: float = 0.0
    atom_weight: float = 0.0


def _interval_mass(lo: np.ndarray, hi: np.ndarray, mean: float, sd: float) -> np.ndarray:
    """``N(mean, sd^2)`` mass of ``(lo, hi]``, from the nearer tail (no cancellation in either tail)."""
    a, b = (lo - mean) / sd, (hi - mean) / sd
    return np.where(a > 0, ndtr(-a) - ndtr(-b), ndtr(b) - ndtr(a))


def _weights(law: _Law, interval: float) -> np.ndarray:
    """``E_Q[S' 1(S' = s_i)] = mass_i s_i`` of every grid point, in logs (the values ``s_i`` may overflow)."""
    step = law.unit * interval
    with np.errstate(divide="ignore"):
        return np.exp(np.log(law.mass) + (law.start + np.arange(law.mass.size)) * step)


def _unit(m: int, spread: float, splits: int, precision: float, interval: float, span: float) -> int:
    """The grid (PLD intervals, a power of two) of a law of partial sums of ``m`` terms spanning ``span`` in
    log: the precision target's step for ``m`` (module docs; ``spread = 1 / c^2``), coarsened to at most
    ``_MAX_POINTS`` points."""
    step = min(math.log1p(math.sqrt(4 * precision / (splits * (1 + m * spread)))), _MAX_STEP)
    unit = 1 << max(0, math.floor(math.log2(step / interval)))
    while span / (unit * interval) > _MAX_POINTS:
        unit <<= 1
    return unit


def _base(mu: float, t: int, up: bool, unit: int, interval: float) -> _Law:
    """The law of ``W = e^l / t`` for one coordinate, split onto the grid (module docs for the tails)."""
    step, shift = unit * interval, math.log(t)
    q_mean, p_mean = -mu * mu / 2, mu * mu / 2
    low = q_mean - _LOW_SDS * mu
    high = (p_mean if up else q_mean) + _TAIL_SDS * mu
    first, last = math.floor((low - shift) / step), math.ceil((high - shift) / step)
    edges = np.arange(first, last + 1) * step + shift  # log-losses l of the grid points
    q = _interval_mass(edges[:-1], edges[1:], q_mean, mu)  # Q-mass of each gap
    moment = _interval_mass(edges[:-1], edges[1:], p_mean, mu) / t  # E_Q[W 1(gap)]
    lower = np.exp(edges[:-1] - shift)
    # Mean-preserving split of each gap's mass between its two ends.
    upper = np.clip((moment - lower * q) / (lower * math.expm1(step)), 0.0, q)
    mass = np.zeros(edges.size)
    mass[:-1] += q - upper
    mass[1:] += upper
    below_q = float(ndtr((edges[0] - q_mean) / mu))
    below_moment = float(ndtr((edges[0] - p_mean) / mu)) / t
    raised = below_q if up else min(below_q, below_moment / math.exp(edges[0] - shift))
    mass[0] += raised
    law = _Law(first, unit, mass, zero=below_q - raised)
    above_q = float(ndtr((q_mean - edges[-1]) / mu))
    if up:
        law.atom, law.atom_weight = above_q, float(ndtr((p_mean - edges[-1]) / mu)) / t
    else:
        mass[-1] += above_q
    return _trim(law, up, interval)


def _convert(law: _Law, unit: int, interval: float) -> _Law:
    """``law`` on the grid of width ``unit``: exact on a finer grid (it holds the coarse points), by
    mean-preserving splits on a coarser one."""
    if unit == law.unit:
        return law
    if law.unit % unit == 0:
        ratio = law.unit // unit
        mass = np.zeros((law.mass.size - 1) * ratio + 1)
        mass[::ratio] = law.mass
        return _Law(law.start * ratio, unit, mass, law.zero, law.atom, law.atom_weight)
    ratio = unit // law.unit
    index = law.start + np.arange(law.mass.size)
    coarse = index // ratio
    rest = index - coarse * ratio
    upper = law.mass * np.expm1(rest * law.unit * interval) / math.expm1(unit * interval)
    first = int(coarse[0])
    mass = np.bincount(coarse - first, law.mass - upper, minlength=int(coarse[-1]) - first + 2)
    mass[1:] += np.bincount(coarse - first, upper, minlength=mass.size - 1)[: mass.size - 1]
    return _Law(first, unit, mass, law.zero, law.atom, law.atom_weight)


def _add_pairs(
    out: np.ndarray,
    origin: int,
    large: tuple[np.ndarray, int],
    small: tuple[np.ndarray, int],
    step: float,
    first: int,
    double: bool,
) -> None:
    """Add to ``out`` (grid point ``origin + i`` at ``out[i]``) the sums of the pairs whose larger term ``a``
    comes from ``large`` and smaller term ``b`` from ``small`` (each ``(masses, start)``), ``a - b = j >=
    first``; ``double`` counts each pair with ``j > 0`` twice (the two orders of one law with itself).

    ``e^(a step) + e^(b step) = e^((a + phi_j) step)`` with ``phi_j = log1p(e^(-j step)) / step``: the pair's
    mass goes to ``a + k`` and ``a + k + 1`` (``k = floor(phi_j)``) in the proportions that keep its mean,
    which depend on ``j`` only. For the ``j`` of one ``k`` that is a short convolution of ``small``, by direct
    sums of non-negative terms (no cancellation in the tails)."""
    (x, x_start), (y, y_start) = large, small
    j_lo = max(first, x_start - (y_start + y.size - 1))
    j_hi = x_start + x.size - 1 - y_start
    if j_hi < j_lo:
        return
    j = np.arange(j_lo, j_hi + 1)
    log_sum = np.log1p(np.exp(-j * step))  # (a + phi_j - a) * step
    k = np.floor(log_sum / step).astype(np.int64)
    theta = np.clip(np.expm1(log_sum - k * step) / math.expm1(step), 0.0, 1.0)
    weight = np.where(j > 0, 2.0, 1.0) if double else np.ones(j.size)
    bounds = [0, *(np.flatnonzero(np.diff(k)) + 1).tolist(), j.size]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        # conv[i] = sum_j part_j y[i - (j - j[lo])]: for a = x_start + s, i = s + x_start - y_start - j[lo].
        offset = x_start - y_start - int(j[lo])
        begin, stop = max(0, -offset), min(x.size, y.size + hi - lo - 1 - offset)
        if begin >= stop:
            continue
        target = x_start + begin + int(k[lo]) - origin
        for part in ((1.0 - theta[lo:hi]) * weight[lo:hi], theta[lo:hi] * weight[lo:hi]):
            conv = np.convolve(y, part)
            out[target : target + stop - begin] += x[begin:stop] * conv[begin + offset : stop + offset]
            target += 1


def _combine(a: _Law, b: _Law, unit: int, up: bool, interval: float) -> _Law:
    """The law of ``S_a + S_b`` for independent partial sums, on the grid ``unit`` (module docs)."""
    same = a is b
    a, b = _convert(a, unit, interval), _convert(b, unit, interval)
    step = unit * interval
    origin = min(a.start, b.start)
    end = max(a.start + a.mass.size, b.start + b.mass.size)
    mass = np.zeros(end - origin + math.floor(math.log(2) / step) + 2)
    if same:
        _add_pairs(mass, origin, (a.mass, a.start), (a.mass, a.start), step, 0, True)
    else:  # a pair with equal terms is counted once
        _add_pairs(mass, origin, (a.mass, a.start), (b.mass, b.start), step, 0, False)
        _add_pairs(mass, origin, (b.mass, b.start), (a.mass, a.start), step, 1, False)
    # Add pass only: a sum with a zero part (probability ~t 1e-33) is lowered to zero, a decreasing move.
    law = _Law(origin, unit, mass, zero=a.zero + b.zero - a.zero * b.zero)
    if up:  # +inf absorbs; the P-mass of the sum's infinite outcomes, from the parts' (exact) ones
        finite_a, finite_b = float(_weights(a, interval).sum()), float(_weights(b, interval).sum())
        law.atom = a.atom + b.atom - a.atom * b.atom
        law.atom_weight = a.atom_weight + b.atom_weight + finite_a * b.atom + finite_b * a.atom
    return _trim(law, up, interval)


def _trim(law: _Law, up: bool, interval: float) -> _Law:
    """Drop the ends of the support that hold at most ``_NEGLIGIBLE`` of mass and of ``P``-mass in all, moving
    them to the private side (module docs). Cumulative, not point by point: the far-off sums that a zero term
    leaves (``S_a + 0``) would otherwise keep thousands of near-empty points and coarsen the grids."""
    weight = _weights(law, interval) if up else law.mass
    size = np.maximum(law.mass, weight)
    first = int(np.searchsorted(np.cumsum(size), _NEGLIGIBLE, side="right"))
    last = size.size - 1 - int(np.searchsorted(np.cumsum(size[::-1]), _NEGLIGIBLE, side="right"))
    if first > last:  # nothing but negligible mass: keep its largest point
        first = last = int(np.argmax(size))
    mass = law.mass[first : last + 1].copy()
    if up:  # low end raised to the first point; high end to +inf, with its P-mass
        mass[0] += law.mass[:first].sum()
        law.atom += float(law.mass[last + 1 :].sum())
        law.atom_weight += float(weight[last + 1 :].sum())
    else:  # low end lowered to 0; high end to the last point
        mass[-1] += law.mass[last + 1 :].sum()
        law.zero += float(law.mass[:first].sum())
    law.start, law.mass = law.start + first, mass
    return law


def _span(*laws: _Law, interval: float) -> float:
    """The widest log-extent of ``laws``' supports: the doubling kernel's cost is the product of two of them
    in grid points (the sum's extent is no wider)."""
    return max(law.mass.size * law.unit for law in laws) * interval


def _sum_law(mu: float, t: int, up: bool, interval: float, precision: float) -> _Law:
    """The law of ``S'`` for ``S`` the sum of ``t`` one-coordinate terms, by binary doubling on the grids the
    precision target chooses (module docs)."""
    spread = 1.0 / max(math.expm1(min(mu * mu, 700.0)), 1e-300)  # 1 / c^2
    splits = t.bit_length() + bin(t).count("1") - 1  # the base, the doublings and the accumulations
    width = mu * mu + 2 * _TAIL_SDS * mu
    power = _base(mu, t, up, _unit(1, spread, splits, precision, interval, width), interval)
    size, total, total_size = 1, None, 0
    remaining = t
    while True:
        if remaining & 1:
            if total is None:
                total, total_size = power, size
            else:
                total_size += size
                span = _span(total, power, interval=interval)
                unit = _unit(total_size, spread, splits, precision, interval, span)
                total = _combine(total, power, unit, up, interval)
        remaining >>= 1
        if not remaining:
            return total
        size *= 2
        unit = _unit(size, spread, splits, precision, interval, _span(power, interval=interval))
        power = _combine(power, power, unit, up, interval)


def _pmf(law: _Law, interval: float, up: bool) -> pld_pmf.PLDPmf:
    """The remove PMF (law of ``L = log S'`` under ``P' = S' Q'``), or the add PMF (``-L`` under ``Q'``)."""
    index = (law.start + np.arange(law.mass.size)) * law.unit
    probs = _weights(law, interval) if up else law.mass
    losses = index if up else -index
    keep = probs > 0
    infinity = law.atom_weight if up else law.zero
    # P (remove) and Q (add) are probabilities: what float round-off lost of them (about t times 1e-16) gets
    # the infinite loss.
    infinity += max(0.0, 1.0 - math.fsum(probs[keep]) - infinity)
    return pld_pmf.create_pmf(
        dict(zip(losses[keep].tolist(), probs[keep].tolist())), interval, infinity, pessimistic_estimate=True
    )


@functools.lru_cache(maxsize=64)
def random_allocation_gaussian_pld(
    noise_multiplier: float,
    num_steps: int,
    value_discretization_interval: float = PLD_DISCRETIZATION,
    precision: float = PRECISION,
) -> pld_lib.PrivacyLossDistribution:
    """Pessimistic PLD of one epoch of ``num_steps`` Gaussian releases under random allocation (each record in
    exactly one uniformly random step), under add/remove, with dpvr's noise multiplier (module docs).

    Guarantee: both directions' privacy profiles upper-bound the exact ones at every epsilon, so the PLD
    dominates the epoch and its compositions. ``precision`` is the target relative excess of the variance of
    the epoch's likelihood ratio (about twice the relative excess of an epsilon), met whatever ``num_steps``
    and the number of epochs, except where a law would need more than ``_MAX_POINTS`` grid points. ``num_steps
    = 1`` is the Gaussian mechanism (dp_accounting's own PLD), and so is a noise multiplier below
    ``1 / 25`` (a valid bound: no amplification). The result holds both directions and composes with
    dp_accounting's PLDs on the same grid; it is cached (the calls are pure).
    """
    z = _checks.positive("noise_multiplier", noise_multiplier)
    t = _checks.count("num_steps", num_steps, minimum=1)
    interval = _checks.positive("value_discretization_interval", value_discretization_interval)
    precision = _checks.positive("precision", precision)
    if t == 1 or 1.0 / z > _GAUSSIAN_MU:  # dp_accounting's Gaussian PLD, built vectorised
        return gaussian_pld(z, 1.0, 1.0, interval)
    return _allocation_pld(z, t, interval, precision)


def _allocation_pld(
    z: float, t: int, interval: float, precision: float = PRECISION
) -> pld_lib.PrivacyLossDistribution:
    """The doubling construction, for any ``t >= 1`` (the tests compare ``t = 1`` with the Gaussian)."""
    mu = 1.0 / z
    remove = _pmf(_sum_law(mu, t, True, interval, precision), interval, True)
    add = _pmf(_sum_law(mu, t, False, interval, precision), interval, False)
    return pld_lib.PrivacyLossDistribution(remove, add)


__all__ = ["PRECISION", "random_allocation_gaussian_pld"]
