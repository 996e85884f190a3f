"""dpvr.tuning: private hyper-parameter search by random stopping (Papernot and Steinke, ICLR 2022)."""

from __future__ import annotations

import itertools
import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpvr.algorithms import DPGD
from dpvr.audit import threshold_lower_bound
from dpvr.ops import NoiseGenerator
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.tuning import TrialCount, truncated_negative_binomial_mean, tune

DELTA = 1e-5


def logistic(output, target):
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


def data(seed=0, n=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).double()


X, Y = data(0)
XV, YV = data(1)


def builder(steps=6, x=X, y=Y):
    def build(lr, privacy):
        torch.manual_seed(0)
        return DPGD(torch.nn.Linear(x.shape[1], 1).double(), logistic, x, y, lr=lr, clip=1.0, steps=steps,
                    privacy=privacy)
    return build


def held_out_score(alg):
    with torch.no_grad():
        return -float(logistic(alg.model(XV), YV))


def rdp_epsilon(event, delta=DELTA):
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("distribution,shape", [("poisson", None), ("negative-binomial", 1.0),
                                                ("negative-binomial", 0.5)])
def test_search_epsilon_is_dp_accountings_for_the_same_event(distribution, shape):
    steps, mean = 6, 4
    result = tune(builder(steps), [0.1, 1.0], epsilon=1.5, delta=DELTA, score=held_out_score,
                  trials_mean=mean, distribution=distribution, shape=shape, seed=1, reproducible=True)
    z = result.noise["gradient"]
    # DP-GD under replace-one: dpvr's multiplier is relative to half the replace-one sensitivity.
    trial = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z / 2), steps)
    expected_shape = math.inf if distribution == "poisson" else shape
    search = dp_event.RepeatAndSelectDpEvent(trial, mean, expected_shape)
    assert result.epsilon == pytest.approx(rdp_epsilon(search), rel=1e-9)
    assert result.per_trial_epsilon == pytest.approx(rdp_epsilon(trial), rel=1e-9)
    assert result.per_trial_epsilon < result.epsilon <= 1.5
    assert result.epsilon == pytest.approx(1.5, rel=1e-4)  # the calibration spends the budget
    assert result.accountant.epsilon(DELTA) == pytest.approx(result.epsilon, rel=1e-9)
    record = result.to_dict()
    assert record["hyperparameter_tuning_accounted"] is True
    assert record["spent_epsilon"] == result.epsilon
    assert "trials" not in record and "trials_drawn" not in record  # K and the losers are not released


@pytest.mark.parametrize("distribution", ["poisson", "negative-binomial"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tuned_run_never_exceeds_its_total_budget(distribution, seed):
    result = tune(builder(), [0.05, 0.5, 2.0], epsilon=1.0, delta=DELTA, score=held_out_score, trials_mean=3,
                  distribution=distribution, seed=seed, reproducible=True)
    assert result.epsilon <= 1.0
    assert result.accountant.epsilon(DELTA) <= 1.0
    assert len(result.trials) == result.trials_drawn
    for trial in result.trials:
        assert trial.candidate in (0.05, 0.5, 2.0)
    if result.algorithm is not None:  # its own run spent the per-trial budget, no more
        assert result.algorithm.privacy_spent(DELTA).epsilon <= result.per_trial_epsilon * (1 + 1e-9)


def test_the_selection_picks_the_best_score():
    scores = {0.01: 0.3, 0.1: 0.9, 1.0: 0.5}
    result = tune(builder(steps=1), list(scores), epsilon=2.0, delta=DELTA, score=lambda a: scores[a.lr],
                  trials_mean=20, distribution="negative-binomial", seed=3, reproducible=True)
    assert result.trials_drawn >= 2
    seen = {t.candidate for t in result.trials}
    assert result.best == max(seen, key=scores.get)
    assert result.score == scores[result.best]
    assert result.algorithm.lr == result.best
    lowest = tune(builder(steps=1), list(scores), epsilon=2.0, delta=DELTA, score=lambda a: scores[a.lr],
                  trials_mean=20, maximize=False, seed=3, reproducible=True)
    assert lowest.best == min({t.candidate for t in lowest.trials}, key=scores.get)


def test_a_diverged_trial_scores_worst_and_a_sampler_is_accepted():
    def score(alg):
        return math.nan if alg.lr > 1 else -alg.lr

    result = tune(builder(steps=1), lambda rng: float(rng.choice([0.5, 5.0])), epsilon=2.0, delta=DELTA,
                  score=score, trials_mean=10, seed=0, reproducible=True)
    assert {t.candidate for t in result.trials} == {0.5, 5.0}
    assert result.best == 0.5


def test_a_private_score_is_noisy_and_charged_in_the_trial():
    public = tune(builder(), [0.5], epsilon=2.0, delta=DELTA, score=held_out_score, trials_mean=3, seed=0,
                  reproducible=True)
    private = tune(builder(), [0.5], epsilon=2.0, delta=DELTA, score=held_out_score, trials_mean=3, seed=0,
                   reproducible=True, score_sensitivity=0.1, score_noise=20.0)
    assert private.epsilon <= 2.0
    assert private.noise["gradient"] > public.noise["gradient"]  # the score's release takes part of it
    assert all(t.score != held_out_score(public.algorithm) for t in private.trials)
    with pytest.raises(ValueError, match="score_sensitivity and score_noise"):
        tune(builder(), [0.5], epsilon=2.0, delta=DELTA, score=held_out_score, trials_mean=3, score_noise=1.0)
    with pytest.raises(ValueError, match="raise score_noise"):
        tune(builder(), [0.5], epsilon=0.5, delta=DELTA, score=held_out_score, trials_mean=3,
             score_sensitivity=1.0, score_noise=0.5)


@pytest.mark.parametrize("changes, match", [
    (dict(candidates=[]), "grid of candidates is empty"),
    (dict(trials_mean=0), "trials_mean must be a finite number >= 1"),
    (dict(trials_mean=-2.0), "trials_mean must be a finite number >= 1"),
    (dict(epsilon=0.0), "epsilon must be a finite number > 0"),
    (dict(epsilon=-1.0), "epsilon must be a finite number > 0"),
    (dict(delta=0.0), "delta must lie in"),
    (dict(distribution="uniform"), "distribution must be one of"),
    (dict(distribution="poisson", shape=2.0), "Poisson distribution takes no shape"),
    (dict(shape=-1.0), "shape of the truncated negative binomial"),
    (dict(privacy=PrivacyConfig(epsilon=1.0)), "privacy.epsilon is set by tune"),
    (dict(privacy=PrivacyConfig(accountant="pld")), "accountant must be 'rdp'"),
])
def test_bad_inputs_raise_clear_errors(changes, match):
    arguments = dict(candidates=[0.1], epsilon=1.0, delta=DELTA, trials_mean=3)
    arguments.update(changes)
    with pytest.raises(ValueError, match=match):
        tune(builder(), arguments.pop("candidates"), score=held_out_score, **arguments)


def test_candidates_that_change_the_mechanism_are_refused():
    def build(steps, privacy):
        return builder(steps)(0.1, privacy)

    with pytest.raises(ValueError, match="changes what a trial releases"):
        tune(build, [3, 6], epsilon=1.0, delta=DELTA, score=held_out_score, trials_mean=2, seed=0,
             reproducible=True)

    def ignores_privacy(lr, privacy):
        return DPGD(torch.nn.Linear(3, 1).double(), logistic, X, Y, lr=lr, clip=1.0, steps=6, noise=1.0)

    with pytest.raises(ValueError, match="differs from the calibrated one"):
        tune(ignores_privacy, [0.1], epsilon=1.0, delta=DELTA, score=held_out_score, trials_mean=2, seed=0,
             reproducible=True)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0])
def test_trial_counts_follow_their_law(shape):
    count = TrialCount.make("negative-binomial", 6.0, shape)
    assert truncated_negative_binomial_mean(count.gamma, shape) == pytest.approx(6.0, rel=1e-9)
    draws = np.array([count.draw(np.random.default_rng(s)) for s in range(4000)])
    assert draws.min() >= 1
    assert draws.mean() == pytest.approx(6.0, rel=0.1)
    poisson = TrialCount.make("poisson", 6.0)
    poisson_draws = [poisson.draw(np.random.default_rng(s)) for s in range(4000)]
    assert np.mean(poisson_draws) == pytest.approx(6.0, rel=0.05)
    assert TrialCount.make("negative-binomial", 1.0, shape).draw(np.random.default_rng(0)) == 1


def _canary_runs(with_canary: bool, runs: int, epsilon: float) -> np.ndarray:
    """The tuned DP-GD's released weight, on data whose one record is a canary or its neighbour."""
    x = torch.zeros(8, 1, dtype=torch.float64)
    y = torch.zeros(8, dtype=torch.float64)
    if with_canary:
        x[0, 0], y[0] = 10.0, 1.0  # its gradient on the weight is clipped to 1; its neighbour's is zero
    outputs = []
    keys = itertools.count(10**6 if with_canary else 0)  # reproducible, and independent between the two sides
    for seed in range(runs):
        def build(lr, privacy):
            model = torch.nn.Linear(1, 1, bias=False).double()
            torch.nn.init.zeros_(model.weight)
            noise = NoiseGenerator(next(keys), reproducible=True)
            return DPGD(model, logistic, x, y, lr=lr, clip=1.0, steps=1, privacy=privacy,
                        runtime=RuntimeConfig(generator=noise))

        result = tune(build, [4.0, 8.0], epsilon=epsilon, delta=DELTA, score=lambda a: 0.0, trials_mean=2,
                      distribution="negative-binomial", seed=seed + (10**6 if with_canary else 0),
                      reproducible=True)
        outputs.append(result.algorithm.model.weight.item() / result.best)
    return np.array(outputs)


@pytest.mark.slow  # seconds (hundreds of tuned runs); the search's accounting is checked exactly above
@pytest.mark.parametrize("epsilon, runs", [(50.0, 100), (2.0, 400)])
def test_audit_of_a_tuned_dp_gd_run_stays_within_its_claim(epsilon, runs):
    """A canary record, the tuned model scored: the lower bound on epsilon must not exceed the claim. At a
    large claim the audit has the power to see the canary at all, so the check is not vacuous."""
    inside, outside = _canary_runs(True, runs, epsilon), _canary_runs(False, runs, epsilon)
    bound = threshold_lower_bound(inside, outside, delta=DELTA, rng=np.random.default_rng(0))
    assert bound.epsilon <= epsilon
    if epsilon > 10:
        assert bound.epsilon > 1.0
