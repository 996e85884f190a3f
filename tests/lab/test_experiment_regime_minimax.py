"""The PrivateDiff-vs-DP-SGDA regime experiment: its problem's constants, its replicas against dpvr's
algorithms, and its protocols against dpvr.trainer.defaults."""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import pytest
import torch
from torch import nn

import dpvr
from dpvr.algorithms import DPSGDA, PrivateDiff
from dpvr.optim import RuntimeConfig
from dpvr.problems import MinimaxProblem
from dpvr.problems.minimax import YSensitivity
from dpvr_lab.experiments import regime, regime_minimax
from dpvr_lab.experiments.regime_minimax import G_PHI, MinimaxPlanted, dphi, phi


class _Planted(MinimaxProblem):
    """``f(x, y; z) = y phi(a^T x - b) - (mu/2) y^2`` on ``Y = [0, 1]`` as a dpvr minimax problem."""

    y_dim, strong_concavity, diameter, y_lipschitz = 1, 1.0, 1.0, 1.0

    def loss(self, output: torch.Tensor, target: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        r = output[0] - target
        return y[0] * r * r / (1 + r * r) - 0.5 * y[0] * y[0]

    def project(self, y: torch.Tensor) -> torch.Tensor:
        return y.clamp(0.0, 1.0)

    def bounded_outputs(self, outputs: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(outputs, nan=0.0, posinf=0.0, neginf=0.0)

    def y_sensitivity(self) -> YSensitivity:
        return YSensitivity(gradient_range=1.0, strong_concavity=1.0, smoothness=1.0)


def _model(d: int) -> nn.Module:
    model = nn.Linear(d, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def _records(p: MinimaxPlanted, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(p.atoms[0]).repeat(copies, 1), torch.tensor(p.targets[0]).repeat(copies)


def test_the_inner_maximiser_and_the_primal_gradient_are_exact():
    """y*(x) = F(x) maximises the mean of f over Y (a grid of 2001 y's does no better), and grad Phi =
    F grad F is the finite-difference gradient of Phi = max_y mean f (to 1e-7); the per-sample constants:
    ||grad_x f|| <= G and ||grad_xy f|| = |phi'| <= G over 200 random points."""
    p = MinimaxPlanted.planted([0, 1], 8, 200)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(p.solution.shape) * 2
    grid = np.linspace(0, 1, 2001)
    f = p.value(x)[:, None] * grid[None, :] - 0.5 * grid[None, :] ** 2
    assert np.all(f.max(axis=1) <= p.value(x) ** 2 / 2 + 1e-15)
    assert np.allclose(p.inner(x), p.value(x))

    def primal(z: np.ndarray) -> np.ndarray:
        return p.value(z) ** 2 / 2

    h, fd = 1e-6, np.zeros_like(x)
    for k in range(x.shape[1]):
        e = np.zeros_like(x)
        e[:, k] = h
        fd[:, k] = (primal(x + e) - primal(x - e)) / (2 * h)
    assert np.allclose(fd, p.primal_gradient(x), atol=1e-7)
    for _ in range(200):
        z = p.solution + rng.standard_normal(p.solution.shape) * rng.uniform(0.01, 10)
        assert np.abs(dphi(p.residuals(z))).max() <= G_PHI * (1 + 1e-12)  # y <= 1: ||grad_x f|| <= G


def test_the_replica_is_dpvrs_dpsgda_without_noise():
    """Each of 30 atoms twice (n = 60), full batch: dpvr's DP-SGDA with noise 1e-12 and the replica without
    noise end at the same x to 1e-9 after 40 steps (lr_y large enough that y moves off 0 and is projected)."""
    p = MinimaxPlanted.planted([4], 5, 30)
    inputs, targets = _records(p, 2)
    model = _model(5)
    alg = DPSGDA(model, _Planted(), inputs, targets, lr=0.7, lr_y=0.9, steps=40, batch_size=None,
                 clip={"x": G_PHI, "y": 1.0}, noise={"x": 1e-12, "y": 1e-12}, sampling="full")
    for _ in range(40):
        alg.step()
    x = regime_minimax.run_dpsgda(p, 60, 40, 0.7, 0.9, {"x": 0.0, "y": 0.0}, np.random.default_rng(0))
    assert np.allclose(model.weight.detach().numpy().ravel(), x[0], atol=1e-9)
    assert 0 < float(alg.y[0]) < 1


@pytest.mark.parametrize(("per_move", "c3"), [(regime_minimax.SMOOTH, 1e-3), (0.05, 1e-4), (200.0, 1e-3)])
def test_the_replica_is_dpvrs_private_diff_without_noise(per_move, c3):
    """n = 60, full batch, y by output perturbation: dpvr's PrivateDiff with noise 1e-12 and the replica
    without noise end at the same x to 1e-9 over 30 rounds of period 6, with the stated difference radius,
    a small one (clipping active) and a large one (the cap 2 C1 active); dpvr's y sensitivity is the
    replica's Delta."""
    p = MinimaxPlanted.planted([5], 5, 30)
    inputs, targets = _records(p, 2)
    model = _model(5)
    alg = PrivateDiff(model, _Planted(), inputs, targets, lr=0.5, steps=30, restart=6, y_steps=5,
                      batch_size=None, clip={"checkpoint": G_PHI, "difference": (per_move, c3)},
                      noise={"checkpoint": 1e-12, "difference": 1e-12, "y": 1e-12}, sampling="full",
                      y_release="output")
    for _ in range(30):
        alg.step()
    assert alg.y_sensitivity == pytest.approx(regime_minimax.y_sensitivity(60), rel=1e-12)
    saved = regime_minimax.SMOOTH
    try:
        regime_minimax.SMOOTH = per_move
        x, capped = regime_minimax.run_private_diff(
            p, 60, 30, 6, 0.5, {"checkpoint": 0.0, "difference": 0.0, "y": 0.0}, c3, np.random.default_rng(0))
    finally:
        regime_minimax.SMOOTH = saved
    assert np.allclose(model.weight.detach().numpy().ravel(), x[0], atol=1e-9)
    if per_move > 100:
        assert capped[0] > 0


def test_the_replicas_y_noise_has_the_librarys_scale():
    """One round at x0 = 0 over 300 noise seeds in dpvr and in the replica: the released y's std around y*(0)
    is z_y Delta / 2 in both (chi-square bounds: within 15% for 300 draws)."""
    p = MinimaxPlanted.planted([2], 4, 20)
    inputs, targets = _records(p, 1)
    n, z = 20, 4.0
    expected = z * regime_minimax.y_sensitivity(n) / 2
    centre = float(p.value(np.zeros_like(p.solution))[0])
    library = []
    for seed in range(300):
        alg = PrivateDiff(_model(4), _Planted(), inputs, targets, lr=0.1, steps=1, restart=1, y_steps=5,
                          batch_size=None, clip={"checkpoint": G_PHI, "difference": (6.0, 1e-3)},
                          noise={"checkpoint": 1.0, "difference": 1.0, "y": z}, sampling="full",
                          y_release="output",
                          runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed, reproducible=True)))
        alg.step()
        library.append(float(alg.y[0]) - centre)
    stacked = MinimaxPlanted(np.repeat(p.atoms, 300, 0), np.repeat(p.targets, 300, 0),
                             np.repeat(p.solution, 300, 0))
    rng = np.random.default_rng(1)
    ours = np.clip(stacked.inner(np.zeros_like(stacked.solution))
                   + rng.standard_normal(300) * expected, 0, 1) - centre
    for sample in (np.asarray(library), ours):
        assert np.std(sample) == pytest.approx(expected, rel=0.15)


def test_the_protocols_are_the_library_defaults_at_the_problems_constants():
    """The experiment's schedules are dpvr.trainer.defaults' with G = 3 sqrt(3)/8, l = 2, mu = 1, L = 6, the
    y range 1 and the cross bound G; the offset C3 is three sigmas of the y jump times G."""
    from dpvr.trainer.defaults import dpsgda_protocol, private_diff_protocol

    pd = regime_minimax.schedule("PrivateDiff", 50_000, 10, 1.0, 0.2)
    ref = private_diff_protocol(50_000, 10, 1.0, 1e-6, G_PHI, 6.0, 0.2, cross=G_PHI, strong_concavity=1.0,
                                y_range=1.0)
    assert (pd.rounds, pd.restart, pd.lr) == (ref.rounds, ref.restart, ref.lr)
    sg = regime_minimax.schedule("DP-SGDA", 50_000, 10, 1.0, 0.2)
    ref = dpsgda_protocol(50_000, 10, 1.0, 1e-6, 1.0, 2.0, 1.0, 0.2, 1.0)
    assert (sg.rounds, sg.lr, sg.lr_y) == (ref.rounds, ref.lr, ref.lr_y) and sg.lr_y == 0.5
    assert regime_minimax.offset(1000, 10.0) == pytest.approx(G_PHI * 3 * math.sqrt(2) * 10 * 1.02e-3 / 2)
    assert phi(np.asarray(0.0)) == 0


def test_quick_pieces_run_and_spend_at_most_epsilon():
    """One cell per method at n = 2000, eps = 4 (the pieces --quick runs): finite norms, the accountant's
    epsilon at most the target and within 0.2% of it."""
    p = MinimaxPlanted.planted([0, 1], 5, 40)
    gap = float((p.value(np.zeros_like(p.solution)) ** 2 / 2).max())
    for method in regime_minimax.METHODS:
        plan = regime_minimax.schedule(method, 2000, 5, 4.0, gap)
        result = regime_minimax.evaluate(method, p, 2000, plan, 4.0, 0)
        assert np.all(np.isfinite(result["norms"])) and np.all(result["norms"] > 0)
        assert 4.0 * (1 - 2e-3) <= result["spent"] <= 4.0 * (1 + 1e-9)


@pytest.mark.slow  # ~1 minute on two cores: the --quick run
def test_quick_run_writes_tables_exponents_and_crossover(tmp_path, capsys):
    args = argparse.Namespace(quick=True, n=None, epsilon=None, seeds=None, grid=None, tuning_seeds=2,
                              dimension=10, atoms=500, out=str(tmp_path), paper="private-diff")
    doc = regime.run(args)
    assert len(doc["records"]) == 2 * 2 * 3 * 2 * 3  # methods x protocols x sizes x epsilons x seeds
    summary = doc["config"]["summary"]
    assert {e["method"] for e in summary["exponents"]} == {
        "PrivateDiff (theorem)", "DP-SGDA (theorem)", "PrivateDiff (fair)", "DP-SGDA (fair)"}
    assert [c["protocol"] for c in summary["crossovers"]] == ["theorem", "fair"]
    for record in doc["records"]:
        target = record["epsilon"]
        assert target * (1 - 2e-3) <= record["spent_epsilon"] <= target * (1 + 1e-9)
    for name in ("regime-private-diff.json", "regime-private-diff.csv", "regime-private-diff.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert "crossover" in capsys.readouterr().out


def test_the_fair_grid_is_public_and_each_point_is_calibrated_to_the_target():
    """The fair tuning's candidates at n = 2000, eps = 4: every x-step of LR_GRID with ceil(f R) rounds for f
    in ROUND_FRACTIONS (R the theorem's), nothing else; each point's noise is dpvr's calibration for its own R
    (the accountant's epsilon within 0.2% below the target) and grows with R (more rounds: no stream's
    multiplier lower, one at least 5% higher; a grid that kept one noise for every R would fail this)."""
    p = MinimaxPlanted.planted([0], 5, 40)
    gap = float((p.value(np.zeros_like(p.solution)) ** 2 / 2).max())
    for method in regime_minimax.METHODS:
        theorem = regime_minimax.schedule(method, 2000, 5, 4.0, gap)
        grid = regime_minimax.fair_grid(method, 2000, 5, 4.0, gap)
        assert [(q.lr, q.rounds) for q in grid] == [
            (lr, max(1, math.ceil(theorem.rounds * f)))
            for lr in regime_minimax.LR_GRID for f in regime_minimax.ROUND_FRACTIONS]
        assert regime_minimax.LR_GRID[0] == pytest.approx(1 / (16 * 9 * 2))  # DP-SGDA's theorem step
        assert regime_minimax.LR_GRID[-1] == pytest.approx(1 / regime_minimax.SMOOTH)
        multipliers = {}
        for q in grid[:len(regime_minimax.ROUND_FRACTIONS)]:  # the noise depends on R only
            result = regime_minimax.evaluate(method, p, 2000, q, 4.0, 0)
            assert 4.0 * (1 - 2e-3) <= result["spent"] <= 4.0 * (1 + 1e-9)
            multipliers[q.rounds] = result["noise"]
        ordered = [multipliers[r] for r in sorted(multipliers)]
        assert len(ordered) == 3
        for fewer, more in zip(ordered, ordered[1:]):  # no stream quieter, one louder
            assert all(more[k] >= fewer[k] * (1 - 1e-9) for k in fewer)
            assert any(more[k] > fewer[k] * 1.05 for k in fewer)


def test_the_fair_choice_reads_only_the_held_out_seeds(tmp_path, monkeypatch):
    """A tiny run (n = 2000, eps = 4, seeds 0 and 1, tuning seeds 1000 and 1001): every tuning run sees only
    the held-out instances, the evaluated fair protocol is a grid point, and it is the one with the lowest
    median on the held-out instances (recomputed here from the recorded tuning runs)."""
    calls = []
    original = regime_minimax.evaluate

    def spy(method, problem, n, protocol, epsilon, seed):
        result = original(method, problem, n, protocol, epsilon, seed)
        calls.append((method, problem.solution.copy(), protocol, float(np.median(result["norms"]))))
        return result

    monkeypatch.setattr(regime_minimax, "evaluate", spy)
    args = argparse.Namespace(quick=True, n=[2000], epsilon=[4.0], seeds=2, grid=None, tuning_seeds=2,
                              dimension=5, atoms=40, out=str(tmp_path), paper="private-diff")
    doc = regime_minimax.run(args)
    held_out = MinimaxPlanted.planted([1000, 1001], 5, 40).solution
    evaluated = MinimaxPlanted.planted([0, 1], 5, 40).solution
    assert doc["config"]["tuning_seeds"] == [1000, 1001] and doc["config"]["seeds"] == [0, 1]
    for method in regime_minimax.METHODS:
        runs = [c for c in calls if c[0] == method]
        tuning = [c for c in runs if np.array_equal(c[1], held_out)]
        final = [c for c in runs if np.array_equal(c[1], evaluated)]
        assert len(tuning) + len(final) == len(runs) and len(final) == 2  # theorem and fair, nothing else
        grid = regime_minimax.fair_grid(method, 2000, 5, 4.0, doc["config"]["gap"],
                                        regime_minimax.QUICK_LR_GRID, (1 / 4, 1.0))
        assert [c[2] for c in tuning] == grid
        assert final[1][2] == min(tuning, key=lambda c: c[3])[2]
