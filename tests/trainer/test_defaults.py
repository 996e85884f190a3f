"""make_private's settings from the papers' theorems: the theorems' formulas at public quantities, chosen
before and independently of the private data, and runs that are calibrated with them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.algorithms import DIFF2Plan, DPSGDAPlan, DPSGDPlan, PrivateDiffPlan
from dpvr.privacy.calibration import calibrate
from dpvr.trainer.defaults import (
    Public,
    derive,
    diff2_noise,
    diff2_protocol,
    dpgd_protocol,
    dpsgda_protocol,
    noise_constant,
    private_diff_noise,
    private_diff_protocol,
    spider_protocol,
)
from tests.algorithms.test_registry import FRONT_DOOR


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


def test_the_step_size_reads_the_noise_multiplier_the_run_is_given():
    """With noise_multiplier= beside epsilon, Theorem 4.3's eta reads the difference noise the run draws,
    not the calibration's share (it did: the rules never saw the given noise)."""
    trainer = dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data(0), algorithm="diff2", epsilon=50.0,
                                noise_multiplier=40.0, **DIFF2)
    restart = trainer.derived["restart"].value
    lr = 1 / (2.0 * max(1.0, math.sqrt(restart * 46) * 40.0 / 600))
    assert trainer.derived["lr"].value == pytest.approx(lr)
    assert "z2=40 (given)" in trainer.derived["lr"].why


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
    c = _c(2.0, 1e-5)
    tau = (math.sqrt(1.5 * c) * 1.0**2 * math.sqrt(d) / (1.0 * n)) ** (2 / 3)  # C1 = C2 = 1
    assert trainer.derived["restart"].value == min(50, max(1, round(tau * 50)))
    assert "Theorem 6" in trainer.derived["restart"].why
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
    k, c, steps = (4 if algorithm == "double-spider" else 5), _c(2.0, 1e-5), given["steps"]
    if algorithm == "double-spider":  # Theorem 7, log(1/delta)/eps^2 read as k c
        q = round((n / math.sqrt(k * c * d)) ** (2 / 3))
    else:  # Theorem 8, L = the v-difference radius
        q = math.floor(n**2 / (given["clip"]["v-difference"] ** 2 * steps * d * k * c))
    assert trainer.derived["restart"].value == min(steps, max(1, q))
    g, lip = ((given["clip"]["x-refresh"], given["clip"]["x-difference"][0]) if algorithm == "double-spider"
              else (given["clip"]["v-refresh"], given["clip"]["v-difference"]))
    b2 = max((g * n / math.sqrt(lip * d * k * c)) ** (2 / 3), (g * n * d * k * c) ** (1 / 3) / lip ** (1 / 6))
    x_difference = "x-difference" if algorithm == "double-spider" else "v-difference"
    assert sizes[x_difference] == min(n, math.ceil(b2))
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


def test_private_diff_noise_is_the_calibrations_equal_thirds():
    """z1^2 = 3c ceil(R/T), z2^2 = 3c (R - ceil(R/T)), z_y^2 = 3c R against dpvr's joint PLD calibration of
    the full-batch, output-y PrivateDiff plan, to 2%."""
    c = noise_constant(1.0, 1e-6)
    for rounds, restart in ((400, 20), (3000, 7)):
        z1, z2, zy = private_diff_noise(rounds, restart, c)
        tight = calibrate(PrivateDiffPlan(1000, 1000, rounds, restart, 1, "full", y_release="output"), 1.0,
                          1e-6, accountant="pld")
        assert (z1, z2, zy) == pytest.approx((tight["checkpoint"], tight["difference"], tight["y"]), rel=0.02)


def test_private_diff_protocol_is_theorem_6s_proof_with_the_accountants_constant():
    """tau = (sqrt(3c/2) G^2 sqrt(d) / (gap L N))^(2/3), R = max(1/tau, N / sqrt(6 c d tau)),
    T = round(tau R), eta = 1 / (2 L max(1, sqrt(2 T d) z2 / N)) and the bound, computed here from the
    formulas; with the problem's l, mu and gradient range the rounds stop at
    R_y = sqrt(2 gap L / (3 c)) 2 N mu / (l range)."""
    n, d, g, lip, gap = 200_000, 10, 0.65, 6.0, 0.3
    c = noise_constant(1.0, 1e-6)
    tau = (math.sqrt(1.5 * c) * g**2 * math.sqrt(d) / (gap * lip * n)) ** (2 / 3)
    rounds = math.ceil(max(1 / tau, n / math.sqrt(6 * c * d * tau)))
    restart = round(tau * rounds)
    z1 = math.sqrt(3 * c * math.ceil(rounds / restart))
    z2 = math.sqrt(3 * c * (rounds - math.ceil(rounds / restart)))
    lr = 1 / (2 * lip * max(1, math.sqrt(2 * restart * d) * z2 / n))
    p = private_diff_protocol(n, d, 1.0, 1e-6, g, lip, gap)
    assert (p.rounds, p.restart) == (rounds, restart)
    assert p.tau == pytest.approx(tau, rel=1e-12) and p.lr == pytest.approx(lr, rel=1e-12)
    assert p.bound == pytest.approx(2 * gap / (lr * rounds) + 2 * d * (z1 * g / n) ** 2, rel=1e-12)
    cross, mu, spread = 2.0, 1.0, 1.0
    r_y = math.sqrt(2 * gap * lip / (3 * c)) * 2 * n * mu / (cross * spread)  # noise std z_y Delta / 2
    q = private_diff_protocol(n, d, 1.0, 1e-6, g, lip, gap, cross=cross, strong_concavity=mu, y_range=spread)
    assert q.rounds == min(rounds, math.ceil(r_y))
    assert q.bound > private_diff_protocol(n, d, 1.0, 1e-6, g, lip, gap, rounds=q.rounds).bound


def test_private_diff_period_minimises_its_bound():
    """At the protocol's R, no period T in [1, R] gives the bound (with eta and the noise re-derived for T) a
    value below 1.05 times that at the derived T: tau is the bound's minimiser, not only its formula."""
    n, d, g, lip, gap = 500_000, 100, 0.65, 6.0, 0.5
    c = noise_constant(4.0, 1e-6)
    p = private_diff_protocol(n, d, 4.0, 1e-6, g, lip, gap)

    def bound(restart: int) -> float:
        z1, z2, _ = private_diff_noise(p.rounds, restart, c)
        eta = 1 / (2 * lip * max(1, math.sqrt(2 * restart * d) * z2 / n))
        return 2 * gap / (eta * p.rounds) + 2 * d * (z1 * g / n) ** 2

    best = min(bound(t) for t in range(1, p.rounds + 1, max(1, p.rounds // 4000)))
    assert p.restart > 1 and bound(p.restart) <= 1.05 * best


def test_dpsgda_protocol_is_theorem_2s_bound_41_with_the_accountants_constant():
    """eta_x = 1 / (16 (kappa + 1)^2 l), eta_y = 1 / l, T = N sqrt(A / (2 K c d G^2)) with A = 3 gap / eta_x +
    6 kappa l^2 Lambda^2, K = 2 max(9 kappa + 1/(8 kappa), 1/(4 kappa)); and the two streams' calibrated
    multipliers are z^2 = 2 c T (equal shares), to 2%."""
    n, d, g, cross, mu, gap, lam = 100_000, 10, 0.65, 2.0, 1.0, 0.3, 1.0
    c = noise_constant(0.5, 1e-6)
    kappa = cross / mu
    eta = 1 / (16 * (kappa + 1) ** 2 * cross)
    a = 3 * gap / eta + 6 * kappa * cross**2 * lam**2
    k = 2 * max(9 * kappa + 1 / (8 * kappa), 1 / (4 * kappa))
    rounds = math.ceil(n * math.sqrt(a / (2 * k * c * d * g**2)))
    p = dpsgda_protocol(n, d, 0.5, 1e-6, g, cross, mu, gap, lam)
    assert (p.rounds, p.restart) == (rounds, 1)
    assert p.lr == pytest.approx(eta) and p.lr_y == pytest.approx(1 / cross)
    assert p.bound == pytest.approx(a / rounds + k * 2 * c * d * g**2 * rounds / n**2, rel=1e-12)
    tight = calibrate(DPSGDAPlan(1000, 1000, 500, "full"), 0.5, 1e-6, accountant="pld")
    assert tight["x"] == pytest.approx(math.sqrt(2 * c * 500), rel=0.02) == tight["y"]


def test_spider_protocol_is_theorem_8_with_the_accountants_constant():
    """T, q, b2 and eta of Theorem 8, log(1/delta)/eps^2 read as k c (k = 5 streams), from the formulas."""
    n, d, g, lip = 50_000, 20, 1.0, 3.0
    c = noise_constant(1.0, 1e-6)
    kc = 5 * c
    rounds = math.ceil(max((lip**0.25 * n / math.sqrt(g * d * kc)) ** (4 / 3), n / math.sqrt(d * kc)))
    q = max(1, math.floor(n**2 / (lip**2 * rounds * d * kc)))
    b2 = max((g * n / math.sqrt(lip * d * kc)) ** (2 / 3), (g * n * d * kc) ** (1 / 3) / lip ** (1 / 6))
    p = spider_protocol(n, d, 1.0, 1e-6, g, lip)
    assert (p.rounds, p.restart, p.batch) == (rounds, min(rounds, q), min(n, math.ceil(b2)))
    assert p.lr == 1 / (2 * lip)


def test_private_diff_without_a_length_runs_theorem_6s_rounds_and_recursive_spider_takes_its_step():
    """Neither steps nor epochs: PrivateDiff's R is Theorem 6's and its step follows (no lr given), the run's
    plan is that length; Recursive-SPIDER without lr takes Theorem 8's 1/(2L)."""
    (model, criterion, data), settings = FRONT_DOOR["private-diff"]
    given = {k: v for k, v in settings.items() if k not in ("restart", "y_steps", "steps", "lr")}
    trainer = dpvr.make_private(model(), criterion, data(), algorithm="private-diff", epsilon=2.0, **given)
    n = len(data())
    d = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    c1, c2 = given["clip"]["checkpoint"], given["clip"]["difference"][0]
    expected = private_diff_protocol(n, d, 2.0, 1e-5, c1, c2)
    assert trainer.derived["steps"].value == expected.rounds == trainer.algorithm.plan.steps
    assert trainer.derived["restart"].value == expected.restart
    assert trainer.derived["lr"].value == pytest.approx(expected.lr, rel=1e-9)
    (model, criterion, data), settings = FRONT_DOOR["recursive-spider"]
    given = {k: v for k, v in settings.items() if k not in ("restart", "batch_sizes", "lr")}
    trainer = dpvr.make_private(model(), criterion, data(), algorithm="recursive-spider", epsilon=2.0,
                                **given)
    expected = spider_protocol(len(data()), 1, 2.0, 1e-5, 1.0, given["clip"]["v-difference"])
    assert trainer.derived["lr"].value == expected.lr and "Theorem 8" in trainer.derived["lr"].why
