"""The WGAN objective's gradients against autograd, and a short run of ``dpvr experiment wgan``."""

import json

import pytest
import torch
from torch import nn

from dpvr.cli import main
from dpvr.grads import per_sample_grads
from dpvr.objectives import WGAN, WGANModel
from dpvr.optim.gradients import ClippedGradients


def _setup():
    torch.manual_seed(0)
    dim, latent, n = 6, 3, 5
    generator = nn.Sequential(nn.Linear(latent, 8), nn.ReLU(), nn.Linear(8, dim), nn.Sigmoid()).double()
    discriminator = nn.Sequential(nn.Linear(dim, 7), nn.LeakyReLU(0.2), nn.Linear(7, 1)).double()
    model = WGANModel(generator, dim, latent)
    problem = WGAN(discriminator, dim, penalty=0.1, radius=50.0)
    records = model.records(torch.rand(n, dim, dtype=torch.float64))
    return model, discriminator, problem, records


def _reference(model, discriminator, problem, record, y):
    """f(w_G, w_D; x, z) written directly with the discriminator module."""
    torch.nn.utils.vector_to_parameters(y, discriminator.parameters())
    real, latent = record[None, : model.data_dim], record[None, model.data_dim :]
    penalty = sum(p.square().sum() for p in discriminator.parameters())
    return (discriminator(real) - discriminator(model.generator(latent))).sum() - problem.penalty * penalty


def test_wgan_gradients_match_autograd():
    model, discriminator, problem, records = _setup()
    y = problem.initial_y(torch.float64)
    targets = torch.zeros(len(records))
    y_grads = problem.y_grads(model(records), targets, y)
    x_grads = per_sample_grads(model, lambda out, t: problem.loss(out, t, y), records, targets)
    params = list(model.parameters())
    for i, record in enumerate(records):
        ref = _reference(model, discriminator, problem, record, y.clone())
        g_y = torch.autograd.grad(ref, list(discriminator.parameters()), retain_graph=True)
        torch.testing.assert_close(y_grads[i], torch.cat([g.reshape(-1) for g in g_y]))
        for got, want in zip(x_grads, torch.autograd.grad(ref, params)):
            torch.testing.assert_close(got[i], want)
    # The clipped sums the algorithms use (ghost path where it applies) agree with autograd too.
    out = [torch.zeros(p.numel(), dtype=p.dtype) for p in params]
    ClippedGradients(model, lambda o, t: problem.loss(o, t, y)).sum(records, targets, 1e9, out)
    total = sum(_reference(model, discriminator, problem, r, y.clone()) for r in records)
    for got, want in zip(out, torch.autograd.grad(total, params)):
        torch.testing.assert_close(got, want.reshape(-1))


def test_generator_gradient_does_not_read_the_real_samples():
    model, _, problem, records = _setup()
    y = problem.initial_y(torch.float64)
    other = records.clone()
    other[:, : model.data_dim] = torch.rand_like(other[:, : model.data_dim])
    loss = lambda out, t: problem.loss(out, t, y)  # noqa: E731
    targets = torch.zeros(len(records))
    for a, b in zip(
        per_sample_grads(model, loss, records, targets), per_sample_grads(model, loss, other, targets)
    ):
        torch.testing.assert_close(a, b)


def test_projection_and_wasserstein():
    _, _, problem, _ = _setup()
    big = torch.full((problem.y_dim,), 100.0, dtype=torch.float64)
    assert abs(float(problem.project(big).norm()) - problem.radius) < 1e-9
    y = problem.initial_y(torch.float64)
    samples = torch.rand(4, 6, dtype=torch.float64)
    assert problem.wasserstein(y, samples, samples) == 0.0


@pytest.mark.slow  # an experiment end to end
def test_wgan_experiment_runs(tmp_path, capsys):
    argv = ["experiment", "wgan", "--quick", "--steps", "4", "--epsilon", "8", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "PrivateDiff" in capsys.readouterr().out
    doc = json.loads((tmp_path / "wgan.json").read_text())
    assert {r["method"] for r in doc["records"]} == {"DP-SGDA", "PrivateDiff"}
    assert "declared range [0, 16]" in doc["config"]["preprocessing"]
    for record in doc["records"]:
        assert 0 < record["spent_epsilon"] <= 8.0 * (1 + 1e-6)
        assert len(record["metrics"]["curves"]["wasserstein"]) >= 2
        assert "diagnostics" not in record["metrics"]  # every metric reads the test images only
    for name in ("wgan_wasserstein.png", "wgan_mmd.png", "wgan_samples.png"):
        assert (tmp_path / name).exists()
