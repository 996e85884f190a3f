"""Where PrivateDiff wins: PrivateDiff against DP-SGDA on an NC-SC minimax problem whose constants are known.

The problem (:class:`MinimaxPlanted`): ``f(x, y; z_j) = y phi(a_j^T x - b_j) - (mu / 2) y^2`` on ``Y = [0,
1]``, ``mu = 1``, with the planted robust-regression atoms of :mod:`dpvr_lab.experiments.regime` (unit
``a_j``, ``b_j = a_j^T x*``, ``phi(t) = t^2 / (1 + t^2)``). For every ``x`` the inner problem is strongly
concave and its maximiser is ``y*(x) = F(x) = (1/m) sum_j phi(a_j^T x - b_j)`` (in ``[0, 1)``), so ``Phi(x) =
F(x)^2 / 2``, ``min Phi = Phi(x*) = 0`` and ``grad Phi(x) = F(x) grad F(x)``: the paper's stationarity measure
``||grad Phi(x_R)||`` is exact. Constants, per sample: ``||grad_x f|| <= G = max|phi'| = 3 sqrt(3) / 8``
(``y <= 1``), ``||grad_xx f|| <= 2``, ``||grad_xy f|| <= G``, so ``l = 2``, ``kappa = l / mu = 2`` and ``Phi``
is ``L = l + kappa l = 6``-smooth; ``|grad_y f| <= 1``; ``grad_y f`` ranges over an interval of length 1 (the
inner maximiser's replace-one sensitivity is ``1 / (n mu)``); ``Phi(x0) - min Phi = F(0)^2 / 2``
(``x0 = 0``). As in the DIFF2 experiment, the ``n`` records are ``m`` atoms repeated ``n / m`` times: one
objective at every ``n``, a full-batch round costs ``O(m d)``.

Methods, at their theorems' protocols (:mod:`dpvr.trainer.defaults`), full batch, five paired seeds:

- ``PrivateDiff (theorem)``: ``y_release="output"`` (the paper's form, made private as dpvr releases it:
  the exact inner maximiser plus Gaussian noise of multiplier ``z_y`` over its sensitivity ``Delta = 1 /
  (n mu) + 2 tau``, ``tau`` the default solver tolerance, 1% of ``1 / (n mu)``), the x-estimator reset every
  ``T`` rounds, ``R``, ``T`` and ``eta`` from :func:`~dpvr.trainer.defaults.private_diff_protocol` with the
  problem's ``l = ||grad_xy f|| <= G``, ``mu`` and gradient range, clip radii ``C1 = G``, ``C2 = L`` and the
  offset ``C3 = G * 3 sqrt(2) z_y Delta / 2`` (three standard deviations of the jump the y-noise makes
  between rounds, which moves a per-sample difference by ``||grad_xy f|| |y_{r+1} - y_r|``: public);
- ``DP-SGDA (theorem)``: Theorem 2's ``T``, ``eta_x = 1 / (16 (kappa + 1)^2 l)``, ``eta_y = 1 / l``
  (:func:`~dpvr.trainer.defaults.dpsgda_protocol`), clip radii ``G`` (x) and 1 (y);
- ``... (fair)``: a tuning that can move either method. The x-step from a public grid (:data:`LR_GRID`:
  ``1/288``, DP-SGDA's theorem step, to ``1/6 = 1/L``, factors of 4) and, for each step, the number of
  rounds from a small grid (:data:`ROUND_FRACTIONS`: ``R/16``, ``R/4``, ``R`` of the method's theorem
  ``R``; fewer rounds, less noise per round), every grid point's noise recalibrated by dpvr for its own
  ``R`` to the target ``(eps, delta)`` and ``T`` re-derived for it; the point with the lowest median on two
  held-out tuning seeds (instances 1000, 1001, never the evaluation seeds) is kept. This is a public grid on
  held-out instances of the same synthetic family, not a private selection: no evaluation record is read
  to choose, so the choice costs no privacy and the reported epsilon is the one run's. (An earlier tuning
  kept ``eta R`` fixed, ``eta k`` with ``R / k`` rounds, and so could not help DP-SGDA, whose theorem step
  sets ``eta R`` far below what the problem needs.)

Noise multipliers come from dpvr's own calibration of each run's plan (``PrivateDiffPlan`` with
``y_release="output"``, ``DPSGDAPlan``, full batches, PLD, replace-one); the updates are exact replicas of
:class:`dpvr.algorithms.PrivateDiff` and :class:`dpvr.algorithms.DPSGDA` on these closed-form gradients
(checked against the library to 1e-9 in the tests), vectorised over seeds. The metric is ``||grad Phi(x_R)||``
at the last iterate (the paper's output is a uniformly drawn iterate; the last one is what a user keeps).

Output as the DIFF2 experiment's: medians, exponents in ``n`` (theory ``-2/3`` for PrivateDiff, ``-1/2`` for
DP-SGDA; with dpvr's private y the PrivateDiff protocol stops at ``R_y`` and its bound returns to ``-1/2``
at large ``n``, :func:`~dpvr.trainer.defaults.private_diff_protocol`), the crossover in ``n eps / sqrt(d)``
beside the one the two bounds predict, and a PNG.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np

from dpvr.algorithms import DPSGDAPlan, PrivateDiffPlan
from dpvr.privacy.accountant import account
from dpvr.privacy.calibration import calibrate
from dpvr.results import Record, document
from dpvr.trainer.defaults import Protocol, dpsgda_protocol, private_diff_protocol, restart_period

from . import regime
from .common import derive_seed, progress, save
from .regime import G_PHI, L_PHI, Problem, dphi, phi

NAME = "regime-private-diff"
DELTA = regime.DELTA
MU = 1.0  # strong concavity in y
CROSS = L_PHI  # l: max(||grad_xx f||, ||grad_xy f||, mu) = 2
SMOOTH = CROSS + (CROSS / MU) * CROSS  # l + kappa l: Phi's smoothness, PrivateDiff's C2
Y_RANGE = 1.0  # grad_y f = phi - mu y ranges over an interval of length 1 for y fixed
Y_CLIP = 1.0  # |grad_y f| <= 1 on Y = [0, 1]
TOLERANCE = 0.01  # the solver's default tolerance, as a fraction of 1 / (n mu)
METHODS = ("PrivateDiff", "DP-SGDA")
SIZES = regime.SIZES
QUICK_SIZES = (4_000, 16_000, 64_000)
LR_GRID = (1 / 288, 1 / 72, 1 / 18, 1 / 6)  # the fair tuning's x-steps: 1/(16 (kappa+1)^2 l) to 1/L
ROUND_FRACTIONS = (1 / 16, 1 / 4, 1.0)  # the fair tuning's rounds, as fractions of the theorem's R
QUICK_LR_GRID = (1 / 288, 1 / 18)


class MinimaxPlanted(Problem):
    """The planted atoms of :class:`dpvr_lab.experiments.regime.Problem` as the minimax problem of the module
    documentation; ``y*(x) = F(x)`` and ``Phi = F^2 / 2``."""

    def inner(self, x: np.ndarray) -> np.ndarray:
        """``y*(x) = Proj_[0,1](F(x) / mu)`` per instance."""
        return np.clip(self.value(x) / MU, 0.0, 1.0)

    def primal_gradient(self, x: np.ndarray) -> np.ndarray:
        """``grad Phi(x) = grad_x f(x, y*(x))`` averaged: ``y* grad F``."""
        return self.inner(x)[:, None] * self.gradient(x)


def y_sensitivity(n: int) -> float:
    """``Delta = gradient_range / (n mu) + 2 tau``, the solver's default ``tau`` (1% of the first term)."""
    return Y_RANGE / (n * MU) * (1 + 2 * TOLERANCE)


def run_dpsgda(problem: MinimaxPlanted, n: int, rounds: int, lr: float, lr_y: float, noise: dict[str, float],
               rng: np.random.Generator) -> np.ndarray:
    """DP-SGDA, full batch (the replica of :class:`dpvr.algorithms.DPSGDA`): at ``(x_t, y_t)`` the means of
    per-sample ``grad_x f = y phi' a`` clipped at ``G`` and ``grad_y f = phi - mu y`` clipped at 1, plus
    ``N(0, (z C / n)^2)`` each; ``x <- x - eta_x v_x``, ``y <- Proj(y + eta_y v_y)``. Returns ``x_R``."""
    c1 = G_PHI
    s, d = problem.solution.shape
    x, y = np.zeros((s, d)), np.zeros(s)
    for _ in range(rounds):
        res = problem.residuals(x)
        gx = problem.mean(np.clip(y[:, None] * dphi(res), -c1, c1))
        gy = np.clip(phi(res) - MU * y[:, None], -Y_CLIP, Y_CLIP).mean(axis=1)
        vx = gx + rng.standard_normal((s, d)) * (noise["x"] * c1 / n)
        vy = gy + rng.standard_normal(s) * (noise["y"] * Y_CLIP / n)
        x = x - lr * vx
        y = np.clip(y + lr_y * vy, 0.0, 1.0)
    return x


def offset(n: int, z_y: float) -> float:
    """``C3 = ||grad_xy f|| 3 sqrt(2) z_y Delta / 2``: three standard deviations of the y-noise's jump between
    rounds, times the bound ``G`` on ``||grad_xy f||`` (public)."""
    return G_PHI * 3 * math.sqrt(2) * z_y * y_sensitivity(n) / 2


def run_private_diff(problem: MinimaxPlanted, n: int, rounds: int, restart: int, lr: float,
                     noise: dict[str, float], c3: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """PrivateDiff, full batch, ``y_release="output"`` (the replica of :class:`dpvr.algorithms.PrivateDiff`):
    round ``r`` releases ``y_{r+1} = Proj(y*(x_r) + N(0, (z_y Delta / 2)^2))``; a checkpoint round resets
    ``v`` to the mean of ``grad_x f(x_r, y_{r+1})`` clipped at ``C1 = G`` plus ``N(0, (z1 C1 / n)^2)``, a
    difference round adds the mean of same-sample differences ``grad_x f(x_r, y_{r+1}) - grad_x f(x_{r-1},
    y_r)`` clipped at ``min(C2 ||x_r - x_{r-1}|| + C3, 2 C1)`` plus noise of std ``z2`` times that radius over
    ``n``; ``x <- x - eta v``. Returns ``(x_R, capped)``, ``capped`` the difference rounds at the cap."""
    c1, c2, cap = G_PHI, SMOOTH, 2 * G_PHI
    s, d = problem.solution.shape
    x, y, v = np.zeros((s, d)), np.zeros(s), np.zeros((s, d))
    move, slope_prev = np.zeros(s), None
    capped = np.zeros(s, dtype=np.int64)
    y_std = noise["y"] * y_sensitivity(n) / 2
    for r in range(1, rounds + 1):
        y_prev = y
        res = problem.residuals(x)
        y = np.clip(np.clip(phi(res).mean(axis=1) / MU, 0.0, 1.0) + rng.standard_normal(s) * y_std, 0.0, 1.0)
        slope = dphi(res)
        if (r - 1) % restart == 0:
            v = problem.mean(np.clip(y[:, None] * slope, -c1, c1)) + rng.standard_normal((s, d)) * (
                noise["checkpoint"] * c1 / n)
        else:
            wanted = c2 * move + c3
            radius = np.minimum(wanted, cap)
            capped += wanted > cap
            bound = radius[:, None]
            delta = np.clip(y[:, None] * slope - y_prev[:, None] * slope_prev, -bound, bound)
            v = v + problem.mean(delta) + rng.standard_normal((s, d)) * (noise["difference"] * bound / n)
        step = lr * v
        x = x - step
        move = np.linalg.norm(step, axis=1)
        slope_prev = slope
    return x, capped


def schedule(method: str, n: int, dimension: int, epsilon: float, gap: float) -> Protocol:
    """The theorem's protocol of ``method`` at this problem's constants."""
    if method == "DP-SGDA":
        return dpsgda_protocol(n, dimension, epsilon, DELTA, max(G_PHI, Y_CLIP), CROSS, MU, gap, 1.0)
    return private_diff_protocol(n, dimension, epsilon, DELTA, G_PHI, SMOOTH, gap, cross=G_PHI,
                                 strong_concavity=MU, y_range=Y_RANGE, y_dim=1)


def fair_grid(method: str, n: int, dimension: int, epsilon: float, gap: float, lrs=LR_GRID,
              fractions=ROUND_FRACTIONS) -> list[Protocol]:
    """The fair tuning's candidates for ``method``: every x-step of ``lrs`` with every ``ceil(f R)`` rounds,
    ``f`` in ``fractions`` and ``R`` the theorem's; ``T`` re-derived for those rounds (PrivateDiff), the
    y-step kept. Each is a function of public inputs only (``n``, ``d``, ``eps``, the public ``gap``);
    its noise is calibrated when it is run (:func:`evaluate`)."""
    base = schedule(method, n, dimension, epsilon, gap)
    out = []
    for lr in lrs:
        for fraction in fractions:
            rounds = max(1, math.ceil(base.rounds * fraction))
            restart = 1 if method == "DP-SGDA" else restart_period(base.tau, rounds)
            out.append(Protocol(rounds, restart, float(lr), base.tau, base.bound, base.noise_constant,
                                base.lr_y))
    return out


def tune_fair(method: str, tuner: MinimaxPlanted, n: int, dimension: int, epsilon: float, gap: float,
              lrs=LR_GRID, fractions=ROUND_FRACTIONS) -> tuple[Protocol, dict[str, float]]:
    """The candidate of :func:`fair_grid` with the lowest median ``||grad Phi||`` on the held-out ``tuner``
    instances (each run at its own calibrated noise), and every candidate's score keyed ``"lr,R"``. Only
    ``tuner`` is read: the evaluation instances never reach this function."""
    scores: dict[str, float] = {}
    best, best_score = None, math.inf
    for i, plan in enumerate(fair_grid(method, n, dimension, epsilon, gap, lrs, fractions)):
        result = evaluate(method, tuner, n, plan, epsilon, 20_000 + i)
        score = float(np.median(result["norms"]))
        scores[f"{plan.lr:.6g},{plan.rounds}"] = score
        if score < best_score:
            best, best_score = plan, score
    assert best is not None, "an empty grid"
    return best, scores


def _noise(method: str, n: int, protocol: Protocol, epsilon: float) -> tuple[dict[str, float], float]:
    if method == "DP-SGDA":
        plan = DPSGDAPlan(n, n, protocol.rounds, "full")
    else:
        plan = PrivateDiffPlan(n, n, protocol.rounds, protocol.restart, 5, "full", y_release="output")
    noise = calibrate(plan, epsilon, DELTA, accountant="pld")
    return dict(noise), account(plan(noise), DELTA, "pld").epsilon


def evaluate(method: str, problem: MinimaxPlanted, n: int, protocol: Protocol, epsilon: float,
             seed: int) -> dict[str, Any]:
    """Runs ``method`` at ``protocol`` on every instance: ``||grad Phi(x_R)||``, capped rounds, the noise
    multipliers and the epsilon the accountant (PLD) reports for the releases made."""
    rng = np.random.default_rng(derive_seed(seed, n, int(epsilon * 1000), 10 + METHODS.index(method)))
    noise, spent = _noise(method, n, protocol, epsilon)
    if method == "DP-SGDA":
        x = run_dpsgda(problem, n, protocol.rounds, protocol.lr, protocol.lr_y, noise, rng)
        capped = np.zeros(len(x), dtype=np.int64)
    else:
        noise.setdefault("difference", 0.0)
        x, capped = run_private_diff(problem, n, protocol.rounds, protocol.restart, protocol.lr, noise,
                                     offset(n, noise["y"]), rng)
    # Phi = F^2 / 2 with F >= 0: F orders the iterates as Phi does
    norms, escaped = regime.scored(x, problem.value, problem.primal_gradient)
    return {"norms": norms, "escaped": escaped, "capped": capped, "noise": noise, "spent": float(spent)}


def theory_crossover(dimension: int, epsilon: float, gap: float) -> float:
    """The ``n eps / sqrt(d)`` where the two protocols' bounds are equal (``nan`` when PrivateDiff's is below
    DP-SGDA's nowhere in ``[10, 1e12]``, or everywhere)."""
    def below(n: int) -> bool:
        return schedule("PrivateDiff", n, dimension, epsilon, gap).bound < \
            schedule("DP-SGDA", n, dimension, epsilon, gap).bound

    return regime.crossing(below, dimension, epsilon)


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)
    sizes = list(args.n or (QUICK_SIZES if quick else SIZES))
    epsilons = list(args.epsilon or ((1.0, 4.0) if quick else regime.EPSILONS))
    seeds = list(range(args.seeds or (3 if quick else 5)))
    d, m = args.dimension, args.atoms
    # --grid: the fair tuning's x-steps (none or one value: no tuning)
    grid = list((QUICK_LR_GRID if quick else LR_GRID) if args.grid is None else args.grid)
    fractions = (1 / 4, 1.0) if quick else ROUND_FRACTIONS
    tuning = [1000 + s for s in range(args.tuning_seeds)] if len(grid) > 1 else []
    problem = MinimaxPlanted.planted(seeds, d, m)
    tuner = MinimaxPlanted.planted(tuning, d, m) if tuning else None
    gaps = problem.value(np.zeros_like(problem.solution)) ** 2 / 2  # Phi(x0) - min Phi, exact
    gap = float(gaps.max())
    protocols = ("theorem", "fair") if tuning else ("theorem",)
    records: list[Record] = []
    norms: dict[tuple[str, str, float], list[np.ndarray]] = {}
    with progress(len(sizes) * len(epsilons) * len(METHODS) * len(protocols), f"{NAME}: d={d}") as bar:
        for epsilon in epsilons:
            for n in sizes:
                for method in METHODS:
                    for protocol_name in protocols:
                        plan, scores = schedule(method, n, d, epsilon, gap), {}
                        if protocol_name == "fair":
                            plan, scores = tune_fair(method, tuner, n, d, epsilon, gap, grid, fractions)
                        result = evaluate(method, problem, n, plan, epsilon, 0)
                        label = f"{method} ({protocol_name})"
                        norms.setdefault((label, "", epsilon), []).append(result["norms"])
                        for i, seed in enumerate(seeds):
                            metrics = {
                                "grad_norm": float(result["norms"][i]), "escaped": bool(result["escaped"][i]),
                                "n": n, "dimension": d, "coordinate": n * epsilon / math.sqrt(d),
                                "rounds": plan.rounds, "restart": plan.restart, "lr": plan.lr,
                                "lr_y": plan.lr_y, "tau": plan.tau, "bound": plan.bound,
                                "noise": result["noise"],
                                "capped_rounds": int(result["capped"][i]), "gap": float(gaps[i]),
                                "tuning_scores": scores,
                            }
                            records.append(Record(label, f"minimax-planted-d{d}", epsilon, DELTA, seed,
                                                  result["spent"], metrics))
                        bar.update(1)
    summary = summarise(norms, sizes, epsilons, d, gap, protocols)
    config = {"quick": quick, "sizes": sizes, "epsilons": epsilons, "seeds": seeds, "dimension": d,
              "atoms": m, "lr_grid": grid, "round_fractions": list(fractions), "tuning_seeds": tuning,
              "delta": DELTA, "gap": gap,
              "lipschitz": G_PHI, "cross": CROSS, "smoothness": SMOOTH, "strong_concavity": MU,
              "summary": summary}
    doc = document(NAME, config, records)
    os.makedirs(args.out, exist_ok=True)
    paths = save(doc, records, args.out)
    regime.print_tables(summary, norms, sizes, epsilons, d)
    paths.append(regime.plot(os.path.join(args.out, f"{NAME}.png"), norms, sizes, epsilons, d, summary,
                             methods=METHODS, measure="||grad Phi(x_R)||"))
    print("wrote " + ", ".join(paths))
    return doc


def summarise(norms, sizes, epsilons, d, gap, protocols=("theorem",)) -> dict[str, Any]:
    """Exponents per method, protocol and epsilon; the crossover per protocol (all epsilons pooled) and the
    theory's per epsilon."""
    return regime.summarise(norms, sizes, epsilons, d, gap, protocols, methods=METHODS,
                            theory=lambda e: theory_crossover(d, e, gap))
