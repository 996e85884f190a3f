"""Phased output perturbation ("bring your own algorithm") against DP-SGD / DP-SGDA at equal spent epsilon.

Three problem families, each at several dataset sizes ``n`` and budgets ``epsilon``:

- ``breast_cancer``: L2-regularised logistic regression (DP-SCO); ``phased-SC`` (Algorithm 1) and
  ``phased-C`` (Algorithm 2, ignoring the strong convexity) against ``DP-SGD``; metric: excess empirical
  risk ``F(x~) - F(x*)`` of the regularised objective on the ``n`` samples used. Per seed, a random 10% of
  the records is a public split whose statistics standardise the features (fitted on the private
  records, they would let one record move all the others); the ``n`` private records are drawn from the
  rest, get an intercept and are scaled to unit norm (a per-record map);
- ``quadratic-scsc``: a random SC-SC quadratic saddle problem; ``phased-SCSC`` (Algorithm 3) against
  ``DP-SGDA``; metric: empirical duality gap (closed form);
- ``robust-regression``: ``min_{||x|| <= 1} max_{||y||_inf <= 1} y^T (A x - b)`` on synthetic records with
  outliers, convex-concave; ``phased-CC`` (Algorithms 4 and 5) against ``DP-SGDA``; metric: empirical
  duality gap (closed form).

The phased methods use the paper's ``mu`` and phase count, the certified built-in solvers (tolerance 0.05)
and the analytic Gaussian mechanism with the releases calibrated jointly (``gaussian="tight"``), so each run
spends the target epsilon. The baselines are full-batch noisy (projected) gradient descent / descent-ascent
with per-sample clipping at the problem's Lipschitz constant (so clipping never biases them), noise from
:func:`dpvr.ops.noisy_update`, and a noise multiplier set so that their spent epsilon equals the phased
method's: ``T`` full-batch Gaussian steps with multiplier ``z`` compose to exactly one Gaussian with
``z / sqrt(T)``, so ``z = sqrt(T) z_phased`` for one phased release (``sqrt(T/2) z_phased`` for two). Every
``spent_epsilon`` comes from a replace-one PLD accountant (exact for Gaussian releases; an RDP accountant
would report about 10 % more than the target for a release calibrated by the analytic Gaussian mechanism).
The baselines' schedules are fixed rules, not tuned on the data: DP-SGD takes ``ceil(kappa log n)`` steps of
``1/smoothness``; DP-SGDA takes ``ceil(kappa^2 log n)`` steps of ``mu/smoothness^2`` on the SC-SC problem
and ``ceil(8 sqrt n)`` steps of ``diameter/(L sqrt T)`` with iterate averaging on the C-C one (the
``n^{3/2}`` gradient evaluations the paper quotes for DP-SGDA).

``grad_evals`` counts per-sample gradient evaluations (the phased solvers stop at their certificate, so
theirs depends on the data). It and both metrics are measured on the private records without noise:
diagnostics, not private (``metrics["diagnostics"]``, :mod:`dpvr_lab.experiments.common`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpvr import data
from dpvr.algorithms import DPSGDPlan
from dpvr.algorithms.phased.algorithm import PhasedOutputPerturbation
from dpvr.objectives.phased_problems import LogisticRegression, QuadraticSaddle, RobustRegression
from dpvr.ops import NoiseGenerator, clip_accumulate, noisy_update
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.privacy import Accountant
from dpvr.problems import FiniteSumProblem
from dpvr.results import Record, document, format_table, write_figure

from .common import DIAGNOSTIC_NOTE, derive_seed, diagnostic, format_mean_std, metric, record_metrics, save
from .common import progress as progress_bar

DELTA = 1e-5
_L2 = 0.05  # ridge of the logistic regression: the strong convexity phased-SC and DP-SGD rely on
DIAGNOSTICS = ("excess_risk", "duality_gap", "grad_evals", "grad_evals_per_n")
"""Every metric of a run: all are measured on the private records without noise."""
PREPROCESSING = (
    f"breast_cancer: {data.PublicScaling.description()}; the n private records of a run are drawn from "
    f"the rest, get an intercept and are scaled to unit L2 norm (a per-record map). quadratic-scsc, "
    "robust-regression: synthetic records, each clipped to the problem's norm bound (a per-record map)"
)


@dataclass(frozen=True)
class _Family:
    """A problem family: how to build an instance, its methods, and its metric."""

    dataset: str
    build: Callable[[int, int], FiniteSumProblem]  # (n, seed) -> problem
    methods: tuple[str, ...]
    metric: str


def _split(full: data.Dataset, n: int, seed: int) -> tuple[data.Dataset, data.Dataset]:
    """``(public, private)``: the public split, and ``n`` records drawn from the rest (values unread)."""
    public, rest = data.split_public(full, seed=derive_seed(seed, 0))
    return public, rest.subset(np.random.default_rng(seed).permutation(len(rest))[:n])


def _logistic_problem(full: data.Dataset, n: int, seed: int) -> LogisticRegression:
    public, private = _split(full, n, seed)
    return LogisticRegression.from_dataset(data.PublicScaling.fit(public)(private), l2=_L2)


def _logistic(n: int, seed: int) -> LogisticRegression:
    return _logistic_problem(data.load("breast_cancer"), n, seed)


def _quadratic(n: int, seed: int) -> QuadraticSaddle:
    return QuadraticSaddle.random(n, 5, 5, seed=seed)


def _robust(n: int, seed: int) -> RobustRegression:
    return RobustRegression.synthetic(n, 5, 10, radius=1.0, seed=seed)


FAMILIES = (
    _Family("breast_cancer", _logistic, ("phased-SC", "phased-C", "DP-SGD"), "excess_risk"),
    _Family("quadratic-scsc", _quadratic, ("phased-SCSC", "DP-SGDA"), "duality_gap"),
    _Family("robust-regression", _robust, ("phased-CC", "DP-SGDA"), "duality_gap"),
)
_SIZES = {  # family -> n grid (quick, full); breast_cancer has 512 records besides its public split
    "breast_cancer": ((128, 256, 512), (64, 128, 256, 512)),
    "quadratic-scsc": ((256, 1024, 4096), (256, 1024, 4096, 16384)),
    "robust-regression": ((256, 1024, 4096), (256, 1024, 4096, 16384)),
}
_SETTINGS = {"phased-SC": "sc", "phased-C": "c", "phased-SCSC": "sc-sc", "phased-CC": "c-c"}


def _metric(
    problem: FiniteSumProblem, metric: str, x: np.ndarray, y: np.ndarray | None, reference: float | None
) -> float:
    if metric == "excess_risk":
        return problem.objective(x) - reference
    return problem.duality_gap(x, y)


def _radius(problem: FiniteSumProblem) -> float:
    """The public norm bound D of the paper's mu: a bound on ||x*|| for the ridge logistic regression
    (F(x*) <= F(0) = log 2 gives ||x*|| <= sqrt(2 log 2 / l2)), the domain's largest norm otherwise."""
    if isinstance(problem, LogisticRegression):
        return math.sqrt(2 * math.log(2) / problem.l2)
    return max(problem.domain_x.radius, math.sqrt(problem.dim_y))


_SPENT: dict[str, float] = {}


def _spent(accountant: Accountant) -> float:
    """``accountant.epsilon(DELTA)``, memoised by its ledger: the phased runs of one method and epsilon
    record the same releases at every n and seed, and a PLD query takes a noticeable fraction of a second."""
    key = json.dumps(accountant.state_dict()["ledger"], sort_keys=True)
    if key not in _SPENT:
        _SPENT[key] = accountant.epsilon(DELTA)
    return _SPENT[key]


def _phased(problem: FiniteSumProblem, method: str, epsilon: float, seed: int):
    setting = _SETTINGS[method]
    algorithm = PhasedOutputPerturbation(
        setting,
        gaussian="tight",
        radius=_radius(problem) if setting in ("c", "c-c") else None,
        privacy=PrivacyConfig(epsilon=epsilon, delta=DELTA),
        runtime=RuntimeConfig(
            generator=NoiseGenerator(derive_seed(seed, 1), reproducible=True),
            sampler_seed=derive_seed(seed, 2),
        ),
    )
    result = algorithm.run(problem)
    return result.x, result.y, result.grad_evals, result.noise_multipliers, _spent(result.accountant)


def _project(problem: FiniteSumProblem, z: np.ndarray) -> np.ndarray:
    x = problem.domain_x.project(z[: problem.dim_x])
    return np.concatenate([x, problem.domain_y.project(z[problem.dim_x :])]) if problem.dim_y else x


def _schedule(problem: FiniteSumProblem) -> tuple[int, float, bool]:
    """``(steps, learning rate, average)`` of the baseline (see the module documentation)."""
    n, smooth = problem.n, problem.smoothness + problem.public_smoothness
    mu = min(problem.moduli[: 2 if problem.dim_y else 1])
    if not problem.dim_y:
        return math.ceil(smooth / mu * math.log(n)), 1 / smooth, False
    if mu > 0:
        return math.ceil((smooth / mu) ** 2 * math.log(n)), mu / smooth**2, False
    steps = math.ceil(8 * math.sqrt(n))
    diameter = 2 * math.hypot(problem.domain_x.radius, math.sqrt(problem.dim_y))
    return steps, diameter / (problem.lipschitz * math.sqrt(steps)), True


def _baseline(problem: FiniteSumProblem, phased_noise: dict[str, float], seed: int):
    """Full-batch DP-GD / DP-GDA at the phased method's spent epsilon (see the module documentation)."""
    steps, lr, average = _schedule(problem)
    noise = math.sqrt(steps / sum(z**-2 for z in phased_noise.values()))
    generator = NoiseGenerator(derive_seed(seed, 3), reproducible=True)
    rows, clip = np.arange(problem.n), problem.lipschitz
    z = _project(problem, np.zeros(problem.dim_x + problem.dim_y))
    mean, total, direction = np.zeros_like(z), np.empty_like(z), np.empty_like(z)
    for t in range(steps):
        total[:] = 0.0
        clip_accumulate(problem.sample_operator(z, rows), clip, total)
        total += problem.n * problem.public_operator(z)  # public part: no clipping, no noise needed
        noisy_update(
            direction,
            generator=generator,
            stream="baseline",
            sigma=noise * clip,
            sum=total,
            reset=True,
            params=z,
            lr=lr / problem.n,
        )
        z[:] = _project(problem, z)
        mean += (z - mean) / (t + 1)
    accountant = Accountant("pld", "replace-one")
    plan = DPSGDPlan(steps=steps, sampling="full", neighbouring="replace-one")
    attribution, event = plan.step("gradient", noise)
    accountant.record(attribution, event, steps)
    out = mean if average else z
    x, y = out[: problem.dim_x], (out[problem.dim_x :] if problem.dim_y else None)
    return x, y, steps * problem.n, _spent(accountant)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags beyond the shared ones."""
    del parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``dpvr experiment phased``: the grid, a table per problem, JSON/CSV and ``phased.png``."""
    epsilons = args.epsilon or ([1.0, 4.0] if args.quick else [0.5, 1.0, 2.0, 4.0])
    seeds = args.seeds or (2 if args.quick else 5)
    os.makedirs(args.out, exist_ok=True)
    records = run_grid(quick=args.quick, epsilons=epsilons, seeds=seeds, out_dir=args.out)
    rows = []
    for family in FAMILIES:
        mine = [r for r in records if r.dataset == family.dataset]
        for key in sorted({(r.metrics["n"], r.epsilon) for r in mine}):
            for method in family.methods:
                cell = [r for r in mine if (r.metrics["n"], r.epsilon) == key and r.method == method]
                rows.append(
                    [
                        family.dataset,
                        *key,
                        method,
                        max(r.spent_epsilon for r in cell),
                        format_mean_std(metric(r.metrics, family.metric) for r in cell),
                        family.metric,
                        format_mean_std(metric(r.metrics, "grad_evals_per_n") for r in cell),
                    ]
                )
    print(
        format_table(
            [
                "problem",
                "n",
                "ε",
                "method",
                "spent ε",
                diagnostic("value"),
                "metric",
                diagnostic("grad evals / n"),
            ],
            rows,
        )
    )
    print(f"\n{DIAGNOSTIC_NOTE}")
    doc = document(
        "phased",
        {
            "quick": args.quick,
            "epsilons": list(epsilons),
            "seeds": seeds,
            "delta": DELTA,
            "preprocessing": PREPROCESSING,
        },
        records,
    )
    save(doc, records, args.out)
    return doc


def run_grid(
    *,
    quick: bool,
    epsilons: Sequence[float],
    seeds: int | Sequence[int],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
) -> list[Record]:
    """Run the grid (families x n x epsilon x seeds x methods); write ``phased.png`` under ``out_dir``."""
    epsilons = [float(e) for e in epsilons]
    if not epsilons or not all(math.isfinite(e) and e > 0 for e in epsilons):
        raise ValueError(f"epsilons must be a non-empty list of finite numbers > 0, got {epsilons!r}")
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list:
        raise ValueError(f"seeds must be a positive count or a non-empty list, got {seeds!r}")
    grid = [
        (family, n, seed)
        for family in FAMILIES
        for n in _SIZES[family.dataset][0 if quick else 1]
        for seed in seed_list
    ]
    bar = progress_bar(len(grid) * len(epsilons), "phased") if progress else None
    records = []
    for family, n, seed in grid:
        problem = family.build(n, seed)
        reference = problem.objective(problem.solution()) if family.metric == "excess_risk" else None
        for epsilon in epsilons:
            run_seed = derive_seed(seed, n, round(epsilon * 1e6))
            for method in family.methods:
                if method in _SETTINGS:
                    x, y, evals, noise, spent = _phased(problem, method, epsilon, run_seed)
                    phased_noise = noise
                else:
                    x, y, evals, spent = _baseline(problem, phased_noise, run_seed)
                records.append(
                    Record(
                        method,
                        family.dataset,
                        epsilon,
                        DELTA,
                        seed,
                        spent,
                        record_metrics(
                            {
                                "n": n,
                                family.metric: _metric(problem, family.metric, x, y, reference),
                                "grad_evals": evals,
                                "grad_evals_per_n": evals / n,
                            },
                            DIAGNOSTICS,
                        ),
                    )
                )
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    plot(records, os.path.join(out_dir, "phased.png"))
    return records


def plot(records: Sequence[Record], path: str | os.PathLike[str]) -> None:
    """Per family: the metric against n (largest epsilon) and against epsilon (largest n), and the gradient
    evaluations against n; means over seeds, log scales. Every axis is a diagnostic, labelled so."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(3, len(FAMILIES), figsize=(5 * len(FAMILIES), 11), squeeze=False)
    for col, family in enumerate(FAMILIES):
        rows = [r for r in records if r.dataset == family.dataset]
        if not rows:
            continue
        eps_max = max(r.epsilon for r in rows)
        n_max = max(r.metrics["n"] for r in rows)
        panels = (
            ("n", family.metric, f"epsilon = {eps_max:g}"),
            ("epsilon", family.metric, f"n = {n_max}"),
            ("n", "grad_evals", "gradient evaluations"),
        )
        for row, (axis, name, note) in enumerate(panels):
            ax = axes[row][col]
            for method in family.methods:
                points: dict[float, list[float]] = {}
                for r in rows:
                    # Against n at the largest epsilon; against epsilon at the largest n.
                    kept = r.epsilon == eps_max if axis == "n" else r.metrics["n"] == n_max
                    if r.method == method and kept:
                        key = r.metrics["n"] if axis == "n" else r.epsilon
                        points.setdefault(key, []).append(metric(r.metrics, name))
                xs = sorted(points)
                ax.plot(xs, [np.mean(points[v]) for v in xs], marker="o", label=method)
            if name == "grad_evals":
                xs = sorted({r.metrics["n"] for r in rows})
                ax.plot(xs, [10 * v for v in xs], "k:", label="10 n")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ticks = sorted({r.metrics["n"] if axis == "n" else r.epsilon for r in rows})
            ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlabel(axis)
            ax.set_ylabel(diagnostic(name))
            ax.set_title(f"{family.dataset}: {note}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    write_figure(path, fig, dpi=110)
    plt.close(fig)


__all__ = ["DELTA", "FAMILIES", "plot", "run"]
