"""Event builders: what each algorithm releases, against the papers' own RDP expressions and dp_accounting."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from dpvr.algorithms import (
    DIFF2Plan,
    DoubleSpiderPlan,
    DPSGDAPlan,
    DPSGDPlan,
    PhasedPlan,
    PrivateDiffPlan,
    RecursiveSpiderPlan,
)
from dpvr.privacy import Accountant, Mechanism, Sampling, Stream, output_perturbation_multiplier

RO = dpa.NeighboringRelation.REPLACE_ONE


def _rdp(mechanism):
    acc = Accountant("rdp", mechanism.neighbouring)
    acc.record_mechanism(mechanism)
    return np.array(acc.orders), acc._total


def test_diff2_gd_is_proposition_4_1():
    """RDP of DIFF2-GD at every order a: 2a ceil(R/T) / (nP s1)^2 + 2a (R - ceil(R/T)) / (nP s2)^2."""
    n, clients, rounds, restart, s1, s2 = 1650, 10, 2000, 60, 0.0013, 0.021
    plan = DIFF2Plan(n, clients, rounds, restart)
    assert plan.streams == ("restart", "difference")
    mechanism = plan({s: plan.noise_multiplier(v, s) for s, v in (("restart", s1), ("difference", s2))})
    orders, rdp = _rdp(mechanism)
    big_n = n * clients
    restarts = math.ceil(rounds / restart)
    expected = (
        2 * orders * restarts / (big_n * s1) ** 2 + 2 * orders * (rounds - restarts) / (big_n * s2) ** 2
    )
    assert np.allclose(rdp, expected, rtol=1e-12)
    assert DIFF2Plan(n, clients, rounds, 1).streams == ("restart",)  # T = 1 is DP-GD


def test_diff2_local_steps_are_subsampled_without_replacement():
    plan = DIFF2Plan(dataset_size=5000, clients=4, steps=30, restart=10, local_steps=6, local_batch=25)
    noise = {"restart": 50.0, "difference": 300.0, "local": 3.0}
    streams = {s.name: s for s in plan(noise).streams}
    assert streams["local"].count == 5 * math.ceil(30 / 4)
    assert streams["local"].sampling == Sampling("wor", 25 / 5000, 5000)
    orders, rdp = _rdp(plan(noise))
    direct = rdp_privacy_accountant.RdpAccountant(list(orders), RO)
    direct.compose(dpa.GaussianDpEvent(25.0), 3).compose(dpa.GaussianDpEvent(150.0), 27)
    # Proposition E.2's local RDP: subsampled (b/n) Gaussian with eps(alpha) = 2 alpha / (b^2 sigma3^2).
    direct.compose(dpa.SampledWithoutReplacementDpEvent(5000, 25, dpa.GaussianDpEvent(3.0 / 2)), 40)
    assert np.allclose(rdp, direct.rdp, rtol=1e-12)
    assert plan.sigma(plan.noise_multiplier(0.12, "local"), "local") == pytest.approx(0.12)


def test_private_diff_streams():
    plan = PrivateDiffPlan(dataset_size=6000, batch_size=60, steps=25, restart=4, y_steps=3)
    layout = {
        s.name: (s.count, s.sampling.scheme) for s in plan({"checkpoint": 1, "difference": 1, "y": 1}).streams
    }
    assert layout == {"checkpoint": (7, "wor"), "difference": (18, "wor"), "y": (75, "wor")}
    output = PrivateDiffPlan(6000, 60, 25, 4, y_release="output")
    assert {
        s.name: (s.count, s.sampling.scheme)
        for s in output({"checkpoint": 1, "difference": 1, "y": 1}).streams
    }["y"] == (25, "full")


def test_spider_streams():
    double = DoubleSpiderPlan(dataset_size=1000, steps=95, restart=10, batch_sizes=(1000, 32, 500, 16))
    streams = {s.name: s for s in double(dict.fromkeys(double.streams, 1.0)).streams}
    assert list(streams) == ["eta-refresh", "eta-difference", "x-refresh", "x-difference"]
    assert [s.count for s in streams.values()] == [10, 85, 10, 85]
    assert streams["eta-refresh"].sampling.scheme == "full"
    assert streams["x-refresh"].sampling == Sampling("wor", 0.5, 1000)
    recursive = RecursiveSpiderPlan(1000, 95, 10, (1000, 32, 1000, 32))
    streams = {s.name: s for s in recursive(dict.fromkeys(recursive.streams, 1.0)).streams}
    assert list(streams) == ["v-refresh", "v-difference", "u-refresh", "u-difference", "s"]
    assert streams["s"].count == 95 and streams["s"].sampling == Sampling("wor", 1 / 1000, 1000)
    poisson = RecursiveSpiderPlan(
        1000, 95, 10, (500, 32, 500, 32), sampling="poisson", neighbouring="add-remove"
    )
    with pytest.raises(ValueError, match="add-remove.*'v-refresh', 'u-refresh'.*private"):  # n divides them
        RecursiveSpiderPlan(1000, 95, 10, (1000, 32, 1000, 32), sampling="poisson", neighbouring="add-remove")
    streams = {s.name: s for s in poisson(dict.fromkeys(poisson.streams, 1.0)).streams}
    assert streams["s"].count == 95 and streams["s"].sampling == Sampling("poisson", 1 / 1000)


def test_phased_is_one_release_per_run():
    mechanism = PhasedPlan("c-c")({"x": 10.0, "y": 20.0})
    assert [(s.name, s.count) for s in mechanism.streams] == [("x", 1), ("y", 1)]
    orders, rdp = _rdp(mechanism)
    assert np.allclose(rdp, orders * 2 * (1 / 10.0**2 + 1 / 20.0**2))
    assert output_perturbation_multiplier(3.0, 2.0) == 3.0
    assert output_perturbation_multiplier(3.0, 2.0, "add-remove") == 1.5


def test_step_gives_what_an_algorithm_records():
    plan = DPSGDAPlan(dataset_size=1000, batch_size=10, steps=50)
    parts, event = plan.step("y", {"x": 1.0, "y": 1.0})
    assert parts == pytest.approx({"x": 0.5, "y": 0.5})
    running = Accountant("rdp", "replace-one")
    for _ in range(50):
        running.record(parts, event)
    whole = Accountant("rdp", "replace-one")
    whole.record_mechanism(plan({"x": 1.0, "y": 1.0}))
    assert running.epsilon(1e-5) == pytest.approx(whole.epsilon(1e-5), rel=1e-12)
    assert len(running._ledger) == 1


def test_dp_sgd_sampling_schemes():
    assert DPSGDPlan(10, "full")(2.0).streams[0].sampling.scheme == "full"
    # The relation DP-SGD defaults to: add/remove with Poisson sampling, else replace-one.
    assert DPSGDPlan(10, "poisson", 0.01).neighbouring == "add-remove"
    assert DPSGDPlan(10, "full").neighbouring == DPSGDPlan(10, "wor", 0.01).neighbouring == "replace-one"
    wor = DPSGDPlan(10, "wor", 0.01, neighbouring="replace-one")(2.0).streams[0].sampling
    assert wor.rate == 0.01 and wor.batch_size / wor.dataset_size == 0.01


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: DPSGDPlan(10, "poisson", 0.0), "sample_rate"),
        (lambda: DPSGDPlan(10, "poisson", 1.5), "sample_rate"),
        (lambda: DPSGDPlan(-1, "poisson", 0.1), "steps"),
        (lambda: DPSGDPlan(10, "wor", 0.1, neighbouring="add-remove"), "replace-one"),
        (lambda: DPSGDPlan(10, "stratified", 0.1), "sampling"),
        (lambda: DPSGDPlan(10, "poisson", 0.1, neighbouring="swap"), "neighbouring"),
        (lambda: DIFF2Plan(0, 2, 10, 2), "dataset_size"),
        (lambda: DIFF2Plan(100, 2, 10, 2, local_steps=3), "local_batch"),
        (lambda: DoubleSpiderPlan(100, 10, 2, (10, 10, 10)), "4 batch sizes"),
        (lambda: DoubleSpiderPlan(100, 10, 2, (10, 10, 10, 200)), "exceeds"),
        (lambda: RecursiveSpiderPlan(100, 10, 2, (10, 10, 10, 10, 10)), "4 batch sizes"),
        (lambda: DPSGDAPlan(100, 10, 5, sampling="full"), "full-batch"),
        (lambda: PhasedPlan("nonconvex"), "setting"),
        (lambda: PhasedPlan("sc", neighbouring="add-remove"), "replace-one"),
        (lambda: PrivateDiffPlan(100, 10, 5, 2, y_release="nothing"), "y_release"),
        (lambda: Stream("g", 0.0, 1), "noise multiplier"),
        (lambda: Stream("g", -1.0, 1), "noise multiplier"),
        (lambda: Stream("g", 1.0, -2), "count"),
        (lambda: Mechanism((Stream("g", 1.0, 1), Stream("g", 2.0, 1))), "unique"),
        (lambda: DPSGDPlan(10, "poisson", 0.1)({"gradient": 1.0, "other": 1.0}), "unknown"),
        (lambda: DIFF2Plan(100, 2, 10, 2)(1.0), "each of the streams"),
    ],
)
def test_bad_input_names_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()
