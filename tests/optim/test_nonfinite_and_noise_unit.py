"""Every algorithm takes the non-finite policy and one noise unit; paper sigmas only through the converter
(regressions of an independent privacy review)."""

import inspect

import pytest
import torch

import dpvr
from dpvr.algorithms import DIFF2, DPSGD, DPSGDA, DoubleSpider, PrivateDiff, RecursiveSpider
from toys import data, dp_gd, linear, logistic


@pytest.mark.parametrize("cls", [DPSGD, DIFF2, DPSGDA, PrivateDiff, DoubleSpider, RecursiveSpider])
def test_every_algorithm_takes_the_nonfinite_policy_and_one_noise_unit(cls):
    parameters = inspect.signature(cls).parameters
    assert "runtime" in parameters and parameters["runtime"].default.nonfinite == "zero"
    assert "noise" in parameters
    paper_units = {"noise_multiplier", "sigma1", "sigma2", "sigma3", "sigma_x", "sigma_y", "sigma_x1",
                   "sigma_x2"}
    assert not paper_units & set(parameters)


def test_nonfinite_raise_stops_dp_sgd_before_the_release():
    x, y = data()
    x[2, 1] = float("inf")
    alg = dp_gd(x, y, nonfinite="raise")
    before = [p.detach().clone() for p in alg.params]
    with pytest.raises(dpvr.ops.NonFiniteError):
        alg.step()
    assert all(torch.equal(p, q) for p, q in zip(alg.params, before)) and alg.steps_done == 0
    assert not alg.accountant.streams  # nothing was charged: nothing was released
    assert dp_gd(x, y).step()["nonfinite"] == 1  # the default drops the record


# ---- 6. one noise unit, paper sigmas only through the converter -------------------------------------------


def test_paper_sigmas_convert_through_the_plan():
    x, y = data(n=8)
    shards = [(x[:4], y[:4]), (x[4:], y[4:])]
    common = dict(lr=0.2, steps=3, restart=2, clip={"restart": 1.0, "difference": 1.0})
    paper = DIFF2(linear(), logistic, shards, noise=dpvr.PaperSigmas(restart=0.1, difference=0.2), **common)
    assert paper.noise == {"restart": 0.1 * 4 * 2, "difference": 0.2 * 4 * 2}  # sigma * n * P
    direct = DIFF2(linear(), logistic, shards, noise=paper.noise, **common)
    assert direct.plan.mechanism(direct.noise) == paper.plan.mechanism(paper.noise)
    with pytest.raises(ValueError, match="not streams of"):
        DIFF2(linear(), logistic, shards, noise={"restart": 1.0, "y": 1.0}, **common)
