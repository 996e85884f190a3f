"""The shared parts the algorithms are made of: configs, the difference estimator, iterates, samplers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpvr.algorithms import (
    DIFF2,
    DPSGD,
    DPSGDA,
    DIFF2Plan,
    DoubleSpider,
    DPSGDPlan,
    PrivateDiff,
    RecursiveSpider,
)
from dpvr.ops import NoiseGenerator
from dpvr.optim import (
    ClippedSum,
    DifferenceEstimator,
    DivergedError,
    Iterate,
    PrivacyConfig,
    Radius,
    RuntimeConfig,
)
from dpvr.optim.config import stream_clips
from dpvr.optim.sampling import BatchSampler


def _data(n: int = 40, d: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(
        n, generator=g, dtype=torch.float64
    )


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (output.squeeze() - target) ** 2


def _model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 1).double()


def _gen(seed: int = 5) -> NoiseGenerator:
    return NoiseGenerator(seed, reproducible=True)


def test_radius_is_the_reset_clip_or_the_scaled_moves_plus_offset() -> None:
    rule = Radius(2.0, per_move=(3.0, 5.0), offset=0.25)
    assert rule(True, 10.0, 10.0) == 2.0
    assert rule(False, 1.0, 0.1) == pytest.approx(3.0 + 0.25)
    assert rule(False, 0.1, 1.0) == pytest.approx(5.0 + 0.25)
    with pytest.raises(DivergedError, match="diverged"):
        rule(False, math.inf, 0.0)
    with pytest.raises(ValueError, match="2 moves"):
        rule(False, 1.0)


def test_difference_estimator_release_matches_a_float64_reference() -> None:
    like = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    v = DifferenceEstimator(like)
    total = [
        torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
        torch.tensor([-1.0, 0.5], dtype=torch.float64),
    ]
    v.release("s", ClippedSum(total, 0.0, 2), noise_multiplier=1.0, reset=True, generator=_gen())
    torch.testing.assert_close(v.value[0], 0.5 * total[0])
    v.release("s", ClippedSum(total, 0.0, 1), noise_multiplier=1.0, reset=False, generator=_gen())
    torch.testing.assert_close(v.value[1], 1.5 * total[1])


def test_fused_sgd_step_and_optimizer_step_agree_and_both_measure_the_move() -> None:
    """The fused native step and torch's SGD on the released estimate reach the same point; the move is
    ||x_t - x_{t-1}|| in both, and the previous point is kept."""
    results = []
    for use_optimizer in (False, True):
        params = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)]
        optimizer = torch.optim.SGD(params, lr=0.1) if use_optimizer else None
        x = Iterate(params, optimizer)
        v = DifferenceEstimator(x.flat)
        total = [torch.tensor([0.3, 0.1, -0.2], dtype=torch.float64)]
        v.release(
            "s", ClippedSum(total, 0.5), noise_multiplier=1.0, reset=True, generator=_gen(), iterate=x,
            lr=None if use_optimizer else 0.1,
        )
        results.append((params[0].detach().clone(), x.previous[0].clone(), x.move, v.value[0].clone()))
    (p_sgd, prev_sgd, move_sgd, v_sgd), (p_opt, prev_opt, move_opt, v_opt) = results
    torch.testing.assert_close(v_sgd, v_opt)  # the same release: same noise key, same signal
    torch.testing.assert_close(p_sgd, p_opt)
    torch.testing.assert_close(prev_sgd, torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    assert move_sgd == pytest.approx(float((p_sgd - prev_sgd).norm()))
    assert move_opt == pytest.approx(move_sgd)



def test_the_optimizer_steps_on_a_copy_of_the_release_kept_in_the_gradient_it_already_holds() -> None:
    """Each step writes the released estimate into the ``.grad`` the parameter already holds (no fresh
    allocation per step), never handing the optimizer the estimator's own buffer: an optimizer that changes
    ``.grad`` in place (here: doubles it) leaves the estimate, which later releases build on, untouched."""

    class Doubling(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.mul_(2.0)
            return super().step(closure)

    params = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)]
    x = Iterate(params, Doubling(params, lr=0.1))
    v = DifferenceEstimator(x.flat)
    grads = []
    for step in range(2):
        total = [torch.tensor([0.3, 0.1, -0.2], dtype=torch.float64) * (step + 1)]
        v.release("s", ClippedSum(total, 0.5), noise_multiplier=1.0, reset=True, generator=_gen(), iterate=x)
        torch.testing.assert_close(params[0].grad, 2.0 * v.value[0].view_as(params[0]), rtol=0, atol=0)
        assert params[0].grad.data_ptr() != v.value[0].data_ptr()
        grads.append(params[0].grad)
    assert grads[0] is grads[1]  # the same tensor, written again

def test_an_optimizer_over_other_parameters_is_refused() -> None:
    params = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="holds 0 of the model's 1 trainable parameters"):
        Iterate(params, torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))


def test_configs_validate_what_they_hold() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        PrivacyConfig(epsilon=0.0)
    with pytest.raises(ValueError, match="delta"):
        PrivacyConfig(delta=1.0)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyConfig(accountant="gdp")
    with pytest.raises(ValueError, match="grad_mode"):
        RuntimeConfig(grad_mode="fast")
    with pytest.raises(TypeError, match="NoiseGenerator"):
        RuntimeConfig(generator=object())
    assert RuntimeConfig(generator=_gen(), sampler_seed=7).sampler_seed_for(2) == 9


def test_clip_mappings_name_every_stream_and_only_those() -> None:
    assert stream_clips({"a": 1, "b": (2, 0)}, ("a", "b"), pairs=("b",)) == {"a": 1.0, "b": (2.0, 0.0)}
    with pytest.raises(ValueError, match=r"exactly the streams \['a', 'b'\]"):
        stream_clips({"a": 1.0}, ("a", "b"))
    with pytest.raises(ValueError, match=r"clip\['a'\]: must be > 0"):
        stream_clips({"a": -1.0}, ("a",))
    with pytest.raises(ValueError, match="not both 0"):
        stream_clips({"b": (0, 0)}, ("b",), pairs=("b",))
    with pytest.raises(TypeError, match="stream: radius"):
        stream_clips(1.0, ("a",))


def _algorithms() -> dict[str, object]:
    x, y = _data()
    labels = (y > 0).long()
    from dpvr.objectives import KL, AUCMargin, AUCModel

    runtime = RuntimeConfig(generator=_gen(), sampler_seed=3)
    noise = 2.0
    return {
        "dp-sgd": DPSGD(
            _model(), _loss, x, y, lr=0.1, clip=1.0, steps=4, batch_size=8, noise=noise, runtime=runtime
        ),
        "diff2-bvr": DIFF2(
            _model(),
            _loss,
            [(x[:25], y[:25]), (x[25:], y[25:])],
            lr=0.1,
            steps=4,
            restart=2,
            routine="bvr-l-sgd",
            local_steps=3,
            local_batch=5,
            clip={"restart": 1.0, "difference": 1.0, "local": 1.0},
            noise={"restart": 3.0, "difference": 3.0, "local": 3.0},
            runtime=runtime,
        ),
        "dp-sgda": DPSGDA(
            AUCModel(_model()).double(),
            AUCMargin(0.5),
            x,
            labels.double(),
            lr=0.1,
            lr_y=0.1,
            steps=3,
            batch_size=8,
            clip={"x": 1.0, "y": 1.0},
            noise={"x": noise, "y": noise},
            runtime=runtime,
        ),
        "private-diff": PrivateDiff(
            AUCModel(_model()).double(),
            AUCMargin(0.5),
            x,
            labels.double(),
            lr=0.1,
            lr_y=0.1,
            steps=3,
            restart=2,
            y_steps=1,
            batch_size=8,
            clip={"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.0)},
            noise={"checkpoint": noise, "difference": noise, "y": noise},
            runtime=runtime,
        ),
        "double-spider": DoubleSpider(
            nn.Linear(4, 2).double(),
            lambda o, t: nn.functional.cross_entropy(o.unsqueeze(0), t.unsqueeze(0)),
            x,
            labels,
            divergence=KL(),
            lam=1.0,
            steps=3,
            restart=2,
            batch_sizes=(40, 8, 40, 8),
            lr=0.1,
            lr_eta=0.1,
            max_move=1.0,
            noise=dict.fromkeys(("eta-refresh", "eta-difference", "x-refresh", "x-difference"), noise),
            clip={
                "eta-refresh": 1.0,
                "eta-difference": (1.0, 1.0),
                "x-refresh": 1.0,
                "x-difference": (1.0, 1.0),
            },
            runtime=runtime,
        ),
        "recursive-spider": RecursiveSpider(
            nn.Linear(4, 2).double(),
            lambda o, t: nn.functional.cross_entropy(o.unsqueeze(0), t.unsqueeze(0)),
            x,
            labels,
            rho=0.1,
            lam0=0.1,
            steps=3,
            restart=2,
            batch_sizes=(40, 8, 40, 8),
            lr=0.1,
            lr_lam=0.01,
            beta=0.5,
            loss_bound=5.0,
            noise=dict.fromkeys(("v-refresh", "v-difference", "u-refresh", "u-difference", "s"), noise),
            clip={"v-refresh": 1.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1.0},
            runtime=runtime,
        ),
    }


def test_every_sampler_draws_what_its_stream_is_charged_for() -> None:
    """Each algorithm's sampler is built from its plan's description of the stream: the same scheme, batch
    size and rate (a DIFF2 client with a larger shard draws at a lower rate, never a higher one)."""
    for name, alg in _algorithms().items():
        plan = alg.plan
        if name == "dp-sgd":
            pairs = [("gradient", alg.sampler)]
        elif name == "diff2-bvr":
            pairs = [("local", s) for s in alg.samplers]
        elif name in ("dp-sgda", "private-diff"):
            pairs = [(stream, alg.sampler) for stream in plan.streams]
        else:
            pairs = list(alg.samplers.items())
        for stream, sampler in pairs:
            charged, drawn = plan.stream_sampling(stream), sampler.describe()
            assert drawn.scheme == charged.scheme, (name, stream)
            assert drawn.rate <= charged.rate * (1 + 1e-12), (name, stream)
            if sampler.n == (plan.dataset_size if hasattr(plan, "dataset_size") else sampler.n):
                assert drawn == charged, (name, stream)
        alg.run()  # every sampler and estimator runs through a refresh and a difference step


def test_a_sampler_that_draws_more_than_charged_is_refused() -> None:
    plan = DIFF2Plan(20, 2, 4, 2, 3, 5)
    with pytest.raises(ValueError, match="higher rate"):
        BatchSampler.for_stream(plan, "local", 10)
    poisson = DPSGDPlan(10, "poisson", batch_size=10, dataset_size=100)
    assert BatchSampler.for_stream(poisson, "gradient", 100).batch_size == 10


def test_difference_radii_are_capped_so_noise_cannot_feed_on_itself() -> None:
    rule = Radius(1.0, per_move=(10.0,), cap=2.0)
    assert rule(False, 0.05) == pytest.approx(0.5)
    assert rule(False, 100.0) == 2.0
    with pytest.raises(ValueError, match="max_radius"):
        Radius(1.0, per_move=(1.0,), cap=0.0)
    # A DIFF2 run with a step far too large: every difference radius stays at most 2 * clip["restart"].
    x, y = _data()
    alg = DIFF2(
        _model(),
        _loss,
        [(x, y)],
        lr=5.0,
        steps=6,
        restart=3,
        clip={"restart": 0.5, "difference": 100.0},
        noise={"restart": 1.0, "difference": 1.0},
        runtime=RuntimeConfig(generator=_gen()),
    )
    radii = [info["radius"] for info in alg.run()]
    assert max(radii) <= 1.0 and radii[1] == 1.0


def test_a_diverged_step_stops_the_run_naming_the_knobs() -> None:
    params = [torch.zeros(2, dtype=torch.float64)]
    x = Iterate(params)
    with pytest.raises(DivergedError, match="learning rate"):
        x.step([torch.tensor([math.inf, 0.0], dtype=torch.float64)], 0.1)


def test_a_round_that_would_not_fit_the_budget_releases_nothing() -> None:
    """PrivateDiff's round is y_steps ascent releases and one x release: a budget that runs out inside a
    round stops the run before the round's first release, never between its y-steps and its x-step."""
    from dpvr.objectives import AUCMargin, AUCModel
    from dpvr.optim import BudgetExhaustedError

    x, y = _data()
    labels = (y > 0).double()
    alg = PrivateDiff(
        AUCModel(_model()).double(),
        AUCMargin(0.5),
        x,
        labels,
        lr=0.1,
        lr_y=0.1,
        steps=50,
        restart=2,
        y_steps=3,
        batch_size=8,
        clip={"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.0)},
        noise={"checkpoint": 8.0, "difference": 8.0, "y": 8.0},
        privacy=PrivacyConfig(epsilon=1.0),  # runs out after 5 of the 50 rounds (at 2.0, after 21: slower)
        runtime=RuntimeConfig(generator=_gen(), sampler_seed=1),
    )
    with pytest.raises(BudgetExhaustedError, match="next round"):
        alg.run()
    counts = {s: 0 for s in ("y", "checkpoint", "difference")}
    for entry in alg.accountant.state_dict()["ledger"]:
        for stream in entry["streams"]:
            counts[stream] += entry["count"]
    rounds = counts["checkpoint"] + counts["difference"]
    assert 0 < rounds < 50 and counts["y"] == 3 * rounds == 3 * alg.steps_done
    assert alg.privacy_spent().epsilon <= 1.0


def test_poisson_batches_are_independent_coin_flips() -> None:
    """What the accountant prices: each record in each batch independently with probability q. Over 20000
    seeded draws of n = 30 at q = 0.2: every inclusion rate, the batch size's mean and variance (binomial)
    and every pair's co-inclusion rate (q^2) within 5 standard errors."""
    n, q, draws = 30, 0.2, 20_000
    sampler = BatchSampler("poisson", n, round(q * n), seed=11)
    hits = np.zeros((draws, n), dtype=bool)
    for k in range(draws):
        batch = sampler.draw_ahead()
        assert len(np.unique(batch)) == len(batch) and np.all(np.diff(batch) > 0)
        hits[k, batch] = True
    rate = hits.mean(axis=0)
    assert np.all(np.abs(rate - q) < 5 * math.sqrt(q * (1 - q) / draws))
    sizes = hits.sum(axis=1)
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(n * q * (1 - q) / draws)
    assert abs(sizes.var() / (n * q * (1 - q)) - 1) < 5 * math.sqrt(2 / draws)
    pairs = (hits.T.astype(float) @ hits.astype(float)) / draws
    off = pairs[~np.eye(n, dtype=bool)]
    assert np.all(np.abs(off - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / draws))
