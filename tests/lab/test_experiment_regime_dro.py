"""The Recursive-SPIDER-vs-DP-SGD-on-the-dual regime experiment: its problem's constants, its replicas against
dpvr's algorithms, its noise scale, and its protocols against dpvr.trainer.defaults."""

from __future__ import annotations

import argparse
import copy
import math
import os

import numpy as np
import pytest
import torch
from torch import nn

import dpvr
from dpvr.algorithms import DPGD, RecursiveSpider
from dpvr.objectives import WithEta, divergence, dual_loss
from dpvr.optim import RuntimeConfig
from dpvr.trainer.defaults import dpgd_protocol, spider_protocol
from dpvr_lab.experiments import regime_dro
from dpvr_lab.experiments.regime import Problem, phi
from dpvr_lab.experiments.regime_dro import LAM, dual_constants, spider_constants


def _phi_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    r = output[0] - target
    return r * r / (1 + r * r)


def _model(d: int) -> nn.Module:
    model = nn.Linear(d, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def _records(p: Problem, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(p.atoms[0]).repeat(copies, 1), torch.tensor(p.targets[0]).repeat(copies)


def test_the_spider_constants_bound_random_points_and_are_nearly_attained():
    """C1, k2, C3, k4 bound their per-sample terms at 200,000 random (t, lam >= lam0) points and the best of
    them reaches 99% of each; the partial derivatives the constants are built from match central
    differences of g (to 1e-6)."""
    c = spider_constants()
    rng = np.random.default_rng(0)
    t = rng.uniform(-12, 12, (200_000, 1))
    lam = LAM * np.exp(rng.exponential(0.5, (200_000, 1)))
    q = regime_dro.inner_terms(t, lam)
    found = {"v-refresh": np.abs(q["gx"]).max(), "v-difference": np.hypot(q["A"], q["b"]).max(),
             "u-refresh": q["u"].max(), "u-difference": np.hypot(q["u_t"], q["u_lam"]).max()}
    for key, value in found.items():
        assert value <= c[key] * (1 + 1e-9), key
        assert value >= 0.99 * c[key], key
    h = 1e-5
    t, lam = np.linspace(-4, 4, 81)[:, None], np.array([[1.0, 1.7, 3.0]])

    def g(a, b):
        return regime_dro.inner_terms(a, b)["g"]

    def gx(a, b):
        return regime_dro.inner_terms(a, b)["gx"]

    def u(a, b):
        return regime_dro.inner_terms(a, b)["u"]

    assert np.allclose((g(t + h, lam) - g(t - h, lam)) / (2 * h), gx(t, lam), atol=1e-6)
    assert np.allclose((g(t, lam + h) - g(t, lam - h)) / (2 * h), u(t, lam), atol=1e-6)
    assert np.allclose((gx(t + h, lam) - gx(t - h, lam)) / (2 * h), q_of(t, lam, "A"), atol=1e-6)
    assert np.allclose((gx(t, lam + h) - gx(t, lam - h)) / (2 * h), q_of(t, lam, "b"), atol=1e-6)
    assert np.allclose((u(t + h, lam) - u(t - h, lam)) / (2 * h), q_of(t, lam, "u_t"), atol=1e-6)
    assert np.allclose((u(t, lam + h) - u(t, lam - h)) / (2 * h), q_of(t, lam, "u_lam"), atol=1e-6)


def q_of(t: np.ndarray, lam: np.ndarray, key: str) -> np.ndarray:
    return regime_dro.inner_terms(t, lam)[key]


def test_the_dual_constants_bound_random_points_and_the_gaps_are_exact():
    """The dual's G and L bound the per-sample gradient norm and Hessian norm at 200,000 random points with
    eta in [0, 1] (and are reached to 99%); the Hessian's spectral norm is numpy's; F(x*) = 0, F >= 0, the
    closed-form grad F is F's finite-difference gradient, and min over eta of the dual is F (eta grid)."""
    g_max, l_max = dual_constants()
    rng = np.random.default_rng(1)
    t, eta = rng.uniform(-12, 12, (200_000, 1)), rng.uniform(0, 1, (200_000, 1))
    q = regime_dro.dual_terms(t, eta)
    assert q["grad"].max() <= g_max * (1 + 1e-9) and q["grad"].max() >= 0.99 * g_max
    assert q["hess"].max() <= l_max * (1 + 1e-9) and q["hess"].max() >= 0.99 * l_max
    from dpvr_lab.experiments.regime import d2phi, dphi
    for tt, ee in zip(t[:20, 0], eta[:20, 0]):
        e = math.exp((phi(tt) - ee) / LAM)
        off = -dphi(tt) / LAM
        hess = e * np.array([[d2phi(tt) + dphi(tt) ** 2 / LAM, off], [off, 1 / LAM]])
        stated = regime_dro.dual_terms(np.array(tt), np.array(ee))["hess"]
        assert np.linalg.norm(hess, 2) == pytest.approx(stated)
    p = Problem.planted([0, 1], 6, 200)
    assert np.allclose(regime_dro.objective(p, p.solution), 0.0, atol=1e-12)
    x = rng.standard_normal(p.solution.shape)
    assert np.all(regime_dro.objective(p, x) >= 0)
    h, fd = 1e-6, np.zeros_like(x)
    for k in range(x.shape[1]):
        e_k = np.zeros_like(x)
        e_k[:, k] = h
        fd[:, k] = (regime_dro.objective(p, x + e_k) - regime_dro.objective(p, x - e_k)) / (2 * h)
    assert np.allclose(fd, regime_dro.gradient(p, x), atol=1e-7)
    losses = phi(p.residuals(x))
    etas = np.linspace(-1, 2, 30001)
    dual = (LAM * np.expm1((losses[:, :, None] - etas) / LAM)).mean(axis=1) + etas
    assert np.allclose(dual.min(axis=1), regime_dro.objective(p, x), atol=1e-7)


@pytest.mark.parametrize("rho", [regime_dro.RHO, -1.0])
def test_the_replica_is_dpvrs_recursive_spider_without_noise(monkeypatch, rho):
    """Each of 30 atoms twice (n = 60), full batches, noise 1e-12: dpvr's RecursiveSpider and the replica
    without noise (given the library's s records) end at the same x and lam to 1e-9 after 40 steps of period
    7; with rho = -1 (not a DRO radius: a test of the update) lam leaves lam0, exercising its step and u."""
    monkeypatch.setattr(regime_dro, "RHO", rho)
    p = Problem.planted([3], 5, 30)
    inputs, targets = _records(p, 2)
    clip = spider_constants()
    model = _model(5)
    alg = RecursiveSpider(model, _phi_loss, inputs, targets, rho=rho, lam0=LAM, steps=40, restart=7,
                          batch_sizes=[60, 60, 60, 60], lr=2.0, lr_lam=0.5, beta=regime_dro.BETA,
                          loss_bound=regime_dro.BOUND, clip=clip, lam_init=LAM, s0=1.0,
                          s_floor=regime_dro.S_FLOOR, noise={k: 1e-12 for k in clip})
    picked = []
    draw = alg._draw

    def spy(stream):
        batch = draw(stream)
        if stream == "s":
            row = batch.inputs[0].numpy()
            picked.append(int(np.argmin(np.linalg.norm(p.atoms[0] - row, axis=1))))
        return batch

    alg._draw = spy
    for _ in range(40):
        alg.step()
    full = np.full((1, 30), 2)

    def draws(stream, t):
        return np.array([picked[t]]) if stream == "s" else full

    x, lam = regime_dro.run_spider(p, 60, 40, 7, 60, 2.0, 0.5, {k: 0.0 for k in clip}, clip,
                                   np.random.default_rng(0), draws=draws)
    assert np.allclose(model.weight.detach().numpy().ravel(), x[0], atol=1e-9)
    assert float(alg.lam) == pytest.approx(float(lam[0]), abs=1e-9)
    if rho < 1:
        assert float(alg.lam) > LAM + 1e-3
    assert np.linalg.norm(x[0]) > 0.1


def test_the_replica_is_dpvrs_dpgd_on_the_dual_without_noise():
    """n = 60, full batch: dpvr's DPGD on (x, eta) with the KL dual loss (noise 1e-12) and the replica end at
    the same x to 1e-9 after 40 steps, with clipping active (a radius below G)."""
    p = Problem.planted([4], 5, 30)
    inputs, targets = _records(p, 2)
    base = _model(5)
    model = WithEta(base).double()
    alg = DPGD(model, dual_loss(divergence("kl"), LAM, base=_phi_loss), inputs, targets, lr=0.7, clip=0.8,
               steps=40, noise=1e-12)
    for _ in range(40):
        alg.step()
    x = regime_dro.run_dual(p, 60, 40, 0.7, 0.0, 0.8, np.random.default_rng(0))
    assert np.allclose(base.weight.detach().numpy().ravel(), x[0], atol=1e-9)


def test_the_replicas_noise_has_the_librarys_scale():
    """One refresh step at x0 over 300 noise seeds, in dpvr and in the replica (n = 60, z = 3): the x step's
    std per coordinate is lr (lam / s') z C1 / n in both (chi-square bounds: within 15%). s' is made the same
    constant in both: its noise is off (a tiny z_s) and both read the same record for it (the library's s
    sampler seeded alike in every run, the replica told that record's atom), since s' depends on which
    record the one-record s batch holds."""
    p = Problem.planted([2], 4, 20)
    inputs, targets = _records(p, 3)
    clip = spider_constants()
    noise = {"v-refresh": 3.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1e-9}
    lib, s_records = [], set()
    for seed in range(300):
        model = _model(4)
        runtime = RuntimeConfig(generator=dpvr.NoiseGenerator(seed, reproducible=True), sampler_seed=11)
        alg = RecursiveSpider(model, _phi_loss, inputs, targets, rho=regime_dro.RHO, lam0=LAM, steps=1,
                              restart=1, batch_sizes=[60, 60, 60, 60], lr=1.0, lr_lam=0.1, beta=1.0,
                              loss_bound=1.0, clip=clip, s_floor=regime_dro.S_FLOOR, noise=noise,
                              runtime=runtime)
        s_records.add(int(copy.deepcopy(alg.samplers["s"]).draw()[0]))
        alg.step()
        lib.append(model.weight.detach().numpy().ravel())
    (record,) = s_records
    atom = record % p.atoms.shape[1]  # the records are the atoms repeated

    def draws(stream: str, t: int) -> np.ndarray:
        assert stream == "s", stream  # one refresh step draws no difference batch
        return np.full(300, atom)

    stacked = Problem(np.repeat(p.atoms, 300, 0), np.repeat(p.targets, 300, 0), np.repeat(p.solution, 300, 0))
    x, _ = regime_dro.run_spider(stacked, 60, 1, 1, 60, 1.0, 0.1, noise, clip, np.random.default_rng(1),
                                 draws=draws)
    lib_, rep = np.asarray(lib), x
    assert np.allclose(lib_.mean(axis=0), rep.mean(axis=0), atol=0.25 * lib_.std())
    ratio = lib_.std(axis=0) / rep.std(axis=0)
    assert np.all((ratio > 0.85) & (ratio < 1.15))


def test_sampled_batches_are_uniform_subsets():
    """sample_counts: every batch has exactly b distinct records (counts sum to b, none above the copies);
    each atom's mean count is b/m and its variance the hypergeometric one, b (1/m)(1 - 1/m)(n - b)/(n - 1),
    within 10% over 20,000 draws of b = 40 from n = 60 (where sampling with replacement would give 2.5x)."""
    rng = np.random.default_rng(7)
    counts = regime_dro.sample_counts(rng, 60, 3, 40, (20_000,))
    assert np.all(counts.sum(axis=1) == 40) and counts.max() <= 20
    var = 40 * (1 / 3) * (2 / 3) * (60 - 40) / 59
    assert np.allclose(counts.mean(axis=0), 40 / 3, rtol=0.01)
    assert np.allclose(counts.var(axis=0), var, rtol=0.1)


def test_the_protocols_are_the_library_defaults_at_the_problems_constants():
    """The theorem protocols are dpvr.trainer.defaults' at this problem's constants (Recursive-SPIDER: G = C1,
    L = k2, Psi0 = F(0); the dual: d + 1 coordinates), and the tuned multiplier keeps eta T to rounding."""
    c = spider_constants()
    got = regime_dro.schedule("Recursive-SPIDER", 50_000, 10, 1.0, 0.6)
    want = spider_protocol(50_000, 10, 1.0, regime_dro.DELTA, c["v-refresh"], c["v-difference"], psi0=0.6)
    assert (got.rounds, got.restart, int(got.tau), got.lr) == (want.rounds, want.restart, want.batch, want.lr)
    g, lip = dual_constants()
    got = regime_dro.schedule("DP-SGD-dual", 50_000, 10, 1.0, 0.9)
    want = dpgd_protocol(50_000, 1, 11, 1.0, regime_dro.DELTA, g, lip, 0.9)
    assert (got.rounds, got.lr) == (want.rounds, want.lr)
    tuned = regime_dro.schedule("Recursive-SPIDER", 50_000, 10, 1.0, 0.6, 4.0)
    base = regime_dro.schedule("Recursive-SPIDER", 50_000, 10, 1.0, 0.6)
    assert tuned.lr * tuned.rounds == pytest.approx(base.lr * base.rounds, rel=1e-3)


def test_one_cell_spends_at_most_epsilon():
    """One cell per method at n = 2000, eps = 1: finite norms, the accountant's epsilon within the target."""
    p = Problem.planted([0, 1], 10, 500)
    for method in regime_dro.METHODS:
        plan = regime_dro.schedule(method, 2000, 10, 1.0, 0.7)
        result = regime_dro.evaluate(method, p, 2000, plan, 1.0, 0)
        assert np.all(np.isfinite(result["norms"]))
        assert 0.95 < result["spent"] <= 1.0 + 1e-9


@pytest.mark.slow  # about a minute: the --quick run
def test_quick_run_writes_tables_exponents_and_crossover(tmp_path, capsys):
    args = argparse.Namespace(quick=True, n=None, epsilon=None, seeds=None, grid=None, tuning_seeds=2,
                              dimension=10, atoms=500, out=str(tmp_path), paper="spider")
    doc = regime_dro.run(args)
    out = capsys.readouterr().out
    assert "exponent in n" in out and "crossover" in out
    summary = doc["config"]["summary"]
    assert {e["method"] for e in summary["exponents"]} == {
        f"{m} ({p})" for m in regime_dro.METHODS for p in ("theorem", "tuned")}
    assert all(r["spent_epsilon"] <= r["epsilon"] + 1e-9 for r in doc["records"])
    assert os.path.exists(tmp_path / "regime-spider-d10.png")


def test_a_run_thrown_onto_the_plateau_counts_as_no_progress():
    """phi is flat far from x*: Recursive-SPIDER at 16x its step (n = 2000, eps = 1) throws some instances
    out, to F(x_T) > F(0); those report ||grad F(x0)|| and escaped, the others their own norm at an
    objective at most F(0)."""
    p = Problem.planted([0, 1, 2, 3], 10, 500)
    plan = regime_dro.schedule("Recursive-SPIDER", 2000, 10, 1.0, 0.7, 16.0)
    result = regime_dro.evaluate("Recursive-SPIDER", p, 2000, plan, 1.0, 0)
    start = np.zeros_like(p.solution)
    at_start = np.linalg.norm(regime_dro.gradient(p, start), axis=1)
    escaped = result["escaped"]
    assert escaped.any()
    assert np.all(result["objective"][escaped] > regime_dro.objective(p, start)[escaped])
    assert np.allclose(result["norms"][escaped], at_start[escaped])
    assert np.all(result["objective"][~escaped] <= regime_dro.objective(p, start)[~escaped])
