"""psi-divergences and DRO objectives: conjugates, dual gradients, the KL compositional form."""

import math

import pytest
import torch

from dpvr.objectives import (
    KL,
    ChiSquare,
    CressieRead,
    KLRegularisedCVaR,
    PenalisedDRO,
    WithEta,
    dual_eta_grads,
    dual_loss,
    dual_losses,
    dual_weights,
    indexed_targets,
    kl_compositional,
    project_simplex,
)
from dpvr.objectives.dro import cross_entropy
from dpvr.problems import compositional_gradient, inner_lambda_grads, inner_values, inner_x_weights

DIVERGENCES = [ChiSquare(), KL(), KLRegularisedCVaR(0.2), CressieRead(1.5), CressieRead(2), CressieRead(3)]


@pytest.mark.parametrize("div", DIVERGENCES, ids=repr)
def test_conjugate_matches_a_numerical_supremum(div):
    s = torch.linspace(-4, 2.5, 27, dtype=torch.float64) + 0.013  # off the kinks, where (psi*)' is not smooth
    t = torch.linspace(0, 60, 240_001, dtype=torch.float64)  # holds t = 1/alpha = 5 exactly
    psi = div.psi(t)
    numeric = torch.stack([(si * t - psi).max() for si in s])
    assert torch.allclose(div.conjugate(s), numeric, atol=1e-6)
    # (psi*)' against a central difference of psi*
    h = 1e-6
    fd = (div.conjugate(s + h) - div.conjugate(s - h)) / (2 * h)
    assert torch.allclose(div.conjugate_grad(s), fd, atol=1e-5)


def test_smoothness_constants():
    assert ChiSquare().smoothness() == 1.0
    assert KL().smoothness(2.0) == pytest.approx(math.exp(2.0))
    assert KLRegularisedCVaR(0.2).smoothness(10.0) == pytest.approx(5.0)
    assert CressieRead(3.0).smoothness(1.0) == math.inf
    s = torch.linspace(-1, 1, 201, dtype=torch.float64)
    div = CressieRead(1.5)
    second = (div.conjugate_grad(s + 1e-6) - div.conjugate_grad(s - 1e-6)) / 2e-6
    assert float(second.max()) <= div.smoothness(1.0) + 1e-6


def _model_and_data(n=12, classes=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, classes)).double()
    x = torch.randn(n, 4, dtype=torch.float64)
    y = torch.randint(0, classes, (n,))
    return model, x, y


def _per_sample_grads(fn, params, n):
    return [torch.autograd.grad(fn(i), params) for i in range(n)]


@pytest.mark.parametrize("div", [ChiSquare(), KL(), KLRegularisedCVaR(0.3)], ids=repr)
def test_per_sample_dual_gradients_match_autograd(div):
    model, x, y = _model_and_data()
    lam, eta = 0.7, torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    params = list(model.parameters())
    loss = lambda i: cross_entropy(model(x[i]), y[i])  # noqa: E731
    with torch.no_grad():
        losses = torch.stack([loss(i) for i in range(len(x))])
    weights = dual_weights(div, losses, eta.detach(), lam)
    eta_grads = dual_eta_grads(div, losses, eta.detach(), lam)
    for i in range(len(x)):
        value = dual_losses(div, loss(i), eta, lam)
        *gx, ge = torch.autograd.grad(value, [*params, eta])
        for g, gl in zip(gx, torch.autograd.grad(loss(i), params)):
            assert torch.allclose(g, weights[i] * gl, atol=1e-12)
        assert float(ge) == pytest.approx(float(eta_grads[i]), abs=1e-12)
    # the same loss through the WithEta wrapper (what DP-SGD on the dual trains)
    wrapped = WithEta(model, 0.4).double()
    out = wrapped(x)
    per_sample = torch.stack([dual_loss(div, lam)(out[i], y[i]) for i in range(len(x))])
    assert torch.allclose(per_sample, dual_losses(div, losses, 0.4, lam))


def test_kl_compositional_gradient_is_the_softmax_weighted_loss_gradient():
    model, x, y = _model_and_data()
    params = list(model.parameters())
    lam, rho = 0.3, 0.5
    losses = torch.stack([cross_entropy(o, t) for o, t in zip(model(x), y)])
    grads = torch.autograd.grad(kl_compositional(losses, lam, rho), params, retain_graph=True)
    weights = torch.softmax(losses.detach() / lam, dim=0)
    expected = torch.autograd.grad((weights * losses).sum(), params)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, atol=1e-12)


def test_shifted_inner_estimates_give_the_exact_compositional_gradient():
    """z = ((lam/s) v, (lam/s) u + log s + rho) with exact means of the shifted g equals autograd of Psi."""
    model, x, y = _model_and_data()
    params = list(model.parameters())
    lam, rho, bound = 0.05, 0.5, 20.0  # exp(l/lam) alone would be ~e^40: the shift keeps it <= 1
    lam_t = torch.tensor(lam, dtype=torch.float64, requires_grad=True)
    losses = torch.stack([cross_entropy(o, t) for o, t in zip(model(x), y)])
    value = kl_compositional(losses, lam_t, rho)
    *gx, glam = torch.autograd.grad(value, [*params, lam_t], retain_graph=True)
    ell = losses.detach()
    s = float(inner_values(ell, lam, bound).mean())
    assert value.item() == pytest.approx(lam * math.log(s) + bound + lam * rho, rel=1e-12)
    a = inner_x_weights(ell, lam, bound)
    v = torch.autograd.grad((a * losses).mean(), params)
    u = float(inner_lambda_grads(ell, lam, bound).mean())
    for g, vk in zip(gx, v):
        zx, zlam = compositional_gradient(s, vk, u, lam, rho)
        assert torch.allclose(g, zx, atol=1e-10)
    assert float(glam) == pytest.approx(zlam, rel=1e-9)


def test_simplex_projection_and_penalised_problem():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        y = torch.randn(7, generator=g, dtype=torch.float64) * 3
        p = project_simplex(y)
        assert float(p.sum()) == pytest.approx(1.0) and float(p.min()) >= 0
        # optimality: <y - p, q - p> <= 0 for the vertices q
        for k in range(7):
            q = torch.zeros(7, dtype=torch.float64)
            q[k] = 1
            assert float((y - p) @ (q - p)) <= 1e-12
    # at uniform p the penalised objective is the mean loss, and the best p for chi^2 has a closed form
    model, x, labels = _model_and_data()
    n = len(x)
    problem = PenalisedDRO(ChiSquare(), 2.0, n)
    targets = indexed_targets(labels)
    out = model(x).detach()
    p = problem.initial_y(torch.float64)
    losses = torch.stack([cross_entropy(o, t) for o, t in zip(out, labels)])
    assert float(problem.objective(out, targets, p)) == pytest.approx(float(losses.mean()))
    grads = problem.y_grads(out, targets, p)
    assert grads.shape == (n, n)
    assert torch.count_nonzero(grads - torch.diag(torch.diagonal(grads))) == 0  # each sample: its own p_i
