"""Does DIFF2's located crossover predict real data? DIFF2-GD against DP-GD on MNIST-1D records.

The planted experiment (:mod:`dpvr_lab.experiments.regime`) located the crossover of DIFF2-GD and DP-GD at
``n eps / sqrt(d) ~ 1.8e5`` (95% interval ``[1.2e5, 3.0e5]``, d = 10, theorems' protocols). This one asks
whether that coordinate carries over to a loss on real records, with the same per-sample constants and the
same protocols, so that only the data differ.

**Records.** MNIST-1D (:func:`dpvr.data.mnist1d.load_mnist1d`, generated locally by ``mnist1d``'s
``make_dataset``; never its download). Each record's 40 inputs go through a data-independent map: a fixed
Gaussian projection to ``d - 1`` coordinates (its seed :data:`PROJECTION_SEED` is public, nothing is fitted
on any record), a constant coordinate 1 appended (a bias), the row scaled to unit norm. The target is a
one-vs-rest label ``b = +1`` for the digit :data:`LABEL`, ``-1`` otherwise.

**Loss.** ``f(x) = (1/n) sum_i phi(a_i^T x - b_i)``, ``phi(t) = t^2 / (1 + t^2)``: with ``|b| = 1`` this is
``phi(1 - b a^T x)``, the margin loss of a linear one-vs-rest classifier, bounded in ``[0, 1)`` and
nonconvex. Per sample (``||a_i|| = 1``): ``||grad|| <= G = max|phi'| = 3 sqrt(3) / 8`` and the gradient is
``L = max|phi''| = 2``-Lipschitz, the planted problem's constants (tested). ``f* >= 0`` is unknown; at
``x0 = 0`` every record's loss is ``phi(1) = 1/2``, so ``f(x0) - f* <= 1/2`` is the public gap
(:data:`GAP`) the theorems' protocols take.

**Sizes.** As in the planted experiment, the ``n`` records are ``m`` distinct records repeated ``n / m``
times (``m = --atoms``, default 500; seed ``s`` takes records ``s m .. (s+1) m - 1`` of the training split,
disjoint across seeds): the objective is the same at every ``n`` and only the privacy noise changes with
``n``, which is what the coordinate measures; a full-batch round costs ``O(m d)``. A data set of ``n``
*distinct* records costs ``O(n d)`` a round and DIFF2's theorem ``R`` grows as ``n^(4/3)``: out of reach
above ``n ~ 10^4`` here (:func:`estimate_seconds`).

**Methods.** DIFF2-GD and DP-GD at their theorems' protocols (:func:`dpvr.trainer.defaults.diff2_protocol`
and :func:`~dpvr.trainer.defaults.dpgd_protocol` through :func:`dpvr_lab.experiments.regime.schedule`),
noise from dpvr's PLD calibration of each run's plan (delta = 1e-6, replace-one), the updates the planted
experiment's numpy replicas of :class:`dpvr.algorithms.DIFF2` and :class:`dpvr.algorithms.DPGD`, vectorised
over five paired seeds (a seed draws the records and the noise; both methods see the same records). No tuning:
the question is whether the theorems' protocols cross where the planted problem says.

**Measures.** ``||grad f(x_R)||`` on the run's records (a diagnostic of the private training data, not a
release: :mod:`dpvr_lab.experiments.common`) and the accuracy of ``sign(a^T x_R)`` on the fixed MNIST-1D test
split (not private). Output: the median norms, the paired ratio DIFF2 / DP-GD per cell with its one-sided
paired t-test, the exponents in ``n``, the fitted crossover beside the planted one, and a PNG.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np

from dpvr.algorithms import DPSGDPlan
from dpvr.data.mnist1d import load_mnist1d
from dpvr.privacy.accountant import account
from dpvr.privacy.calibration import calibrate
from dpvr.results import Record, document, format_table

from . import regime
from .common import derive_seed, diagnostic, one_sided_ttest, progress, record_metrics, save
from .regime import G_PHI, L_PHI, Problem

NAME = "regime-real"
PROJECTION_SEED = 20_240_044  # public: the projection is drawn from it, never fitted on records
LABEL = 0  # the one-vs-rest digit
GAP = 0.5  # f(x0) = phi(1) = 1/2 for every record and f* >= 0: a public bound on f(x0) - f*
SIZES = regime.SIZES
QUICK_SIZES = (4_000, 16_000)
EPSILONS = regime.EPSILONS
PLANTED_CROSSOVER = (1.8e5, 1.2e5, 3.0e5)  # regime at d = 10, theorem protocol (docs/experiments.md)
SECONDS_PER_ROUND = 2.4e-9  # per seed and record coordinate, one core (measured ~60 us at 5 x 500 x 10)


def projection(dimension: int) -> np.ndarray:
    """The fixed ``40 x (dimension - 1)`` Gaussian projection (seed :data:`PROJECTION_SEED`, public)."""
    if dimension < 2:
        raise ValueError(f"dimension must be at least 2 (a projection and the bias), got {dimension}")
    rng = np.random.default_rng(PROJECTION_SEED)
    return rng.standard_normal((40, dimension - 1)) / math.sqrt(40)


def features(signals: np.ndarray, dimension: int) -> np.ndarray:
    """Each record's map (no statistic of any other record enters): projection, bias 1, unit norm."""
    z = np.concatenate([signals @ projection(dimension), np.ones((len(signals), 1))], axis=1)
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def targets(labels: np.ndarray, label: int = LABEL) -> np.ndarray:
    return np.where(labels == label, 1.0, -1.0)


def records(seeds: list[int], dimension: int, atoms: int, label: int = LABEL) -> Problem:
    """The instances: seed ``s`` holds training records ``s m .. (s+1) m - 1`` as unit feature rows and
    one-vs-rest targets. ``solution`` is zero (there is no planted optimum); it only fixes the shape."""
    if atoms < 1 or any(s < 0 for s in seeds):
        raise ValueError(f"atoms must be positive and seeds non-negative, got {atoms} and {seeds}")
    pool = load_mnist1d((max(seeds) + 1) * atoms, "train")
    x, y = np.asarray(pool.features), np.asarray(pool.targets)
    rows = [features(x[s * atoms:(s + 1) * atoms], dimension) for s in seeds]
    labels = [targets(y[s * atoms:(s + 1) * atoms], label) for s in seeds]
    return Problem(np.stack(rows), np.stack(labels), np.zeros((len(seeds), dimension)))


def test_accuracy(x: np.ndarray, dimension: int, label: int = LABEL) -> np.ndarray:
    """Accuracy of ``sign(a^T x)`` per instance on the fixed MNIST-1D test split (not the private records)."""
    test = load_mnist1d(1, "test")
    a, b = features(np.asarray(test.features), dimension), targets(np.asarray(test.targets), label)
    return (np.sign(a @ x.T) == b[:, None]).mean(axis=0)


def estimate_seconds(sizes, epsilons, dimension: int, atoms: int,
                     seeds: int) -> dict[tuple[int, float], float]:
    """One core's seconds per ``(n, eps)`` cell (both methods): the theorems' rounds times the measured cost
    of a round of the replicas (:data:`SECONDS_PER_ROUND` per seed and record coordinate, at least 25 us)."""
    per_round = max(25e-6, SECONDS_PER_ROUND * seeds * atoms * dimension)
    out = {}
    for epsilon in epsilons:
        for n in sizes:
            rounds = sum(regime.schedule(m, n, dimension, epsilon, GAP).rounds for m in regime.METHODS)
            out[(n, epsilon)] = rounds * per_round
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)
    sizes = list(args.n or (QUICK_SIZES if quick else SIZES))
    epsilons = list(args.epsilon or ((4.0,) if quick else EPSILONS))
    seeds = list(range(args.seeds or (3 if quick else 5)))
    d, m = args.dimension, args.atoms
    cost = estimate_seconds(sizes, epsilons, d, m, len(seeds))
    print(f"{NAME}: estimated {sum(cost.values()) / 60:.1f} min of one core "
          f"(largest cell {max(cost.values()) / 60:.1f} min)", flush=True)
    problem = records(seeds, d, m)
    records_: list[Record] = []
    norms: dict[tuple[str, str, float], list[np.ndarray]] = {}
    cells = []
    with progress(len(sizes) * len(epsilons) * len(regime.METHODS), f"{NAME}: d={d}") as bar:
        for epsilon in epsilons:
            for n in sizes:
                per_method = {}
                for method in regime.METHODS:
                    plan = regime.schedule(method, n, d, epsilon, GAP, problem=problem)
                    result = evaluate(method, problem, n, plan, epsilon)
                    accuracy = test_accuracy(result["x"], d)
                    per_method[method] = result["norms"]
                    label = f"{method} (theorem)"
                    norms.setdefault((label, "", epsilon), []).append(result["norms"])
                    for i, seed in enumerate(seeds):
                        values = {
                            "grad_norm": float(result["norms"][i]), "escaped": bool(result["escaped"][i]),
                            "test_accuracy": float(accuracy[i]), "n": n, "dimension": d,
                            "coordinate": n * epsilon / math.sqrt(d), "rounds": plan.rounds,
                            "restart": plan.restart, "lr": plan.lr, "tau": plan.tau, "bound": plan.bound,
                            "noise": result["noise"],
                            "capped_rounds": int(result["capped"][i]),
                        }
                        records_.append(Record(label, f"mnist1d-onevsrest{LABEL}-d{d}-m{m}", epsilon,
                                               regime.DELTA, seed, result["spent"],
                                               record_metrics(values, ("grad_norm",))))
                    bar.update(1)
                cells.append(_cell(n, epsilon, d, per_method))
                print(_cell_line(cells[-1]), flush=True)
    summary = regime.summarise(norms, sizes, epsilons, d, GAP, ("theorem",))
    summary["cells"] = cells
    summary["planted_crossover"] = list(PLANTED_CROSSOVER)
    config = {"quick": quick, "sizes": sizes, "epsilons": epsilons, "seeds": seeds, "dimension": d,
              "atoms": m, "label": LABEL, "projection_seed": PROJECTION_SEED, "delta": regime.DELTA,
              "gap": GAP, "lipschitz": G_PHI, "smoothness": L_PHI, "estimated_seconds": sum(cost.values()),
              "summary": summary}
    doc = document(NAME, config, records_)
    os.makedirs(args.out, exist_ok=True)
    paths = save(doc, records_, args.out)
    regime.print_tables(summary, norms, sizes, epsilons, d)
    print()
    print(format_table(["n", "epsilon", "n eps/sqrt(d)", "DIFF2/DP-GD (median paired)", "DIFF2 lower in",
                        "p (one-sided, paired)"],
                       [[c["n"], c["epsilon"], c["coordinate"], c["ratio"], f"{c['wins']}/{c['seeds']}",
                         c["p"]] for c in cells]))
    paths.append(regime.plot(os.path.join(args.out, f"{NAME}.png"), norms, sizes, epsilons, d, summary,
                             measure=diagnostic("||grad f(x_R)||")))
    print("wrote " + ", ".join(paths))
    return doc


def evaluate(method: str, problem: Problem, n: int, plan, epsilon: float) -> dict[str, Any]:
    """Runs ``method`` at ``plan`` on every instance with the planted experiment's replicas and calibration:
    the last iterates, their gradient norms, the capped difference rounds, the noise multipliers and the
    epsilon the accountant (PLD) reports for the releases made."""
    rng = np.random.default_rng(derive_seed(0, n, int(epsilon * 1000), regime.METHODS.index(method)))
    if method == "DP-GD":
        gd = DPSGDPlan(steps=plan.rounds, sampling="full", dataset_size=n)
        noise = dict(calibrate(gd, epsilon, regime.DELTA, accountant="pld"))
        spent = account(gd(noise), regime.DELTA, "pld").epsilon
        x = regime.run_dpgd(problem, n, plan.rounds, plan.lr, noise["gradient"], rng)
        capped = np.zeros(len(x), dtype=np.int64)
    else:
        noise, spent = regime._noise_diff2(n, plan.rounds, plan.restart, epsilon)
        x, capped = regime.run_diff2(problem, n, plan.rounds, plan.restart, plan.lr, noise, rng)
    norms, escaped = regime.scored(x, problem.value, problem.gradient)
    return {"x": x, "norms": norms, "escaped": escaped, "capped": capped, "noise": noise,
            "spent": float(spent)}


def _cell(n: int, epsilon: float, d: int, per_method: dict[str, np.ndarray]) -> dict[str, Any]:
    a, b = per_method["DIFF2-GD"], per_method["DP-GD"]
    return {"n": n, "epsilon": epsilon, "coordinate": n * epsilon / math.sqrt(d),
            "ratio": float(np.exp(np.median(np.log(a / b)))), "wins": int((a < b).sum()), "seeds": len(a),
            "p": one_sided_ttest(np.log(a), np.log(b), paired=True)}


def _cell_line(c: dict[str, Any]) -> str:
    return (f"n={c['n']} eps={c['epsilon']} coordinate={c['coordinate']:.3g}: DIFF2/DP-GD {c['ratio']:.3f} "
            f"({c['wins']}/{c['seeds']} seeds lower, p={c['p']:.3g})")
