"""PrivateDiff's plan: checkpoint and difference streams for x, y by gradient steps or by output
perturbation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ...privacy import _checks
from ...privacy.events import (
    PER_SAMPLE,
    SAME_SAMPLE,
    Plan,
    accumulated_differences,
    ceil_div,
    check_paper_regime,
    check_relation,
    output_perturbation_multiplier,
    released_stream,
)
from ...privacy.mechanism import Sampling
from ...privacy.relations import REPLACE_ONE


@dataclass(frozen=True)
class PrivateDiffPlan(Plan):
    """PrivateDiff Minimax (Zhang et al.): streams ``"checkpoint"``, ``"difference"`` and ``"y"``.

    ``steps`` outer rounds ``R`` with checkpoints every ``restart = T`` rounds; each x-release is a clipped
    mean over a batch of ``batch_size = m`` plus ``N(0, sigma_x^2 C^2 I)`` (``z = sigma_x * m``).

    The ascent output ``y_{r+1}`` feeds the next x-gradients, so it must be private. ``y_release``:

    - ``"ascent"`` (dpvr's choice): ``y_steps = T2`` noisy clipped ascent steps per round, each a sampled
      Gaussian release on ``m`` records (``z = sigma_y * m`` with noise ``sigma_y C0`` on the mean);
    - ``"output"`` (the paper's form): one Gaussian output perturbation of ``y_{r+1}`` per round, unsampled,
      with ``z`` relative to a *worst-case* replace-one sensitivity of ``y_{r+1}`` (see
      :func:`output_perturbation_multiplier`; the paper's uniform-stability bound is an expectation, so
      dpvr's algorithm solves the inner problem over all ``n`` records to a certified tolerance ``tau`` and
      uses ``gradient_range / (n mu) + 2 tau``). ``y_steps`` then only caps the solver's iterations.

    Guarantee: adaptive composition of all three streams.
    """

    _all_streams: ClassVar = ("checkpoint", "difference", "y")
    _vectors: ClassVar = {"y": "y"}

    dataset_size: int
    batch_size: int
    steps: int
    restart: int
    y_steps: int = 1
    sampling: str = "wor"
    y_release: str = "ascent"
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        _checks.count("steps", self.steps)
        _checks.count("restart", self.restart, minimum=1)
        _checks.count("y_steps", self.y_steps, minimum=1)
        if self.y_release not in ("ascent", "output"):
            raise ValueError(f"y_release must be 'ascent' or 'output', got {self.y_release!r}")
        check_relation(self.neighbouring, self.batch_sampling)
        self._refuse_private_size()

    @property
    def batch_sampling(self) -> Sampling:
        return Sampling.make(self.sampling, batch_size=self.batch_size, dataset_size=self.dataset_size)

    @property
    def checkpoints(self) -> int:
        return ceil_div(self.steps, self.restart)

    def _streams(self, noise):
        streams = released_stream(noise, "checkpoint", self.checkpoints, self.batch_sampling)
        streams += released_stream(noise, "difference", self.steps - self.checkpoints, self.batch_sampling)
        if self.y_release == "ascent":
            return streams + released_stream(noise, "y", self.steps * self.y_steps, self.batch_sampling)
        return streams + released_stream(noise, "y", self.steps)

    def _assumptions(self):
        y = (
            f"y: {self.y_steps} noisy clipped ascent steps per round, {self.batch_sampling.describe()}"
            if self.y_release == "ascent"
            else "y: one output perturbation per round of y solved over all records; noise multiplier "
            "relative to a worst-case sensitivity"
        )
        return (PER_SAMPLE, SAME_SAMPLE, f"x: {self.batch_sampling.describe()}", y)

    def _unit(self, stream: str) -> float:
        # x (and ascent y): sigma times the clip radius is the noise std on the batch mean; output y: sigma is
        # the noise std over y's replace-one sensitivity, twice dpvr's unit.
        if stream == "y" and self.y_release == "output":
            return output_perturbation_multiplier(1.0, 1.0, self.neighbouring)
        return float(self.batch_size)

    def exposures(self) -> dict[str, float]:
        # Lemma 12: T2 ascent steps carry their noise into y's error over T2; an output perturbation, once
        carried = {
            "checkpoint": 1.0,
            "difference": accumulated_differences(self.steps, self.restart),
            "y": 1.0 / self.y_steps if self.y_release == "ascent" else 1.0,
        }
        return {s: carried[s] for s in self.streams}

    def paper_noise(self, epsilon: float, delta: float) -> dict[str, float]:
        """Remark 5.1, with ``L = log(1/delta)``: ``sigma_x1 = 4 sqrt((R/T) L) / (n eps)``,
        ``sigma_x2 = 4 sqrt(R L) / (n eps)``, ``sigma_y = 4 (2 C0^2 + beta M) sqrt(R L) / (mu n eps)``, i.e.
        ``4 sqrt(R L) / eps`` times the y-output sensitivity ``(2 C0^2 + beta M)/(mu n)``.

        Stated for ``epsilon <= 1``, ``delta <= 1/n^2`` and ``m = max(1, n sqrt(epsilon/(8T)))``. Remark 5.1
        prices y as one output perturbation per round, so it applies only with ``y_release="output"``.
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        if self.y_release != "output":
            raise ValueError(
                "Remark 5.1 prices y as one output perturbation per round; with y_release='ascent' "
                "there is no closed form (use calibration='tight' or y_release='output')"
            )
        check_paper_regime("PrivateDiff (Remark 5.1)", epsilon, delta, self.dataset_size)
        log_term = math.log(1 / delta)
        n, r = self.dataset_size, self.steps
        sigma = {
            "checkpoint": 4 * math.sqrt(r / self.restart * log_term) / (n * epsilon),
            "difference": 4 * math.sqrt(r * log_term) / (n * epsilon),
        }
        sigma["y"] = 4 * math.sqrt(r * log_term) / epsilon
        return {k: self.noise_multiplier(v, k) for k, v in sigma.items() if k in self.streams}


__all__ = ["PrivateDiffPlan"]
