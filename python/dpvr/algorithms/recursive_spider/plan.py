"""DP Recursive-SPIDER's plan: the refresh and difference streams of its estimators and the ``s`` stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..spider_plan import SpiderPlan


@dataclass(frozen=True)
class RecursiveSpiderPlan(SpiderPlan):
    """DP Recursive-SPIDER (KL-DRO, compositional form): five streams.

    ``"v-refresh"``/``"v-difference"`` (the x-gradient of the inner function, batches ``b1``/``b2``),
    ``"u-refresh"``/``"u-difference"`` (its lambda-gradient, ``b3``/``b4``) and ``"s"`` (the STORM estimate of
    the inner function value from one record per step).

    For ``"s"`` the released value is one record's STORM term ``Clip(g(w_t)) - (1 - beta) Clip(g(w_{t-1}))``
    with ``0 <= Clip(g) <= C5``: it lies in ``[-(1 - beta) C5, C5]``, so replacing the record moves it by at
    most the range ``(2 - beta) C5``. In dpvr's convention (the replace-one accountant charges twice the
    unit) the unit is half of that, ``(2 - beta) C5 / 2``: noise std ``z (2 - beta) C5 / 2``. Under
    add/remove (a plan for accounting only: the algorithm is replace-one) adding a record moves the sum by
    its term, at most ``C5`` in absolute value, which is then the unit.

    Guarantee: composition of all five streams' sampled Gaussian releases in one accountant.
    """

    _layout: ClassVar = (
        ("v-refresh", "refresh"),
        ("v-difference", "difference"),
        ("u-refresh", "refresh"),
        ("u-difference", "difference"),
        ("s", "every"),
    )
    _fixed_batches: ClassVar = {"s": 1}
    _vectors: ClassVar = {"u-refresh": "scalar", "u-difference": "scalar", "s": "scalar"}  # u, s: of lambda


__all__ = ["RecursiveSpiderPlan"]
