"""The random-allocation PLD against independent bounds: the upper and lower bounds of Feldman and
Shenfeld's accountant (PyPI ``PLD-accounting``), recorded below and recomputed where that package is
installed, and Poisson sampling at rate 1/t."""

from __future__ import annotations

import warnings

import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpvr.privacy.pld.random_allocation import random_allocation_gaussian_pld

DELTA = 1e-5


def _epochs(z: float, t: int, epochs: int, delta: float = DELTA) -> float:
    epoch = random_allocation_gaussian_pld(z, t)
    return float((epoch.self_compose(epochs) if epochs > 1 else epoch).get_epsilon_for_delta(delta))


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
