"""Every algorithm of the registry honours ``PrivacyConfig(neighbouring=...)`` or refuses it: none accounts a
run under another relation than the one asked for.

Under add/remove the dataset size is private, so an algorithm whose batch sizes, sampling rates or divisors
are read from the size of its data (or whose full-batch means divide by it) must refuse add/remove with a
``ValueError`` that names the relation; one that honours it records under it.
"""

from __future__ import annotations

import pytest
import torch

import sensitivity as harness
from dpvr import NoiseGenerator, registry
from dpvr.algorithms import (
    DIFF2,
    DPGD,
    DPSGD,
    DPSGDA,
    DoubleSpider,
    PhasedOutputPerturbation,
    PrivateDiff,
    RecursiveSpider,
)
from dpvr.objectives import ChiSquare
from dpvr.optim import PrivacyConfig, RuntimeConfig

N = 12


def _data(task) -> tuple[torch.Tensor, torch.Tensor]:
    return task.records(N, torch.Generator().manual_seed(0))


def _common(privacy: PrivacyConfig) -> dict:
    runtime = RuntimeConfig(generator=NoiseGenerator(3, reproducible=True), sampler_seed=3)
    return {"privacy": privacy, "runtime": runtime}


def _dp_sgd(privacy, sampling="poisson"):
    x, y = _data(harness.REGRESSION)
    return DPSGD(harness.REGRESSION.model(True), harness.REGRESSION.loss, x, y, lr=0.1, clip=1.0, steps=2,
                 batch_size=N if sampling == "full" else 4, sampling=sampling, noise=1.0, **_common(privacy))


def _dp_gd(privacy, sampling=None):
    x, y = _data(harness.REGRESSION)
    return DPGD(harness.REGRESSION.model(True), harness.REGRESSION.loss, x, y, lr=0.1, clip=1.0, steps=2,
                noise=1.0, **_common(privacy))


def _last_iterate(privacy, sampling=None):
    x, y = _data(harness.REGRESSION)
    return DPSGD(harness.REGRESSION.model(True), harness.REGRESSION.loss, x, y, lr=0.1, clip=1.0, steps=2,
                 batch_size=4, weak_convexity=0.0, smoothness=1.0, noise=1.0,
                 **registry.get("last-iterate").algorithm_options, **_common(privacy))


def _diff2(privacy, sampling=None):
    x, y = _data(harness.REGRESSION)
    routine = {"routine": "bvr-l-sgd", "local_steps": 2, "local_batch": 2} if sampling == "local" else {}
    streams = ("restart", "difference", "local") if routine else ("restart", "difference")
    return DIFF2(harness.REGRESSION.model(True), harness.REGRESSION.loss, [(x, y), (x, y)], lr=0.1, steps=2,
                 restart=2, clip=dict.fromkeys(streams, 1.0), noise=dict.fromkeys(streams, 1.0), **routine,
                 **_common(privacy))


def _dp_sgda(privacy, sampling="wor"):
    x, y = _data(harness.MINIMAX)
    return DPSGDA(harness.MINIMAX.model(True), harness.MINIMAX.problem, x, y, lr=0.1, lr_y=0.1, steps=2,
                  batch_size=N if sampling == "full" else 4, sampling=sampling, clip={"x": 1.0, "y": 1.0},
                  noise={"x": 1.0, "y": 1.0}, **_common(privacy))


def _private_diff(privacy, sampling="wor"):
    x, y = _data(harness.MINIMAX)
    return PrivateDiff(harness.MINIMAX.model(True), harness.MINIMAX.problem, x, y, lr=0.1, lr_y=0.1, steps=2,
                       restart=2, y_steps=1, batch_size=4, sampling=sampling,
                       clip={"checkpoint": 1.0, "difference": (1.0, 0.0), "y": 1.0},
                       noise={"checkpoint": 1.0, "difference": 1.0, "y": 1.0}, **_common(privacy))


def _double_spider(privacy, sampling="wor"):
    x, y = _data(harness.DRO)
    streams = ("eta-refresh", "eta-difference", "x-refresh", "x-difference")
    clip = {s: (1.0, 1.0) if s.endswith("difference") else 1.0 for s in streams}
    return DoubleSpider(harness.DRO.model(True), harness.DRO.loss, x, y, divergence=ChiSquare(), lam=1.0,
                        steps=2, restart=2, batch_sizes=(4, 4, 4, 4), lr=0.1, lr_eta=0.1, max_move=1.0,
                        clip=clip, sampling=sampling, noise=dict.fromkeys(streams, 1.0), **_common(privacy))


def _recursive_spider(privacy, sampling="wor"):
    x, y = _data(harness.DRO)
    streams = ("v-refresh", "v-difference", "u-refresh", "u-difference", "s")
    return RecursiveSpider(harness.DRO.model(True), harness.DRO.loss, x, y, rho=0.5, lam0=0.1, steps=2,
                           restart=2, batch_sizes=(4, 4, 4, 4), lr=0.1, lr_lam=0.05, beta=0.5,
                           loss_bound=10.0, clip=dict.fromkeys(streams, 1.0), sampling=sampling,
                           noise=dict.fromkeys(streams, 1.0), **_common(privacy))


def _phased(privacy, sampling=None):
    budget = PrivacyConfig(epsilon=1.0, neighbouring=privacy.neighbouring)
    return PhasedOutputPerturbation("sc", privacy=budget)


BUILD = {
    "dp-sgd": (_dp_sgd, ("poisson", "wor", "full")),
    "dp-gd": (_dp_gd, (None,)),
    "last-iterate": (_last_iterate, (None,)),
    "diff2": (_diff2, (None, "local")),
    "dp-sgda": (_dp_sgda, ("wor", "poisson", "full")),
    "private-diff": (_private_diff, ("wor", "poisson")),
    "double-spider": (_double_spider, ("wor", "poisson")),
    "recursive-spider": (_recursive_spider, ("wor", "poisson")),
    "phased": (_phased, (None,)),
}
CASES = [pytest.param(name, s, id=f"{name}-{s}") for name, (_, schemes) in BUILD.items() for s in schemes]


def test_every_registry_algorithm_is_built_here():
    assert sorted(BUILD) == sorted(registry.REGISTRY)


@pytest.mark.parametrize(("name", "sampling"), CASES)
def test_add_remove_is_honoured_or_refused_by_name(name, sampling):
    build = BUILD[name][0]
    try:
        algorithm = build(PrivacyConfig(neighbouring="add-remove"), sampling)
    except ValueError as refused:
        assert "add-remove" in str(refused), f"{name}: refused without naming the relation: {refused}"
        return
    assert algorithm.accountant.neighbouring == "add-remove", f"{name} ignored neighbouring='add-remove'"


@pytest.mark.parametrize(("name", "sampling"), CASES)
def test_replace_one_is_honoured_where_the_sampling_allows_it(name, sampling):
    build = BUILD[name][0]
    algorithm = build(PrivacyConfig(neighbouring="replace-one"), sampling)
    assert algorithm.accountant.neighbouring == "replace-one"


@pytest.mark.parametrize("name", ["diff2", "dp-sgda", "private-diff", "double-spider", "recursive-spider",
                                  "phased"])
def test_the_algorithms_that_read_their_datas_size_refuse_add_remove(name):
    """Before: each of these accepted neighbouring='add-remove' and recorded under replace-one (DIFF2's plan
    was built without it, the minimax, SPIDER and phased classes never read it)."""
    build, schemes = BUILD[name]
    for sampling in schemes:
        with pytest.raises(ValueError, match="add-remove"):
            build(PrivacyConfig(neighbouring="add-remove"), sampling)
