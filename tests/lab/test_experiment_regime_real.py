"""``dpvr experiment regime --paper diff2-real``: the MNIST-1D margin loss has the stated per-sample
constants, its features are a per-record map, the replicas release what dpvr's DIFF2 and DP-GD release on
these records, and a tiny run spends its budget and writes its tables."""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import pytest
import torch
from torch import nn

from dpvr.algorithms import DIFF2, DPGD
from dpvr_lab.experiments import regime, regime_real
from dpvr_lab.experiments.regime import dphi

pytest.importorskip("mnist1d")


@pytest.fixture(scope="module")
def real() -> regime.Problem:
    return regime_real.records([0, 1], 10, 300)


def test_the_losss_constants_hold_per_sample_on_the_records(real):
    """Rows have unit norm, so over 200 random points every per-sample gradient has norm <= G = 3 sqrt(3)/8
    (attained to 1%) and every per-sample gradient difference is <= L ||x - y||, L = 2; f(x0) = 1/2 exactly
    for every record (the public gap) and f >= 0; targets are +-1 with the digit's share near 1/10."""
    assert np.allclose(np.linalg.norm(real.atoms, axis=2), 1.0, atol=1e-12)
    assert set(np.unique(real.targets)) == {-1.0, 1.0}
    assert 0.05 < (real.targets == 1).mean() < 0.15
    assert np.allclose(real.value(np.zeros_like(real.solution)), regime_real.GAP, atol=1e-15)
    rng = np.random.default_rng(11)
    worst_g, worst_l = 0.0, 0.0
    for _ in range(200):
        x = rng.standard_normal(real.solution.shape) * rng.uniform(0.01, 20)
        y = x + rng.standard_normal(x.shape) * rng.uniform(1e-4, 3)
        gx = dphi(real.residuals(x))[:, :, None] * real.atoms
        gy = dphi(real.residuals(y))[:, :, None] * real.atoms
        worst_g = max(worst_g, float(np.linalg.norm(gx, axis=2).max()))
        ratio = np.linalg.norm(gx - gy, axis=2) / np.linalg.norm(x - y, axis=1)[:, None]
        worst_l = max(worst_l, float(ratio.max()))
        assert np.all(real.value(x) >= 0)
    assert 0.99 * regime.G_PHI <= worst_g <= regime.G_PHI * (1 + 1e-12)
    assert worst_l <= regime.L_PHI * (1 + 1e-9)


def test_the_features_are_a_per_record_map_with_a_public_projection():
    """A record's features do not depend on the other records (a row alone = the row within a batch, to
    rounding), the projection is the same at every call (its seed is public), and a dimension below 2 is
    refused."""
    signals = np.random.default_rng(2).standard_normal((50, 40))
    batch = regime_real.features(signals, 10)
    assert np.allclose(regime_real.features(signals[7:8], 10)[0], batch[7], rtol=0, atol=1e-14)
    assert np.array_equal(regime_real.projection(10), regime_real.projection(10))
    assert np.all(batch[:, -1] > 0)  # the bias coordinate, scaled with the row
    with pytest.raises(ValueError, match="dimension"):
        regime_real.projection(1)


def _model(d: int) -> nn.Module:
    model = nn.Linear(d, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    r = out.squeeze(-1) - target
    return r * r / (1 + r * r)


def test_the_replicas_are_dpvrs_diff2_and_dpgd_without_noise_on_real_records():
    """30 MNIST-1D records twice (n = 60), d = 6: dpvr's DIFF2-GD (30 rounds, period 6, C1 = G, C2 = L) and
    DP-GD (25 steps, clip 0.2: active) with noise 1e-12 end where the replicas without noise end, to 1e-9."""
    p = regime_real.records([0], 6, 30)
    inputs = torch.tensor(p.atoms[0]).repeat(2, 1)
    targets = torch.tensor(p.targets[0]).repeat(2)
    model = _model(6)
    alg = DIFF2(model, _loss, [(inputs, targets)], lr=3.0, steps=30, restart=6,
                clip={"restart": regime.G_PHI, "difference": regime.L_PHI},
                noise={"restart": 1e-12, "difference": 1e-12})
    for _ in range(30):
        alg.step()
    x, _ = regime.run_diff2(p, 60, 30, 6, 3.0, {"restart": 0.0, "difference": 0.0}, np.random.default_rng(0))
    assert np.abs(x[0]).max() > 0.1  # it moved
    assert np.allclose(model.weight.detach().numpy().ravel(), x[0], atol=1e-9)
    clipped = regime.Problem(p.atoms, p.targets, p.solution, 0.2, regime.L_PHI)
    model = _model(6)
    alg = DPGD(model, _loss, inputs, targets, lr=2.0, steps=25, clip=0.2, noise=1e-12)
    for _ in range(25):
        alg.step()
    x = regime.run_dpgd(clipped, 60, 25, 2.0, 0.0, np.random.default_rng(0))
    assert np.allclose(model.weight.detach().numpy().ravel(), x[0], atol=1e-9)


def test_the_protocols_are_the_planted_experiments_at_the_public_gap(real):
    """The schedules are regime.schedule's (dpvr.trainer.defaults at G, L) with f(x0) - f* <= 1/2, and one
    cell per method spends at most its epsilon (within 0.2% of it), with finite norms."""
    for method in regime.METHODS:
        plan = regime.schedule(method, 2000, 10, 4.0, regime_real.GAP, problem=real)
        assert plan == regime.schedule(method, 2000, 10, 4.0, 0.5)
        result = regime_real.evaluate(method, real, 2000, plan, 4.0)
        assert np.all(np.isfinite(result["norms"])) and np.all(result["norms"] > 0)
        assert 4.0 * (1 - 2e-3) <= result["spent"] <= 4.0 * (1 + 1e-9)
        assert np.allclose(np.linalg.norm(real.gradient(result["x"]), axis=1), result["norms"])


def test_tiny_run_writes_tables_cells_and_crossover(tmp_path, capsys):
    args = argparse.Namespace(quick=True, n=[2000, 8000], epsilon=[4.0], seeds=2, grid=None, tuning_seeds=2,
                              dimension=10, atoms=100, out=str(tmp_path), paper="diff2-real")
    doc = regime.run(args)
    assert len(doc["records"]) == 2 * 2 * 2  # methods x sizes x seeds
    for record in doc["records"]:
        assert 4.0 * (1 - 2e-3) <= record["spent_epsilon"] <= 4.0 * (1 + 1e-9)
        assert record["metrics"]["diagnostics"]["private"] is False
        assert math.isfinite(record["metrics"]["diagnostics"]["grad_norm"])
        assert 0 <= record["metrics"]["test_accuracy"] <= 1
    cells = doc["config"]["summary"]["cells"]
    assert [(c["n"], c["epsilon"]) for c in cells] == [(2000, 4.0), (8000, 4.0)]
    for name in ("regime-real.json", "regime-real.csv", "regime-real.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert "DIFF2/DP-GD" in capsys.readouterr().out
