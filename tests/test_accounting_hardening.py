"""Privacy-review regressions of the accountant: runs are priced separately, a calibrated or closed-form run
never reports more than its target, low noise keeps every answer bounded in time and memory, and the
random-allocation PLD is as tight as an independent accountant's bounds.

Every reference is independent of what it checks: the exact epoch PLD composed by hand, the Gaussian
mechanism's closed-form profile, dp_accounting's optimistic (lower-bound) PLD, and the upper and lower bounds
of Feldman and Shenfeld's accountant (PyPI ``PLD-accounting``), recorded below and recomputed where that
package is installed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import warnings

import dp_accounting as dpa
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.optimize import brentq
from scipy.stats import norm

from dpvr.privacy import (
    Accountant,
    DPSGDAPlan,
    DPSGDPlan,
    PrivateDiffPlan,
    calibrate,
)
from dpvr.privacy.pld.random_allocation import random_allocation_gaussian_pld
from dpvr.privacy.random_allocation import RandomAllocationDpEvent

DELTA = 1e-5


def _epochs(z: float, t: int, epochs: int, delta: float = DELTA) -> float:
    epoch = random_allocation_gaussian_pld(z, t)
    return float((epoch.self_compose(epochs) if epochs > 1 else epoch).get_epsilon_for_delta(delta))


# -- item 5: random-allocation epochs are counted per run ------------------------------------------------


def test_two_recorded_runs_are_priced_as_two_runs():
    """Two runs of 15 steps (t = 10) cost two epochs each; merged, they would pass for three."""
    plan = DPSGDPlan(steps=15, sampling="random-allocation", batch_size=10, dataset_size=100)
    acc = Accountant("pld", "add-remove")
    acc.record_mechanism(plan(1.0))
    acc.record_mechanism(plan(1.0))
    assert acc.epsilon(DELTA) == pytest.approx(_epochs(1.0, 10, 4), rel=1e-9)
    assert acc.epsilon(DELTA) > _epochs(1.0, 10, 3) * 1.05


def test_step_by_step_releases_belong_to_the_run_the_caller_names():
    event = RandomAllocationDpEvent(10, dpa.GaussianDpEvent(1.0))
    acc = Accountant("pld", "add-remove")
    for run in ("", "b", ""):  # the implicit run is one run, interrupted or not
        for _ in range(5):
            acc.record("gradient", event, run=run)
    two = _epochs(1.0, 10, 2)
    assert acc.epsilon(DELTA) == pytest.approx(two, rel=1e-9)
    # The guard prices a release in its own run: run "b" has room in its epoch, the implicit run has none.
    assert not acc.would_exceed("gradient", event, two * (1 + 1e-9), DELTA, run="b")
    assert acc.would_exceed("gradient", event, two * (1 + 1e-9), DELTA)
    assert acc.would_exceed("gradient", event, two * (1 + 1e-9), DELTA, run="c")
    # The run identity survives a checkpoint: "b" still has room after a restore.
    restored = Accountant.from_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.epsilon(DELTA) == acc.epsilon(DELTA)
    restored.record("gradient", event, run="b")
    assert restored.epsilon(DELTA) == pytest.approx(two, rel=1e-9)


def test_a_recorded_mechanism_never_joins_a_run_named_like_it():
    plan = DPSGDPlan(steps=5, sampling="random-allocation", batch_size=10, dataset_size=100)
    acc = Accountant("pld", "add-remove")
    parts, event = plan.step("gradient", 1.0)
    acc.record(parts, event, 5, run="mechanism-1")
    acc.record_mechanism(plan(1.0))
    acc.record_mechanism(plan(1.0))
    assert acc.epsilon(DELTA) == pytest.approx(_epochs(1.0, 10, 3), rel=1e-9)


def test_states_without_run_identities_load_pessimistically():
    """A state saved before runs were recorded cannot tell them apart: each random-allocation entry is charged
    as a run of its own (an upper bound, stated in the report); other ledgers load unchanged."""
    event = RandomAllocationDpEvent(10, dpa.GaussianDpEvent(1.0))
    legacy = {
        "format": "dpvr.privacy.Accountant/1",
        "accountant": "pld",
        "neighbouring": "add-remove",
        "orders": [2.0, 4.0, 8.0, 16.0, 32.0],
        "failure_probability": 0.0,
        "assumptions": [],
        "ledger": [
            {"streams": {"gradient": 1.0}, "count": 5, "event": json.loads(json.dumps(_dict(event)))},
            {"streams": {"gradient": 1.0}, "count": 5, "event": json.loads(json.dumps(_dict(event)))},
        ],
    }
    acc = Accountant.from_state_dict(legacy)
    assert acc.epsilon(DELTA) == pytest.approx(_epochs(1.0, 10, 2), rel=1e-9)
    assert any("run identities" in text for text in acc.report(DELTA).assumptions)
    gaussian = dict(
        legacy, ledger=[{"streams": {"g": 1.0}, "count": 3, "event": _dict(dpa.GaussianDpEvent(2.0))}]
    )
    plain = Accountant.from_state_dict(gaussian)
    fresh = Accountant("pld", "add-remove")
    fresh.record("g", dpa.GaussianDpEvent(2.0), 3)
    assert plain.epsilon(DELTA) == fresh.epsilon(DELTA)
    assert not any("run identities" in text for text in plain.report(DELTA).assumptions)
    with pytest.raises(ValueError, match="format"):
        Accountant.from_state_dict(dict(legacy, format="dpvr.privacy.Accountant/0"))


def _dict(event: dpa.DpEvent) -> dict:
    from dpvr.privacy import event_to_dict

    return event_to_dict(event)


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


# -- item 10: low noise is answered in bounded time and memory -------------------------------------------


def _bounded(code: str, memory_gib: float = 4.0, timeout: float = 900.0) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter whose address space is capped at
    ``memory_gib``. The cap and the timeout guard against a blow-up or a hang; they time nothing."""
    cap = int(memory_gib * 2**30)
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_low_noise_runs_are_answered_with_bounded_memory():
    out = _bounded(
        """
        import json
        from dpvr.privacy import Accountant, DPSGDPlan, calibrate
        from dpvr.privacy.random_allocation import RandomAllocationDpEvent
        import dp_accounting as dpa
        out = {}
        full = Accountant("pld", "replace-one")
        full.record("gradient", dpa.GaussianDpEvent(0.05), 2000)
        out["full"] = full.epsilon(1e-5)
        out["full_notes"] = full.report(1e-5).assumptions
        poisson = Accountant("pld", "add-remove")
        poisson.record("gradient", dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(0.02)), 1000)
        out["poisson"] = poisson.epsilon(1e-5)
        allocation = Accountant("pld", "add-remove")
        allocation.record("gradient", RandomAllocationDpEvent(100, dpa.GaussianDpEvent(0.01)), 5000)
        out["allocation"] = allocation.epsilon(1e-5)
        plan = DPSGDPlan(steps=100, sampling="full")
        noise = calibrate(plan, 1e4, 1e-5, accountant="pld")
        spent = Accountant("pld", plan.neighbouring)
        spent.record_mechanism(plan(noise))
        out["calibrated_noise"], out["calibrated"] = noise["gradient"], spent.epsilon(1e-5)
        print(json.dumps(out))
        """
    )
    # Full batch: one Gaussian with sensitivity 2 sqrt(T) / z (replace-one); the report is its epsilon, above.
    exact = _gaussian_epsilon(2 * math.sqrt(2000) / 0.05, 1e-5)
    assert exact <= out["full"] <= exact * (1 + 1e-3)
    # Poisson: above dp_accounting's optimistic PLD (a lower bound) on a grid it can afford.
    lower = pld_lib.from_gaussian_mechanism(
        0.02, sampling_prob=0.01, pessimistic_estimate=False, value_discretization_interval=0.05
    )
    assert out["poisson"] >= lower.self_compose(1000).get_epsilon_for_delta(1e-5)
    # Random allocation at z = 0.01: no better than no amplification, 50 epochs of one Gaussian each.
    assert out["allocation"] >= _gaussian_epsilon(math.sqrt(50) / 0.01, 1e-5) * 0.99
    # Calibration to epsilon = 1e4: at most the target, and more noise than the exact Gaussian needs.
    assert 1e4 * (1 - 1e-3) <= out["calibrated"] <= 1e4
    exact_noise = brentq(lambda z: _gaussian_epsilon(2 * math.sqrt(100) / z, 1e-5) - 1e4, 1e-4, 1.0)
    assert out["calibrated_noise"] >= exact_noise


def test_a_coarsened_grid_is_stated_in_the_report():
    acc = Accountant("pld", "add-remove")
    acc.record("gradient", dpa.GaussianDpEvent(0.005))
    report = acc.report(DELTA)
    assert any("grid" in text and "coarser" in text for text in report.assumptions)
    assert report.epsilon >= _gaussian_epsilon(1 / 0.005, DELTA)
    fine = Accountant("pld", "add-remove")
    fine.record("gradient", dpa.GaussianDpEvent(1.0))
    assert not any("coarser" in text for text in fine.report(DELTA).assumptions)


# -- item 13: the random-allocation PLD against Feldman and Shenfeld's bounds ----------------------------

#: (sigma, t, epochs, delta) -> (lower, upper) epsilon of PLD-accounting 2.0 (GEOM convolution, dominating and
#: dominated bounds, loss_discretization 1e-2, tail_truncation delta / 1000).
FELDMAN_SHENFELD = {
    (2.0, 100, 1, 1e-5): (0.16931562087285484, 0.17687178004068965),
    (5.0, 100, 1, 1e-5): (0.055549182744879674, 0.06311751394014316),
    (5.0, 100, 10, 1e-5): (0.2051393838770003, 0.212756984841304),
    (1.0, 100, 5, 1e-5): (1.2019248545469183, 1.2092729130089372),
    (0.8, 10, 3, 1e-6): (6.079158870181817, 6.083696584963284),
    (5.0, 1000, 10, 1e-5): (0.056053227074737325, 0.06247902655660773),
    (3.0, 1000, 5, 1e-6): (0.08399019432601419, 0.09040376779104525),
    (1.0, 1000, 2, 1e-5): (0.1949245705282992, 0.20129452796652345),
}


#: The same at loss_discretization 2e-3, where their bounds are within 1 % and 3 % of each other.
FELDMAN_SHENFELD_FINE = {
    (2.0, 100, 1, 1e-5): (0.17239902863119264, 0.17391928133622062),
    (5.0, 100, 1, 1e-5): (0.058523728909892186, 0.06004144319530051),
}


def _feldman_shenfeld(z: float, t: int, epochs: int, delta: float) -> tuple[float, float]:
    """Their accountant's (lower, upper) bounds at the settings of :data:`FELDMAN_SHENFELD`."""
    fs = pytest.importorskip("PLD_accounting")
    params = fs.PrivacyParams(sigma=z, num_steps=t, num_epochs=epochs, delta=delta)
    config = fs.AllocationSchemeConfig(
        loss_discretization=1e-2, tail_truncation=delta / 1000, convolution_method=fs.ConvolutionMethod.GEOM
    )
    return tuple(
        fs.gaussian_allocation_epsilon_configurable(params=params, config=config, bound_type=bound)
        for bound in (fs.BoundType.IS_DOMINATED, fs.BoundType.DOMINATES)
    )


@pytest.mark.parametrize(("point", "bounds"), list(FELDMAN_SHENFELD.items()), ids=str)
def test_random_allocation_lies_within_feldman_shenfeld_bounds(point, bounds):
    """Never below their lower bound (both are valid), never more than 1 % above their upper bound."""
    lower, upper = bounds
    ours = _epochs(*point)
    assert lower <= ours <= upper * 1.01


@pytest.mark.parametrize(("point", "bounds"), list(FELDMAN_SHENFELD_FINE.items()), ids=str)
def test_random_allocation_lies_within_their_tight_bounds(point, bounds):
    lower, upper = bounds
    assert lower <= _epochs(*point) <= upper


@pytest.mark.slow
@pytest.mark.parametrize("point", [(2.0, 100, 1, 1e-5), (5.0, 100, 1, 1e-5)], ids=str)
def test_recorded_bounds_are_feldman_shenfelds(point):
    """The recorded bounds are what their package computes (seconds with numba, half a minute without)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # their warning that numba is missing
        lower, upper = _feldman_shenfeld(*point)
    assert (lower, upper) == pytest.approx(FELDMAN_SHENFELD[point], rel=1e-6)
    assert lower <= _epochs(*point) <= upper * 1.01


@pytest.mark.parametrize(("z", "t"), [(2.0, 100), (3.0, 100), (5.0, 100), (5.0, 1000)])
def test_random_allocation_is_below_poisson_at_rate_one_over_t(z, t):
    ours = _epochs(z, t, 1)
    poisson = pld_lib.from_gaussian_mechanism(z, sampling_prob=1 / t).self_compose(t)
    assert ours <= poisson.get_epsilon_for_delta(DELTA)
