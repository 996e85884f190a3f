"""make_private's settings from the papers' theorems: the theorems' formulas at public quantities, chosen
before and independently of the private data, and runs that are calibrated with them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.privacy.calibration import calibrate
from dpvr.privacy.events import DIFF2Plan, DPSGDPlan
from dpvr.trainer.defaults import Public, derive, diff2_noise, diff2_protocol, dpgd_protocol, noise_constant
from test_registry import FRONT_DOOR


def _data(seed: int, n: int = 600) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))  # d = 46


DIFF2 = dict(steps=300, clip={"restart": 1.0, "difference": 2.0})


def _c(epsilon: float, delta: float) -> float:
    """The accountant's constant: a full-batch run of R steps at (epsilon, delta) has z^2 = c R (PLD)."""
    z = calibrate(DPSGDPlan(steps=1000, sampling="full", dataset_size=10), epsilon, delta,
                  accountant="pld")["gradient"]
    return z * z / 1000


def test_noise_constant_is_the_accountants_and_the_issues_numbers():
    """c = z^2/R of a calibrated 1000-step full-batch run (1e-3), and the issue's 71.4 (eps 1) and 5.7
    (eps 4) at delta 1e-6."""
    for epsilon in (0.5, 1.0, 4.0):
        assert noise_constant(epsilon, 1e-6) == pytest.approx(_c(epsilon, 1e-6), rel=1e-3)
    assert noise_constant(1.0, 1e-6) == pytest.approx(71.4, abs=0.05)
    assert noise_constant(4.0, 1e-6) == pytest.approx(5.70, abs=0.01)


def test_diff2_noise_is_the_calibrations_equal_shares():
    """z1^2 = 2c ceil(R/T) and z2^2 = 2c (R - ceil(R/T)) against dpvr's joint PLD calibration of the DIFF2
    plan (equal shares), to 2%."""
    c = noise_constant(1.0, 1e-5)
    for rounds, restart in ((600, 7), (5000, 40)):
        z1, z2 = diff2_noise(rounds, restart, c)
        tight = calibrate(DIFF2Plan(1000, 1, rounds, restart), 1.0, 1e-5, accountant="pld")
        assert z1 == pytest.approx(tight["restart"], rel=0.02)
        assert z2 == pytest.approx(tight["difference"], rel=0.02)
    assert diff2_noise(50, 1, c) == (math.sqrt(c * 50), 0.0)


def test_diff2_restart_and_lr_are_theorem_4_3_at_the_public_sizes():
    """T = round(tau R) with the proof's tau = (sqrt(2c) C1^2 sqrt(d) / (C2 n))^(2/3), and eta = 1 / (C2
    max(1, sqrt(T d) z2 / n)) with z2^2 = 2c (R - ceil(R/T)); the run then spends at most epsilon."""
    trainer = dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=2.0,
                                **DIFF2)
    c = _c(2.0, 1e-5)
    tau = (math.sqrt(2 * c) * 1.0**2 * math.sqrt(46) / (2.0 * 600)) ** (2 / 3)  # 0.101
    assert trainer.derived["restart"].value == round(tau * 300) == 30
    assert trainer.algorithm.restart == 30
    z2 = math.sqrt(2 * c * (300 - 10))
    lr = 1 / (2.0 * max(1.0, math.sqrt(30 * 46) * z2 / 600))
    assert trainer.derived["lr"].value == pytest.approx(lr, rel=1e-3)
    assert trainer.algorithm.lr == pytest.approx(lr, rel=1e-3)
    assert "Theorem 4.3" in trainer.derived["restart"].why and "C2=2 (for L)" in trainer.derived["lr"].why
    trainer.run(3)
    assert trainer.privacy_spent().epsilon <= 2.0 * (1 + 1e-9)


def test_a_given_lr_or_optimizer_is_kept_and_bvr_needs_its_own():
    given = dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=2.0,
                              lr=0.3, **DIFF2)
    assert given.algorithm.lr == 0.3 and "lr" not in given.derived
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with_opt = dpvr.make_private(model, nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=2.0,
                                 optimizer=optimizer, **DIFF2)
    assert "lr" not in with_opt.derived and "restart" in with_opt.derived
    public = Public(n=600, clients=1, dimension=46, epsilon=2.0, delta=1e-5, steps=300)
    with pytest.raises(ValueError, match="lr: not given.*BVR-L-SGD"):
        derive("diff2", {"routine": "bvr-l-sgd", **DIFF2}, public)


def test_diff2_protocol_rounds_balance_the_bound_and_dpgd_takes_its_optimal_rounds():
    """The theorem's R = max(1/tau, N / sqrt(2 c d tau)) is where eta reaches 1/L (sqrt(T d) z2 / N ~ 1);
    DP-GD's R = N sqrt(2 gap L / (c d)) / G minimises its bound 2 gap L / R + c R d (G / N)^2 (R/2 and 2R
    are both worse); at n = 1e6, d = 10 DIFF2's bound is below DP-GD's and falls faster in n (as n^(-4/3)
    against n^(-1))."""
    c = noise_constant(1.0, 1e-6)
    p = diff2_protocol(10**6, 1, 10, 1.0, 1e-6, 0.65, 2.0, 0.6)
    tau = (math.sqrt(2 * c) * 0.65**2 * math.sqrt(10) / (0.6 * 2.0 * 1e6)) ** (2 / 3)
    assert p.tau == pytest.approx(tau)
    assert p.rounds == math.ceil(max(1 / tau, 1e6 / math.sqrt(2 * c * 10 * tau)))
    assert p.restart == round(tau * p.rounds)
    z2 = diff2_noise(p.rounds, p.restart, c)[1]
    assert math.sqrt(p.restart * 10) * z2 / 1e6 == pytest.approx(1.0, rel=0.01)
    g = dpgd_protocol(10**6, 1, 10, 1.0, 1e-6, 0.65, 2.0, 0.6)
    assert g.rounds == math.ceil(1e6 * math.sqrt(2 * 0.6 * 2.0 / (c * 10)) / 0.65) and g.lr == 0.5

    def bound(r):
        return 2 * 0.6 * 2.0 / r + c * r * 10 * (0.65 / 1e6) ** 2

    assert g.bound == pytest.approx(bound(g.rounds))
    assert bound(g.rounds // 2) > g.bound and bound(2 * g.rounds) > g.bound
    assert p.bound < g.bound
    p10 = diff2_protocol(10**7, 1, 10, 1.0, 1e-6, 0.65, 2.0, 0.6)
    g10 = dpgd_protocol(10**7, 1, 10, 1.0, 1e-6, 0.65, 2.0, 0.6)
    assert math.log10(p10.bound / p.bound) == pytest.approx(-4 / 3, abs=0.02)
    assert math.log10(g10.bound / g.bound) == pytest.approx(-1.0, abs=0.02)


def test_a_given_setting_is_kept_and_nothing_is_derived():
    trainer = dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=2.0,
                                restart=4, lr=0.1, **DIFF2)
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
    tau = (math.sqrt(2 * noise_constant(epsilon, 1e-5)) * math.sqrt(46) / (2.0 * 600)) ** (2 / 3)
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


def test_diff2_without_a_length_runs_the_theorems_rounds():
    """Neither steps nor epochs: DIFF2's R is Theorem 4.3's (its proof with the accountant's constant), the
    restart period and step follow from it, and the run's plan is exactly that length; other algorithms still
    need a length."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, 3, generator=g), torch.randn(400, 1, generator=g)
    clip = {"restart": 1.0, "difference": 2.0}
    trainer = dpvr.make_private(torch.nn.Linear(3, 1), torch.nn.MSELoss(), TensorDataset(x, y),
                                algorithm="diff2", epsilon=4.0, delta=1e-6, clip=clip)
    expected = diff2_protocol(400, 1, 4, 4.0, 1e-6, lipschitz=1.0, smoothness=2.0)
    assert trainer.derived["steps"].value == expected.rounds == trainer.algorithm.plan.steps
    assert trainer.derived["restart"].value == expected.restart
    assert "Theorem 4.3" in trainer.derived["steps"].why
    with pytest.raises(ValueError, match="exactly one of epochs= or steps="):
        dpvr.make_private(torch.nn.Linear(3, 1), torch.nn.MSELoss(), TensorDataset(x, y), algorithm="dp-gd",
                          epsilon=4.0, clip=1.0, lr=0.1)
