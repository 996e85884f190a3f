"""The random number of trials of a private search (Papernot and Steinke, ICLR 2022, Definition 1).

The count must be drawn independently of the data, and kept secret: the guarantee of the search is for
the best trial's output alone. Two families, named as dp_accounting's ``RepeatAndSelectDpEvent`` encodes
them by its ``shape``:

- ``"poisson"`` (``shape = inf``): ``K ~ Poisson(mean)``; ``K = 0`` (probability ``exp(-mean)``) selects
  nothing;
- ``"negative-binomial"`` (``0 <= shape < inf``): the truncated negative binomial ``D_{shape, gamma}``,
  ``P(K = k) = (1 - gamma)^k / (gamma^-shape - 1) * prod_{l<k} (l + shape) / (l + 1)`` for ``k >= 1``;
  ``shape = 1`` is the geometric and ``shape = 0`` the logarithmic distribution
  (``P(K = k) = (1 - gamma)^k / (k log(1 / gamma))``). ``gamma`` is solved from the mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

DISTRIBUTIONS = ("poisson", "negative-binomial")


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials: ``distribution``, its ``mean`` and its ``shape``."""

    distribution: str
    mean: float
    shape: float

    @classmethod
    def make(cls, distribution: str, mean: float, shape: float | None = None) -> TrialCount:
        """Checked: a known family, ``mean >= 1`` (dp_accounting's analysis needs it), and a shape only for
        the negative binomial (default 1: the geometric distribution)."""
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if not (isinstance(mean, (int, float)) and math.isfinite(mean) and mean >= 1):
            raise ValueError(
                f"trials_mean must be a finite number >= 1 (the expected number of trials), got {mean!r}"
            )
        if distribution == "poisson":
            if shape is not None and shape != math.inf:
                raise ValueError(f"the Poisson distribution takes no shape (it is shape=inf), got {shape!r}")
            return cls(distribution, float(mean), math.inf)
        shape = 1.0 if shape is None else shape
        if not (isinstance(shape, (int, float)) and math.isfinite(shape) and shape >= 0):
            raise ValueError(
                f"shape of the truncated negative binomial must be finite and >= 0, got {shape!r}"
            )
        return cls(distribution, float(mean), float(shape))

    @property
    def gamma(self) -> float:
        """The halting probability of the truncated negative binomial with this mean (1 for mean 1)."""
        if self.shape == math.inf:
            raise ValueError("the Poisson distribution has no gamma")
        return _gamma(self.shape, self.mean)

    def tail(self, cap: int) -> float:
        """``P(K > cap)``: the probability that a search capped at ``cap`` trials differs from this one.

        Poisson: the Poisson survival function. Truncated negative binomial: the negative binomial's
        survival function over its mass on ``K >= 1``, ``NB(shape, gamma).sf(cap) / (1 - gamma^shape)``;
        the logarithmic distribution's own for ``shape = 0``."""
        if not (isinstance(cap, (int, np.integer)) and cap >= 0):
            raise ValueError(f"cap must be an integer >= 0, got {cap!r}")
        if self.shape == math.inf:
            return float(stats.poisson.sf(cap, self.mean))
        gamma = self.gamma
        if gamma >= 1.0:  # K = 1 always
            return 0.0 if cap >= 1 else 1.0
        if self.shape == 0:
            return float(stats.logser.sf(cap, 1.0 - gamma))
        return float(stats.nbinom.sf(cap, self.shape, gamma) / -math.expm1(self.shape * math.log(gamma)))

    def draw(self, rng: np.random.Generator) -> int:
        """One draw of the number of trials."""
        if self.shape == math.inf:
            return int(rng.poisson(self.mean))
        gamma = self.gamma
        if gamma >= 1.0:
            return 1
        if self.shape == 0:
            return int(rng.logseries(1.0 - gamma))
        while True:  # the negative binomial conditioned on K >= 1, by rejection (P(K = 0) = gamma^shape < 1)
            k = int(rng.negative_binomial(self.shape, gamma))
            if k >= 1:
                return k


def truncated_negative_binomial_mean(gamma: float, shape: float) -> float:
    """``E[K]`` of ``D_{shape, gamma}``: ``shape (1 - gamma) / (gamma (1 - gamma^shape))``, and
    ``(1 - gamma) / (gamma log(1 / gamma))`` for ``shape = 0``."""
    if gamma >= 1.0:
        return 1.0
    if shape == 0:
        return (1.0 - gamma) / (gamma * -math.log(gamma))
    return shape * (1.0 - gamma) / (gamma * -math.expm1(shape * math.log(gamma)))


def _gamma(shape: float, mean: float) -> float:
    """The ``gamma`` whose truncated negative binomial has ``mean``: the mean falls as gamma grows, so
    bisect (on ``log gamma``, as gamma is small for large means)."""
    if mean <= 1.0:
        return 1.0
    low, high = math.log(1e-300), 0.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if truncated_negative_binomial_mean(math.exp(middle), shape) > mean:
            low = middle
        else:
            high = middle
        if high - low < 1e-13:
            break
    return math.exp(0.5 * (low + high))
