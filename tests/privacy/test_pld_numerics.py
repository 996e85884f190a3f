"""dpvr's vectorised PLD steps against dp_accounting's own: the same PMFs, truncation bounds and epsilons."""

import math

import numpy as np
import pytest
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpvr.privacy.pld import numerics as pld_numerics
from dpvr.privacy.pld.adapter import directions
from dpvr.privacy.pld.subsampling import _dense, gaussian_pld

# (noise, sensitivity, sampling rate, grid): small rates with few and many points, a plain Gaussian.
CASES = [(0.9, 1.0, 2.6e-4, 1e-3), (1.5, 1.0, 0.05, 1e-4), (4.0, 2.0, 1.0, 1e-4), (0.7, 1.0, 0.01, 1e-2)]


def _same_pmf(ours: pld_pmf.PLDPmf, theirs: pld_pmf.PLDPmf) -> None:
    loss, prob, infinity = _dense(ours)
    loss_ref, prob_ref, infinity_ref = _dense(theirs)
    np.testing.assert_array_equal(loss, loss_ref)
    np.testing.assert_array_equal(prob, prob_ref)
    assert infinity == infinity_ref


@pytest.mark.parametrize("grid", [1e-4, 1e-2])
@pytest.mark.parametrize("size", [7, 5000])
def test_connect_dots_pmf_is_dp_accountings(grid, size):
    """The same PMF, point for point, from the same hockey-stick curve (sparse and dense sizes)."""
    rng = np.random.default_rng(size)
    deltas = np.sort(rng.random(size) * 0.3)[::-1]
    deltas[1::3] += 1e-13  # rises within dp_accounting's tolerance
    lower = -(size // 3)
    upper = lower + size - 1
    ours = pld_numerics.connect_dots_pmf(grid, lower, upper, deltas)
    _same_pmf(ours, pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(grid, lower, upper, deltas))


def test_connect_dots_pmf_refuses_what_dp_accounting_refuses():
    with pytest.raises(ValueError, match="non-increasing"):
        pld_numerics.connect_dots_pmf(1e-3, 0, 1999, np.linspace(0.1, 0.2, 2000))


@pytest.mark.parametrize("count", [2, 37, 4000])
@pytest.mark.parametrize("case", CASES[:3])
def test_self_convolve_bounds_are_dp_accountings(case, count):
    """The grid the accountant plans for a self-composition is the one dp_accounting allocates."""
    noise, sensitivity, rate, grid = case
    pld = gaussian_pld(noise, sensitivity, rate, grid)
    for pmf in directions(pld):
        probs = _dense(pmf)[1]
        expected = pld_common.compute_self_convolve_bounds(probs, count, 1e-15)
        assert pld_numerics.self_convolve_bounds(probs, count, 1e-15) == expected


@pytest.mark.parametrize("count", [2, 100])
@pytest.mark.parametrize("case", CASES)
def test_self_compose_is_dp_accountings(case, count):
    noise, sensitivity, rate, grid = case
    pld = gaussian_pld(noise, sensitivity, rate, grid)
    ours, theirs = pld_numerics.self_compose(pld, count), pld.self_compose(count)
    for mine, reference in zip(directions(ours), directions(theirs)):
        _same_pmf(mine, reference)


@pytest.mark.parametrize("count", [1, 50, 3000])
@pytest.mark.parametrize("case", CASES)
def test_epsilon_for_delta_is_dp_accountings(case, count):
    """Equal to the last few ulp (np.exp against math.exp), never below, at every delta, including where
    epsilon is 0 and where no finite epsilon reaches delta."""
    noise, sensitivity, rate, grid = case
    pld = gaussian_pld(noise, sensitivity, rate, grid)
    pld = pld.self_compose(count) if count > 1 else pld
    for delta in (1e-15, 1e-10, 1e-6, 1e-3, 0.3, 0.999):
        expected = pld.get_epsilon_for_delta(delta)
        got = pld_numerics.epsilon_for_delta(pld, delta)
        if math.isinf(expected) or expected == 0:
            assert got == expected
        else:
            assert got == pytest.approx(expected, rel=1e-12, abs=1e-14)
            assert got >= expected  # rounded up, never below dp_accounting's


def test_epsilon_for_delta_at_an_underflowing_loss():
    """Losses so large that exp(-loss) is 0: the loss at which the mass above reaches delta."""
    probs = np.zeros(3000)
    probs[-5:] = 0.2
    pmf = pld_pmf.DensePLDPmf(1.0, 0, probs, 0.0, True)
    pld = pld_lib.PrivacyLossDistribution(pmf)
    for delta in (0.1, 0.3, 0.5):
        assert pld_numerics.epsilon_for_delta(pld, delta) == pld.get_epsilon_for_delta(delta)
