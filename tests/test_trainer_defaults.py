"""make_private's settings from the papers' theorems: the theorems' formulas at public quantities, chosen
before and independently of the private data, and runs that are calibrated with them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.trainer.defaults import Public, derive
from test_registry import FRONT_DOOR


def _data(seed: int, n: int = 600) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))  # d = 46


DIFF2 = dict(steps=300, lr=0.1, clip={"restart": 1.0, "difference": 2.0})


def test_diff2_restart_is_theorem_4_3_at_the_public_sizes():
    trainer = dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=2.0,
                                **DIFF2)
    tau = (1.0**2 * math.sqrt(46) / (2.0 * 600 * 1 * 2.0)) ** (2 / 3)  # 0.0200
    assert trainer.derived["restart"].value == round(tau * 300) == 6
    assert trainer.algorithm.restart == 6
    assert "Theorem 4.3" in trainer.derived["restart"].why
    trainer.run(3)
    assert trainer.privacy_spent().epsilon <= 2.0 * (1 + 1e-9)


def test_a_given_setting_is_kept_and_nothing_is_derived():
    trainer = dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=2.0,
                                restart=4, **DIFF2)
    assert trainer.algorithm.restart == 4 and trainer.derived == {}


def test_the_derived_settings_do_not_depend_on_the_private_records():
    """Two neighbouring datasets (and two unrelated ones of the same size) get the same settings: the
    defaults read sizes, the budget and the user's settings only."""
    neighbour = _data(0)
    neighbour.tensors[0][17] = 1e3  # one record replaced by an outlier
    settings = []
    for data in (_data(0), neighbour, _data(1)):
        trainer = dpvr.make_private(_model(), nn.CrossEntropyLoss(), data, algorithm="diff2", epsilon=2.0,
                                    **DIFF2)
        settings.append({k: d.value for k, d in trainer.derived.items()})
    assert settings[0] == settings[1] == settings[2]


@pytest.mark.parametrize(("steps", "epsilon"), [(10, 8.0), (10_000, 0.5), (5, 1e-4)])
def test_the_restart_period_stays_within_one_and_the_run(steps, epsilon):
    """A short run with a large budget: tau R < 1, a restart every round (the theorem's DP-GD); a budget
    so small that tau > 1: the period is the whole run."""
    public = Public(n=600, clients=1, dimension=46, epsilon=epsilon, delta=1e-5, steps=steps)
    value = derive("diff2", {"clip": {"restart": 1.0, "difference": 2.0}}, public)["restart"].value
    assert 1 <= value <= steps
    tau = (math.sqrt(46) / (2.0 * 600 * epsilon)) ** (2 / 3)
    assert value == min(steps, max(1, round(tau * steps)))
    assert value == {10: 1, 5: 5}.get(steps, value)


def test_a_default_that_needs_a_missing_radius_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"restart: not given.*clip\['difference'\]"):
        dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=2.0,
                          steps=10, lr=0.1, clip={"restart": 1.0})


def test_private_diff_takes_theorem_6_restart_and_one_ascent_step():
    (model, criterion, data), settings = FRONT_DOOR["private-diff"]
    given = {k: v for k, v in settings.items() if k not in ("restart", "y_steps")}
    given["steps"] = 50
    trainer = dpvr.make_private(model(), criterion, data(), algorithm="private-diff", epsilon=2.0, **given)
    n = len(data())
    d = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    tau = (1.0 * math.sqrt(d) / (1.0 * n * 2.0)) ** (2 / 3)
    assert trainer.derived["restart"].value == min(50, max(1, round(tau * 50)))
    assert trainer.derived["y_steps"].value == 1 and "ascent" in trainer.derived["y_steps"].why
    trainer.run(2)
    assert trainer.privacy_spent().epsilon <= 2.0 * (1 + 1e-9)


def test_private_diff_output_solve_takes_theorem_6_iteration_cap():
    public = Public(n=5000, clients=1, dimension=675, epsilon=1.0, delta=1e-6, steps=64)
    settings = {"y_release": "output", "restart": 2,
                "clip": {"checkpoint": 1.0, "difference": (2.0, 0.05)}}
    t2 = derive("private-diff", settings, public)["y_steps"].value
    assert t2 == math.ceil(max(5000 ** (4 / 3) / 675 ** (2 / 3), 2 * 64 * 675 ** (1 / 3) / 5000 ** (2 / 3)))


@pytest.mark.parametrize("algorithm", ["double-spider", "recursive-spider"])
def test_the_spiders_take_the_dro_theorems_period_and_batches(algorithm):
    (model, criterion, data), settings = FRONT_DOOR[algorithm]
    given = {k: v for k, v in settings.items() if k not in ("restart", "batch_sizes")}
    trainer = dpvr.make_private(model(), criterion, data(), algorithm=algorithm, epsilon=2.0, **given)
    n = len(data())
    sizes = trainer.derived["batch_sizes"].value
    refresh = [s for s in sizes if s.endswith("refresh")]
    assert all(sizes[s] == n for s in refresh)  # Theorem 8: b1 = n
    assert all(1 <= b <= n for b in sizes.values())
    d = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    q = (n * 2.0 / math.sqrt(d * math.log(1e5))) ** (2 / 3)
    assert trainer.derived["restart"].value == min(given["steps"], max(1, round(q)))
    trainer.run()
    assert trainer.privacy_spent().epsilon <= 2.0 * (1 + 1e-9)
