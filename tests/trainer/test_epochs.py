"""An epoch is the sampler's: an epoch of random-allocation batches is charged as one epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.algorithms import DPSGDPlan
from dpvr.optim.sampling import BatchSampler, steps_per_epoch
from dpvr.privacy import calibrate

DELTA = 1e-5


def logistic(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


# ---- 11. random-allocation epochs ------------------------------------------------------------------------


def test_one_epoch_of_random_allocation_is_charged_as_one() -> None:
    """n = 100, b = 14: the sampler's epoch is round(100/14) = 7 steps; ceil gave 8, a second (partial)
    epoch, and 2.14 times the clip radius of noise against the 1.66 one epoch needs at epsilon 1."""
    n, b = 100, 14
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    y = (x[:, 0] > 0).float()
    torch.manual_seed(0)
    trainer = dpvr.make_private(
        nn.Linear(3, 1),
        logistic,
        TensorDataset(x, y),
        algorithm="dp-sgd",
        epsilon=1.0,
        batch_size=b,
        epochs=1,
        clip=1.0,
        lr=0.1,
        sampling="random-allocation",
        public_dataset_size=n,
    )
    sampler = trainer.algorithm.sampler
    assert trainer.steps_per_epoch == trainer.total_steps == sampler.steps_per_epoch == 7
    direct = calibrate(
        DPSGDPlan(steps=7, sampling="random-allocation", batch_size=b, dataset_size=n),
        1.0,
        DELTA,
        accountant="pld",
    )
    assert trainer.algorithm.noise["gradient"] == pytest.approx(direct["gradient"], rel=1e-12)


@pytest.mark.parametrize(
    "scheme, n, b, expected",
    [
        ("random-allocation", 100, 14, 7),
        ("random-allocation", 100, 15, 7),
        ("random-allocation", 10, 10, 1),
        ("poisson", 100, 14, 8),
        ("wor", 100, 25, 4),
        ("cyclic", 40, 10, 4),
        ("full", 100, None, 1),
    ],
)
def test_the_epoch_is_the_samplers(scheme: str, n: int, b: int | None, expected: int) -> None:
    assert steps_per_epoch(scheme, n, b) == expected
    sampler = BatchSampler(scheme, n, b, seed=0)
    if scheme == "random-allocation":
        assert sampler.steps_per_epoch == expected
    drawn = np.concatenate([sampler.draw() for _ in range(expected)])
    if scheme in ("random-allocation", "cyclic", "full"):  # one epoch uses every record exactly once
        assert sorted(drawn.tolist()) == list(range(n))
    with pytest.raises(ValueError, match="divide"):
        steps_per_epoch("cyclic", 40, 7)
