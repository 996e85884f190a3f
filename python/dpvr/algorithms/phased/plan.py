"""The phased output-perturbation framework's plan: one release per phase (x, or x and y)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import dp_accounting as dpa

from ...privacy import _checks
from ...privacy.events import Plan, output_perturbation_multiplier
from ...privacy.mechanism import Stream
from ...privacy.relations import REPLACE_ONE, check_neighbouring

_PHASED = {  # setting -> (streams, budget share of each release, share of delta per release)
    "sc": (("x",), 1.0, 0.5),
    "c": (("x",), 1.0, 0.5),
    "c-sc": (("x",), 1.0, 0.5),
    "sc-sc": (("x", "y"), 0.5, 0.25),
    "c-c": (("x", "y"), 0.5, 0.25),
}


@dataclass(frozen=True)
class PhasedPlan(Plan):
    """The phased output-perturbation framework of "bring your own algorithm" (Zhang, Thekumparampil, Oh, He).

    ``setting``: ``"sc"`` (Algorithm 1), ``"c"`` (Algorithm 2, phases on disjoint chunks), ``"sc-sc"``
    (Algorithm 3: x and y), ``"c-c"`` (Algorithms 4 and 5, each on all the data, each phased) or ``"c-sc"``.
    Each stream is one Gaussian output perturbation ``x + N(0, sigma^2 I)`` whose noise multiplier is
    relative to the replace-one sensitivity of the base solver's output (``4L/(mu n)`` for Algorithm 1,
    ``4L/(n sqrt(mu_x mu))`` for Algorithm 3, per phase with ``mu_k`` and ``n/K`` in the phased ones); use
    :func:`output_perturbation_multiplier`. The phases of one run touch disjoint chunks, so by parallel
    composition a run costs one release whatever ``K`` is.

    The sensitivity holds only if the base solver reached its accuracy target: with a certificate (dpvr's
    default) it holds surely; otherwise pass the paper's ``failure_probability`` (added to delta).
    """

    _vectors: ClassVar = {"y": "y"}

    setting: str
    failure_probability: float = 0.0
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        if self.setting not in _PHASED:
            raise ValueError(f"setting must be one of {tuple(_PHASED)}, got {self.setting!r}")
        if not 0 <= self.failure_probability < 1:
            raise ValueError(f"failure_probability must lie in [0, 1), got {self.failure_probability!r}")
        if check_neighbouring(self.neighbouring) != REPLACE_ONE:
            raise ValueError(
                "the phased framework's sensitivities are replace-one stability bounds; "
                "neighbouring must be 'replace-one'"
            )

    def _streams(self, noise):
        return [Stream(name, noise.get(name, 1.0), 1) for name in _PHASED[self.setting][0]]

    def _failure_probability(self) -> float:
        return self.failure_probability

    def exposures(self) -> dict[str, float]:
        return dict.fromkeys(self.streams, 1.0)  # one output perturbation per stream

    def _unit(self, stream: str) -> float:
        # sigma is the noise std over the replace-one sensitivity, twice dpvr's unit.
        return output_perturbation_multiplier(1.0, 1.0, self.neighbouring)

    def _assumptions(self):
        notes = [
            "the base solver's output is within its accuracy target of the regularised optimum "
            "(certified, or with the stated failure probability)"
        ]
        if self.setting in ("c", "c-c", "c-sc"):
            notes.append("phases use disjoint chunks of the data (parallel composition)")
        return tuple(notes)

    def paper_noise(self, epsilon: float, delta: float, *, gaussian: str = "classic") -> dict[str, float]:
        """The paper's noise: each release gets ``(epsilon', delta') = (epsilon, delta/2)`` (one release) or
        ``(epsilon/2, delta/4)`` (x and y); the rest of delta covers the solver's failure probability.

        ``gaussian="classic"`` is the paper's ``sigma/Delta = sqrt(2 log(1.25/delta'))/epsilon'`` (stated for
        ``epsilon < 1``); ``"analytic"`` is Balle and Wang's exact Gaussian mechanism at the same split
        (dp_accounting's ``get_sigma_gaussian``).
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        names, eps_share, delta_share = _PHASED[self.setting]
        eps_r, delta_r = epsilon * eps_share, delta * delta_share
        if gaussian == "classic":
            if epsilon >= 1:
                raise ValueError(
                    f"the classic Gaussian mechanism is stated for epsilon < 1, got {epsilon}; "
                    "use gaussian='analytic'"
                )
            ratio = math.sqrt(2 * math.log(1.25 / delta_r)) / eps_r
        elif gaussian == "analytic":
            ratio = dpa.get_sigma_gaussian(eps_r, delta_r)
        else:
            raise ValueError(f"gaussian must be 'classic' or 'analytic', got {gaussian!r}")
        return {name: self.noise_multiplier(ratio, name) for name in names}


__all__ = ["PhasedPlan"]
