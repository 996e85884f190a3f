"""``tune()``'s trials are independent runs: a build that shares a model, optimizer, noise generator,
buffer or storage between trials is refused before the trial runs (regressions of a privacy review of
the front door)."""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from dpvr.algorithms import DPGD
from dpvr.ops import NoiseGenerator
from dpvr.optim import RuntimeConfig
from dpvr.tuning import TrialCount, tune
from dpvr.tuning.independence import Independence
from tests.tuning.toy_task import X, Y, fresh_model, held_out, logistic

DELTA = 1e-5


def _tune(build, candidates, *, mean, seed, runs):
    """``tune`` at epsilon 1 on the held-out score, counting the trials that ran into ``runs``."""
    return tune(build, candidates, epsilon=1.0, delta=DELTA, score=held_out, trials_mean=mean, seed=seed,
                reproducible=True, train=_counting(runs))  # fmt: skip


def _counting(runs: list[int]):
    def train(alg) -> None:
        runs.append(id(alg))
        alg.run()

    return train


# ---- 6. tune(): independent trials ---------------------------------------------------------------------


def test_a_build_that_closes_over_one_model_is_refused_before_any_trial_runs() -> None:
    """The reviewed bug: every trial trained the same model, so the released "best" trial was the last of
    K chained runs. tune() refuses such a build before a single trial touches the data."""
    torch.manual_seed(0)
    shared = fresh_model()
    runs: list[int] = []

    def build(lr, privacy):
        return DPGD(shared, logistic, X, Y, lr=lr, clip=1.0, steps=2, privacy=privacy)

    with pytest.raises(
        ValueError, match=r"the build of candidate 1.0 shares its model with the build of candidate 0.1"
    ):
        _tune(build, [0.1, 1.0], mean=4, seed=0, runs=runs)
    assert runs == []


def test_a_per_candidate_cache_of_models_is_refused_before_any_trial_runs() -> None:
    cache: dict[float, nn.Module] = {}
    runs: list[int] = []

    def build(lr, privacy):
        torch.manual_seed(0)
        model = cache.setdefault(lr, fresh_model())
        return DPGD(model, logistic, X, Y, lr=lr, clip=1.0, steps=2, privacy=privacy)

    with pytest.raises(ValueError, match=r"a second build of candidate 0.1 shares its model with the build"):
        _tune(build, [0.1, 1.0], mean=4, seed=0, runs=runs)
    assert runs == []


def test_a_trial_that_reuses_an_earlier_trials_model_is_refused_before_it_runs() -> None:
    """Independent at the probes, chained later: a pool of three models handed out in turn. The fourth trial
    gets the first trial's (trained) model and is refused before it runs."""
    torch.manual_seed(0)
    pool = [fresh_model() for _ in range(3)]
    calls = itertools.count()
    runs: list[int] = []

    def build(lr, privacy):
        return DPGD(pool[next(calls) % 3], logistic, X, Y, lr=lr, clip=1.0, steps=2, privacy=privacy)

    # seed 1 draws K >= 4 for a geometric count of mean 10 (checked below); the probes use calls 0, 1, 2
    assert TrialCount.make("negative-binomial", 10.0).draw(np.random.default_rng(1)) >= 4
    with pytest.raises(ValueError, match=r"trial 4 shares its model with trial 1"):
        _tune(build, [0.1, 1.0], mean=10, seed=1, runs=runs)
    assert len(runs) == 3


def test_shared_optimizer_noise_generator_or_buffer_is_refused() -> None:
    dummy = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([dummy], lr=0.1)

    def with_optimizer(clip, privacy):
        model = fresh_model()
        optimizer.param_groups[0]["params"] = list(model.parameters())
        return DPGD(model, logistic, X, Y, clip=clip, steps=2, optimizer=optimizer, privacy=privacy)

    with pytest.raises(ValueError, match="shares its optimizer"):
        tune(with_optimizer, [0.5, 1.0], epsilon=1.0, delta=DELTA, score=held_out, trials_mean=3,
             seed=0, reproducible=True)

    runtime = RuntimeConfig(generator=NoiseGenerator(5, reproducible=True))

    def with_generator(lr, privacy):
        return DPGD(fresh_model(), logistic, X, Y, lr=lr, clip=1.0, steps=2, privacy=privacy, runtime=runtime)

    with pytest.raises(ValueError, match="noise generator"):
        tune(with_generator, [0.1, 1.0], epsilon=1.0, delta=DELTA, score=held_out, trials_mean=3,
             seed=0, reproducible=True)

    def same_seed(lr, privacy):
        noise = RuntimeConfig(generator=NoiseGenerator(5, reproducible=True))
        return DPGD(fresh_model(), logistic, X, Y, lr=lr, clip=1.0, steps=2, privacy=privacy, runtime=noise)

    with pytest.raises(ValueError, match="noise seed"):
        tune(same_seed, [0.1, 1.0], epsilon=1.0, delta=DELTA, score=held_out, trials_mean=3,
             seed=0, reproducible=True)

    scale = torch.ones(1, dtype=torch.float64)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = fresh_model()
            self.register_buffer("scale", scale)  # one tensor for every model

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.linear(inputs) * self.scale

    def with_buffer(lr, privacy):
        return DPGD(Scaled(), logistic, X, Y, lr=lr, clip=1.0, steps=2, privacy=privacy)

    with pytest.raises(ValueError, match="buffer 'scale'"):
        tune(with_buffer, [0.1, 1.0], epsilon=1.0, delta=DELTA, score=held_out, trials_mean=3,
             seed=0, reproducible=True)


def test_a_parameter_over_shared_storage_or_carried_optimizer_state_is_refused() -> None:
    """Tensor-level sharing behind fresh objects: a new Parameter over one tensor in every model (refused at
    the probes), and an optimizer warm-started from the previous trial's state (refused before trial 2)."""
    weight = torch.zeros(1, 3, dtype=torch.float64)

    def rewrapped(lr, privacy):
        model = fresh_model()
        model.weight = nn.Parameter(weight)  # a new Parameter object, the same storage
        return DPGD(model, logistic, X, Y, lr=lr, clip=1.0, steps=2, privacy=privacy)

    with pytest.raises(ValueError, match=r"shares parameter 'weight' with the build of candidate 0.1"):
        tune(rewrapped, [0.1, 1.0], epsilon=1.0, delta=DELTA, score=held_out, trials_mean=3,
             seed=0, reproducible=True)

    optimizers: list[torch.optim.Optimizer] = []
    runs: list[int] = []

    def warm_started(clip, privacy):
        model = fresh_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        if optimizers:
            optimizer.load_state_dict(optimizers[-1].state_dict())  # keeps the earlier state's tensors
        optimizers.append(optimizer)
        return DPGD(model, logistic, X, Y, clip=clip, steps=2, optimizer=optimizer, privacy=privacy)

    assert TrialCount.make("negative-binomial", 6.0).draw(np.random.default_rng(1)) >= 2
    with pytest.raises(ValueError, match=r"trial 2 shares optimizer state '\w+' of parameter 0 with trial 1"):
        _tune(warm_started, [0.5, 1.0], mean=6, seed=1, runs=runs)
    assert len(runs) == 1


def test_storage_left_by_a_finished_trial_is_recognised_after_its_tensors_are_gone() -> None:
    """A new Parameter over storage the build keeps (an earlier trial trained it, and that trial's objects
    are gone): the trial starts from the earlier one's result, which is refused; a fresh tensor that merely
    lands at a freed address is not."""
    storage = torch.zeros(1, 3, dtype=torch.float64)
    tracker = Independence()

    def trial(weight: torch.Tensor | None) -> DPGD:
        model = fresh_model()
        if weight is not None:
            model.weight = nn.Parameter(weight)
        return DPGD(model, logistic, X, Y, lr=1.0, clip=1.0, steps=2, noise=1.0)

    first = trial(storage)
    started = tracker.admit(first, "trial 1")
    first.run()
    tracker.finish(started)
    del first, started
    gc.collect()
    with pytest.raises(ValueError, match="holds what trial 1 left in its parameter 'weight'"):
        tracker.admit(trial(storage), "trial 2")

    fresh = Independence()
    first = trial(None)
    started = fresh.admit(first, "trial 1")
    first.run()
    fresh.finish(started)
    del first, started
    gc.collect()
    for index in range(2, 6):  # whether or not the allocator hands out the freed addresses again
        fresh.finish(fresh.admit(trial(None), f"trial {index}"))


def test_independent_trials_pass_and_the_released_model_is_the_best_trials_own() -> None:
    after_run: dict[int, list[torch.Tensor]] = {}

    def build(lr, privacy):
        torch.manual_seed(0)
        return DPGD(fresh_model(), logistic, X, Y, lr=lr, clip=1.0, steps=3, privacy=privacy)

    def train(alg) -> None:
        alg.run()
        after_run[id(alg)] = [p.detach().clone() for p in alg.model.parameters()]

    result = tune(
        build, [0.05, 0.5, 2.0], epsilon=2.0, delta=DELTA, score=held_out, trials_mean=6, train=train,
        seed=1, reproducible=True
    )
    assert result.trials_drawn >= 2
    for p, q in zip(result.algorithm.model.parameters(), after_run[id(result.algorithm)]):
        assert torch.equal(p, q)  # no later trial wrote into the released model
