"""``dpvr experiment regime``: the synthetic problem's stated constants are true, the numpy replica releases
what dpvr's DIFF2 and DP-GD release, and a tiny run produces its tables and files."""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import pytest
import torch
from torch import nn

import dpvr
from dpvr.algorithms import DIFF2, DPGD
from dpvr.optim import RuntimeConfig
from dpvr_lab.experiments import regime
from dpvr_lab.experiments.regime import Problem, dphi, phi, run_diff2, run_dpgd


def test_phi_constants_are_the_suprema():
    """G = max|phi'| = 3 sqrt(3)/8 and L = max|phi''| = 2, both attained (on a fine grid to 1e-9)."""
    t = np.linspace(-20, 20, 4_000_001)
    assert np.abs(dphi(t)).max() == pytest.approx(regime.G_PHI, abs=1e-9)
    assert np.abs(regime.d2phi(t)).max() == pytest.approx(regime.L_PHI, abs=1e-9)
    # phi'' is the derivative of phi', phi' of phi (central differences)
    h = 1e-5
    assert np.allclose((phi(t + h) - phi(t - h)) / (2 * h), dphi(t), atol=1e-8)
    assert np.allclose((dphi(t + h) - dphi(t - h)) / (2 * h), regime.d2phi(t), atol=1e-6)


def test_problem_constants_hold_per_sample_and_the_optimum_is_zero():
    """Every per-sample gradient has norm <= G, every per-sample gradient difference is <= L ||x - y||
    (200 random pairs, near-tight for a close pair at residual 0), f >= 0 with f(x*) = 0 (so f* = 0 and
    f(x0) - f* = f(x0) exactly), and the closed-form gradient is f's (finite differences)."""
    p = Problem.planted([0, 1], 12, 300)
    rng = np.random.default_rng(5)
    assert np.allclose(np.linalg.norm(p.atoms, axis=2), 1.0)
    worst_g, worst_l = 0.0, 0.0
    for _ in range(200):
        x = p.solution + rng.standard_normal(p.solution.shape) * rng.uniform(0.01, 10)
        y = x + rng.standard_normal(x.shape) * rng.uniform(1e-4, 3)
        gx = dphi(p.residuals(x))[:, :, None] * p.atoms  # per-sample gradients (S, m, d)
        gy = dphi(p.residuals(y))[:, :, None] * p.atoms
        worst_g = max(worst_g, np.linalg.norm(gx, axis=2).max())
        ratio = np.linalg.norm(gx - gy, axis=2) / np.linalg.norm(x - y, axis=1)[:, None]
        worst_l = max(worst_l, ratio.max())
        assert np.all(p.value(x) >= 0)
    assert worst_g <= p.lipschitz * (1 + 1e-12) and worst_g >= 0.99 * p.lipschitz
    assert worst_l <= p.smoothness * (1 + 1e-9)
    # tightness of L: a step along a_0 from x* (residual 0, where |phi''| = 2)
    step = 1e-4 * p.atoms[:, 0, :]
    g0 = dphi(p.residuals(p.solution + step))[:, 0]
    assert np.all(np.abs(g0) / 1e-4 >= 0.999 * p.smoothness)
    assert np.allclose(p.value(p.solution), 0.0, atol=1e-24)
    x = rng.standard_normal(p.solution.shape)
    h, fd = 1e-6, np.zeros_like(x)
    for k in range(x.shape[1]):
        e = np.zeros_like(x)
        e[:, k] = h
        fd[:, k] = (p.value(x + e) - p.value(x - e)) / (2 * h)
    assert np.allclose(fd, p.gradient(x), atol=1e-8)


def _library_model(d: int) -> nn.Module:
    model = nn.Linear(d, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    r = out.squeeze(-1) - target
    return r * r / (1 + r * r)


def _records(p: Problem, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(p.atoms[0]).repeat(copies, 1), torch.tensor(p.targets[0]).repeat(copies)


@pytest.mark.parametrize(("lipschitz", "smoothness"),
                         [(regime.G_PHI, regime.L_PHI), (0.2, 0.3), (0.2, 50.0)])
def test_the_replica_is_dpvrs_diff2_without_noise(lipschitz, smoothness):
    """Each of 40 atoms twice (n = 80): dpvr's DIFF2-GD with noise 1e-12 and the replica without noise end
    at the same point to 1e-9, with the stated radii (never active), with small ones (clipping active) and
    with a large difference radius (the cap 2 C1 active), over 30 rounds of period 6."""
    p = Problem.planted([3], 5, 40)
    p = Problem(p.atoms, p.targets, p.solution, lipschitz, smoothness)
    inputs, targets = _records(p, 2)
    model = _library_model(5)
    alg = DIFF2(model, _loss, [(inputs, targets)], lr=0.8, steps=30, restart=6,
                clip={"restart": lipschitz, "difference": smoothness},
                noise={"restart": 1e-12, "difference": 1e-12})
    for _ in range(30):
        alg.step()
    x, capped = run_diff2(p, 80, 30, 6, 0.8, {"restart": 0.0, "difference": 0.0}, np.random.default_rng(0))
    assert np.allclose(model.weight.detach().numpy().ravel(), x[0], atol=1e-9)
    if smoothness > 10:
        assert capped[0] > 0  # the cap path was exercised


def test_the_replica_is_dpvrs_dpgd_without_noise():
    p = Problem.planted([4], 5, 40)
    p = Problem(p.atoms, p.targets, p.solution, 0.2, regime.L_PHI)  # clipping active
    inputs, targets = _records(p, 3)
    model = _library_model(5)
    alg = DPGD(model, _loss, inputs, targets, lr=0.8, steps=25, clip=0.2, noise=1e-12)
    for _ in range(25):
        alg.step()
    x = run_dpgd(p, 120, 25, 0.8, 0.0, np.random.default_rng(0))
    assert np.allclose(model.weight.detach().numpy().ravel(), x[0], atol=1e-9)


@pytest.mark.slow  # 400 library runs (~12 s)
def test_the_replicas_noise_has_the_librarys_scale():
    """One restart round (x_1 = -lr (mean + noise)) repeated over 400 noise seeds in dpvr and in the replica:
    the per-coordinate std of x_1 around its noiseless value is lr z C1 / n in both (chi-square bounds:
    within 15% for 2000 draws)."""
    p = Problem.planted([2], 5, 20)
    inputs, targets = _records(p, 1)
    z, lr, n = 3.0, 0.5, 20
    expected = lr * z * p.lipschitz / n
    clean, _ = run_diff2(p, n, 1, 1, lr, {"restart": 0.0, "difference": 0.0}, np.random.default_rng(0))
    library = []
    for seed in range(400):
        model = _library_model(5)
        alg = DIFF2(model, _loss, [(inputs, targets)], lr=lr, steps=1, restart=1,
                    clip={"restart": p.lipschitz, "difference": p.smoothness},
                    noise={"restart": z, "difference": z},
                    runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed, reproducible=True)))
        alg.step()
        library.append(model.weight.detach().numpy().ravel() - clean[0])
    stacked = Problem(np.repeat(p.atoms, 400, 0), np.repeat(p.targets, 400, 0), np.repeat(p.solution, 400, 0))
    ours, _ = run_diff2(stacked, n, 1, 1, lr, {"restart": z, "difference": z}, np.random.default_rng(1))
    for sample in (np.asarray(library), ours - clean[0]):
        assert np.std(sample) == pytest.approx(expected, rel=0.15)


@pytest.mark.slow  # ~13 s on two cores
def test_tiny_run_writes_tables_exponents_and_crossover(tmp_path, capsys):
    args = argparse.Namespace(quick=True, n=[2000, 8000], epsilon=[4.0], seeds=2, grid=[1.0, 4.0],
                              tuning_seeds=1, dimension=5, atoms=50, out=str(tmp_path))
    doc = regime.run(args)
    assert len(doc["records"]) == 2 * 2 * 2 * 2  # methods x protocols x sizes x seeds
    for record in doc["records"]:
        assert record["metrics"]["grad_norm"] > 0 and math.isfinite(record["metrics"]["grad_norm"])
        assert 4.0 * (1 - 2e-3) <= record["spent_epsilon"] <= 4.0 * (1 + 1e-9)
    summary = doc["config"]["summary"]
    assert {e["method"] for e in summary["exponents"]} == {
        "DIFF2-GD (theorem)", "DIFF2-GD (tuned)", "DP-GD (theorem)", "DP-GD (tuned)"}
    assert [c["protocol"] for c in summary["crossovers"]] == ["theorem", "tuned"]
    for name in ("regime.json", "regime.csv", "regime.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert "crossover" in capsys.readouterr().out


def test_the_theorems_protocol_the_experiment_runs_is_the_library_default():
    """The DIFF2 schedule of the experiment is dpvr.trainer.defaults' at the problem's constants."""
    from dpvr.trainer.defaults import diff2_protocol

    plan = regime.schedule("DIFF2-GD", 50_000, 10, 1.0, 0.6)
    ref = diff2_protocol(50_000, 1, 10, 1.0, regime.DELTA, regime.G_PHI, regime.L_PHI, 0.6)
    assert (plan.rounds, plan.restart, plan.lr) == (ref.rounds, ref.restart, ref.lr)


def test_a_run_thrown_onto_phis_plateau_counts_as_no_progress():
    """``scored``: phi is flat far from x*, so an iterate far out has a tiny gradient at an objective above
    the start's; it reports the start's norm and ``escaped``, an iterate near x* its own norm, a non-finite
    one the start's. Without the rule the far iterate would score as the best of the three."""
    p = Problem.planted([3], 4, 20)
    far = 1e3 * np.ones((1, 4))
    x = np.concatenate([far, 0.999 * p.solution, np.full((1, 4), np.nan)])
    problem = Problem(np.repeat(p.atoms, 3, 0), np.repeat(p.targets, 3, 0), np.repeat(p.solution, 3, 0))
    raw = np.linalg.norm(problem.gradient(x), axis=1)
    assert raw[0] < raw[1] and problem.value(x)[0] > problem.value(np.zeros_like(x))[0]
    norms, escaped = regime.scored(x, problem.value, problem.gradient)
    at_start = np.linalg.norm(problem.gradient(np.zeros_like(x)), axis=1)
    assert escaped.tolist() == [True, False, True]
    assert norms[0] == at_start[0] and norms[2] == at_start[2] and norms[1] == raw[1]
