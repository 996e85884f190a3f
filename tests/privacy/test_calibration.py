"""Calibration: round trips through the accountant, budget shares, and the papers' closed forms."""

import math

import dp_accounting as dpa
import pytest

from dpvr.algorithms import (
    CyclicDPSGDPlan,
    DIFF2Plan,
    DoubleSpiderPlan,
    DPSGDAPlan,
    DPSGDPlan,
    PhasedPlan,
    PrivateDiffPlan,
    RecursiveSpiderPlan,
)
from dpvr.privacy import account, calibrate

ROUND_TRIP = [
    DPSGDPlan(10_000, "poisson", 0.01),
    DPSGDPlan(2_000, "wor", batch_size=64, dataset_size=20_000, neighbouring="replace-one"),
    DPSGDPlan(300, "full", neighbouring="replace-one"),
    DIFF2Plan(dataset_size=1650, clients=10, steps=2000, restart=20),
    DIFF2Plan(dataset_size=8000, clients=5, steps=100, restart=10, local_steps=5, local_batch=16),
    DPSGDAPlan(dataset_size=50_000, batch_size=500, steps=3000),
    PrivateDiffPlan(dataset_size=30_000, batch_size=300, steps=500, restart=5, y_steps=3),
    DoubleSpiderPlan(60_000, 10_000, 100, (6000, 256, 6000, 256), "poisson", "add-remove"),
    RecursiveSpiderPlan(60_000, 2_000, 50, (6000, 128, 6000, 128), "poisson", "add-remove"),
    RecursiveSpiderPlan(60_000, 2_000, 50, (60_000, 128, 60_000, 128)),  # full batches: replace-one
    PhasedPlan("sc-sc"),
    CyclicDPSGDPlan(
        10_000, 10, 50_000, lr=1e-3, clip=1.0, weak_convexity=1.0, smoothness=1.0, clipping=False
    ),
]


@pytest.mark.parametrize("plan", ROUND_TRIP, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("epsilon", [0.5, pytest.param(4.0, marks=pytest.mark.slow)])
def test_calibrate_then_account_gives_the_target(plan, epsilon):
    delta = 1e-6
    noise = calibrate(plan, epsilon, delta)
    spent = account(plan(noise), delta).epsilon
    assert spent <= epsilon * (1 + 1e-9)
    assert spent == pytest.approx(epsilon, rel=1e-3)


@pytest.mark.parametrize(
    "plan",
    [
        DPSGDPlan(1000, "poisson", 0.02),
        PhasedPlan("c-c"),
        DIFF2Plan(dataset_size=1000, clients=5, steps=100, restart=10),
    ],
    ids=lambda p: type(p).__name__,
)
def test_pld_round_trip(plan):
    noise = calibrate(plan, 1.0, 1e-5, accountant="pld")
    spent = account(plan(noise), 1e-5, accountant="pld").epsilon
    assert spent <= 1.0 and spent == pytest.approx(1.0, rel=1e-3)
    # The PLD accountant needs no more noise than RDP's.
    rdp = calibrate(plan, 1.0, 1e-5)
    assert all(noise[k] <= rdp[k] for k in noise)


def test_pld_reaches_epsilons_below_the_rdp_floor():
    """RDP's conversion certifies no epsilon below a floor at delta, whatever the noise; PLD has no floor, and
    its calibration, which takes the ratios between streams from RDP's, still reaches the target."""
    plan = DIFF2Plan(dataset_size=100, clients=2, steps=10, restart=2)
    with pytest.raises(ValueError, match="RDP accountant certifies") as refused:
        calibrate(plan, 0.01, 1e-12)
    assert "PLD accountant has no such floor" in str(refused.value)
    noise = calibrate(plan, 0.01, 1e-12, accountant="pld")
    spent = account(plan(noise), 1e-12, accountant="pld").epsilon
    assert spent <= 0.01 and spent == pytest.approx(0.01, rel=1e-3)


def test_shares_are_what_the_report_shows():
    plan = DoubleSpiderPlan(60_000, 10_000, 100, (6000, 256, 30_000, 256), "poisson", "add-remove")
    shares = {"eta-refresh": 1, "eta-difference": 2, "x-refresh": 3, "x-difference": 4}
    report = account(plan(calibrate(plan, 2.0, 1e-5, shares=shares)), 1e-5)
    assert report.shares == pytest.approx({k: v / 10 for k, v in shares.items()}, abs=0.01)
    joint = DPSGDAPlan(dataset_size=50_000, batch_size=500, steps=3000)
    noise = calibrate(joint, 1.0, 1e-6, shares={"x": 3, "y": 1})
    assert (noise["y"] / noise["x"]) ** 2 == pytest.approx(3.0)
    assert account(joint(noise), 1e-6).shares == pytest.approx({"x": 0.75, "y": 0.25})


def test_single_stream_matches_dp_accounting_calibration():
    plan = DPSGDPlan(5000, "poisson", 0.004)
    ours = calibrate(plan, 1.5, 1e-6)["gradient"]

    def event(z):
        return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.004, dpa.GaussianDpEvent(z)), 5000)

    theirs = dpa.calibrate_dp_mechanism(
        dpa.rdp.RdpAccountant, event, 1.5, 1e-6, dpa.LowerEndpointAndGuess(0.3, 1.0), tol=1e-7
    )
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_more_privacy_needs_more_noise():
    plan = DIFF2Plan(dataset_size=1650, clients=10, steps=2000, restart=20)
    noise = [calibrate(plan, eps, 1e-5) for eps in (8.0, 3.0, 1.0)]
    for loose, strict in zip(noise, noise[1:]):
        assert all(strict[k] > loose[k] for k in loose)


# -- the papers' closed forms -----------------------------------------------------------------------------


def test_diff2_proposition_4_1_exactly():
    n, clients, rounds, restart, eps, delta, u = 1651, 10, 2000, 20, 3.0, 1e-5, 1.25
    plan = DIFF2Plan(n, clients, rounds, restart)
    sigma = {k: plan.sigma(v, k) for k, v in calibrate(plan, eps, delta, calibration="paper", u=u).items()}
    alpha = 1 + math.ceil(2 * math.log(1 / delta) / eps)
    restarts = math.ceil(rounds / restart)
    assert sigma["restart"] ** 2 == pytest.approx(
        4 * u * alpha * restarts / (n**2 * clients**2 * eps), rel=1e-12
    )
    assert sigma["difference"] ** 2 == pytest.approx(
        4 * u / (u - 1) * alpha * (rounds - restarts) / (n**2 * clients**2 * eps), rel=1e-12
    )
    # The worked values for California Housing at T = 0.01 R (n_min P = 16,510), and DP-GD (T = 1, u = 1).
    assert sigma["restart"] == pytest.approx(0.00235, abs=5e-6)
    assert sigma["difference"] == pytest.approx(0.02045, abs=5e-6)
    dp_gd = DIFF2Plan(n, clients, rounds, 1)
    noise = calibrate(dp_gd, eps, delta, calibration="paper", u=1.0)
    assert dp_gd.sigma(noise["restart"], "restart") ** 2 == pytest.approx(
        4 * alpha * rounds / (n**2 * clients**2 * eps), rel=1e-12
    )
    assert dp_gd.sigma(noise["restart"], "restart") == pytest.approx(0.00938, abs=5e-6)


def test_diff2_proposition_e_2_exactly():
    n, clients, rounds, restart, k, b, eps, delta = 10_000, 10, 200, 20, 10, 10, 1.0, 1e-5
    plan = DIFF2Plan(n, clients, rounds, restart, local_steps=k, local_batch=b)
    sigma = {s: plan.sigma(v, s) for s, v in calibrate(plan, eps, delta, calibration="paper").items()}
    alpha = 1 + math.ceil(2 * math.log(1 / delta) / eps)
    expected = max(
        8 / 3 * (4 + math.e) * alpha**2 / (alpha - 1) * 6 * k * math.ceil(rounds / clients) / (n**2 * eps),
        6 * alpha / b**2,
    )
    assert sigma["local"] ** 2 == pytest.approx(expected, rel=1e-12)
    assert sigma["restart"] ** 2 == pytest.approx(4 * 3 * alpha * 10 / ((n * clients) ** 2 * eps), rel=1e-12)
    with pytest.raises(ValueError, match="local_batch"):
        calibrate(DIFF2Plan(n, clients, rounds, restart, k, 200), eps, delta, calibration="paper")


def test_minimax_practical_constants_exactly():
    n, m, steps, eps, delta = 60_000, 949, 1000, 1.0, 1 / 60_000**2
    sgda = DPSGDAPlan(n, m, steps)
    sigma = 8 * math.sqrt(steps * math.log(1 / delta)) / (n * eps)
    assert calibrate(sgda, eps, delta, calibration="paper") == pytest.approx({"x": m * sigma, "y": m * sigma})
    diff = PrivateDiffPlan(n, 15_000, steps=1000, restart=2, y_steps=3, y_release="output")
    noise = calibrate(diff, eps, delta, calibration="paper")
    log_term = math.log(1 / delta)
    assert noise["checkpoint"] == pytest.approx(15_000 * 4 * math.sqrt(500 * log_term) / (n * eps))
    assert noise["difference"] == pytest.approx(15_000 * 4 * math.sqrt(1000 * log_term) / (n * eps))
    # sigma_y / (y-sensitivity) = 4 sqrt(R log(1/delta)) / eps; dpvr's unit is half that sensitivity.
    assert noise["y"] == pytest.approx(2 * 4 * math.sqrt(1000 * log_term) / eps)


@pytest.mark.parametrize("gaussian", ["classic", "analytic"])
def test_phased_closed_forms_exactly(gaussian):
    eps, delta = 0.5, 1e-5
    for setting, eps_r, delta_r in (("sc", eps, delta / 2), ("c-c", eps / 2, delta / 4)):
        noise = calibrate(PhasedPlan(setting), eps, delta, calibration="paper", gaussian=gaussian)
        ratio = (
            math.sqrt(2 * math.log(1.25 / delta_r)) / eps_r
            if gaussian == "classic"
            else dpa.get_sigma_gaussian(eps_r, delta_r)
        )
        assert all(z == pytest.approx(2 * ratio, rel=1e-12) for z in noise.values())
    # Algorithm 1's printed sigma/Delta = sqrt(2 log(2.5/delta)) / epsilon.
    classic = calibrate(PhasedPlan("sc"), eps, delta, calibration="paper")["x"]
    assert classic / 2 == pytest.approx(math.sqrt(2 * math.log(2.5 / delta)) / eps, rel=1e-12)


def _tight_with_the_papers_split(plan, paper, epsilon, delta, accountant="rdp"):
    """Tight calibration with the budget split the paper's own noise ends up with."""
    shares = account(plan(paper), delta, accountant=accountant).shares
    return calibrate(plan, epsilon, delta, shares=shares, accountant=accountant)


def test_paper_noise_is_never_below_the_tight_noise():
    eps, delta = 3.0, 1e-5
    for restart in (6, 200):
        plan = DIFF2Plan(dataset_size=1651, clients=10, steps=2000, restart=restart)
        for u in (1.25, 2.0):
            paper = calibrate(plan, eps, delta, calibration="paper", u=u)
            # Proposition 4.1's split of the RDP budget is 1/u : (u-1)/u at every order.
            tight = calibrate(plan, eps, delta, shares={"restart": 1, "difference": u - 1})
            assert all(paper[k] >= tight[k] for k in paper)
    cases = [
        (DIFF2Plan(10_000, clients=10, steps=200, restart=20, local_steps=10, local_batch=10), 1.0, {}),
        (DPSGDAPlan(60_000, 949, 1000), 1.0, {}),
        (DPSGDAPlan(10_000, 71, 5000), 1.0, {}),
    ]
    for plan, epsilon, options in cases:
        small = 1 / plan.dataset_size**2 if isinstance(plan, DPSGDAPlan) else delta
        paper = calibrate(plan, epsilon, small, calibration="paper", **options)
        tight = _tight_with_the_papers_split(plan, paper, epsilon, small)
        assert all(paper[k] >= v for k, v in tight.items())
    for setting in ("sc", "sc-sc"):
        plan = PhasedPlan(
            setting, failure_probability=delta / 2
        )  # the paper spends delta/2 on solver failure
        for gaussian in ("classic", "analytic"):
            paper = calibrate(plan, 0.5, delta, calibration="paper", gaussian=gaussian)
            tight = _tight_with_the_papers_split(plan, paper, 0.5, delta, accountant="pld")
            # The analytic Gaussian is exact for one release; PLD is exact up to its discretisation.
            assert all(paper[k] >= v * (1 - 1e-4) for k, v in tight.items())


def test_private_diff_remark_5_1_spends_more_than_its_target():
    """Remark 5.1's x-noise is half what its replace-one sensitivity 2C/m needs; dpvr reports the truth."""
    n, eps = 60_000, 1.0
    delta = 1 / n**2
    plan = PrivateDiffPlan(
        n, round(n * math.sqrt(eps / 16)), steps=1000, restart=2, y_steps=3, y_release="output"
    )
    paper = calibrate(plan, eps, delta, calibration="paper")
    assert account(plan(paper), delta).epsilon > 1.5 * eps
    doubled = {k: (2 * v if k != "y" else v) for k, v in paper.items()}
    assert account(plan(doubled), delta).epsilon < eps


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: calibrate(DPSGDPlan(10, "poisson", 0.1), 0.0, 1e-5), "epsilon"),
        (lambda: calibrate(DPSGDPlan(10, "poisson", 0.1), 1.0, 1.0), "delta"),
        (lambda: calibrate(DPSGDPlan(10, "poisson", 0.1), 1.0, 1e-5, calibration="loose"), "calibration"),
        (lambda: calibrate(DPSGDPlan(10, "poisson", 0.1), 1.0, 1e-5, accountant="gdp"), "accountant"),
        (lambda: calibrate(DIFF2Plan(100, 2, 10, 2), 1.0, 1e-5, shares={"restart": 1}), "difference"),
        (
            lambda: calibrate(DIFF2Plan(100, 2, 10, 2), 1.0, 1e-5, shares={"restart": 1, "difference": 0}),
            "share",
        ),
        (
            lambda: calibrate(DoubleSpiderPlan(100, 10, 2, (10,) * 4), 1.0, 1e-5, calibration="paper"),
            "closed-form",
        ),
        (lambda: calibrate(DPSGDAPlan(1000, 10, 10), 2.0, 1e-7, calibration="paper"), "epsilon <= 1"),
        (lambda: calibrate(DPSGDAPlan(1000, 10, 10), 0.5, 1e-5, calibration="paper"), "delta <= 1/n"),
        (lambda: calibrate(PrivateDiffPlan(1000, 10, 10, 2), 0.5, 1e-7, calibration="paper"), "ascent"),
        (lambda: calibrate(PhasedPlan("sc"), 2.0, 1e-5, calibration="paper"), "analytic"),
        (lambda: calibrate(DIFF2Plan(100, 2, 10, 2), 1.0, 1e-5, calibration="paper", u=1.0), "u must"),
        (lambda: calibrate(DPSGDPlan(10, "poisson", 0.1, neighbouring="replace-one"), 1.0, 1e-5), "Poisson"),
        (
            lambda: calibrate(
                DPSGDPlan(10, "wor", 0.1, neighbouring="add-remove"), 1.0, 1e-5, accountant="pld"
            ),
            "replace-one",
        ),
        (lambda: calibrate(PhasedPlan("sc", failure_probability=1e-5), 1.0, 1e-5), "failure probability"),
        (lambda: calibrate(DPSGDPlan(0, "poisson", 0.1), 1.0, 1e-5), "no noise streams"),
    ],
)
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
