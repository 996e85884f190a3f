"""Low noise is answered in bounded time and memory, and a coarsened PLD grid is stated in the report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import dp_accounting as dpa
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy.optimize import brentq
from scipy.stats import norm

from dpvr.privacy import (
    Accountant,
)

DELTA = 1e-5


# -- item 9: no report exceeds the target its noise was set for ------------------------------------------


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with sensitivity / std ``mu`` (its closed-form profile)."""

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps + norm.logcdf(-eps / mu - mu / 2)) - delta

    return brentq(excess, 0.0, mu * mu / 2 + 50 * mu + 10, xtol=1e-14, rtol=1e-15)


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
        from dpvr.algorithms import DPSGDPlan
        from dpvr.privacy import Accountant, calibrate
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
