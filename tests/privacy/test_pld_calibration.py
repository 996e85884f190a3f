"""PLD calibration and the default accountant: calibrated runs spend at most, and nearly, their target on the
accountant's own grid; the vectorised Gaussian PLD is dp_accounting's; algorithms default to the tightest."""

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from dpvr.algorithms import CyclicDPSGDPlan, DIFF2Plan, DPSGDAPlan, DPSGDPlan, PrivateDiffPlan
from dpvr.optim import PrivacyConfig
from dpvr.optim.base import tightest_accountant
from dpvr.privacy import Accountant, calibrate
from dpvr.privacy.pld import pld_epsilon
from dpvr.privacy.pld.adapter import directions
from dpvr.privacy.pld.calibration import _PLD_RTOL
from dpvr.privacy.pld.subsampling import _dense, gaussian_pld


@pytest.mark.parametrize(
    ("noise", "sensitivity", "rate"),
    [
        pytest.param(0.8, 2, 0.2, marks=pytest.mark.slow),  # the slowest (seconds); the rest span the range
        (1.7, 2, 0.01),
        (12, 2, 0.064),
        (3, 2, 1.0),
        (1.1, 1, 0.01),
        (5, 1, 0.99),
    ],
)
def test_gaussian_pld_is_dp_accountings(noise, sensitivity, rate):
    """Same grid, same masses (to float round-off amplified by the connect-the-dots differences), same
    epsilons: only the evaluation of the hockey-stick divergence is vectorised."""
    ours = gaussian_pld(noise, sensitivity, rate)
    theirs = privacy_loss_distribution.from_gaussian_mechanism(
        noise, sensitivity=sensitivity, sampling_prob=rate
    )
    for mine, reference in zip(directions(ours), directions(theirs)):
        loss, prob, infinity = _dense(mine)
        loss_ref, prob_ref, infinity_ref = _dense(reference)
        np.testing.assert_array_equal(loss, loss_ref)
        np.testing.assert_allclose(prob, prob_ref, rtol=0, atol=1e-10)
        assert infinity == pytest.approx(infinity_ref, rel=1e-9, abs=1e-30)
    for delta in (1e-3, 1e-6, 1e-9):
        expected = theirs.get_epsilon_for_delta(delta)
        assert ours.get_epsilon_for_delta(delta) == pytest.approx(expected, rel=1e-9)


PLANS = [
    DPSGDAPlan(4000, 256, 600),  # fixed-size batches, one shared release
    PrivateDiffPlan(4000, 256, 600, 2, 3),  # three streams, two of them alike
    DPSGDPlan(600, "poisson", batch_size=256, dataset_size=4000),
    DIFF2Plan(dataset_size=1650, clients=10, steps=200, restart=20),  # full batches
    DPSGDPlan(30, "random-allocation", batch_size=50, dataset_size=100),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("epsilon", [1.0, pytest.param(4.0, marks=pytest.mark.slow)])
def test_pld_calibration_spends_at_most_and_nearly_its_target(plan, epsilon):
    delta = 1e-5
    noise = calibrate(plan, epsilon, delta, accountant="pld")
    spent = pld_epsilon(plan(noise), delta)
    assert epsilon * (1 - _PLD_RTOL) <= spent <= epsilon
    # The run, recorded release by release as an algorithm records it, passes its budget guard to the end.
    accountant = Accountant("pld", plan.neighbouring)
    mechanism = plan(noise)
    last = mechanism.releases[-1]
    for release in mechanism.releases[:-1]:
        accountant.record(dict(release.parts), release.step_event(), release.count)
    accountant.record(dict(last.parts), last.step_event(), last.count - 1)
    assert not accountant.would_exceed(dict(last.parts), last.step_event(), epsilon, delta)
    accountant.record(dict(last.parts), last.step_event())
    assert accountant.epsilon(delta) == pytest.approx(spent, rel=1e-9)


def test_pld_calibration_keeps_the_rdp_ratios_and_shares():
    """PLD moves every stream by one common factor from the RDP design, so the split the shares ask for
    holds in the ratios; the PLD needs far less noise than RDP for fixed-size batches."""
    plan = PrivateDiffPlan(4000, 256, 600, 2, 3)
    shares = {"checkpoint": 1, "difference": 2, "y": 3}
    rdp = calibrate(plan, 1.0, 1e-5, shares=shares)
    pld = calibrate(plan, 1.0, 1e-5, shares=shares, accountant="pld")
    ratios = {k: pld[k] / rdp[k] for k in rdp}
    assert max(ratios.values()) == pytest.approx(min(ratios.values()), rel=1e-4)
    assert max(ratios.values()) < 0.6


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (DPSGDPlan(10, "poisson", 0.1), "pld"),
        (DPSGDPlan(10, "wor", batch_size=10, dataset_size=100), "pld"),
        (DPSGDPlan(10, "full"), "pld"),
        (DPSGDPlan(10, "random-allocation", batch_size=10, dataset_size=100), "pld"),
        (DPSGDAPlan(100, 10, 10), "pld"),
        (PrivateDiffPlan(100, 10, 10, 2, y_release="output"), "pld"),
        # the last-iterate bound is a zCDP curve, which PLD cannot take; "best" here is composition of passes
        (CyclicDPSGDPlan(100, 10, 50, lr=1e-3, clip=1.0, weak_convexity=1.0, smoothness=1.0,
                         bound="last-iterate"), "rdp"),
        (CyclicDPSGDPlan(100, 10, 50, lr=1e-3, clip=1.0, weak_convexity=1.0, smoothness=1.0), "pld"),
        (CyclicDPSGDPlan(100, 10, 50, lr=1e-3, clip=1.0, smoothness=1.0, bound="composition"), "pld"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_the_default_accountant_is_the_tightest_the_plan_supports(plan, expected):
    assert PrivacyConfig().accountant is None
    assert tightest_accountant(plan) == expected
