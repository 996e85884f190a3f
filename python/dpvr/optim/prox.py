"""Proximal operators of the composite term h (cyclic DP-SGD: ``x <- prox_{lr h}(x - lr g + noise)``).

Each is data-independent post-processing, so it costs no privacy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class L1:
    """``h(x) = strength * ||x||_1``: soft thresholding."""

    strength: float

    def __call__(self, x: torch.Tensor, lr: float) -> None:
        t = lr * self.strength
        x.copy_(torch.sign(x) * torch.clamp(x.abs() - t, min=0.0))


@dataclass(frozen=True)
class ElasticNet:
    """``h(x) = l1 * ||x||_1 + (l2 / 2) * ||x||^2``."""

    l1: float
    l2: float

    def __call__(self, x: torch.Tensor, lr: float) -> None:
        L1(self.l1)(x, lr)
        x.div_(1.0 + lr * self.l2)


@dataclass(frozen=True)
class L2Ball:
    """Indicator of ``{||x|| <= radius}`` (over all parameters jointly): projection. Its domain is bounded
    with diameter ``2 * radius``, which the last-iterate bound of Theorem 2.2 can use."""

    radius: float

    @property
    def diameter(self) -> float:
        return 2.0 * self.radius

    def project(self, xs: list[torch.Tensor]) -> None:
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in xs))
        if norm > self.radius:
            for x in xs:
                x.mul_(self.radius / norm)


def apply(prox: object | None, params: list[torch.Tensor], lr: float) -> None:
    """Applies ``prox`` to the parameters (separable operators per tensor, the ball jointly)."""
    if prox is None:
        return
    if isinstance(prox, L2Ball):
        prox.project(params)
        return
    for p in params:
        prox(p, lr)
