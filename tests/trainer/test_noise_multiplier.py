"""Issue 48, item 4: a fixed-noise front door, make_private(noise_multiplier=...).

Before: ``make_private(noise=...)`` was refused (and no other way existed at the front door), ``noise=0`` on
DPSGD was refused without saying why, and ``privacy_spent()`` at noise 1e-6 raised ``OverflowError``.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.algorithms.dp_sgd.algorithm import DPSGD
from dpvr.optim import BudgetExhaustedError, PrivacyConfig

N, B, DELTA = 64, 8, 1e-5
G = torch.Generator().manual_seed(0)
X = torch.randn(N, 3, generator=G, dtype=torch.float64)
Y = (X[:, 0] > 0).long()
DATA = TensorDataset(X, Y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2).double()


def _dpsgd(**kw) -> dpvr.PrivateTrainer:
    options = dict(algorithm="dp-sgd", batch_size=B, lr=0.1, clip=1.0, public_dataset_size=N)
    return dpvr.make_private(_model(), nn.CrossEntropyLoss(), DATA, **{**options, **kw})


def _poisson_epsilon(z: float, steps: int) -> float:
    """dp_accounting's PLD epsilon of ``steps`` Poisson-sampled Gaussians (add/remove, rate B/N)."""
    acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(B / N, dpa.GaussianDpEvent(z)), steps))
    return acc.get_epsilon(DELTA)


def test_noise_multiplier_without_a_budget_reports_what_was_spent() -> None:
    trainer = _dpsgd(noise_multiplier=1.1, steps=6)
    assert trainer.algorithm.noise == {"gradient": 1.1}
    trainer.run()
    spent = trainer.privacy_spent(DELTA)
    assert spent.noise_multipliers == {"gradient": 1.1}
    assert spent.epsilon == pytest.approx(_poisson_epsilon(1.1, 6), rel=1e-3)


def test_noise_multiplier_with_a_budget_is_still_refused_past_it() -> None:
    steps_within = 0
    while _poisson_epsilon(1.0, steps_within + 1) <= 2.0:
        steps_within += 1
    trainer = _dpsgd(noise_multiplier=1.0, epsilon=2.0, steps=steps_within + 3)
    with pytest.raises(BudgetExhaustedError, match="would exceed the budget epsilon=2"):
        trainer.run()
    assert trainer.steps_done == steps_within  # every release within the budget, none past it
    assert trainer.privacy_spent(DELTA).epsilon <= 2.0


def test_a_number_is_every_streams_multiplier_and_a_mapping_is_per_stream() -> None:
    clip = {"restart": 1.0, "difference": 1.0}
    common = dict(algorithm="diff2", steps=4, restart=2, lr=0.1, clip=clip)
    every = dpvr.make_private(_model(), nn.CrossEntropyLoss(), DATA, noise_multiplier=3.0, **common)
    assert every.algorithm.noise == {"restart": 3.0, "difference": 3.0}
    keyed = dpvr.make_private(_model(), nn.CrossEntropyLoss(), DATA,
                              noise_multiplier={"restart": 3.0, "difference": 5.0}, **common)
    assert keyed.algorithm.noise == {"restart": 3.0, "difference": 5.0}
    with pytest.raises(ValueError, match="not streams of this plan"):
        dpvr.make_private(_model(), nn.CrossEntropyLoss(), DATA, noise_multiplier={"gradient": 3.0}, **common)


def test_the_theorem_defaults_need_a_budget() -> None:
    with pytest.raises(ValueError, match="restart.*functions of the budget epsilon"):
        dpvr.make_private(_model(), nn.CrossEntropyLoss(), DATA, algorithm="diff2", steps=4, lr=0.1,
                          clip={"restart": 1.0, "difference": 1.0}, noise_multiplier=3.0)


@pytest.mark.parametrize("bad,error,match", [
    (0, ValueError, "not differentially private at any epsilon"),
    (0.0, ValueError, "not differentially private at any epsilon"),
    (-1.0, ValueError, "finite number > 0"),
    (math.inf, ValueError, "finite number > 0"),
    ("1", TypeError, "is a number"),
])
def test_bad_noise_multipliers_are_refused_naming_it(bad, error, match) -> None:
    with pytest.raises(error, match=f"noise_multiplier: .*{match}"):
        _dpsgd(noise_multiplier=bad, steps=2)


def test_noise_zero_on_dpsgd_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="noise: a noise multiplier of 0 .* not differentially private"):
        DPSGD(_model(), lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), X, Y, lr=0.1,
              clip=1.0, steps=2, batch_size=B, noise=0.0, privacy=PrivacyConfig())


def test_neither_budget_nor_noise_and_the_old_noise_keyword() -> None:
    with pytest.raises(ValueError, match="give epsilon= .* or noise_multiplier="):
        _dpsgd(steps=2)
    with pytest.raises(ValueError, match="noise: give the noise as noise_multiplier="):
        _dpsgd(epsilon=1.0, noise=1.0, steps=2)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_a_tiny_noise_multiplier_reports_an_unbounded_epsilon_without_raising(accountant) -> None:
    trainer = _dpsgd(noise_multiplier=1e-6, steps=2, accountant=accountant)
    trainer.step()
    spent = trainer.privacy_spent(DELTA)
    assert spent.epsilon == math.inf or spent.epsilon > 1e9
    if spent.epsilon == math.inf:
        assert any("exceeds floating point" in a for a in spent.assumptions)
    # With a budget, the first release is refused (not an OverflowError).
    budgeted = _dpsgd(noise_multiplier=1e-6, steps=2, epsilon=10.0, accountant=accountant)
    with pytest.raises(BudgetExhaustedError):
        budgeted.step()
    assert budgeted.steps_done == 0
