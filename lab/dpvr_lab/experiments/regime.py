"""Where DIFF2 wins: DIFF2-GD against DP-GD on a smooth nonconvex finite sum whose constants are known.

The problem (:class:`Problem`): ``f(x) = (1/n) sum_i phi(a_i^T x - b_i)`` with ``phi(t) = t^2 / (1 + t^2)``
(bounded, nonconvex for ``|t| > 1/sqrt(3)``), unit-norm ``a_i`` and ``b_i = a_i^T x*`` for a planted ``x*``.
Its constants are exact: every per-sample gradient has norm at most ``G = max|phi'| = 3 sqrt(3) / 8``, every
per-sample gradient is ``L = max|phi''| = 2``-smooth, ``f* = f(x*) = 0``, so ``f(x0) - f* = f(x0)``
(``x0 = 0``). The ``n`` records are ``m`` distinct atoms ``(a_j, b_j)``, each repeated ``n / m`` times: the
objective is the same function at every ``n``, so only the privacy noise (which scales as ``1/n``) changes
with ``n``, and a full-batch round costs ``O(m d)`` whatever ``n``. That is what makes ``n`` up to ``10^6``
and beyond reachable; it is also the honest scope: the located regime is the noise's, on one objective.

Methods, each at the theorem's protocol and at a tuned one, five paired seeds (a seed draws the atoms,
``x*`` and the noise; both methods see the same problem):

- ``DIFF2-GD (theorem)``: ``R``, ``T``, ``eta`` from the proof of Theorem 4.3 with the accountant's noise
  constant (:func:`dpvr.trainer.defaults.diff2_protocol`, ``C1 = G``, ``C2 = L``, the exact ``f(x0)``);
- ``DP-GD (theorem)``: its own optimal ``R`` with ``eta = 1/L`` (:func:`dpvr.trainer.defaults.dpgd_protocol`);
- ``... (tuned)``: the step multiplied by ``k`` in a public grid (default 1, 4, 16) with ``R / k`` rounds (the
  same ``eta R``), ``T`` re-derived, the ``k`` with the lowest median on two held-out tuning seeds kept. This
  is a public grid on held-out seeds of the same synthetic family, not a private selection.

Noise multipliers come from dpvr's own calibration of each run's plan (``DIFF2Plan``, ``DPSGDPlan`` with full
batches, PLD, replace-one) and every release is priced as the library prices it; the updates are an exact
replica of :class:`dpvr.algorithms.DIFF2` and :class:`dpvr.algorithms.DPGD` on these closed-form gradients
(checked against the library on small ``n`` in the tests), vectorised over seeds. The metric is the exact
``||grad f(x_R)||`` at the last iterate.

Output: per ``(method, n, epsilon)`` the median gradient norm; per method and epsilon the exponent of the
norm in ``n`` (theory: ``-2/3`` for DIFF2, ``-1/2`` for DP-GD) with a 95% bootstrap interval over seeds; the
paired ratio DIFF2 / DP-GD against the coordinate ``n epsilon / sqrt(d)`` and the coordinate where the
fitted ratio crosses 1 (with its interval), beside the crossover the theorems' bounds predict; a PNG of the
norm against ``n epsilon / sqrt(d)`` with the fitted lines.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpvr.algorithms import DIFF2Plan, DPSGDPlan
from dpvr.privacy.accountant import account
from dpvr.privacy.calibration import calibrate
from dpvr.results import Record, document, format_table, write_figure
from dpvr.trainer.defaults import Protocol, diff2_protocol, diff2_tau, dpgd_protocol, restart_period

from .common import derive_seed, progress, save

NAME = "regime"
DELTA = 1e-6
EPSILONS = (0.5, 1.0, 4.0)
SIZES = (10_000, 31_623, 100_000, 316_228, 1_000_000)
QUICK_SIZES = (4_000, 16_000, 64_000)
GRID = (1.0, 4.0, 16.0)
G_PHI = 3 * math.sqrt(3) / 8  # max |phi'(t)|, at t = 1/sqrt(3)
L_PHI = 2.0  # max |phi''(t)|, at t = 0
METHODS = ("DIFF2-GD", "DP-GD")


def phi(t: np.ndarray) -> np.ndarray:
    return t * t / (1 + t * t)


def dphi(t: np.ndarray) -> np.ndarray:
    return 2 * t / (1 + t * t) ** 2


def d2phi(t: np.ndarray) -> np.ndarray:
    return (2 - 6 * t * t) / (1 + t * t) ** 3


@dataclass
class Problem:
    """``S`` independent instances (one per seed) of the planted robust-regression sum, stacked.

    ``atoms`` ``(S, m, d)`` unit rows, ``targets`` ``(S, m)``, ``solution`` ``(S, d)`` (``x*``). Constants:
    per sample, ``lipschitz`` (G) bounds every gradient's norm, ``smoothness`` (L) every Hessian's;
    ``f* = 0``.
    """

    atoms: np.ndarray
    targets: np.ndarray
    solution: np.ndarray
    lipschitz: float = G_PHI
    smoothness: float = L_PHI

    @classmethod
    def planted(cls, seeds: list[int], dimension: int, atoms: int, scale: float = 2.0) -> Problem:
        """``a_j`` uniform on the sphere, ``x* = scale sqrt(d) u`` with ``u`` uniform on it (so the residuals
        at ``x0 = 0`` are about ``N(0, scale^2)``: most atoms start in ``phi``'s nonconvex region)."""
        a, xs = [], []
        for seed in seeds:
            rng = np.random.default_rng(derive_seed(seed, 7))
            rows = rng.standard_normal((atoms, dimension))
            a.append(rows / np.linalg.norm(rows, axis=1, keepdims=True))
            u = rng.standard_normal(dimension)
            xs.append(scale * math.sqrt(dimension) * u / np.linalg.norm(u))
        a_, x_ = np.stack(a), np.stack(xs)
        return cls(a_, np.einsum("smd,sd->sm", a_, x_), x_)

    def residuals(self, x: np.ndarray) -> np.ndarray:
        return np.matmul(self.atoms, x[:, :, None])[:, :, 0] - self.targets

    def mean(self, weights: np.ndarray) -> np.ndarray:
        """``(1/m) sum_j w_j a_j`` per instance: the full-batch mean of per-sample terms ``w_j a_j``."""
        return np.matmul(weights[:, None, :], self.atoms)[:, 0, :] / self.atoms.shape[1]

    def value(self, x: np.ndarray) -> np.ndarray:
        return phi(self.residuals(x)).mean(axis=1)

    def gradient(self, x: np.ndarray) -> np.ndarray:
        return self.mean(dphi(self.residuals(x)))


def _noise_diff2(n: int, rounds: int, restart: int, epsilon: float) -> tuple[dict[str, float], float]:
    """DIFF2's calibrated noise multipliers and the epsilon the accountant reports for them."""
    plan = DIFF2Plan(n, 1, rounds, restart)
    if plan.restarts == rounds:  # T = 1: every round a restart, one stream (the plan's other one is idle)
        gd = DPSGDPlan(steps=rounds, sampling="full", dataset_size=n)
        z = calibrate(gd, epsilon, DELTA, accountant="pld")["gradient"]
        return {"restart": z, "difference": 0.0}, account(gd({"gradient": z}), DELTA, "pld").epsilon
    noise = calibrate(plan, epsilon, DELTA, accountant="pld")
    return noise, account(plan(noise), DELTA, "pld").epsilon


def run_diff2(problem: Problem, n: int, rounds: int, restart: int, lr: float, noise: dict[str, float],
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """DIFF2-GD (one client) on every instance; returns ``(x_R, capped)``: the last iterates and, per
    instance, how many difference rounds hit the radius cap ``2 C1``.

    The replica of :class:`dpvr.algorithms.DIFF2` (routine ``"gd"``): restart rounds release the mean of
    per-sample gradients clipped at ``C1 = G`` plus ``N(0, (z1 C1 / n)^2)``; difference rounds add the mean
    of same-sample differences clipped at ``min(C2 ||x_{r-1} - x_{r-2}||, 2 C1)`` (``C2 = L``) plus noise of
    std ``z2`` times that radius over ``n``; then ``x <- x - eta v``. With unit-norm atoms a per-sample term
    ``w a_j`` has norm ``|w|``, so clipping it is clipping the scalar. A record repeated ``n / m`` times
    contributes its clipped term that many times: the mean over ``n`` records is the mean over the atoms.
    """
    c1, c2, cap = problem.lipschitz, problem.smoothness, 2 * problem.lipschitz
    s, d = problem.solution.shape
    x = np.zeros((s, d))
    v = np.zeros((s, d))
    slope_prev = None
    move = np.zeros(s)
    capped = np.zeros(s, dtype=np.int64)
    for r in range(1, rounds + 1):
        slope = dphi(problem.residuals(x))
        if (r - 1) % restart == 0:
            noise_std = noise["restart"] * c1 / n
            v = problem.mean(np.clip(slope, -c1, c1)) + rng.standard_normal((s, d)) * noise_std
        else:
            wanted = c2 * move
            radius = np.minimum(wanted, cap)
            capped += wanted > cap
            delta = np.clip(slope - slope_prev, -radius[:, None], radius[:, None])
            noise_std = (noise["difference"] * radius / n)[:, None]
            v = v + problem.mean(delta) + rng.standard_normal((s, d)) * noise_std
        step = lr * v
        x = x - step
        move = np.linalg.norm(step, axis=1)
        slope_prev = slope
    return x, capped


def run_dpgd(problem: Problem, n: int, rounds: int, lr: float, noise: float,
             rng: np.random.Generator) -> np.ndarray:
    """DP-GD on every instance (the replica of :class:`dpvr.algorithms.DPGD`): the full-batch mean of
    per-sample gradients clipped at ``C = G`` plus ``N(0, (z C / n)^2)``, then ``x <- x - eta v``."""
    c = problem.lipschitz
    s, d = problem.solution.shape
    x = np.zeros((s, d))
    for _ in range(rounds):
        clipped = np.clip(dphi(problem.residuals(x)), -c, c)
        v = problem.mean(clipped) + rng.standard_normal((s, d)) * (noise * c / n)
        x = x - lr * v
    return x


def schedule(method: str, n: int, dimension: int, epsilon: float, gap: float, multiplier: float = 1.0,
             problem: Problem | None = None) -> Protocol:
    """The theorem's protocol of ``method``, its step multiplied by ``multiplier`` with ``R / multiplier``
    rounds (``T`` re-derived for those rounds)."""
    g, lip = (problem.lipschitz, problem.smoothness) if problem is not None else (G_PHI, L_PHI)
    if method == "DP-GD":
        base = dpgd_protocol(n, 1, dimension, epsilon, DELTA, g, lip, gap)
        rounds = max(1, math.ceil(base.rounds / multiplier))
        return Protocol(rounds, 1, base.lr * multiplier, 0.0, base.bound, base.noise_constant)
    base = diff2_protocol(n, 1, dimension, epsilon, DELTA, g, lip, gap)
    rounds = max(1, math.ceil(base.rounds / multiplier))
    tau = diff2_tau(n, dimension, base.noise_constant, g, lip, gap)
    restart = restart_period(tau, rounds)
    return Protocol(rounds, restart, base.lr * multiplier, tau, base.bound, base.noise_constant)


def scored(x: np.ndarray, value: Callable[[np.ndarray], np.ndarray],
           gradient: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The last iterates' gradient norms and which runs ``escaped``: ``phi`` is flat far from ``x*``, so a run
    thrown out there has a vanishing gradient at an objective above its start's (``x0 = 0``), which is not
    the stationary point the theorems mean. Such a run, or one whose norm is not finite, counts as no
    progress: its norm is the start's, so neither the tables nor the tuning reward it."""
    start = np.zeros_like(x)
    norms = np.linalg.norm(gradient(x), axis=1)
    escaped = ~(value(x) <= value(start)) | ~np.isfinite(norms)
    return np.where(escaped, np.linalg.norm(gradient(start), axis=1), norms), escaped


def evaluate(method: str, problem: Problem, n: int, protocol: Protocol, epsilon: float,
             seed: int) -> dict[str, Any]:
    """Runs ``method`` at ``protocol`` on every instance: the final gradient norms (:func:`scored`), which
    runs escaped, the difference rounds capped, the noise multipliers and the epsilon the accountant (PLD)
    reports for the releases made."""
    rng = np.random.default_rng(derive_seed(seed, n, int(epsilon * 1000), METHODS.index(method)))
    if method == "DP-GD":
        plan = DPSGDPlan(steps=protocol.rounds, sampling="full", dataset_size=n)
        z = calibrate(plan, epsilon, DELTA, accountant="pld")["gradient"]
        x = run_dpgd(problem, n, protocol.rounds, protocol.lr, z, rng)
        capped = np.zeros(len(x), dtype=np.int64)
        noise, spent = {"gradient": z}, account(plan({"gradient": z}), DELTA, "pld").epsilon
    else:
        noise, spent = _noise_diff2(n, protocol.rounds, protocol.restart, epsilon)
        x, capped = run_diff2(problem, n, protocol.rounds, protocol.restart, protocol.lr, noise, rng)
    norms, escaped = scored(x, problem.value, problem.gradient)
    return {"norms": norms, "escaped": escaped, "capped": capped, "noise": noise, "spent": float(spent)}


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


def exponent(sizes: list[int], norms: np.ndarray, rng: np.random.Generator, boots: int = 2000):
    """Least-squares slope of ``log norm`` on ``log n`` (``norms`` ``(len(sizes), seeds)``), with a 95%
    percentile interval from resampling the seeds (the same resampled seeds at every ``n``)."""
    logn = np.log(np.asarray(sizes, dtype=float))
    logy = np.log(norms)
    point = _fit(np.repeat(logn, logy.shape[1]), logy.ravel())[0]
    seeds = logy.shape[1]
    draws = []
    for _ in range(boots):
        pick = rng.integers(0, seeds, seeds)
        draws.append(_fit(np.repeat(logn, seeds), logy[:, pick].ravel())[0])
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return point, float(lo), float(hi)


def crossover(coords: np.ndarray, log_ratios: np.ndarray, rng: np.random.Generator, boots: int = 2000):
    """Where the fitted ``log(DIFF2 / DP-GD)`` against ``log(n eps / sqrt(d))`` crosses 0: ``(X, lo, hi,
    slope)``, the interval from resampling seeds (``log_ratios`` ``(points, seeds)``, paired); ``X`` is an
    extrapolation when it lies outside the measured coordinates, and ``nan`` for a slope that never
    crosses (ratio not falling with the coordinate)."""
    lx = np.log(coords)
    seeds = log_ratios.shape[1]

    def cross(y: np.ndarray) -> tuple[float, float]:
        slope, intercept = _fit(np.repeat(lx, y.shape[1]), y.ravel())
        return (math.exp(-intercept / slope) if slope < 0 else math.nan), slope

    point, slope = cross(log_ratios)
    draws = [cross(log_ratios[:, rng.integers(0, seeds, seeds)])[0] for _ in range(boots)]
    draws = np.asarray(draws)
    finite = draws[np.isfinite(draws)]
    lo, hi = (np.percentile(finite, [2.5, 97.5]) if len(finite) > boots // 2 else (math.nan, math.nan))
    return point, float(lo), float(hi), slope


def crossing(below: Callable[[int], bool], dimension: int, epsilon: float, low: float = 10.0,
             high: float = 1e12) -> float:
    """The ``n eps / sqrt(d)`` from which the variance-reduced method's bound is below the baseline's
    (``below(n)``), bisected on ``n`` in ``[low, high]`` to 0.1%. When its bound is below everywhere there the
    answer is at most ``low``'s coordinate, which is returned (read it as "below the smallest n searched");
    ``nan`` when it is below nowhere."""
    if below(round(low)) == below(round(high)):
        return low * epsilon / math.sqrt(dimension) if below(round(low)) else math.nan
    lo, hi = low, high
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if below(round(mid)) else (mid, hi)
        if hi / lo < 1.001:
            break
    return hi * epsilon / math.sqrt(dimension)


def theory_crossover(dimension: int, epsilon: float, gap: float) -> float:
    """The ``n eps / sqrt(d)`` where the two theorems' bounds (:class:`Protocol.bound`) are equal."""
    def below(n: int) -> bool:
        return (diff2_protocol(n, 1, dimension, epsilon, DELTA, G_PHI, L_PHI, gap).bound
                < dpgd_protocol(n, 1, dimension, epsilon, DELTA, G_PHI, L_PHI, gap).bound)

    return crossing(below, dimension, epsilon)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--paper", choices=("diff2", "private-diff", "diff2-real", "spider"),
                        default="diff2",
                        help="diff2: DIFF2-GD vs DP-GD (default); private-diff: PrivateDiff vs DP-SGDA on an "
                             "NC-SC minimax problem (dpvr_lab.experiments.regime_minimax); diff2-real: "
                             "DIFF2-GD vs DP-GD on MNIST-1D records (dpvr_lab.experiments.regime_real); "
                             "spider: Recursive-SPIDER vs DP-SGD on the dual, KL-DRO "
                             "(dpvr_lab.experiments.regime_dro)")
    parser.add_argument("--n", type=int, nargs="+", metavar="N", help="dataset sizes (default: 1e4 to 1e6)")
    parser.add_argument("--dimension", type=int, default=10, metavar="D", help="dimension d (default 10)")
    parser.add_argument("--atoms", type=int, default=500, metavar="M", help="distinct records (default 500)")
    parser.add_argument("--grid", type=float, nargs="*", metavar="K",
                        help="step multipliers of the tuned protocol (default 1 4 16; none: no tuning)")
    parser.add_argument("--tuning-seeds", type=int, default=2, metavar="N",
                        help="held-out seeds the tuned protocol selects on (default 2)")


def tune_multiplier(evaluate, schedule, method: str, tuner, n: int, d: int, epsilon: float, gap: float,
                    grid) -> tuple[float, dict[float, float]]:
    """The step multiplier ``k`` of ``grid`` whose schedule gives the lowest median gradient norm on the
    held-out ``tuner`` instances (a public grid on public instances), and every ``k``'s score."""
    scores = {}
    for k in grid:
        result = evaluate(method, tuner, n, schedule(method, n, d, epsilon, gap, k), epsilon,
                          10_000 + int(k * 100))
        scores[k] = float(np.median(result["norms"]))
    return min(scores, key=scores.get), scores


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "paper", "diff2") == "private-diff":
        from . import regime_minimax

        return regime_minimax.run(args)
    if getattr(args, "paper", "diff2") == "diff2-real":
        from . import regime_real

        return regime_real.run(args)
    if getattr(args, "paper", "diff2") == "spider":
        from . import regime_dro

        return regime_dro.run(args)
    quick = bool(args.quick)
    sizes = list(args.n or (QUICK_SIZES if quick else SIZES))
    epsilons = list(args.epsilon or ((1.0, 4.0) if quick else EPSILONS))
    seeds = list(range(args.seeds or (3 if quick else 5)))
    grid = list((1.0, 4.0) if quick and args.grid is None else GRID if args.grid is None else args.grid)
    d, m = args.dimension, args.atoms
    tuning = [1000 + s for s in range(args.tuning_seeds)] if len(grid) > 1 else []
    problem = Problem.planted(seeds, d, m)
    tuner = Problem.planted(tuning, d, m) if tuning else None
    gaps = problem.value(np.zeros_like(problem.solution))  # f(x0) - f*, exact (f* = 0)
    gap = float(gaps.max())  # one public constant per run: the largest over the instances (an upper bound)
    protocols = ("theorem", "tuned") if tuning else ("theorem",)
    total = len(sizes) * len(epsilons) * len(METHODS) * len(protocols)
    records: list[Record] = []
    norms: dict[tuple[str, str, float], list[np.ndarray]] = {}
    with progress(total, f"{NAME}: d={d}") as bar:
        for epsilon in epsilons:
            for n in sizes:
                for method in METHODS:
                    for protocol_name in protocols:
                        multiplier, scores = 1.0, {}
                        if protocol_name == "tuned":
                            multiplier, scores = tune_multiplier(evaluate, schedule, method, tuner, n, d,
                                                                 epsilon, gap, grid)
                        plan = schedule(method, n, d, epsilon, gap, multiplier)
                        result = evaluate(method, problem, n, plan, epsilon, 0)
                        label = f"{method} ({protocol_name})"
                        norms.setdefault((label, "", epsilon), []).append(result["norms"])
                        for i, seed in enumerate(seeds):
                            metrics = {
                                "grad_norm": float(result["norms"][i]), "escaped": bool(result["escaped"][i]),
                                "n": n, "dimension": d, "coordinate": n * epsilon / math.sqrt(d),
                                "rounds": plan.rounds, "restart": plan.restart, "lr": plan.lr,
                                "multiplier": multiplier,
                                "tau": plan.tau, "bound": plan.bound, "noise": result["noise"],
                                "capped_rounds": int(result["capped"][i]), "gap": float(gaps[i]),
                                "tuning_scores": {str(k): v for k, v in scores.items()},
                            }
                            records.append(Record(label, f"planted-d{d}", epsilon, DELTA, seed,
                                                  result["spent"], metrics))
                        bar.update(1)
    summary = summarise(norms, sizes, epsilons, d, gap, protocols)
    config = {"quick": quick, "sizes": sizes, "epsilons": epsilons, "seeds": seeds, "dimension": d,
              "atoms": m, "grid": grid, "tuning_seeds": tuning, "delta": DELTA, "gap": gap,
              "lipschitz": G_PHI, "smoothness": L_PHI, "summary": summary}
    doc = document(NAME, config, records)
    os.makedirs(args.out, exist_ok=True)
    paths = save(doc, records, args.out)
    print_tables(summary, norms, sizes, epsilons, d)
    paths.append(plot(os.path.join(args.out, f"{NAME}.png"), norms, sizes, epsilons, d, summary))
    print("wrote " + ", ".join(paths))
    return doc


def summarise(norms, sizes, epsilons, d, gap, protocols, methods=METHODS, theory=None) -> dict[str, Any]:
    """Exponents per method, protocol and epsilon; the crossover of ``methods[0]`` against ``methods[1]`` per
    protocol (all epsilons pooled), beside ``theory(epsilon)`` (default: DIFF2's against DP-GD's bound)."""
    theory = theory or (lambda e: theory_crossover(d, e, gap))
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"exponents": [], "crossovers": []}
    for (label, _, epsilon), per_n in sorted(norms.items()):
        point, lo, hi = exponent(sizes, np.stack(per_n), rng)
        out["exponents"].append({"method": label, "epsilon": epsilon, "exponent": point, "lo": lo, "hi": hi})
    for protocol in protocols:
        coords, ratios = [], []
        for epsilon in epsilons:
            a = np.stack(norms[(f"{methods[0]} ({protocol})", "", epsilon)])
            b = np.stack(norms[(f"{methods[1]} ({protocol})", "", epsilon)])
            coords += [n * epsilon / math.sqrt(d) for n in sizes]
            ratios.append(np.log(a / b))
        point, lo, hi, slope = crossover(np.asarray(coords), np.concatenate(ratios), rng)
        wins = [(c, float(np.exp(np.median(r)))) for c, r in zip(coords, np.concatenate(ratios))]
        out["crossovers"].append({
            "protocol": protocol, "coordinate": point, "lo": lo, "hi": hi, "slope": slope,
            "measured_from": min(coords), "measured_to": max(coords),
            "median_ratio_at": wins,
            "theory": {str(e): theory(e) for e in epsilons},
        })
    return out


def print_tables(summary, norms, sizes, epsilons, d) -> None:
    rows = []
    for (label, _, epsilon), per_n in sorted(norms.items()):
        rows.append([label, epsilon, *[float(np.median(x)) for x in per_n]])
    print(format_table(["method", "epsilon", *[f"n={n}" for n in sizes]], rows))
    print()
    print(format_table(["method", "epsilon", "exponent in n", "95% interval"],
                       [[e["method"], e["epsilon"], e["exponent"], f"[{e['lo']:.3f}, {e['hi']:.3f}]"]
                        for e in summary["exponents"]]))
    print()
    print(format_table(
        ["protocol", "crossover n eps/sqrt(d)", "95% interval", "measured range", "theory (per eps)"],
        [[c["protocol"], c["coordinate"], f"[{c['lo']:.3g}, {c['hi']:.3g}]",
          f"{c['measured_from']:.3g}-{c['measured_to']:.3g}",
          ", ".join(f"{e}: {v:.3g}" for e, v in c["theory"].items())] for c in summary["crossovers"]]))


def plot(path: str, norms, sizes, epsilons, d, summary, methods=METHODS, measure="||grad f(x_R)||") -> str:
    from matplotlib.figure import Figure

    protocols = sorted({label.split(" (")[1][:-1] for (label, _, _) in norms})
    fig = Figure(figsize=(5.5 * len(protocols), 4.2), layout="tight")
    axes = fig.subplots(1, len(protocols), squeeze=False)[0]
    markers = {e: mk for e, mk in zip(sorted(epsilons), "osD^v")}
    for ax, protocol in zip(axes, protocols):
        for method, colour in zip(methods, ("C3", "C0")):
            xs, ys = [], []
            for epsilon in epsilons:
                per_n = np.stack(norms[(f"{method} ({protocol})", "", epsilon)])
                coord = np.asarray(sizes) * epsilon / math.sqrt(d)
                ax.scatter(coord, np.median(per_n, axis=1), color=colour, marker=markers[epsilon], s=22,
                           label=f"{method}, eps={epsilon:g}")
                xs += list(np.repeat(np.log(coord), per_n.shape[1]))
                ys += list(np.log(per_n).ravel())
            slope, intercept = _fit(np.asarray(xs), np.asarray(ys))
            grid = np.linspace(min(xs), max(xs), 50)
            ax.plot(np.exp(grid), np.exp(intercept + slope * grid), color=colour, lw=1.2,
                    label=f"{method} fit: slope {slope:.2f}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("n eps / sqrt(d)")
        ax.set_ylabel(f"{measure} (median of seeds)")
        ax.set_title(f"{protocol} protocol, d={d}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    write_figure(path, fig, dpi=120)
    return path
