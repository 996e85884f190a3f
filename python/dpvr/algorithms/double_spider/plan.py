"""DP Double-SPIDER's plan: four streams (eta and x, each a refresh and a difference)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..spider_plan import SpiderPlan


@dataclass(frozen=True)
class DoubleSpiderPlan(SpiderPlan):
    """DP Double-SPIDER (DRO, general psi-divergence): four streams.

    ``"eta-refresh"``/``"eta-difference"`` (the dual variable's estimator, batches ``N1``/``N2``) and
    ``"x-refresh"``/``"x-difference"`` (the model's, ``N3``/``N4``); refreshes at ``ceil(T/q)`` steps,
    differences at the others; a batch equal to the dataset size is a full batch. Clipping is per sample
    (the printed Algorithm 2 clips the batch mean, which is not DP).

    Guarantee: composition of all four streams' sampled Gaussian releases in one accountant.
    """

    _layout: ClassVar = (
        ("eta-refresh", "refresh"),
        ("eta-difference", "difference"),
        ("x-refresh", "refresh"),
        ("x-difference", "difference"),
    )
    _vectors: ClassVar = {"eta-refresh": "scalar", "eta-difference": "scalar"}  # the dual eta


__all__ = ["DoubleSpiderPlan"]
