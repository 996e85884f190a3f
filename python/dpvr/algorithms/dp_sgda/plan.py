"""DP-SGDA's plan: an ``"x"`` and a ``"y"`` stream on one shared batch per step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ...privacy import _checks
from ...privacy.events import PER_SAMPLE, Plan, check_paper_regime, check_relation, released_stream
from ...privacy.mechanism import Sampling
from ...privacy.relations import REPLACE_ONE


@dataclass(frozen=True)
class DPSGDAPlan(Plan):
    """DP-SGDA (Yang et al. 2022, as restated by the PrivateDiff paper): streams ``"x"`` and ``"y"``.

    Each of ``steps`` steps draws one batch of ``batch_size`` records and releases the clipped x-gradient
    mean plus ``N(0, sigma_x^2 C1^2 I)`` and the clipped y-gradient mean plus ``N(0, sigma_y^2 C2^2 I)``:
    ``z = sigma * batch_size`` for each. On a shared batch (``shared_batch=True``, as in the paper) the two
    are one release with ``1/z^2 = 1/z_x^2 + 1/z_y^2``.

    Guarantee: composition of ``steps`` sampled Gaussian releases.
    """

    _vectors: ClassVar = {"y": "y"}

    dataset_size: int
    batch_size: int
    steps: int
    sampling: str = "wor"
    shared_batch: bool = True
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        _checks.count("steps", self.steps)
        check_relation(self.neighbouring, self.batch_sampling)
        self._refuse_private_size()

    @property
    def batch_sampling(self) -> Sampling:
        return Sampling.make(self.sampling, batch_size=self.batch_size, dataset_size=self.dataset_size)

    def _streams(self, noise):
        group = "xy" if self.shared_batch else None
        return released_stream(noise, "x", self.steps, self.batch_sampling, group) + released_stream(
            noise, "y", self.steps, self.batch_sampling, group
        )

    def _assumptions(self):
        batches = "one shared batch per step" if self.shared_batch else "independent batches for x and y"
        return (PER_SAMPLE, f"x, y: {self.batch_sampling.describe()}; {batches}")

    def _unit(self, stream: str) -> float:
        # sigma times the clip norm is the noise std on the batch mean.
        return float(self.batch_size)

    def exposures(self) -> dict[str, float]:
        return {"x": 1.0, "y": 1.0}  # one-step releases

    def paper_noise(self, epsilon: float, delta: float) -> dict[str, float]:
        """The practical constants: ``sigma_x = sigma_y = 8 sqrt(T log(1/delta)) / (n epsilon)``.

        Stated for ``epsilon <= 1``, ``delta <= 1/n^2`` and ``m = max(1, n sqrt(epsilon/(4T)))``; ``T`` is
        taken as ``steps``.
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        check_paper_regime("DP-SGDA", epsilon, delta, self.dataset_size)
        sigma = 8 * math.sqrt(self.steps * math.log(1 / delta)) / (self.dataset_size * epsilon)
        return {name: self.noise_multiplier(sigma, name) for name in self.streams}


__all__ = ["DPSGDAPlan"]
