"""``evaluate()`` callbacks see released iterates only: under the last-iterate bound only the final one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from tests.tuning.toy_task import X, Y, logistic

# ---- 7. evaluate(): released iterates only --------------------------------------------------------------


def _last_iterate_trainer() -> dpvr.PrivateTrainer:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    y = (torch.rand(40, generator=g) < 0.5).double()
    torch.manual_seed(0)
    return dpvr.make_private(
        nn.Linear(6, 1).double(),
        logistic,
        TensorDataset(x, y),
        algorithm="last-iterate",
        epsilon=1.0,
        batch_size=10,
        epochs=5,
        clip=math.sqrt(2),
        lr=1.0,
        weak_convexity=0.0,
        smoothness=0.5,
    )


def test_last_iterate_refuses_callbacks_on_intermediate_iterates() -> None:
    """Under the last-iterate bound only the final iterate is released: a callback every few steps saw 19
    unreleased iterates of this 20-step run (in the review: 400, exact epsilon 1.81 against 1.00)."""
    trainer = _last_iterate_trainer()
    seen: list[int] = []
    for every in (1, 5, 10):
        with pytest.raises(ValueError, match="last iterate"):
            trainer.evaluate(lambda t, info: seen.append(t.steps_done), every=every)
    trainer.evaluate(lambda t, info: seen.append(t.steps_done), every=trainer.total_steps)
    assert not trainer.released
    infos = list(trainer)
    assert seen == [trainer.total_steps] == [20]
    assert trainer.released
    # The step information reveals nothing about an intermediate iterate (no step length, no loss).
    assert all(set(info) <= {"step", "batch", "nonfinite"} for info in infos)


def test_sampled_trainers_release_every_iterate() -> None:
    dataset = TensorDataset(X.float(), Y.float())
    trainer = dpvr.make_private(
        nn.Linear(3, 1), logistic, dataset, algorithm="dp-gd", epsilon=1.0, steps=3, clip=1.0, lr=0.5
    )
    seen: list[int] = []
    trainer.evaluate(lambda t, info: seen.append(t.steps_done), every=1)
    assert trainer.released
    trainer.run()
    assert seen == [1, 2, 3]
