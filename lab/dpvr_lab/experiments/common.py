"""What every experiment shares: seeds, mean ± std, the one-sided t-test, progress, curves, result files,
the one shape in which a record keeps its training-set diagnostics apart from what it may publish, and the
private hyper-parameter search of ``--private-tuning``.

Metrics measured on the private training data without noise (train loss, train AUC, gradient norms,
data-dependent gradient-evaluation counts) show how the optimisation went; they are not releases covered by
the privacy guarantee. Every experiment puts them under ``metrics["diagnostics"]``, flagged
``"private": false`` (CSV columns ``diagnostics.*``), and labels them with :func:`diagnostic` in its tables
and plots. Everything else in ``metrics`` is measured on data outside the private training split or
describes the run (its size, its noise, its selected hyper-parameters: an experiment that tunes them on the
private data says so in its config).
"""

from __future__ import annotations

import csv
import io
import math
import os
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from dpvr.optim import PrivacyConfig, PrivateAlgorithm
from dpvr.persistence import atomic_write
from dpvr.results import Record, write_figure, write_json
from dpvr.tuning import tune

DIAGNOSTICS_KEY = "diagnostics"
"""The key of the training-set diagnostics in a record's metrics."""

NOT_PRIVATE = "diagnostic, not private"

DIAGNOSTIC_NOTE = (
    f"({NOT_PRIVATE}): measured on the private training data without noise; it shows how the optimisation "
    "went and is not a release covered by the privacy guarantee."
)
"""The footnote of every table with a :func:`diagnostic` column."""


def diagnostic(title: str) -> str:
    """The table column or plot title of a training-set metric, labelled as not private."""
    return f"{title} ({NOT_PRIVATE})"


def record_metrics(
    values: Mapping[str, Any],
    diagnostics: Collection[str],
    curves: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """A record's metrics: ``values`` and ``curves`` (per-metric series) with the entries named in
    ``diagnostics`` moved to ``metrics["diagnostics"]``, flagged ``"private": False``."""
    curves = curves or {}
    metrics = {k: v for k, v in values.items() if k not in diagnostics}
    released_curves = {k: v for k, v in curves.items() if k not in diagnostics}
    if released_curves:
        metrics["curves"] = released_curves
    measured = {k: v for k, v in values.items() if k in diagnostics}
    measured_curves = {k: v for k, v in curves.items() if k in diagnostics}
    if measured_curves:
        measured["curves"] = measured_curves
    if measured:
        metrics[DIAGNOSTICS_KEY] = {"private": False, **measured}
    return metrics


def metric(metrics: Mapping[str, Any], name: str) -> Any:
    """The value of metric ``name`` in a record's metrics, whichever section holds it."""
    return metrics[name] if name in metrics else metrics[DIAGNOSTICS_KEY][name]


C = TypeVar("C")
A = TypeVar("A", bound=PrivateAlgorithm)
R = TypeVar("R")

SEARCH_METRICS = ("per_trial_epsilon", "trials_distribution", "trials_mean", "trials_shape",
                  "hyperparameter_tuning_accounted")
"""What a record of a privately tuned run adds to its metrics (its ``spent_epsilon`` is the search's)."""


@dataclass(frozen=True)
class Selection(Generic[R]):
    """What :func:`private_search` released: the selected trial's run, the search's epsilon, and the record
    metrics (:data:`SEARCH_METRICS`) that say how the search was accounted."""

    run: R
    spent_epsilon: float
    metrics: dict[str, Any]


def private_search(
    build: Callable[[C, PrivacyConfig], tuple[A, R]],
    grid: Sequence[C],
    *,
    epsilon: float,
    delta: float,
    train: Callable[[A, R], None],
    score: Callable[[A, R], float],
    seed: int,
    maximize: bool = True,
    privacy: PrivacyConfig | None = None,
) -> Selection[R]:
    """``--private-tuning``: the best of a random number of private runs on ``grid``, the whole search
    ``(epsilon, delta)``-DP (:func:`dpvr.tuning.tune`).

    The number of trials is geometric with mean ``len(grid)``: each candidate is tried once on average, as
    an exhaustive search would, and the law has no tail parameter to choose. ``build(candidate, privacy)``
    returns the trial's algorithm, constructed with ``privacy=privacy``, and the experiment's record of it
    (a run with its curves); ``train`` runs the trial and fills that record; ``score`` rates it, and must read
    only the released model and data outside the private training split (a public or test split), which
    makes it post-processing. ``seed`` fixes the number of trials and the draws (``reproducible=True``), which
    the guarantee wants secret: fine for a reproducible experiment, not for a deployment.
    """
    trials: dict[int, tuple[A, R]] = {}  # by the algorithm's id; it is kept alive so that ids stay unique

    def build_trial(candidate: C, trial_privacy: PrivacyConfig) -> A:
        algorithm, run = build(candidate, trial_privacy)
        trials[id(algorithm)] = (algorithm, run)
        return algorithm

    result = tune(
        build_trial,
        grid,
        epsilon=epsilon,
        delta=delta,
        score=lambda algorithm: score(algorithm, trials[id(algorithm)][1]),
        train=lambda algorithm: train(algorithm, trials[id(algorithm)][1]),
        trials_mean=len(grid),
        distribution="negative-binomial",
        shape=1.0,
        maximize=maximize,
        privacy=privacy,
        seed=seed,
        reproducible=True,
    )
    assert result.algorithm is not None, "a geometric number of trials is at least one"
    summary = result.to_dict()
    return Selection(trials[id(result.algorithm)][1], result.epsilon, {k: summary[k] for k in SEARCH_METRICS})


def tuning_note(tuned: str, scored_on: str | None) -> str:
    """The report's sentence on how ``tuned`` (e.g. "Learning rates") were chosen: by :func:`private_search`
    scored on ``scored_on`` (``--private-tuning``), or, with ``None``, on the private training data as in
    the papers, outside the accounting."""
    if scored_on is None:
        return (f"{tuned} were tuned on the private training data, as in the paper; that tuning is not "
                "covered by the privacy accounting.")
    return (f"{tuned} were selected inside the budget by a private search (random stopping, Papernot and "
            f"Steinke 2022; a geometric number of trials, mean the grid's size) scored on {scored_on}: spent "
            "epsilon is the whole search's, per_trial_epsilon in the records one trial's.")


def derive_seed(*keys: int) -> int:
    """A 64-bit seed determined by ``keys`` (e.g. run seed, method, grid point): independent streams for
    every part of a run, reproducible from the run seed alone."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0])


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value)."""
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return math.nan, math.nan
    return float(array.mean()), (float(array.std(ddof=1)) if array.size > 1 else 0.0)


def format_mean_std(values: Iterable[float]) -> str:
    mean, std = mean_std(values)
    return f"{mean:.4g} ± {std:.2g}"


def one_sided_ttest(a: Sequence[float], b: Sequence[float], *, paired: bool) -> float:
    """p-value of the one-sided t-test whose alternative is ``mean(a) < mean(b)``.

    ``paired``: ``a[i]`` and ``b[i]`` share seed ``i`` (the same split, initialisation and clients), so the
    test is on the per-seed differences (df = seeds - 1); otherwise Welch's unequal-variance test.
    NaN when there are too few values or no variance to test.
    """
    from scipy import stats

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if min(a.size, b.size) < 2:
        return math.nan
    if paired:
        result = stats.ttest_rel(a, b, alternative="less")
    else:
        result = stats.ttest_ind(a, b, equal_var=False, alternative="less")
    return float(result.pvalue)


def progress(total: int, description: str) -> Any:
    """A progress bar on stderr (tables go to stdout)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=description, file=sys.stderr, dynamic_ncols=True)


def write_csv(path: str | os.PathLike[str], records: Sequence[Record]) -> None:
    """One row per record; nested metrics become dotted columns (``selected.lr``,
    ``diagnostics.train_loss``)."""
    rows = []
    for record in records:
        row = {k: v for k, v in asdict(record).items() if k != "metrics"}
        row.update(_flatten(record.metrics))
        rows.append(row)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, text.getvalue().encode())


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def save(doc: dict[str, Any], records: Sequence[Record], out: str | os.PathLike[str]) -> list[str]:
    """Writes ``<experiment>.json`` and ``<experiment>.csv`` under ``out``; returns their paths."""
    stem = os.path.join(out, doc["experiment"])
    write_json(stem + ".json", doc)
    write_csv(stem + ".csv", records)
    return [stem + ".json", stem + ".csv"]


def plot_curves(
    path: str | os.PathLike[str],
    x: Sequence[float],
    panels: Mapping[str, Mapping[str, Sequence[Sequence[float]]]],
    *,
    title: str,
    xlabel: str,
    log_y: bool = True,
) -> None:
    """One panel per metric, one line per method: the mean over seeds with a ± std band.

    ``panels`` maps a panel title to ``{method: [curve of seed 0, curve of seed 1, ...]}``, each curve
    evaluated at ``x``.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=(5 * len(panels), 4), layout="tight")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, methods) in zip(axes, panels.items()):
        for method, curves in methods.items():
            values = np.asarray(curves, dtype=np.float64)
            mean = values.mean(axis=0)
            std = values.std(axis=0, ddof=1) if len(values) > 1 else np.zeros_like(mean)
            (line,) = ax.plot(x, mean, label=method)
            # On a log axis the band stops at the lowest seed instead of plunging to zero or below.
            low = np.maximum(mean - std, values.min(axis=0)) if log_y else mean - std
            ax.fill_between(x, low, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    write_figure(path, fig, dpi=120)


__all__ = [
    "DIAGNOSTICS_KEY",
    "DIAGNOSTIC_NOTE",
    "NOT_PRIVATE",
    "SEARCH_METRICS",
    "Selection",
    "derive_seed",
    "diagnostic",
    "format_mean_std",
    "mean_std",
    "metric",
    "one_sided_ttest",
    "plot_curves",
    "private_search",
    "progress",
    "record_metrics",
    "save",
    "tuning_note",
    "write_csv",
]
