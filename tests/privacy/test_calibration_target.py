"""A calibrated or closed-form run never reports more than its target: full-batch Gaussian steps against
the Gaussian mechanism's closed-form profile, calibrated runs recorded step by step."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from dpvr.algorithms import DPSGDAPlan, DPSGDPlan, PrivateDiffPlan
from dpvr.privacy import Accountant, calibrate

DELTA = 1e-5


# -- item 9: no report exceeds the target its noise was set for ------------------------------------------


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with sensitivity / std ``mu`` (its closed-form profile)."""

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps + norm.logcdf(-eps / mu - mu / 2)) - delta

    return brentq(excess, 0.0, mu * mu / 2 + 50 * mu + 10, xtol=1e-14, rtol=1e-15)


@pytest.mark.parametrize("steps", [2, 50, 600])
def test_full_batch_steps_priced_in_closed_form_report_at_most_their_target(steps):
    """The phased experiment's baselines: ``T`` full-batch Gaussian steps compose to exactly one Gaussian with
    noise ``z / sqrt(T)``, so noise ``sqrt(T)`` times the analytic Gaussian mechanism's (Balle and Wang, at
    ``(1, delta)``) spends epsilon = 1. Recorded step by step, the PLD accountant reported up to 1.000008 (it
    composed ``T`` rounded PLDs); it must report at most the target, and what one release at the composed
    noise reports."""
    sigma = dpa.get_sigma_gaussian(1.0, DELTA) * (1 + 1e-9)  # noise / sensitivity; replace-one: 2C
    acc = Accountant("pld", "replace-one")
    for _ in range(steps):
        acc.record("gradient", dpa.GaussianDpEvent(2 * sigma * math.sqrt(steps)))
    single = Accountant("pld", "replace-one")
    single.record("gradient", dpa.GaussianDpEvent(2 * sigma))
    assert acc.epsilon(DELTA) <= 1.0
    assert acc.epsilon(DELTA) == pytest.approx(single.epsilon(DELTA), rel=1e-12)
    assert acc.epsilon(DELTA) == pytest.approx(_gaussian_epsilon(1 / sigma, DELTA), rel=1e-6)
    # Two streams with different noise (x and y of a minimax baseline) compose in closed form too.
    both = Accountant("pld", "replace-one")
    for _ in range(steps):
        both.record("x", dpa.GaussianDpEvent(2 * sigma * math.sqrt(steps) * math.sqrt(5 / 4)))
        both.record("y", dpa.GaussianDpEvent(2 * sigma * math.sqrt(steps) * math.sqrt(5)))
    assert both.epsilon(DELTA) <= 1.0


CALIBRATED = [
    DPSGDAPlan(dataset_size=1000, batch_size=50, steps=200),
    DPSGDAPlan(1000, 50, 200, sampling="poisson", neighbouring="add-remove"),
    DPSGDPlan(steps=300, sampling="poisson", sample_rate=0.02),
    DPSGDPlan(steps=300, sampling="full"),
    PrivateDiffPlan(dataset_size=1000, batch_size=50, steps=40, restart=5, y_steps=3),
    PrivateDiffPlan(1000, 50, 40, 5, y_release="output"),
    DPSGDPlan(steps=25, sampling="random-allocation", batch_size=10, dataset_size=100),
]


@pytest.mark.parametrize("accountant", [pytest.param("rdp", marks=pytest.mark.slow), "pld"])  # pld: default
@pytest.mark.parametrize("plan", CALIBRATED, ids=lambda p: type(p).__name__)
def test_calibrated_runs_recorded_step_by_step_spend_at_most_their_target(plan, accountant):
    """Calibrate to epsilon = 1, then record the planned releases one by one, streams interleaved round by
    round as the algorithms release them: the report is <= 1, and the budget guard prices the last release
    exactly as the report then does (it admits it at that epsilon, not a hair below)."""
    if accountant == "rdp" and plan.batch_sampling.scheme == "random-allocation":
        pytest.skip("random allocation is priced by PLD only")
    noise = calibrate(plan, 1.0, DELTA, accountant=accountant)
    mechanism = plan(noise)
    acc = Accountant(accountant, plan.neighbouring)
    rounds = max(r.count for r in mechanism.releases)
    last = None
    for index in range(rounds):
        for release in mechanism.releases:
            if index < release.count:
                if last is not None:
                    acc.record(*last)
                last = (dict(release.parts), release.step_event())
    before = acc.would_exceed(*last, 1.0, DELTA), acc.would_exceed(*last, 1 - 1e-12, DELTA)
    acc.record(*last)
    spent = acc.epsilon(DELTA)
    assert spent <= 1.0
    assert acc.report(DELTA).epsilon == spent
    assert before == (False, spent > 1 - 1e-12)
    assert not acc.would_exceed(*last, spent, DELTA, count=0)
    assert acc.would_exceed(*last, spent * (1 - 1e-9), DELTA, count=0)
