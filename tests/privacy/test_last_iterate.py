"""Last-iterate bounds of cyclic DP-SGD against a direct high-precision evaluation of Theorems 2.2 and 2.3."""

import math

import dp_accounting as dpa
import mpmath
import numpy as np
import pytest

from dpvr.algorithms import CyclicDPSGDPlan, DPSGDPlan, epsilon_by_epoch
from dpvr.privacy import Accountant, account, calibrate, l_lambda, theorem_2_2_rho, theorem_2_3_rho, theta

mpmath.mp.dps = 60


def _theta_direct(l_squared, s):
    """theta_L(s) = L^(2(s-1)) / sum_{j<s} L^(2j) (eq. 15), in 60-digit arithmetic; L^2 given exactly."""
    l2 = mpmath.mpf(l_squared)
    if s <= 2000:
        total = mpmath.fsum(l2**j for j in range(s))
    else:  # the same geometric sum in closed form
        total = (l2**s - 1) / (l2 - 1) if l2 != 1 else mpmath.mpf(s)
    return float(l2 ** (s - 1) / total)


def _l_squared(lr, m, big_m):
    return 1 + 2 * mpmath.mpf(lr) * m * (1 + mpmath.mpf(m) / (2 * (big_m + m))) if m else mpmath.mpf(1)


@pytest.mark.parametrize("s", [1, 2, 3, 17, 1000, 2000, 10**5, 10**6])
@pytest.mark.parametrize("x", ["0", "1e-12", "1e-7", "1e-3", "0.5", "1", "3"])
def test_theta_matches_the_definition(s, x):
    l_squared = 1 + mpmath.mpf(x)
    assert theta(float(mpmath.sqrt(l_squared)), s) == pytest.approx(_theta_direct(l_squared, s), rel=1e-9)
    clipped = 2 * l_squared  # sqrt(2) L
    assert theta(float(mpmath.sqrt(clipped)), s) == pytest.approx(_theta_direct(clipped, s), rel=1e-9)


def test_theta_properties():
    assert theta(1.0, 0) == 0.0 and theta(1.7, 1) == 1.0 and theta(1.0, 40) == pytest.approx(1 / 40)
    assert theta(math.sqrt(2), 10**6) == pytest.approx(0.5)
    assert theta(0.9, 5) == pytest.approx(_theta_direct(mpmath.mpf("0.81"), 5), rel=1e-12)
    values = [theta(1.01, s) for s in range(1, 50)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_l_lambda():
    assert l_lambda(0.1, 0.0, 5.0) == 1.0
    assert l_lambda(0.0, 3.0, 5.0) == 1.0
    # With m = M and lr = 1/(2m), eq. 13 gives L^2 = 1 + (1 + 1/4) = 9/4.
    assert l_lambda(0.5, 1.0, 1.0) == pytest.approx(1.5)
    assert l_lambda(1e-9, 1e3, 1.0) == pytest.approx(
        float(mpmath.sqrt(_l_squared(1e-9, 1e3, 1.0))), rel=1e-15
    )


def _random_setting(rng):
    b = int(rng.choice([1, 4, 10, 50]))
    k = b * int(rng.integers(1, 3000))
    m, big_m = float(rng.choice([0.0, rng.uniform(0, 100)])), float(rng.uniform(0, 100))
    limit = 1 / (2 * (m + big_m)) if m + big_m else 1.0
    lr = float(rng.uniform(0.01, 1.0) * limit)
    return dict(lr=lr, clip=float(rng.uniform(0.1, 10)), batch_size=b, weak_convexity=m, smoothness=big_m), k


def test_theorem_2_3_matches_a_direct_evaluation(rng):
    for _ in range(25):
        common, k = _random_setting(rng)
        sigma, steps = float(rng.uniform(1e-4, 1)), int(rng.integers(1, 50 * k // common["batch_size"]))
        ell = k // common["batch_size"]
        l2 = _l_squared(common["lr"], common["weak_convexity"], common["smoothness"])
        for clipping, l2_used in ((True, 2 * l2), (False, l2)):
            expected = (
                4
                * (common["lr"] * common["clip"] / (common["batch_size"] * sigma)) ** 2
                * (1 + (steps // ell) * _theta_direct(l2_used, ell))
            )
            got = theorem_2_3_rho(sigma=sigma, dataset_size=k, steps=steps, clipping=clipping, **common)
            assert got == pytest.approx(expected, rel=1e-9)


def test_theorem_2_2_uses_sqrt2_l_lambda_when_clipping_may_be_active(rng):
    for _ in range(10):
        common, _ = _random_setting(rng)
        sigma, d_h = float(rng.uniform(1e-3, 1)), float(rng.uniform(0, 5))
        l_lam = l_lambda(common["lr"], common["weak_convexity"], common["smoothness"])
        shift = 2 * common["lr"] * common["clip"] / common["batch_size"]
        clipped = theorem_2_2_rho(sigma=sigma, domain_diameter=d_h, **common)
        assert clipped == pytest.approx((math.sqrt(2) * l_lam * d_h + shift) ** 2 / (2 * sigma**2), rel=1e-12)
        unclipped = theorem_2_2_rho(sigma=sigma, domain_diameter=d_h, clipping=False, **common)
        assert unclipped == pytest.approx((l_lam * d_h + shift) ** 2 / (2 * sigma**2), rel=1e-12)


def test_figure_1_parameters():
    """The notes' values for the paper's Figure 1 (lr=1e-5, C=10, sigma=1e-5, b=10, k=1e4, alpha=1)."""
    table = {(0, 0): (4.4, 204.0), (1, 1): (4.405, 204.005), (1000, 1000): (13.756, 208.878)}
    for (m, big_m), (unclipped, clipped) in table.items():
        common = dict(
            sigma=1e-5,
            lr=1e-5,
            clip=10,
            batch_size=10,
            dataset_size=10_000,
            steps=100_000,
            weak_convexity=m,
            smoothness=big_m,
        )
        assert theorem_2_3_rho(clipping=False, **common) == pytest.approx(unclipped, abs=1e-3)
        assert theorem_2_3_rho(clipping=True, **common) == pytest.approx(clipped, abs=1e-3)


@pytest.mark.parametrize("clipping", [True, False])
def test_finite_for_a_million_steps_per_pass(clipping):
    plan = CyclicDPSGDPlan(
        dataset_size=10**6,
        batch_size=1,
        steps=20 * 10**6,
        lr=1e-4,
        clip=1.0,
        weak_convexity=10.0,
        smoothness=10.0,
        clipping=clipping,
        bound="last-iterate",
    )
    units = plan.units()
    assert all(math.isfinite(v) and v > 0 for v in units.values())
    assert math.isfinite(account(plan(1.0), 1e-6).epsilon)


def test_curve_composes_with_other_events():
    plan = CyclicDPSGDPlan(
        10_000,
        10,
        30_000,
        lr=1e-3,
        clip=1.0,
        weak_convexity=1.0,
        smoothness=1.0,
        clipping=False,
        bound="last-iterate",
    )
    acc = Accountant("rdp", "replace-one")
    acc.record_mechanism(plan(2.0))
    acc.record("output", dpa.GaussianDpEvent(30.0))
    rho = plan.units()["theorem 2.3"] / 2.0**2
    orders = np.array(acc.orders)
    # A ZCDpEvent adds rho * alpha at every order; the Gaussian adds alpha * 2 / z^2 under replace-one.
    assert np.allclose(acc._total, rho * orders + 2 * orders / 30.0**2, rtol=1e-12)
    pld = Accountant("pld", "replace-one")
    with pytest.raises(ValueError, match="accountant='rdp'"):
        pld.record_mechanism(plan(2.0))


def test_best_bound_and_its_report():
    common = dict(dataset_size=10_000, batch_size=10, lr=1e-5, clip=10, weak_convexity=1.0, smoothness=1.0)
    long_run = CyclicDPSGDPlan(steps=100_000, clipping=False, **common)
    assert long_run.active_bound() == "theorem 2.3"
    report = account(long_run(1.0), 1e-5)
    assert any("no clipping" in a for a in report.assumptions)
    assert any("4 alpha" in a for a in report.assumptions)
    # The clipped bound never beats composition of passes (notes, sec. 7.2): "best" falls back to it.
    clipped = CyclicDPSGDPlan(steps=100_000, **common)
    assert clipped.active_bound() == "composition"
    assert account(clipped(1.0), 1e-5).epsilon == pytest.approx(
        account(CyclicDPSGDPlan(steps=100_000, bound="composition", **common)(1.0), 1e-5).epsilon, rel=1e-9
    )
    bounded = CyclicDPSGDPlan(steps=100_000, domain_diameter=1e-4, **common)
    assert bounded.active_bound() == "theorem 2.2"
    assert any("diameter" in a for a in account(bounded(1.0), 1e-5).assumptions)
    too_fast = CyclicDPSGDPlan(steps=100_000, **{**common, "lr": 1.0})
    assert too_fast.active_bound() == "composition"
    assert any("exceeds" in a for a in account(too_fast(1.0), 1e-5).assumptions)



def test_best_falls_back_to_the_composed_gaussians_themselves():
    """Where composition of passes is the smaller bound, "best" releases what "composition" does: the passes'
    Gaussians, which the PLD accountant prices (it was their zCDP curve, which PLD cannot take and RDP prices
    above the Gaussians' own PLD: 9.01 against 8.39 in a 12-step run)."""
    common = dict(dataset_size=40, batch_size=8, steps=12, lr=0.05, clip=1.0, weak_convexity=1.0,
                  smoothness=1.0)
    best, composition = (CyclicDPSGDPlan(bound=b, **common) for b in ("best", "composition"))
    assert best.active_bound() == "composition"
    spent = [account(plan(2.0), 1e-5, accountant="pld").epsilon for plan in (best, composition)]
    assert spent[0] == spent[1]

def test_composition_bound_is_replace_one_dp_gd_per_pass():
    plan = CyclicDPSGDPlan(1000, 10, 250, lr=0.01, clip=1.0, bound="composition")
    assert plan.passes == 3
    dp_gd = DPSGDPlan(3, "full", neighbouring="replace-one")
    assert account(plan(1.7), 1e-5).epsilon == pytest.approx(account(dp_gd(1.7), 1e-5).epsilon, rel=1e-12)


def test_epsilon_by_epoch_and_calibration():
    plan = CyclicDPSGDPlan(
        10_000, 10, 10_000, lr=1e-5, clip=10, weak_convexity=1.0, smoothness=1.0, clipping=False
    )
    curves = epsilon_by_epoch(plan, 1.0, 1e-5, [1, 2, 5, 20])
    assert np.all(np.diff(curves["last-iterate"]) > 0) and np.all(np.diff(curves["composition"]) > 0)
    assert curves["last-iterate"][-1] < curves["composition"][-1]
    z = calibrate(plan, 1.0, 1e-5)["gradient"]
    assert plan.sigma(z) == pytest.approx(1e-5 * 10 * z / 10)
    assert account(plan(z), 1e-5).epsilon == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.06, "bound": "last-iterate"}, "lr"),  # clipped: lr <= 1/(2(m+M)) = 0.05
        ({"lr": 0.15, "clipping": False, "bound": "last-iterate"}, "lr"),  # unclipped: lr <= 0.1
        ({"batch_size": 7}, "divide"),
        ({"neighbouring": "add-remove"}, "replace-one"),
        ({"weak_convexity": -1.0}, "weak_convexity"),
        ({"clip": 0.0}, "clip"),
        ({"steps": 0}, "steps"),
        ({"domain_diameter": -1.0}, "domain_diameter"),
        ({"bound": "tightest"}, "bound"),
    ],
)
def test_assumptions_are_validated(kwargs, match):
    base = dict(
        dataset_size=100, batch_size=10, steps=50, lr=1e-3, clip=1.0, weak_convexity=5.0, smoothness=5.0
    )
    with pytest.raises(ValueError, match=match):
        CyclicDPSGDPlan(**{**base, **kwargs})
