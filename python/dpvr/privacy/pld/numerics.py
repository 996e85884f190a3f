"""dp_accounting's dense-PLD loops, vectorised: the same PMFs and epsilons, in milliseconds.

Three steps of a PLD calibration run Python loops over every grid point in dp_accounting (10^5 to 10^6
points at the accountant's grid): building a connect-the-dots PMF from its hockey-stick curve (a dict of
every point, then a list), the Chernoff truncation bounds of a self-composition (a log-sum-exp per order),
and epsilon at a delta (a loop over the losses from the top). Each function here computes what its
dp_accounting counterpart computes, with the same formulas in the same order of float operations where that
order is sequential (``np.cumsum`` adds left to right, as the loop does): the PMFs are equal, the bounds
equal, and epsilon equal to the last few ulp (``np.exp`` against ``math.exp``), rounded so that it is never
below dp_accounting's; ``tests`` check each
against dp_accounting. They read dp_accounting's dense PMF fields, for which it has no public accessor,
through :mod:`dpvr.privacy.pld.adapter`, and build its public ``DensePLDPmf``.

Privacy: these compute the accountant's epsilon, so each is held to dp_accounting's result, not to a
tolerance of its own; a PMF they cannot take (a sparse one, an optimistic one) goes to dp_accounting.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import fft

from . import adapter
from .adapter import DELTA_DIFF_TOLERANCE as _DELTA_DIFF_TOLERANCE
from .adapter import MAX_SPARSE_POINTS as _MAX_SPARSE
from .adapter import dense_parts, pmfs

_EXP_DOWN = 1 - 2.0**-50


def connect_dots_pmf(interval: float, lower: int, upper: int, deltas: np.ndarray) -> pld_pmf.PLDPmf:
    """``pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lower, upper, deltas)``, without its
    detour through a dict of every grid point (its arithmetic is already vectorised)."""
    deltas = np.asarray(deltas, dtype=np.float64)
    if upper - lower + 1 <= _MAX_SPARSE or deltas.size != upper - lower + 1:
        return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lower, upper, deltas)
    if np.any(deltas < 0) or np.any(deltas > 1) or np.any(np.diff(deltas) > _DELTA_DIFF_TOLERANCE):
        return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lower, upper, deltas)  # raises
    deltas = np.minimum.accumulate(deltas)
    diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + diffs[0] / math.expm1(interval)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(interval)) / math.expm1(interval)
    probs[-1] = diffs[-1] / math.expm1(-interval)
    probs = np.maximum(0.0, probs)
    # create_pmf keeps the span from the least to the greatest key, zeros included.
    return pld_pmf.DensePLDPmf(interval, lower, probs, float(deltas[-1]), True)


def self_convolve_bounds(probs: np.ndarray, count: int, tail_mass: float) -> tuple[int, int]:
    """``pld_common.compute_self_convolve_bounds(probs, count, tail_mass)`` at its default orders
    ``+-j / len(probs)``, j = 1..20: the moment at order ``j / len`` is ``sum_k probs[k] r^(j k)`` with
    ``r^k = exp(k / len)``, one product per order instead of a log-sum-exp (the factors stay within
    ``[e^-20, e^20]``, so nothing overflows)."""
    size = len(probs)
    lower, upper = 0, (size - 1) * count
    if tail_mass == 0:
        return lower, upper
    step = np.exp(np.arange(size) / size)
    up, down = np.array(probs, dtype=np.float64), np.array(probs, dtype=np.float64)
    for j in range(1, 21):
        up *= step
        down /= step
        for order, moment in ((-j / size, down.sum()), (j / size, up.sum())):
            if moment <= 0:
                continue
            bound = (count * math.log(moment) + math.log(2 / tail_mass)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            else:
                lower = max(lower, math.floor(bound))
    return lower, upper


def self_compose(pld: pld_lib.PrivacyLossDistribution, count: int,
                 tail_mass: float = 1e-15) -> pld_lib.PrivacyLossDistribution:
    """``pld.self_compose(count, tail_mass)``, its truncation bounds by :func:`self_convolve_bounds`."""
    composed = [_self_compose_pmf(pmf, count, tail_mass) for pmf in pmfs(pld)]
    return pld_lib.PrivacyLossDistribution(*composed)


def _self_compose_pmf(pmf: pld_pmf.PLDPmf, count: int, tail_mass: float) -> pld_pmf.PLDPmf:
    if not isinstance(pmf, pld_pmf.DensePLDPmf) or count <= 1:
        return pmf.self_compose(count, tail_mass)
    fields = adapter.dense_fields(pmf)
    probs = fields.probs
    low, high = self_convolve_bounds(probs, count, tail_mass)
    length = high - low + 1
    fast = fft.next_fast_len(max(length, len(probs)))
    wrapped = np.real(fft.ifft(fft.fft(probs, fast) ** count))
    out = np.roll(wrapped, -low)[:length]
    infinity = tail_mass - math.expm1(count * math.log1p(-fields.infinity_mass))
    return pld_pmf.DensePLDPmf(fields.discretization, fields.lower_loss * count + low,
                               np.array(out), infinity, fields.pessimistic)


def epsilon_for_delta(pld: pld_lib.PrivacyLossDistribution, delta: float) -> float:
    """``pld.get_epsilon_for_delta(delta)``: the largest of its PMFs' epsilons."""
    return max(_pmf_epsilon(pmf, delta) for pmf in pmfs(pld))


def _pmf_epsilon(pmf: pld_pmf.PLDPmf, delta: float) -> float:
    """dp_accounting's loop over the losses from the top (``pld_pmf._get_epsilon_for_delta``), at once: it
    stops at the first loss below the epsilon that the masses above it give, and returns that epsilon."""
    if not isinstance(pmf, pld_pmf.DensePLDPmf):
        return float(pmf.get_epsilon_for_delta(delta))
    fields = adapter.dense_fields(pmf)
    infinity = fields.infinity_mass
    if infinity > delta:
        return math.inf
    probs = np.flip(fields.probs)
    step = fields.discretization
    top = (fields.lower_loss + len(probs) - 1) * step
    # itertools.count(top, -step): each loss the previous one minus step, rounded as the loop rounds it.
    losses = np.cumsum(np.concatenate(([top], np.full(len(probs) - 1, -step))))
    # The masses before each loss is taken (the loop's state when it tests that loss).
    upper = np.cumsum(np.concatenate(([infinity], probs)))
    # np.exp is within a few ulp of math.exp, either way: each factor is lowered by 4 ulp so that no term,
    # hence (rounding being monotone) no partial sum, exceeds the loop's, and epsilon is never below its.
    lower = np.cumsum(np.concatenate(([0.0], np.exp(-losses) * _EXP_DOWN * probs)))
    with np.errstate(divide="ignore", invalid="ignore"):
        level = np.log((upper[:-1] - delta) / lower[:-1])
        stop = (upper[:-1] > delta) & (lower[:-1] > 0) & (level >= losses)
        # Where exp(-loss) underflows, the loop returns the loss itself once the upper mass reaches delta.
        underflow = (upper[1:] >= delta) & (lower[1:] == 0)
    first_stop = int(np.argmax(stop)) if stop.any() else len(probs)
    first_underflow = int(np.argmax(underflow)) if underflow.any() else len(probs)
    if first_underflow < first_stop:
        return max(0.0, float(losses[first_underflow]))
    mass_upper, mass_lower = float(upper[first_stop]), float(lower[first_stop])
    if mass_upper <= mass_lower + delta:
        return 0.0
    return math.log((mass_upper - delta) / mass_lower)


def composed_points(pmf: pld_pmf.PLDPmf, count: int, tail_mass: float) -> int:
    """Grid points dp_accounting keeps of ``pmf`` self-composed ``count`` times with ``tail_mass``
    truncated: a sparse PMF stays sparse while ``size ** count`` is within its sparse limit, else it is
    made dense and the span is the Chernoff truncation window (:func:`self_convolve_bounds`); one release
    keeps what a composition's truncation of its tails leaves."""
    if count > 1 and isinstance(pmf, pld_pmf.SparsePLDPmf) and pmf.size ** min(count, 64) <= _MAX_SPARSE:
        return pmf.size**count
    probs = dense_parts(pmf)[1]
    if count == 1:  # what composing it truncates to: a prefix and a suffix of mass at most tail_mass / 2 each
        ends = (probs, probs[::-1])
        cut = [int(np.searchsorted(np.cumsum(end), tail_mass / 2, side="right")) for end in ends]
        return max(1, int(probs.size) - sum(cut))
    lower, upper = self_convolve_bounds(probs, count, tail_mass)
    return upper - lower + 1
