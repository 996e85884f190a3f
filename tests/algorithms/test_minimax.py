"""DP-SGDA and PrivateDiff: telescoping estimator, per-round sensitivity, accounting vs the CLI, resume."""

import json

import pytest
import torch

import dpvr
from dpvr import PaperSigmas
from dpvr.algorithms import DPSGDA, PrivateDiff
from dpvr.cli import main
from dpvr.objectives import AUCMargin, AUCModel
from dpvr.optim import BudgetExhaustedError, PrivacyConfig, RuntimeConfig
from dpvr.optim.estimator import global_norm

TINY = 1e-100  # noise this small is absorbed by float64 rounding: the run is noise-free
PROBLEM = AUCMargin(0.3)


def model_fn():
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return AUCModel(net).double()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = (torch.rand(40, generator=g) < 0.3).long()
    return x, y


def gen(seed=0):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


def private_diff(model, x, y, **kw):
    options = dict(
        lr=0.3, lr_y=0.5, steps=6, restart=3, y_steps=2, batch_size=None, sampling="full",
        clip={"y": 1e6, "checkpoint": 1e6, "difference": (1e6, 0.0)},
        noise=PaperSigmas(checkpoint=TINY, difference=TINY, y=TINY),
        runtime=RuntimeConfig(generator=gen()),
    )  # fmt: skip
    options.update(kw)
    return PrivateDiff(model, PROBLEM, x, y, **options)


def exact_x_gradient(model, x, y, alpha):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = PROBLEM.objective(model(x), y, alpha)
    return torch.autograd.grad(loss, params)


def test_noise_free_estimator_telescopes_to_the_exact_gradient(data):
    """Full batch, no noise, no clipping: v_{r+1} = grad_x L(x_r, y_{r+1}) in every round, also in the
    difference rounds where it is the sum of the checkpoint gradient and the differences since."""
    x, y = data
    model = model_fn()
    alg = private_diff(model, x, y)
    for _ in range(6):
        x_r = [p.detach().clone() for p in alg.params]
        info = alg.step()
        reference = model_fn()
        with torch.no_grad():
            for p, v in zip(reference.parameters(), x_r):
                p.copy_(v)
        exact = exact_x_gradient(reference, x, y, alg.y)
        gap = global_norm([v - e.reshape(-1) for v, e in zip(alg.v.value, exact)])
        assert gap <= 1e-12 * (1 + global_norm(exact)), (info, gap)
    assert alg.steps_done == 6 and float(alg.y) > 0


def test_noise_free_y_steps_are_projected_gradient_ascent(data):
    x, y = data
    alg = private_diff(model_fn(), x, y, y_steps=3, steps=1, lr_y=2.0)
    with torch.no_grad():
        outputs = alg.model(x)
    alpha = PROBLEM.initial_y(torch.float64)
    for _ in range(3):
        g = PROBLEM.y_grads(outputs, y, alpha).mean(0)
        alpha = PROBLEM.project(alpha + 2.0 * g)
    alg.step()
    torch.testing.assert_close(alg.y, alpha, rtol=1e-13, atol=1e-13)


def neighbour(data):
    x, y = data[0].clone(), data[1].clone()
    x[3], y[3] = 30.0, 1 - y[3]
    return x, y


def test_per_round_sensitivity_holds_on_neighbouring_data(data):
    """Noise off, conditioned on the same released history: one replaced record moves a y-step's clipped
    mean by at most 2 C0 / m (so y by lr_y times that) and an x-release by at most 2 C / m, C its radius."""
    clip = {"y": 0.2, "checkpoint": 0.5, "difference": (1.0, 0.05)}
    options = dict(clip=clip, lr=0.5, steps=5, restart=3, y_steps=1)
    m = len(data[0])
    a = private_diff(model_fn(), *data, **options)
    b = private_diff(model_fn(), *neighbour(data), **options)
    for _ in range(5):
        b._restore(a.state_dict())  # the same released history on the neighbouring dataset
        a.step(), b.step()
        assert 0 < float((a.y - b.y).abs()) <= a.lr_y * 2 * 0.2 / m * (1 + 1e-9)
    # y held still (a step of 1e-300 is lost to rounding) so both x-releases read the same y_{r+1}
    a = private_diff(model_fn(), *data, **{**options, "lr_y": 1e-300})
    b = private_diff(model_fn(), *neighbour(data), **{**options, "lr_y": 1e-300})
    for _ in range(5):
        b._restore(a.state_dict())  # the same released history on the neighbouring dataset
        info_a, info_b = a.step(), b.step()
        assert info_a["radius"] == info_b["radius"]
        bound = 2 * info_a["radius"] / m
        gap = global_norm([va - vb for va, vb in zip(a.v.value, b.v.value)])
        assert 0 < gap <= bound * (1 + 1e-9), (info_a, gap, bound)


def test_dp_sgda_sensitivity_and_noise_free_step(data):
    x, y = data
    options = dict(
        lr=0.1, lr_y=0.5, steps=3, batch_size=None, sampling="full", clip={"x": 0.5, "y": 0.2},
        noise=PaperSigmas(x=TINY, y=TINY), runtime=RuntimeConfig(generator=gen()),
    )  # fmt: skip
    a = DPSGDA(model_fn(), PROBLEM, x, y, **options)
    b = DPSGDA(model_fn(), PROBLEM, *neighbour(data), **options)
    for _ in range(3):
        b._restore(a.state_dict())  # the same released history on the neighbouring dataset
        a.step(), b.step()
        step_gap = global_norm([pa.detach() - pb.detach() for pa, pb in zip(a.params, b.params)])
        assert 0 < step_gap <= a.lr * 2 * 0.5 / len(x) * (1 + 1e-9)
        assert float((a.y - b.y).abs()) <= 0.5 * 2 * 0.2 / len(x) * (1 + 1e-9)
    # unclipped and noise-free: one step of simultaneous full-batch gradient descent-ascent
    free = DPSGDA(model_fn(), PROBLEM, x, y, **{**options, "clip": {"x": 1e6, "y": 1e6}, "steps": 1})
    ref = model_fn()
    alpha = PROBLEM.initial_y(torch.float64).requires_grad_()
    params = list(ref.parameters())
    *grads, g_alpha = torch.autograd.grad(PROBLEM.objective(ref(x), y, alpha), [*params, alpha])
    free.step()
    for p, q, g in zip(free.params, params, grads):
        torch.testing.assert_close(p.detach(), (q - 0.1 * g).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(free.y, PROBLEM.project(alpha + 0.5 * g_alpha).detach())


def _cli(capsys, argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_spent_epsilon_equals_the_account_cli(data, capsys):
    x, y = data
    pd = PrivateDiff(
        model_fn(), PROBLEM, x, y, lr=0.05, lr_y=0.1, steps=6, restart=2, y_steps=3, batch_size=10,
        clip={"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.1)},
        privacy=PrivacyConfig(epsilon=2.0, delta=1e-4),
        runtime=RuntimeConfig(generator=gen(), sampler_seed=0),
    )  # fmt: skip
    pd.run(progress=False)
    out = _cli(capsys, [
        "account", "private-diff", "--dataset-size", "40", "--batch-size", "10", "--steps", "6",
        "--restart", "2", "--y-steps", "3", "--sigma-x1", _paper_sigma(pd, "checkpoint"),
        "--sigma-x2", _paper_sigma(pd, "difference"), "--sigma-y", _paper_sigma(pd, "y"),
        "--delta", "1e-4",
    ])  # fmt: skip
    assert pd.privacy_spent().epsilon == pytest.approx(out["epsilon"], rel=1e-9)
    assert out["epsilon"] == pytest.approx(2.0, rel=1e-3)

    sgda = DPSGDA(
        model_fn(), PROBLEM, x, y, lr=0.05, lr_y=0.1, steps=8, batch_size=10, clip={"x": 1.0, "y": 1.0},
        privacy=PrivacyConfig(epsilon=2.0, delta=1e-4),
        runtime=RuntimeConfig(generator=gen(), sampler_seed=0),
    )  # fmt: skip
    sgda.run(progress=False)
    out = _cli(capsys, [
        "account", "dp-sgda", "--dataset-size", "40", "--batch-size", "10", "--steps", "8",
        "--sigma-x", _paper_sigma(sgda, "x"), "--sigma-y", _paper_sigma(sgda, "y"), "--delta", "1e-4",
    ])  # fmt: skip
    assert sgda.privacy_spent().epsilon == pytest.approx(out["epsilon"], rel=1e-9)


def test_checkpoint_resume_and_budget_guard(data):
    x, y = data
    options = dict(
        lr=0.1, lr_y=0.2, steps=6, restart=2, y_steps=2, batch_size=8,
        clip={"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.1)},
        noise=PaperSigmas(checkpoint=0.05, difference=0.05, y=0.05),
    )  # fmt: skip

    def runtime(seed: int) -> RuntimeConfig:
        return RuntimeConfig(generator=gen(seed), sampler_seed=3)

    full = PrivateDiff(model_fn(), PROBLEM, x, y, **options, runtime=runtime(7))
    full.run(progress=False)
    first = PrivateDiff(model_fn(), PROBLEM, x, y, **options, runtime=runtime(7))
    first.run(3, progress=False)
    resumed = PrivateDiff(model_fn(), PROBLEM, x, y, **options, runtime=runtime(99))
    resumed.load_state_dict(first.state_dict())
    resumed.run(progress=False)
    for a, b in zip(full.params, resumed.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(full.y, resumed.y, rtol=0, atol=0)

    tight = PrivateDiff(
        model_fn(), PROBLEM, x, y, **options, privacy=PrivacyConfig(epsilon=0.5, delta=1e-4),
        runtime=RuntimeConfig(generator=gen(), sampler_seed=3),
    )  # fmt: skip
    with pytest.raises(BudgetExhaustedError, match="spent so far"):
        tight.run(progress=False)
    assert tight.privacy_spent().epsilon <= 0.5


def test_bad_arguments(data):
    x, y = data
    with pytest.raises(ValueError, match="missing"):
        PrivateDiff(
            model_fn(), PROBLEM, x, y, lr=0.1, lr_y=0.1, steps=2, restart=1, y_steps=1, batch_size=4,
            clip={"y": 1, "checkpoint": 1, "difference": (1, 0)}, noise=PaperSigmas(checkpoint=1.0),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"clip\['difference'\]"):
        PrivateDiff(
            model_fn(), PROBLEM, x, y, lr=0.1, lr_y=0.1, steps=2, restart=1, y_steps=1, batch_size=4,
            clip={"y": 1, "checkpoint": 1, "difference": (1, -1)}, privacy=PrivacyConfig(epsilon=1.0),
        )  # fmt: skip


def _paper_sigma(alg, stream: str) -> str:
    """The paper's sigma of ``stream`` (the ``dpvr account`` flags take it), from the noise multiplier."""
    return repr(alg.plan.sigma(alg.noise[stream], stream))
