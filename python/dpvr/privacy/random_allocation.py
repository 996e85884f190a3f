"""Privacy loss distribution of the Gaussian mechanism under random allocation (balls-in-bins batches).

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

Numerics (every step errs on the private side). The logs live on a grid of width ``log_grid`` (a multiple of
dp_accounting's PLD grid, onto which the result is written). Two passes are made:

- *remove* (loss ``L``, larger is worse): every log-sum-exp is rounded *up* to the grid, so each outcome is
  recorded at a loss at least its own; alongside each bucket's ``Q``-mass the pass carries
  ``E_Q[S 1(bucket)]``, which is bilinear in the parts' (mass, weight) pairs and so exact, making the
  recorded ``P``-mass of every bucket exactly that of the outcomes assigned to it. A one-step loss above
  ``mu^2/2 + 8 mu`` goes to the infinity mass; one below ``-mu^2/2 - 8 mu`` is raised to the lowest bucket;
- *add* (loss ``-L``, smaller ``L`` is worse): every log-sum-exp is rounded *down*; a one-step loss below the
  range is taken as ``W_j = 0`` (lowering ``S``), and a sum that stays ``0`` goes to the infinity mass; one
  above the range is lowered to the highest bucket.

So the computed profiles upper-bound the exact ones for every ``epsilon``, in each direction, and stay upper
bounds under composition. Each doubling level adds at most ``log_grid`` to a recorded loss, so an epoch's
losses are over-stated by at most about ``log2(t) * log_grid`` (rounding to nearest would halve that, but
would lose the one-sided guarantee). Masses below ``1e-30`` are moved in the same directions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import attr
import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.special import ndtr

from . import _checks
from .subsampling import PLD_DISCRETIZATION

#: Width of the log grid of the doubling; a multiple of the PLD grid (see the module docs for its cost).
LOG_GRID = 1e-3
_TAIL_SDS = 8.0  # one-step losses beyond this many standard deviations go to the tails (mass ~1e-15)
_NEGLIGIBLE = 1e-30


@attr.define(frozen=True)
class RandomAllocationDpEvent(dpa.DpEvent):
    """One step of an epoch of ``num_steps`` steps in which every record is used in exactly one step, chosen
    uniformly at random; the step applies ``event`` to its batch.

    dp_accounting has no such event. dpvr prices a stream's releases by epoch: ``c`` releases of this event
    from the start of a run cost ``ceil(c / num_steps)`` epochs (a partial epoch is a prefix of a full one:
    post-processing). A lone release is charged a whole epoch.
    """

    num_steps: int
    event: dpa.DpEvent


def is_random_allocation(event: dpa.DpEvent) -> bool:
    """Whether ``event`` is one random-allocation step of a Gaussian release (dpvr builds its PLD)."""
    return isinstance(event, RandomAllocationDpEvent) and isinstance(event.event, dpa.GaussianDpEvent)


def epochs(releases: int, num_steps: int) -> int:
    """Epochs spanned by ``releases`` consecutive releases from the start of an epoch of ``num_steps``."""
    return -(-releases // num_steps)


@dataclass
class _Law:
    """The law of a log partial sum ``log S_m`` under ``Q`` on the grid: bucket ``start + i`` holds ``Q``-mass
    ``mass[i]`` and weight ``E_Q[S_m 1(bucket)]`` ``weight[i]`` (remove pass only). ``atom`` is the ``Q``-mass
    (and ``atom_weight`` the weight) of ``S_m = +inf`` (remove pass) or of ``S_m = 0`` (add pass)."""

    start: int
    mass: np.ndarray
    weight: np.ndarray | None
    atom: float
    atom_weight: float = 0.0


def _interval_mass(lo: np.ndarray, hi: np.ndarray, mean: float, sd: float) -> np.ndarray:
    """``N(mean, sd^2)`` mass of ``(lo, hi]``, from the nearer tail (no cancellation in either tail)."""
    a, b = (lo - mean) / sd, (hi - mean) / sd
    return np.where(a > 0, ndtr(-a) - ndtr(-b), ndtr(b) - ndtr(a))


def _base(mu: float, t: int, grid: float, up: bool) -> _Law:
    """The law of ``log W = l - log t`` for one coordinate (see the module docs for the tails)."""
    shift = math.log(t)
    low = -mu * mu / 2 - _TAIL_SDS * mu - shift
    high = mu * mu / 2 + _TAIL_SDS * mu - shift
    first, last = math.floor(low / grid), math.ceil(high / grid)
    index = np.arange(first, last + 1)
    # Remove pass: bucket i holds ((i - 1) grid, i grid]; add pass: [i grid, (i + 1) grid).
    lo = (index - 1 if up else index) * grid + shift
    hi = lo + grid
    lo[0], hi[-1] = -np.inf, np.inf  # the tails join the end buckets ...
    q_mean, p_mean = -mu * mu / 2, mu * mu / 2
    mass = _interval_mass(lo, hi, q_mean, mu)
    if not up:
        below = float(ndtr((first * grid + shift - q_mean) / mu))
        mass[0] -= below  # ... except the add pass's lower tail, which becomes W = 0
        return _Law(int(first), np.maximum(mass, 0.0), None, below)
    above = (last - 1) * grid + shift  # remove pass: losses above the last bucket's lower edge are infinite
    tail_q, tail_p = float(ndtr((q_mean - above) / mu)), float(ndtr((p_mean - above) / mu))
    weight = _interval_mass(lo, hi, p_mean, mu) / t
    mass[-1], weight[-1] = 0.0, 0.0
    return _Law(int(first), mass, weight, tail_q, tail_p / t)


def _steps(grid: float, up: bool) -> list[tuple[int, int, int | None]]:
    """``(k, lo, hi)``: for ``a >= b`` on the grid, ``a - b = j`` in ``[lo, hi]`` (``hi=None``: unbounded)
    makes ``log(e^a + e^b)`` land on ``a + k`` (rounded up or down)."""
    beyond = math.ceil(-math.log(math.expm1(grid)) / grid) + 1  # log1p(e^-x) <= grid from here on
    j = np.arange(beyond + 1)
    exact = np.log1p(np.exp(-j * grid)) / grid
    k = np.ceil(exact - 1e-9) if up else np.floor(exact + 1e-9)
    k = np.maximum(k, 1 if up else 0).astype(int)
    out: list[tuple[int, int, int | None]] = []
    start = 0
    for i in range(1, len(k) + 1):
        if i == len(k) or k[i] != k[start]:
            out.append((int(k[start]), start, i - 1 if i < len(k) else None))
            start = i
    return out


class _Cumulative:
    """Zero-padded left and right cumulative sums of ``y``: window sums are then two slices, taken from
    whichever side subtracts the smaller partial sum (no cancellation in either tail)."""

    def __init__(self, y: np.ndarray, pad: int) -> None:
        self.n, self.pad = y.size, pad
        total = float(y.sum())
        zeros, totals = np.zeros(pad + 1), np.full(pad + 1, total)
        self.left = np.concatenate([zeros, np.cumsum(y), totals])  # left[pad + 1 + i] = sum y[:i + 1]
        self.right = np.concatenate([totals, np.cumsum(y[::-1])[::-1], zeros])  # same index: sum y[i:]

    def window(self, lo: int, hi: int | None) -> np.ndarray:
        """``s[a] = sum_{j = lo}^{hi} y[a - j]`` for every ``a`` (``hi=None``: every ``j >= lo``)."""
        n, o = self.n, self.pad + 1
        top = self.left[o - lo : o - lo + n]  # sum y[: a - lo + 1]
        if hi is None:
            return top
        bottom = self.left[o - hi - 1 : o - hi - 1 + n]  # sum y[: a - hi]
        from_right = self.right[o - hi : o - hi + n]  # sum y[a - hi:]
        after = self.right[o - lo + 1 : o - lo + 1 + n]  # sum y[a - lo + 1:]
        return np.maximum(np.where(top <= from_right, top - bottom, from_right - after), 0.0)


def _lse(
    pairs: list[tuple[np.ndarray, np.ndarray]], steps: list[tuple[int, int, int | None]]
) -> np.ndarray:
    """``out[c] = sum_(x, y) sum over (a, b) landing on c of x[a] y[b]`` (one grid start; ``c >= max(a,
    b)``); the pairs share their cumulative sums."""
    n = pairs[0][0].size
    pad = max(hi for _, _, hi in steps if hi is not None) + 1
    cumulative: dict[int, _Cumulative] = {}
    for array in (v for pair in pairs for v in pair):
        cumulative.setdefault(id(array), _Cumulative(array, pad))
    out = np.zeros(n + steps[0][0] + 1)
    for k, lo, hi in steps:
        target = out[k : k + n]
        for x, y in pairs:
            target += x * cumulative[id(y)].window(lo, hi)  # a >= b
            if hi is None or hi >= 1:
                target += y * cumulative[id(x)].window(max(lo, 1), hi)  # b > a
    return out


def _aligned(a: _Law, b: _Law) -> tuple[int, list[np.ndarray | None]]:
    start = min(a.start, b.start)
    size = max(a.start + a.mass.size, b.start + b.mass.size) - start

    def place(values: np.ndarray | None, at: int) -> np.ndarray | None:
        if values is None:
            return None
        out = np.zeros(size)
        out[at - start : at - start + values.size] = values
        return out

    return start, [place(a.mass, a.start), place(a.weight, a.start), place(b.mass, b.start),
                   place(b.weight, b.start)]


def _combine(a: _Law, b: _Law, steps: list[tuple[int, int, int | None]], up: bool) -> _Law:
    """The law of ``log(S_a + S_b)`` for independent partial sums (module docs)."""
    start, (ma, wa, mb, wb) = _aligned(a, b)
    mass = _lse([(ma, mb)], steps)
    if up:  # +inf atoms absorb; weights are bilinear in (mass, weight)
        weight = _lse([(wa, mb), (ma, wb)], steps)
        atom = a.atom + b.atom - a.atom * b.atom
        atom_weight = a.atom_weight + b.atom_weight + float(wa.sum()) * b.atom + float(wb.sum()) * a.atom
        return _trim(_Law(start, mass, weight, atom, atom_weight), up)
    mass[: ma.size] += a.atom * mb + b.atom * ma  # a zero partial sum leaves the other one unchanged
    return _trim(_Law(start, mass, None, a.atom * b.atom), up)


def _trim(law: _Law, up: bool) -> _Law:
    """Drop negligible end buckets, moving their mass to the private side (module docs)."""
    keep = np.flatnonzero(law.mass > _NEGLIGIBLE)
    first, last = int(keep[0]), int(keep[-1])
    mass = law.mass[first : last + 1].copy()
    weight = None if law.weight is None else law.weight[first : last + 1].copy()
    if up:  # low end raised to the first bucket; high end to +inf
        mass[0] += law.mass[:first].sum()
        weight[0] += law.weight[:first].sum()
        atom = law.atom + float(law.mass[last + 1 :].sum())
        atom_weight = law.atom_weight + float(law.weight[last + 1 :].sum())
        return _Law(law.start + first, mass, weight, atom, atom_weight)
    mass[-1] += law.mass[last + 1 :].sum()  # add pass: high end lowered to the last bucket; low end to 0
    return _Law(law.start + first, mass, None, law.atom + float(law.mass[:first].sum()))


def _sum_law(mu: float, t: int, grid: float, up: bool) -> _Law:
    """The law of ``log S`` for ``S`` the sum of ``t`` one-coordinate terms, by binary doubling."""
    steps = _steps(grid, up)
    power, total = _base(mu, t, grid, up), None
    remaining = t
    while True:
        if remaining & 1:
            total = power if total is None else _combine(total, power, steps, up)
        remaining >>= 1
        if not remaining:
            return total
        power = _combine(power, power, steps, up)


def _pmf(law: _Law, grid: float, interval: float, up: bool) -> pld_pmf.PLDPmf:
    ratio = round(grid / interval)
    index = (np.arange(law.mass.size) + law.start) * ratio
    probs = law.weight if up else law.mass
    losses = index if up else -index
    keep = probs > 0
    infinity = law.atom_weight if up else law.atom
    return pld_pmf.create_pmf(
        dict(zip(losses[keep].tolist(), probs[keep].tolist())), interval, infinity, pessimistic_estimate=True
    )


@functools.lru_cache(maxsize=64)
def random_allocation_gaussian_pld(
    noise_multiplier: float,
    num_steps: int,
    value_discretization_interval: float = PLD_DISCRETIZATION,
    log_grid: float = LOG_GRID,
) -> pld_lib.PrivacyLossDistribution:
    """Pessimistic PLD of one epoch of ``num_steps`` Gaussian releases under random allocation (each record in
    exactly one uniformly random step), under add/remove, with dpvr's noise multiplier (module docs).

    ``num_steps = 1`` is the Gaussian mechanism (dp_accounting's own PLD). The result holds both directions
    and composes with dp_accounting's PLDs on the same grid; it is cached (the calls are pure).
    """
    z = _checks.positive("noise_multiplier", noise_multiplier)
    t = _checks.count("num_steps", num_steps, minimum=1)
    interval = _checks.positive("value_discretization_interval", value_discretization_interval)
    grid = _checks.positive("log_grid", log_grid)
    if abs(grid / interval - round(grid / interval)) > 1e-9 or round(grid / interval) < 1:
        raise ValueError(f"log_grid ({grid}) must be a multiple of the PLD grid ({interval})")
    if t == 1:
        return pld_lib.from_gaussian_mechanism(z, sensitivity=1.0, value_discretization_interval=interval)
    return _allocation_pld(z, t, interval, grid)


def _allocation_pld(z: float, t: int, interval: float, grid: float) -> pld_lib.PrivacyLossDistribution:
    """The doubling construction, for any ``t >= 1`` (the tests compare ``t = 1`` with the Gaussian)."""
    mu = 1.0 / z
    remove = _pmf(_sum_law(mu, t, grid, True), grid, interval, True)
    add = _pmf(_sum_law(mu, t, grid, False), grid, interval, False)
    return pld_lib.PrivacyLossDistribution(remove, add)


__all__ = [
    "LOG_GRID",
    "RandomAllocationDpEvent",
    "epochs",
    "is_random_allocation",
    "random_allocation_gaussian_pld",
]
