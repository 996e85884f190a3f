"""DP Double-SPIDER and DP Recursive-SPIDER: noise-free reduction, per-stream sensitivity, accounting."""

import json
import math

import pytest
import torch
from torch.func import functional_call

import dpvr
from dpvr.algorithms import DoubleSpider, RecursiveSpider
from dpvr.cli import main
from dpvr.objectives import KL, ChiSquare, dual_eta_grads, dual_weights
from dpvr.objectives.dro import cross_entropy
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.problems import inner_lambda_grads, inner_values, inner_x_weights

TINY = 1e-100  # noise this small is absorbed by float64 rounding: the run is noise-free
N = 24
BIG = 1e6


def model_fn():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


def gen(seed=0):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


def double_spider(model, x, y, clip=None, **kw):
    """Double-SPIDER, noise-free and with clipping inactive, except for the radii given in ``clip``."""
    options = dict(
        divergence=ChiSquare(), lam=1.0, steps=5, restart=3, batch_sizes=(N, N, N, N), lr=0.2, lr_eta=0.3,
        max_move=BIG,
        clip={"eta-refresh": BIG, "eta-difference": (BIG, BIG), "x-refresh": BIG, "x-difference": (BIG, BIG),
              **(clip or {})},
        noise={s: TINY for s in ("eta-refresh", "eta-difference", "x-refresh", "x-difference")},
        runtime=RuntimeConfig(generator=gen(), sampler_seed=0),
    )  # fmt: skip
    options.update(kw)
    return DoubleSpider(model, cross_entropy, x, y, **options)


def recursive_spider(model, x, y, clip=None, **kw):
    """Recursive-SPIDER, noise-free and with clipping inactive (``s`` clipped at 1, the inner functions'
    bound), except for the radii given in ``clip``."""
    options = dict(
        rho=0.5, lam0=1e-3, steps=5, restart=3, batch_sizes=(N, N, N, N), lr=0.2, lr_lam=0.05, beta=0.5,
        loss_bound=5.0, lam_init=0.8, s_floor=1e-8,
        clip={"v-refresh": BIG, "v-difference": BIG, "u-refresh": BIG, "u-difference": BIG, "s": 1.0,
              **(clip or {})},
        noise={s: TINY for s in ("v-refresh", "v-difference", "u-refresh", "u-difference", "s")},
        runtime=RuntimeConfig(generator=gen(), sampler_seed=0),
    )  # fmt: skip
    options.update(kw)
    return RecursiveSpider(model, cross_entropy, x, y, **options)


def losses_and_grads(model, x, y):
    params = list(model.parameters())
    losses = torch.stack([cross_entropy(o, t) for o, t in zip(model(x), y)])
    return losses.detach(), params, lambda w: torch.autograd.grad((w * losses).mean(), params)


def test_double_spider_without_noise_or_clipping_is_the_non_private_double_spider(data):
    """Full batches, noise off, clipping inactive: g_t = grad_eta L(x_t, eta_t) and v_t = grad_x L(x_t,
    eta_{t+1}) exactly (the difference steps telescope), and x moves by lr v."""
    x, y = data
    model = model_fn()
    alg = double_spider(model, x, y)
    for _ in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        eta = float(alg.eta)
        losses, _, grad = losses_and_grads(model, x, y)
        g = float(dual_eta_grads(ChiSquare(), losses, eta, 1.0).mean())
        v = grad(dual_weights(ChiSquare(), losses, eta - 0.3 * g, 1.0))
        alg.step()
        assert float(alg.g.value[0]) == pytest.approx(g, abs=1e-10)
        assert float(alg.eta) == pytest.approx(eta - 0.3 * g, abs=1e-10)
        for p, b, vk in zip(model.parameters(), before, v):
            assert torch.allclose(p.detach(), b - 0.2 * vk, atol=1e-10)


def test_recursive_spider_without_noise_or_clipping_is_the_non_private_recursion(data):
    x, y = data
    model = model_fn()
    alg = recursive_spider(model, x, y)
    s_prev, prev = 1.0, [p.detach().clone() for p in model.parameters()]
    lam_prev = 0.8
    for _ in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        lam = float(alg.lam)
        losses, _, grad = losses_and_grads(model, x, y)
        v = grad(inner_x_weights(losses, lam, 5.0))
        u = float(inner_lambda_grads(losses, lam, 5.0).mean())
        g_now = inner_values(losses, lam, 5.0)
        with torch.no_grad():
            names = [name for name, _ in model.named_parameters()]
            outputs = functional_call(model, dict(zip(names, prev)), (x,))
            before_losses = torch.stack([cross_entropy(o, t) for o, t in zip(outputs, y)])
            g_before = inner_values(before_losses, lam_prev, 5.0)
        alg.step()
        # s: a STORM step on one record, the same record at w_t and w_{t-1}
        candidates = g_now - 0.5 * g_before + 0.5 * s_prev
        s = float(alg.s)
        assert torch.isclose(candidates, torch.tensor(s, dtype=torch.float64), atol=1e-12).any()
        scale = lam / s
        assert float(alg.u.value[0]) == pytest.approx(u, abs=1e-10)
        for p, b, vk in zip(model.parameters(), before, v):
            assert torch.allclose(p.detach(), b - 0.2 * scale * vk, atol=1e-10)
        expected_lam = max(1e-3, lam - 0.05 * (scale * u + math.log(s) + 0.5))
        assert float(alg.lam) == pytest.approx(expected_lam, abs=1e-12)
        s_prev, lam_prev, prev = s, lam, before


def _releases(alg):
    """Wraps ``alg._release`` to keep (stream, unit, released sum) of every call; the unit is the bound the
    clipped sum carries: the clip radius, or half the range of a one-sided term (what the noise is scaled
    to)."""
    seen, release = [], alg._release

    def spy(stream, estimator, clipped, reset):
        seen.append((stream, clipped.bound, torch.cat([t.reshape(-1) for t in clipped.tensors]).clone()))
        release(stream, estimator, clipped, reset)

    alg._release = spy
    return seen


@pytest.mark.parametrize("make", [double_spider, recursive_spider], ids=["double", "recursive"])
def test_every_stream_has_sensitivity_at_most_twice_its_unit(data, make):
    """Neighbouring datasets (record 0 replaced by an outlier), noise off, small clip radii (active),
    identical states before the step: each release's sum moves by at most 2 * unit (replace-one), the unit
    being at most the radius."""
    x, y = data
    x2, y2 = x.clone(), y.clone()
    x2[0], y2[0] = 50.0, (y[0] + 1) % 3
    if make is double_spider:
        clips = dict(divergence=KL(), clip={
            "eta-refresh": 0.05, "eta-difference": (0.5, 0.5), "x-refresh": 0.05, "x-difference": (0.5, 0.5),
        })  # fmt: skip
    else:
        clips = dict(clip={"v-refresh": 0.05, "v-difference": 0.5, "u-refresh": 0.05, "u-difference": 0.5})
    # Recursive-SPIDER moves nothing before its last release, so every stream sees the shared state;
    # Double-SPIDER's x-streams come after its eta step, which a vanishing eta step size keeps shared.
    if make is double_spider:
        clips["lr_eta"] = 1e-300
    a, b = make(model_fn(), x, y, **clips), make(model_fn(), x2, y2, **clips)
    for _ in range(4):  # refresh then difference steps, from a shared state each time
        b._restore(a.state_dict())  # the same released history on a neighbouring dataset
        seen_a, seen_b = _releases(a), _releases(b)
        a.step()
        b.step()
        assert [s for s, _, _ in seen_a] == [s for s, _, _ in seen_b]
        for (stream, unit, sa), (_, unit_b, sb) in zip(seen_a, seen_b):
            assert unit == pytest.approx(unit_b, rel=1e-12) and unit > 0
            assert float((sa - sb).norm()) <= 2 * unit * (1 + 1e-9), stream
        if make is recursive_spider:  # the STORM term of one record: within (2 - beta) C5
            assert float((a._s_term - b._s_term).abs()) <= (2 - 0.5) * 1.0
        del a._release, b._release


@pytest.mark.parametrize(
    "make, name, streams, refresh",
    [
        (double_spider, "double-spider", 4, ("eta-refresh", "x-refresh")),
        (recursive_spider, "recursive-spider", 5, ("v-refresh", "u-refresh")),
    ],
    ids=["double", "recursive"],
)
def test_spent_epsilon_equals_the_account_cli(data, capsys, make, name, streams, refresh):
    x, y = data
    alg = make(model_fn(), x, y, batch_sizes=(N, 6, N, 8), steps=7, restart=3, noise=None,
               privacy=PrivacyConfig(epsilon=3.0, delta=1e-4), clip=dict.fromkeys(refresh, 1.0))
    alg.run(progress=False)
    multipliers = ",".join(repr(alg.noise[s]) for s in alg.plan.streams)
    assert main([
        "account", name, "--dataset-size", str(N), "--steps", "7", "--restart", "3", "--batch-sizes",
        f"{N},6,{N},8", "--noise-multipliers", multipliers, "--delta", "1e-4", "--json",
    ]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert len(alg.plan.streams) == streams
    assert alg.privacy_spent().epsilon == pytest.approx(out["epsilon"], rel=1e-9)
    assert out["epsilon"] == pytest.approx(3.0, rel=1e-3)


def test_resume_from_a_checkpoint_reproduces_the_run(data):
    x, y = data
    kw = dict(
        batch_sizes=(N, 6, N, 8), noise=None, privacy=PrivacyConfig(epsilon=3.0, delta=1e-4),
        clip={"v-refresh": 1.0, "u-refresh": 1.0},
    )  # fmt: skip
    a = recursive_spider(model_fn(), x, y, **kw)
    a.run(2, progress=False)
    b = recursive_spider(model_fn(), x, y, **kw)
    b.load_state_dict(a.state_dict())
    a.run(progress=False)
    b.run(progress=False)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert a.privacy_spent().epsilon == b.privacy_spent().epsilon
