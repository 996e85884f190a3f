"""DP-SGD's plan (and DP-GD's, its full-batch case): one ``"gradient"`` stream; with private adaptive
clipping, a second stream on the same batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...privacy import _checks
from ...privacy.events import PER_SAMPLE, Plan, check_relation, public_size_assumption, released_stream
from ...privacy.mechanism import Sampling
from ...privacy.relations import ADD_REMOVE, REPLACE_ONE


@dataclass(frozen=True)
class DPSGDPlan(Plan):
    """DP-SGD / DP-GD: ``steps`` noisy gradient steps, one stream ``"gradient"``.

    Each step releases the sum of per-sample gradients clipped at ``C`` plus ``N(0, (z C)^2 I)`` (Opacus'
    convention; the step divides by a public batch size). Sampling: ``"poisson"`` (``sample_rate``),
    ``"wor"`` (fixed batches without replacement; replace-one only), ``"full"`` (DP-GD),
    ``"random-allocation"`` (epochs of ``t = round(n / batch_size)`` steps, each record in one random step of
    each; add/remove only; priced by epoch, a partial last epoch as a whole one). ``neighbouring``
    defaults to :meth:`default_neighbouring` of the sampling, as :class:`dpvr.algorithms.DPSGD` does.

    Guarantee: the composition of ``steps`` (sampled) Gaussian mechanisms with noise multiplier ``z``.
    """

    steps: int
    sampling: str = "poisson"
    sample_rate: float | None = None
    batch_size: int | None = None
    dataset_size: int | None = None
    neighbouring: str | None = None

    def __post_init__(self) -> None:
        _checks.count("steps", self.steps)
        if self.neighbouring is None:
            object.__setattr__(self, "neighbouring", self.default_neighbouring(self.sampling))
        check_relation(self.neighbouring, self.batch_sampling)
        self._refuse_private_size()

    @classmethod
    def default_neighbouring(cls, sampling: str | None = None) -> str:
        """Add/remove for Poisson sampling (Abadi et al., Opacus) and random allocation (accounted only under
        add/remove), else replace-one: fixed-size batches are accounted only under replace-one, and a full
        batch divides by ``n``, public only under replace-one."""
        return ADD_REMOVE if sampling in ("poisson", "random-allocation") else REPLACE_ONE

    @property
    def batch_sampling(self) -> Sampling:
        return Sampling.make(
            self.sampling,
            sample_rate=self.sample_rate,
            batch_size=self.batch_size,
            dataset_size=self.dataset_size,
        )

    def _streams(self, noise):
        return released_stream(noise, "gradient", self.steps, self.batch_sampling)

    def _assumptions(self):
        return (PER_SAMPLE, f"gradient: {self.batch_sampling.describe()}", *public_size_assumption(self))

    def exposures(self) -> dict[str, float]:
        return {"gradient": 1.0}  # each step's gradient is fresh


@dataclass(frozen=True)
class AdaptiveClipDPSGDPlan(DPSGDPlan):
    """DP-SGD with private adaptive clipping (Andrew et al. 2021; :class:`dpvr.algorithms.DPSGD` with
    ``clipping="adaptive"``): each step releases the noisy clipped gradient sum (stream ``"gradient"``) and,
    on the same batch, the noisy shifted count ``sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)`` (stream
    ``"clip-count"``, noise multiplier ``2 sigma_b``): one record moves the shifted count by at most ``1/2``
    under add/remove and ``1`` under replace-one, dpvr's unit and twice it, as for a clipped gradient
    (unshifted, the count would move by 1 under both relations: worse under add/remove).

    The two streams form one group: one Gaussian on the concatenated release per step, with
    ``1/z**2 = 1/z_gradient**2 + 1/z_count**2`` (the record that moves one part moves the other, so the
    parts are not priced as independent releases, and the group is not priced as two sampled releases).

    Guarantee: the composition of ``steps`` (sampled) Gaussian mechanisms with the group's noise multiplier.
    """

    _vectors: ClassVar = {"clip-count": "scalar"}

    def _streams(self, noise):
        return (released_stream(noise, "gradient", self.steps, self.batch_sampling, "step")
                + released_stream(noise, "clip-count", self.steps, self.batch_sampling, "step"))

    def exposures(self) -> dict[str, float]:
        return {"gradient": 1.0, "clip-count": 1.0}


__all__ = ["DPSGDPlan", "AdaptiveClipDPSGDPlan"]
