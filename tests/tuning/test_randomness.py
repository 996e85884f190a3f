"""dpvr.tuning: the search's secret draws (the number of trials K, each trial's candidate, the score noise).

Papernot and Steinke's bound prices the best of K runs with K random and unknown to the observer, and a
noisy score whose noise the observer cannot subtract. A fixed seed makes both known to whoever knows it, so
``tune`` refuses one unless the caller opts in with ``reproducible=True``, as the mechanisms' noise generator
does (:class:`dpvr.ops.PredictableNoiseError`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpvr.algorithms import DPGD
from dpvr.ops import PredictableNoiseError
from dpvr.tuning import tune

DELTA = 1e-5
SENSITIVITY, SCORE_NOISE = 0.1, 50.0  # the score noise's std is their product, 5


def logistic(output, target):
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


_G = torch.Generator().manual_seed(0)
X = torch.randn(16, 2, generator=_G, dtype=torch.float64)
Y = (X[:, 0] > 0).double()


def build(lr, privacy):
    return DPGD(torch.nn.Linear(2, 1).double(), logistic, X, Y, lr=lr, clip=1.0, steps=1, privacy=privacy)


def search(candidates=(0.1, 0.2), **options):
    """A search whose score is 0 before its noise: a trial's score *is* the tuner's score noise."""
    arguments = dict(epsilon=4.0, delta=DELTA, score=lambda algorithm: 0.0, trials_mean=3,
                     score_sensitivity=SENSITIVITY, score_noise=SCORE_NOISE)
    arguments.update(options)
    return tune(build, list(candidates) if isinstance(candidates, tuple) else candidates, **arguments)


def draws(result):
    """What the tuner drew: K, every trial's candidate and its score noise."""
    return result.trials_drawn, [t.candidate for t in result.trials], [t.score for t in result.trials]


@pytest.mark.parametrize("seed", [0, 12345, np.int64(7), 2**70])
@pytest.mark.parametrize("constant_time", [False, True])
def test_a_fixed_seed_without_the_opt_in_is_refused_before_anything_runs(seed, constant_time):
    built = []

    def counting(lr, privacy):
        built.append(lr)
        return build(lr, privacy)

    refusal = r"seed: a fixed seed .* predictable .* reproducible=True"
    with pytest.raises(PredictableNoiseError, match=refusal):
        tune(counting, [0.1, 0.2], epsilon=4.0, delta=DELTA, score=lambda a: 0.0, trials_mean=3, seed=seed,
             constant_time=constant_time)
    assert built == []  # refused before any build, let alone a trial on the data


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_a_seed_that_is_not_a_non_negative_integer_is_refused(seed):
    with pytest.raises(ValueError, match=r"seed: must be an integer >= 0"):
        search(seed=seed, reproducible=True)


def test_with_the_opt_in_two_searches_agree_exactly():
    def seeded(seed):
        return search(lambda rng: float(rng.uniform(0.01, 1.0)), seed=seed, reproducible=True)

    for seed in (0, 1, 2):
        first, second = seeded(seed), seeded(seed)
        assert draws(first) == draws(second)
        assert first.best == second.best and first.score == second.score
        assert first.trials_drawn == len(first.trials) >= 1
    assert draws(seeded(0)) != draws(seeded(1))
    # The opt-in is recorded where the guarantee's assumptions are: the seed must then stay secret.
    assert any("seed" in text for text in search(seed=0, reproducible=True).accountant.assumptions)
    assert not any("seed" in text for text in search().accountant.assumptions)


def test_the_candidates_stream_never_determines_k_or_the_score_noise():
    """Same seed, candidates drawn from a grid or by a sampler that consumes many draws: K and the score
    noise are the same, as they come from streams of their own."""
    def greedy(rng):
        rng.standard_normal(17)  # a sampler may consume any amount of its stream
        return float(rng.choice([0.1, 0.2]))

    for seed in (0, 3):
        grid = search(seed=seed, reproducible=True, trials_mean=6)
        sampled = search(greedy, seed=seed, reproducible=True, trials_mean=6)
        assert grid.trials_drawn == sampled.trials_drawn
        assert [t.score for t in grid.trials] == [t.score for t in sampled.trials]


def test_without_a_seed_two_searches_draw_different_k_and_different_score_noise():
    """Twenty seedless searches, each after resetting numpy's and torch's global seeds (the secret draws must
    not come from them). K is geometric with mean 3 (P(K = k) = (1/3)(2/3)^(k-1)): all twenty equal has
    probability sum_k P(K = k)^20 = 3^-20 / (1 - (2/3)^20) < 3e-10, and continuous noise repeats with
    probability 0. The pooled noise must be N(0, 5^2): its mean and variance are checked at two-sided
    level 1e-6 each."""
    runs = []
    for _ in range(20):
        np.random.seed(0)
        torch.manual_seed(0)
        runs.append(search())
    counts = [r.trials_drawn for r in runs]
    assert len(set(counts)) > 1
    assert len({r.trials[0].score for r in runs}) == len(runs)
    noise = np.array([t.score for r in runs for t in r.trials])
    n, scale = noise.size, SENSITIVITY * SCORE_NOISE
    assert n == sum(counts) >= 20
    assert abs(noise.mean()) <= stats.norm.isf(0.5e-6) * scale / math.sqrt(n)
    variance = noise.var(ddof=1) * (n - 1) / scale**2  # chi-square with n - 1 degrees of freedom
    assert stats.chi2.ppf(0.5e-6, n - 1) <= variance <= stats.chi2.isf(0.5e-6, n - 1)


def test_without_a_seed_the_candidates_are_secret_draws_too():
    """A seedless search's candidates do not follow numpy's global seed either: the released best candidate
    and a known sequence of candidates would bound K from below (it is at least the index where the best
    candidate first occurs), which the theorem does not price. Forty first candidates drawn uniformly
    from a continuous range repeat with probability 0."""
    firsts = []
    for _ in range(40):
        np.random.seed(0)
        firsts.append(search(lambda rng: float(rng.uniform(0.01, 1.0))).trials[0].candidate)
    assert len(set(firsts)) == len(firsts)
