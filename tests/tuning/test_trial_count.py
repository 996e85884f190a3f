"""The number of trials: its tail is exact, and a constant-time search runs the cap whatever K is and is
charged for it."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from dpvr.algorithms import DPGD
from dpvr.tuning import TrialCount, tune
from tests.tuning.toy_task import X, Y, fresh_model, held_out, logistic

DELTA = 1e-5


def _counting(runs: list[int]):
    def train(alg) -> None:
        runs.append(id(alg))
        alg.run()

    return train


# ---- 6. tune(): running time independent of K ------------------------------------------------------------


@pytest.mark.parametrize(
    "distribution, shape",
    [("poisson", None), ("negative-binomial", 0.0), ("negative-binomial", 1.0), ("negative-binomial", 2.5)],
)
def test_the_tail_of_the_trial_count_is_exact(distribution: str, shape: float | None) -> None:
    count = TrialCount.make(distribution, 3.0, shape)
    if distribution == "poisson":
        pmf = [stats.poisson.pmf(k, 3.0) for k in range(400)]
    else:
        gamma = count.gamma
        if shape == 0:
            pmf = [0.0] + [(1 - gamma) ** k / (k * -math.log(gamma)) for k in range(1, 400)]
        else:
            pmf = [0.0] + [
                (1 - gamma) ** k / (gamma**-shape - 1) * math.prod((i + shape) / (i + 1) for i in range(k))
                for k in range(1, 400)
            ]
    for cap in (1, 3, 10, 30):
        assert count.tail(cap) == pytest.approx(sum(pmf[cap + 1 :]), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("seed", [2, 20, 0])  # K = 2, 0 and 3
def test_constant_time_runs_max_trials_whatever_k_is_and_charges_the_cap(seed: int) -> None:
    runs: list[int] = []
    cap = 14

    def build(lr, privacy):
        torch.manual_seed(0)
        return DPGD(fresh_model(), logistic, X, Y, lr=lr, clip=1.0, steps=1, privacy=privacy)

    result = tune(
        build,
        [0.1, 1.0],
        epsilon=2.0,
        delta=DELTA,
        score=held_out,
        trials_mean=2,
        distribution="poisson",
        seed=seed,
        reproducible=True,
        train=_counting(runs),
        constant_time=True,
        max_trials=cap,
    )
    assert len(runs) == cap  # every search runs the cap, so its running time does not depend on K
    assert len(result.trials) == min(result.trials_drawn, cap)  # only the first K are candidates
    if result.trials:
        assert result.best in {t.candidate for t in result.trials}
    else:
        assert result.best is None and result.algorithm is None
    tail = (1 + math.exp(2.0)) * TrialCount.make("poisson", 2.0).tail(cap)
    assert result.accountant.failure_probability == pytest.approx(tail, rel=1e-12)
    assert result.epsilon <= 2.0 and result.accountant.epsilon(DELTA) <= 2.0 * (1 + 1e-9)
    assert result.to_dict()["max_trials"] == cap


def test_constant_time_refuses_a_cap_whose_tail_exceeds_delta_and_picks_one_by_default() -> None:
    def build(lr, privacy):
        return DPGD(fresh_model(), logistic, X, Y, lr=lr, clip=1.0, steps=1, privacy=privacy)

    with pytest.raises(ValueError, match="max_trials"):
        tune(
            build,
            [0.1],
            epsilon=1.0,
            delta=DELTA,
            score=held_out,
            trials_mean=2,
            distribution="poisson",
            seed=0,
            reproducible=True,
            constant_time=True,
            max_trials=3,
        )
    with pytest.raises(ValueError, match="constant_time"):
        tune(build, [0.1], epsilon=1.0, delta=DELTA, score=held_out, trials_mean=2, seed=0, max_trials=3)
    runs: list[int] = []
    result = tune(
        build,
        [0.1],
        epsilon=1.0,
        delta=DELTA,
        score=held_out,
        trials_mean=2,
        distribution="poisson",
        seed=0,
        reproducible=True,
        train=_counting(runs),
        constant_time=True,
    )
    count = TrialCount.make("poisson", 2.0)
    cap = result.max_trials
    assert len(runs) == cap
    assert (1 + math.e) * count.tail(cap) <= DELTA / 10 < (1 + math.e) * count.tail(cap - 1)
