"""The task the tuning tests share: logistic regression on 48 records of 3 features, and a held-out set
that scores a trained model."""

from __future__ import annotations

import torch
from torch import nn


def logistic(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


def _data(seed: int, n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).double()


X, Y = _data(0)
XV, YV = _data(1)


def fresh_model() -> nn.Module:
    return nn.Linear(3, 1).double()


def held_out(alg) -> float:
    """The negative held-out loss of ``alg``'s model (higher is better)."""
    with torch.no_grad():
        return -float(logistic(alg.model(XV), YV))
