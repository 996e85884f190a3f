"""What every experiment shares: seeds, mean ± std, the one-sided t-test, progress, curves, result files."""

from __future__ import annotations

import csv
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from ..results import Record, write_json


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
    """One row per record; nested metrics become dotted columns (``selected.lr``)."""
    rows = []
    for record in records:
        row = {k: v for k, v in asdict(record).items() if k != "metrics"}
        row.update(_flatten(record.metrics))
        rows.append(row)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


__all__ = [
    "derive_seed",
    "format_mean_std",
    "mean_std",
    "one_sided_ttest",
    "plot_curves",
    "progress",
    "save",
    "write_csv",
]
