"""shares="auto": the budget split that minimises the error proxy of dpvr.privacy.allocation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dpvr.algorithms import DIFF2, DIFF2Plan, DPSGDPlan, PrivateDiffPlan
from dpvr.optim import PrivacyConfig
from dpvr.privacy import account, calibrate
from dpvr.privacy.allocation import proxy, stream_dimensions

EPSILON, DELTA = 1.0, 1e-5
DIFF2_PLAN = DIFF2Plan(dataset_size=300, clients=2, steps=60, restart=10)
DIFF2_DIMS = {"restart": 500, "difference": 500}
PD_PLAN = PrivateDiffPlan(dataset_size=400, batch_size=50, steps=24, restart=4, y_steps=2)
PD_DIMS = {"checkpoint": 2000, "difference": 2000, "y": 3}


def _noise(plan, shares, dims, accountant="rdp"):
    return calibrate(plan, EPSILON, DELTA, shares=shares, dimensions=dims, accountant=accountant)


def test_two_full_batch_streams_match_the_closed_form():
    # Unsampled Gaussians: z_s^2 ∝ sqrt(count_s / W_s), W_s = d_s exposure_s / (n P)^2, with exposures 1 for
    # the restarts and sum_periods L (L - 1) / 2 / R = 6 * 45 / 60 = 4.5 for the differences.
    noise = _noise(DIFF2_PLAN, "auto", DIFF2_DIMS)
    expected = math.sqrt((6 / 1.0) / (54 / 4.5))
    assert noise["restart"] ** 2 / noise["difference"] ** 2 == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "plan, dims, grid",
    [
        (DIFF2_PLAN, DIFF2_DIMS, [{"restart": w, "difference": 1 - w} for w in (0.05, 0.1, 0.3, 0.5, 0.8)]),
        (
            PD_PLAN,
            PD_DIMS,
            [
                {"checkpoint": c * (1 - y), "difference": (1 - c) * (1 - y), "y": y}
                for c, y in itertools.product((0.3, 0.5, 0.7), (0.003, 0.03, 1 / 3))
            ],
        ),
    ],
    ids=["diff2", "privatediff"],
)
@pytest.mark.slow  # the split's optimality (utility, not privacy; the split's spending is checked below)
def test_auto_shares_beat_every_split_of_a_grid(plan, dims, grid):
    best = proxy(plan, _noise(plan, "auto", dims), dims)
    others = [proxy(plan, _noise(plan, shares, dims), dims) for shares in grid]
    assert best <= min(others) * (1 + 1e-6)
    assert best < proxy(plan, _noise(plan, None, dims), dims)  # strictly better than equal shares here


@pytest.mark.parametrize("accountant", [pytest.param("rdp", marks=pytest.mark.slow), "pld"])  # pld: default
def test_the_calibrated_run_spends_exactly_epsilon(accountant):
    noise = _noise(PD_PLAN, "auto", PD_DIMS, accountant)
    spent = account(PD_PLAN(noise), DELTA, accountant=accountant).epsilon
    assert spent <= EPSILON
    assert spent == pytest.approx(EPSILON, rel=1e-4)


@pytest.mark.slow  # utility, not privacy
def test_y_noise_is_cheap_so_y_gets_little_budget():
    noise = _noise(PD_PLAN, "auto", PD_DIMS)
    equal = _noise(PD_PLAN, None, PD_DIMS)
    assert noise["y"] > 3 * equal["y"]
    x_dims = {"checkpoint": 2000, "difference": 2000, "y": 1}  # the x part of the proxy, plus y's at d = 1
    assert proxy(PD_PLAN, noise, x_dims) < proxy(PD_PLAN, equal, x_dims)


def _diff2_noise(seed: int, shares) -> dict[str, float]:
    generator = torch.Generator().manual_seed(seed)
    clients = [(torch.randn(40, 3, generator=generator), torch.randn(40, generator=generator)) for _ in "ab"]
    model = torch.nn.Linear(3, 1)
    algorithm = DIFF2(
        model,
        lambda output, target: (output.squeeze(-1) - target) ** 2,
        clients,
        lr=0.1,
        steps=12,
        restart=4,
        clip={"restart": 1.0, "difference": 1.0},
        privacy=PrivacyConfig(epsilon=EPSILON, delta=DELTA, shares=shares),
    )
    return algorithm.noise


def test_algorithms_pass_their_shapes_and_the_split_depends_on_public_inputs_only():
    first, second = _diff2_noise(0, "auto"), _diff2_noise(1, "auto")  # other data, same shapes
    assert first == second
    plan = DIFF2Plan(dataset_size=40, clients=2, steps=12, restart=4)
    assert stream_dimensions(plan, 4) == {"restart": 4, "difference": 4}
    dimensions = {"restart": 4, "difference": 4}
    assert first == calibrate(plan, EPSILON, DELTA, shares="auto", dimensions=dimensions, accountant="pld")
    assert first != _diff2_noise(0, None)


def test_stream_dimensions_of_the_dual_streams():
    class Problem:
        y_dim = 3

    assert stream_dimensions(PD_PLAN, 2000, Problem()) == PD_DIMS
    assert stream_dimensions(PD_PLAN, 2000) == {"checkpoint": 2000, "difference": 2000}


def test_one_stream_plans_take_the_whole_budget():
    plan = DPSGDPlan(steps=50, sample_rate=0.1)
    assert _noise(plan, "auto", {"gradient": 10}) == pytest.approx(_noise(plan, None, None), rel=1e-9)


@pytest.mark.parametrize(
    "dims, message",
    [
        ({"restart": 5, "difference": 5, "local": 5}, "unknown"),
        ({"restart": 5}, "missing"),
        (None, "missing"),
        ({"restart": -5, "difference": 5}, "integer >= 1"),
        ({"restart": 0, "difference": 5}, "integer >= 1"),
        ({"restart": 2.5, "difference": 5}, "integer >= 1"),
        ({"restart": True, "difference": 5}, "integer >= 1"),
    ],
)
def test_bad_dimensions_are_refused(dims, message):
    with pytest.raises(ValueError, match=message):
        _noise(DIFF2_PLAN, "auto", dims)


def test_bad_shares_are_refused():
    with pytest.raises(ValueError, match="'auto' or None"):
        _noise(DIFF2_PLAN, "equal", DIFF2_DIMS)
    with pytest.raises(ValueError, match="calibration='tight'"):
        calibrate(DIFF2_PLAN, EPSILON, DELTA, shares="auto", dimensions=DIFF2_DIMS, calibration="paper")


def test_a_factory_without_an_error_proxy_is_refused():
    class Factory:  # a mechanism factory that is no algorithm's plan
        streams = DIFF2_PLAN.streams

        def __call__(self, noise):
            return DIFF2_PLAN(noise)

    with pytest.raises(ValueError, match="no error proxy"):
        calibrate(Factory(), EPSILON, DELTA, shares="auto", dimensions=DIFF2_DIMS)


def test_a_minimax_y_without_its_dimension_is_refused():
    with pytest.raises(ValueError, match=r"missing \['y'\]"):
        _noise(PD_PLAN, "auto", stream_dimensions(PD_PLAN, 2000))


def test_units_scale_a_streams_weight_and_bad_units_are_refused():
    from dpvr.privacy.allocation import proxy_weights

    plan = PrivateDiffPlan(1000, 100, 20, 5, 3)
    dims = {"checkpoint": 500, "difference": 500, "y": 1}
    plain = proxy_weights(plan, dims)
    scaled = proxy_weights(plan, dims, {"y": 1e-3})
    assert scaled["y"] == pytest.approx(plain["y"] * 1e-6)
    assert {s: scaled[s] for s in ("checkpoint", "difference")} == {
        s: plain[s] for s in ("checkpoint", "difference")
    }
    with pytest.raises(ValueError, match="not a stream"):
        proxy_weights(plan, dims, {"x": 1.0})
    with pytest.raises(ValueError, match="finite and > 0"):
        proxy_weights(plan, dims, {"y": 0.0})


@pytest.mark.slow  # utility, not privacy
def test_output_y_is_weighted_by_its_sensitivity_so_auto_moves_budget_to_x():
    """PrivateDiff's output-perturbed y has noise relative to Delta ~ 1/(n p (1-p)), far below C1: with its
    unit in the proxy, shares="auto" gives x a smaller noise multiplier than equal shares do."""
    from torch import nn

    from dpvr.algorithms import PrivateDiff
    from dpvr.objectives import AUCMargin, AUCModel

    torch.manual_seed(0)
    x, y = torch.rand(400, 6), (torch.rand(400) < 0.5).long()
    noise = {}
    for shares in (None, "auto"):
        model = AUCModel(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
        alg = PrivateDiff(model, AUCMargin(0.5), x, y, lr=0.1, steps=20, restart=2, y_steps=3, batch_size=40,
                          clip={"checkpoint": 1.0, "difference": (1.0, 0.1)}, y_release="output",
                          privacy=PrivacyConfig(epsilon=1.0, delta=1e-5, shares=shares, accountant="rdp"))
        assert alg._noise_units() == {"y": pytest.approx(alg.y_sensitivity)}
        noise[shares] = alg.noise
    assert noise["auto"]["checkpoint"] < 0.8 * noise[None]["checkpoint"]
    assert noise["auto"]["y"] > noise[None]["y"]
