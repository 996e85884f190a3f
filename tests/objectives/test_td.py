"""The MSPBE objective's gradients against autograd, and a short run of ``dpvr experiment td``."""

import json

import pytest
import torch
from torch import nn

from dpvr.cli import main
from dpvr.grads import per_sample_grads
from dpvr.objectives import MSPBE, ValueModel, semi_gradient_td_loss
from dpvr.objectives.td import TransitionValues


def _setup():
    torch.manual_seed(0)
    state, n = 3, 6
    net = nn.Sequential(nn.Linear(state, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    model = ValueModel(net, state)
    problem = MSPBE(model.num_params, gamma=0.9, radius=10.0)
    inputs = torch.randn(n, 2 * state, dtype=torch.float64)
    targets = torch.stack([torch.randn(n), (torch.arange(n) % 3 == 0).double()], 1).double()
    omega = torch.randn(model.num_params, dtype=torch.float64)
    return model, problem, inputs, targets, omega


def _reference(model, problem, transition, target, omega):
    """Eq. 68 with Psi from autograd (create_graph, so theta's gradient includes second derivatives)."""
    s, s_next = transition[None, : model.state_dim], transition[None, model.state_dim :]
    value = model.net(s).sum()
    psi = torch.cat(
        [g.reshape(-1) for g in torch.autograd.grad(value, list(model.net.parameters()), create_graph=True)]
    )
    delta = target[0] + problem.gamma * (1 - target[1]) * model.net(s_next).sum() - value
    return delta * (psi @ omega) - 0.5 * (psi @ omega) ** 2


def test_mspbe_gradients_match_autograd():
    model, problem, inputs, targets, omega = _setup()
    y_grads = problem.y_grads(model(inputs), targets, omega)
    x_grads = per_sample_grads(model, lambda out, t: problem.loss(out, t, omega), inputs, targets)
    params = list(model.parameters())
    for i in range(len(inputs)):
        w = omega.clone().requires_grad_()
        ref = _reference(model, problem, inputs[i], targets[i], w)
        *g_x, g_y = torch.autograd.grad(ref, [*params, w])
        torch.testing.assert_close(y_grads[i], g_y)
        for got, want in zip(x_grads, g_x):
            torch.testing.assert_close(got[i], want)


def test_mspbe_is_the_maximum_over_omega():
    model, problem, inputs, targets, _ = _setup()
    outputs = model(inputs).detach()
    psi = outputs[:, 2:]
    g = psi.T @ psi / len(psi) + 1e-6 * torch.eye(psi.shape[1], dtype=psi.dtype)
    e = (problem.td_error(outputs, targets)[:, None] * psi).mean(0)
    best = torch.linalg.solve(g, e)  # the unconstrained maximiser
    value = float(problem.objective(outputs, targets, best) - 0.5e-6 * best @ best)
    assert abs(problem.mspbe(outputs, targets) - value) < 1e-4 * max(1.0, abs(value))


def test_semi_gradient_loss_gives_the_td0_direction():
    model, problem, inputs, targets, _ = _setup()
    pair = TransitionValues(model.net, model.state_dim)
    loss = semi_gradient_td_loss(problem.gamma)
    grads = per_sample_grads(pair, loss, inputs, targets)
    for i in range(len(inputs)):
        s = inputs[i : i + 1, : model.state_dim]
        value = model.net(s).sum()
        delta = problem.td_error(pair(inputs[i : i + 1])[0].detach(), targets[i])
        want = torch.autograd.grad(value, list(model.net.parameters()))
        for got, w in zip(grads, want):
            torch.testing.assert_close(got[i], -delta * w)


@pytest.mark.slow  # an experiment end to end
def test_td_experiment_runs(tmp_path, capsys):
    pytest.importorskip("gymnasium", reason="dpvr experiment td needs gymnasium (pip install 'dpvr[rl]')")
    argv = ["experiment", "td", "--quick", "--epochs", "1", "--transitions", "200", "--dataset", "cartpole"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert "DP-TD" in capsys.readouterr().out
    doc = json.loads((tmp_path / "td.json").read_text())
    assert {r["method"] for r in doc["records"]} == {"DP-SGDA", "PrivateDiff", "DP-TD"}
    assert "no statistic of the data is fitted" in doc["config"]["preprocessing"]
    for record in doc["records"]:
        assert 0 < record["spent_epsilon"] <= 4.0 * (1 + 1e-6)
        assert len(record["metrics"]["curves"]["mspbe"]) == 2
        assert "diagnostics" not in record["metrics"]  # the MSPBE is measured on held-out transitions
    assert (tmp_path / "td_cartpole.png").exists()
