"""Random allocation (balls-in-bins) batches: the PLD of an epoch, its accounting, sampler and command line.

Every check is against an independent computation: dp_accounting's Gaussian (t = 1), the exact profile of
t = 2 by one-dimensional quadrature of a closed-form log-normal expectation, Monte Carlo privacy losses
(fixed seed, statistical bounds) for larger t, and the bounds that must sandwich the accountant (no
amplification above, Poisson at rate 1/t as Feldman and Shenfeld report for the Gaussian). Their accountant's
own upper and lower bounds are checked in ``test_random_allocation_bounds.py``.
"""

from __future__ import annotations

import argparse
import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import integrate
from scipy.stats import norm

from dpvr.algorithms import DPSGDPlan
from dpvr.cli import account as account_cli
from dpvr.optim.sampling import BatchSampler
from dpvr.privacy import Accountant, account
from dpvr.privacy.pld.adapter import directions
from dpvr.privacy.pld.random_allocation import (
    _allocation_pld,
    _sum_law,
    _weights,
    random_allocation_gaussian_pld,
)
from dpvr.privacy.random_allocation import RandomAllocationDpEvent

EPSILONS = (0.0, 0.25, 0.5, 1.0, 2.0)


def _directions(pld: pld_lib.PrivacyLossDistribution, eps: float) -> tuple[float, float]:
    remove, add = directions(pld)
    return remove.get_delta_for_epsilon(eps), add.get_delta_for_epsilon(eps)


def test_one_step_is_the_gaussian():
    for z in (0.7, 1.0, 2.0):
        built = _allocation_pld(z, 1, 1e-4, 1e-3)
        gaussian = pld_lib.from_gaussian_mechanism(z, sensitivity=1.0, value_discretization_interval=1e-4)
        for eps in EPSILONS:
            exact = float(norm.cdf(-eps * z + 0.5 / z) - math.exp(eps) * norm.cdf(-eps * z - 0.5 / z))
            for delta in _directions(built, eps):
                assert exact - 1e-12 <= delta <= exact * 1.01 + 1e-9
        expected = gaussian.get_epsilon_for_delta(1e-5)
        assert built.get_epsilon_for_delta(1e-5) == pytest.approx(expected, abs=2e-3)


def _call(s: float, strike: np.ndarray, mu: float) -> np.ndarray:
    """``E[(s W - K)_+]`` for ``W = e^l``, ``l ~ N(-mu^2/2, mu^2)`` (mean 1): Black and Scholes' formula."""
    strike = np.asarray(strike, dtype=float)
    out = s - strike  # K <= 0: the payoff is linear
    positive = strike > 0
    k = strike[positive]
    d1 = (np.log(s / k) + mu * mu / 2) / mu
    out[positive] = s * norm.cdf(d1) - k * norm.cdf(d1 - mu)
    return out


def _exact_two_steps(eps: float, z: float) -> tuple[float, float]:
    """Remove ``E_Q[(S - e^eps)_+]`` and add ``E_Q[(1 - e^eps S)_+]`` for ``S = (W_1 + W_2)/2``, integrating
    over ``l_1`` the closed form in ``W_2`` (put-call parity gives the add side from a call)."""
    mu = 1.0 / z

    def inner(u: float, side: str) -> float:
        w1 = math.exp(mu * u - mu * mu / 2)
        if side == "remove":  # E[(W2/2 - (e^eps - w1/2))_+]
            return float(_call(0.5, np.array([math.exp(eps) - w1 / 2]), mu)[0])
        strike = math.exp(-eps) - w1 / 2  # (1 - e^eps S)_+ = e^eps (e^-eps - S)_+ ; put = call - s + K
        call = float(_call(0.5, np.array([strike]), mu)[0])
        return math.exp(eps) * (call - 0.5 + strike) if strike > 0 else 0.0

    return tuple(
        integrate.quad(lambda u, s=side: norm.pdf(u) * inner(u, s), -12, 12, limit=400, epsabs=1e-13)[0]
        for side in ("remove", "add")
    )


@pytest.mark.parametrize("z", [0.8, 1.5])
def test_two_steps_dominate_the_exact_profile_and_are_tight(z):
    pld = random_allocation_gaussian_pld(z, 2)
    for eps in EPSILONS:
        for computed, exact in zip(_directions(pld, eps), _exact_two_steps(eps, z)):
            assert computed >= exact - 1e-10
            assert computed <= exact * 1.005 + 1e-8


@pytest.mark.parametrize(("z", "t"), [(1.0, 10), (5.0, 1000), (0.5, 100), (2.0, 77)])
def test_the_doubling_keeps_the_mean_of_the_likelihood_ratio(z, t):
    """Every split is mean-preserving, so ``E_Q[S'] = E_Q[S] = 1`` to float round-off in the remove pass
    (whose tail moves raise ``S`` by at most the trimmed masses, 1e-25 each) and at most 1 in the add pass
    (whose tail moves lower it); the Q-masses sum to one in both."""
    for up in (True, False):
        law = _sum_law(1 / z, t, up, 1e-4, 1e-3)
        mean = float(_weights(law, 1e-4).sum()) + (law.atom_weight if up else 0.0)
        assert law.mass.sum() + law.zero + law.atom == pytest.approx(1.0, abs=1e-12)
        if up:
            assert mean == pytest.approx(1.0, abs=1e-12)
        else:
            assert 1.0 - 1e-9 <= mean <= 1.0 + 1e-12


def test_a_finer_precision_is_tighter_and_every_precision_is_valid():
    """The precision target trades time for tightness; at t = 2 every setting still dominates the exact
    profile."""
    coarse, fine = (random_allocation_gaussian_pld(1.0, 2, 1e-4, p) for p in (1e-1, 1e-4))
    for eps in EPSILONS:
        exact = _exact_two_steps(eps, 1.0)
        for pld in (coarse, fine):
            for computed, reference in zip(_directions(pld, eps), exact):
                assert computed >= reference - 1e-10
        assert sum(_directions(fine, eps)) <= sum(_directions(coarse, eps)) + 1e-12


def test_monte_carlo_profile_of_ten_steps():
    """Both directions against 400,000 draws of the pair's privacy loss: within five standard errors below,
    and the grid's pessimism (a few thousandths of loss) above."""
    z, t = 1.0, 10
    rng = np.random.default_rng(7)
    x = rng.standard_normal((400_000, t)) / z  # Q, in units of the noise std: l_j = x_j/z - 1/(2z^2)
    s = np.exp(x / z - 0.5 / z**2).mean(axis=1)
    pld = random_allocation_gaussian_pld(z, t)
    for eps in EPSILONS:
        samples = {"remove": np.maximum(s - math.exp(eps), 0), "add": np.maximum(1 - math.exp(eps) * s, 0)}
        for computed, draws in zip(_directions(pld, eps), samples.values()):
            mean, error = draws.mean(), draws.std() / math.sqrt(draws.size)
            assert mean - 5 * error <= computed <= mean + 5 * error + 0.01 * mean + 1e-6


@pytest.mark.parametrize(("z", "t"), [(1.0, 5), pytest.param(0.8, 20, marks=pytest.mark.slow), (2.0, 100)])
def test_between_no_amplification_and_poisson(z, t):
    epoch = random_allocation_gaussian_pld(z, t).get_epsilon_for_delta(1e-6)
    gaussian = pld_lib.from_gaussian_mechanism(z, sensitivity=1.0).get_epsilon_for_delta(1e-6)
    poisson = pld_lib.from_gaussian_mechanism(z, sensitivity=1.0, sampling_prob=1 / t).self_compose(t)
    assert epoch < gaussian
    assert epoch <= poisson.get_epsilon_for_delta(1e-6) * 1.01


def test_accountant_charges_whole_epochs_per_stream():
    event = RandomAllocationDpEvent(10, dpa.GaussianDpEvent(1.0))
    acc = Accountant("pld", "add-remove")
    acc.record("gradient", event, 25)  # three epochs, the last partial
    epoch = random_allocation_gaussian_pld(1.0, 10)
    assert acc.epsilon(1e-5) == pytest.approx(epoch.self_compose(3).get_epsilon_for_delta(1e-5), rel=1e-9)
    acc.record("gradient", event, 5)  # completes the third epoch: no more cost
    assert acc.epsilon(1e-5) == pytest.approx(epoch.self_compose(3).get_epsilon_for_delta(1e-5), rel=1e-9)
    acc.record("other", event, 1)  # another stream's allocation is independent: one more epoch
    assert acc.epsilon(1e-5) == pytest.approx(epoch.self_compose(4).get_epsilon_for_delta(1e-5), rel=1e-9)
    restored = Accountant.from_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.epsilon(1e-5) == acc.epsilon(1e-5)


def test_plan_relations_and_accountants():
    plan = DPSGDPlan(steps=20, sampling="random-allocation", batch_size=50, dataset_size=100)
    assert plan.neighbouring == "add-remove"
    assert plan.batch_sampling.steps_per_epoch == 2
    run = plan({"gradient": 1.0})
    epoch = random_allocation_gaussian_pld(1.0, 2)
    assert account(run, 1e-5, "pld").epsilon == pytest.approx(
        epoch.self_compose(10).get_epsilon_for_delta(1e-5), rel=1e-9
    )
    with pytest.raises(ValueError, match="accountant='pld'"):
        account(run, 1e-5, "rdp")
    with pytest.raises(ValueError, match="add-remove"):
        DPSGDPlan(20, "random-allocation", batch_size=50, dataset_size=100, neighbouring="replace-one")


def test_sampler_draws_what_is_charged():
    n, b = 103, 10
    plan = DPSGDPlan(steps=30, sampling="random-allocation", batch_size=b, dataset_size=n)
    sampler = BatchSampler.for_stream(plan, "gradient", n, seed=3)
    assert sampler.describe() == plan.stream_sampling("gradient")
    t = sampler.steps_per_epoch
    assert t == 10 and sampler.batch_size == round(n / t)
    counts = np.zeros(n, dtype=int)
    steps_of = np.zeros((n, t), dtype=int)
    for _ in range(300):
        batches = [sampler.draw() for _step in range(t)]
        used = np.concatenate(batches)
        assert np.array_equal(np.sort(used), np.arange(n))  # every record exactly once per epoch
        for step, batch in enumerate(batches):
            steps_of[batch, step] += 1
        counts += np.bincount(used, minlength=n)
    # Each record's step is uniform: 300 epochs give 30 per step; a chi-square over all records and steps.
    chi2 = ((steps_of - 30) ** 2 / 30).sum()
    dof = n * (t - 1)
    assert abs(chi2 - dof) < 5 * math.sqrt(2 * dof)
    state = sampler.state_dict()
    first = sampler.draw()
    sampler.load_state_dict(json.loads(json.dumps(state)))
    assert np.array_equal(sampler.draw(), first)


def _cli(capsys, command: str) -> dict:
    parser = argparse.ArgumentParser(prog="dpvr")
    account_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(command.split())
    assert args.run(args) == 0
    return json.loads(capsys.readouterr().out)


def test_command_line_accounts_and_calibrates_random_allocation(capsys):
    run = "dp-sgd --sampling random-allocation --steps 6 --batch-size 50 --dataset-size 100 --accountant pld"
    spent = _cli(capsys, f"account {run} --noise-multiplier 1.0 --json")
    plan = DPSGDPlan(steps=6, sampling="random-allocation", batch_size=50, dataset_size=100)
    assert spent["neighbouring"] == "add-remove"
    assert spent["epsilon"] == pytest.approx(account(plan({"gradient": 1.0}), 1e-5, "pld").epsilon, rel=1e-9)
    calibrated = _cli(capsys, f"calibrate {run} --epsilon 3 --json")
    assert calibrated["spent_epsilon"] <= 3.0
    assert calibrated["spent_epsilon"] == pytest.approx(3.0, rel=1e-3)
