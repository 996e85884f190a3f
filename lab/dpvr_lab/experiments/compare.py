"""Paired comparison of a method against a baseline across the records of one or more result files.

Every experiment writes one record per (method, dataset, epsilon, seed), and a seed fixes the split, the
initialisation and the clients for every method. So a method and its baseline at the same (dataset,
epsilon) are compared seed by seed: the table gives both means, the mean per-seed difference, how many seeds
the method won, and the p-value of the one-sided paired t-test whose alternative is "the method is better"
(df = seeds - 1). A p-value is not a verdict: with 5 seeds only large, consistent gaps reach p < 0.05.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpvr.results import format_table

from .common import mean_std, one_sided_ttest


@dataclass(frozen=True)
class Comparison:
    """One (dataset, epsilon) cell: ``method`` against ``baseline`` on ``metric``, paired by seed.

    ``difference`` is ``mean(method - baseline)``; ``wins`` counts the seeds where the method is better
    (strictly); ``p_value`` is the one-sided paired t-test of "the method is better" (NaN below two seeds).
    """

    dataset: str
    epsilon: float
    method: str
    baseline: str
    metric: str
    seeds: tuple[int, ...]
    method_values: tuple[float, ...]
    baseline_values: tuple[float, ...]
    higher_is_better: bool

    @property
    def difference(self) -> float:
        return float(np.mean(np.subtract(self.method_values, self.baseline_values)))

    @property
    def wins(self) -> int:
        sign = 1.0 if self.higher_is_better else -1.0
        return int(sum(sign * (m - b) > 0 for m, b in zip(self.method_values, self.baseline_values)))

    @property
    def p_value(self) -> float:
        if self.higher_is_better:  # alternative: baseline < method
            return one_sided_ttest(self.baseline_values, self.method_values, paired=True)
        return one_sided_ttest(self.method_values, self.baseline_values, paired=True)


def load_records(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """The records of the result documents at ``paths`` (as written by ``dpvr experiment``)."""
    records: list[dict[str, Any]] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{os.fspath(path)}: cannot read a result document ({err})") from err
        if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
            raise ValueError(f"{os.fspath(path)}: not a dpvr result document (no 'records' list)")
        records.extend(doc["records"])
    return records


def _value(record: dict[str, Any], metric: str) -> float:
    metrics = record.get("metrics", {})
    if metric in metrics:
        return float(metrics[metric])
    diagnostics = metrics.get("diagnostics", {})
    if metric in diagnostics:
        return float(diagnostics[metric])
    known = sorted(k for k, v in metrics.items() if isinstance(v, int | float)) + sorted(diagnostics)
    raise ValueError(f"metric {metric!r} not in the records (they have {known})")


def compare(
    records: Sequence[dict[str, Any]],
    method: str,
    baseline: str,
    metric: str,
    *,
    higher_is_better: bool = True,
) -> list[Comparison]:
    """One :class:`Comparison` per (dataset, epsilon) where both methods have records, seeds paired.

    Raises ``ValueError`` when a method has no records, or when the two have no (dataset, epsilon, seed)
    in common; a seed present for only one of them is left out of its cell (never imputed).
    """
    by_method: dict[str, dict[tuple[str, float, int], float]] = {method: {}, baseline: {}}
    for record in records:
        name = record.get("method")
        if name in by_method and record.get("epsilon") is not None:
            key = (str(record["dataset"]), float(record["epsilon"]), int(record["seed"]))
            by_method[name][key] = _value(record, metric)
    for name, found in by_method.items():
        if not found:
            present = sorted({str(r.get("method")) for r in records})
            raise ValueError(f"no private records of method {name!r} (the files have {present})")
    common = sorted(set(by_method[method]) & set(by_method[baseline]))
    if not common:
        raise ValueError(f"{method!r} and {baseline!r} share no (dataset, epsilon, seed)")
    cells: dict[tuple[str, float], list[int]] = {}
    for dataset, epsilon, seed in common:
        cells.setdefault((dataset, epsilon), []).append(seed)
    return [
        Comparison(
            dataset, epsilon, method, baseline, metric, tuple(seeds),
            tuple(by_method[method][(dataset, epsilon, s)] for s in seeds),
            tuple(by_method[baseline][(dataset, epsilon, s)] for s in seeds),
            higher_is_better,
        )
        for (dataset, epsilon), seeds in sorted(cells.items())
    ]  # fmt: skip


def _mean_std(values: Sequence[float]) -> str:
    mean, std = mean_std(values)
    return f"{mean:.3f} ± {std:.3f}"


def table(comparisons: Sequence[Comparison]) -> str:
    """A Markdown table of ``comparisons``, one row per (dataset, epsilon)."""
    if not comparisons:
        return ""
    first = comparisons[0]
    better = "higher" if first.higher_is_better else "lower"
    headers = [
        "data", "ε", "seeds", first.method, first.baseline, "mean difference",
        f"wins ({better} is better)", "paired p (one-sided)",
    ]  # fmt: skip
    rows = [
        [c.dataset, f"{c.epsilon:g}", len(c.seeds), _mean_std(c.method_values), _mean_std(c.baseline_values),
         f"{c.difference:+.3f}", f"{c.wins}/{len(c.seeds)}",
         "n/a" if math.isnan(c.p_value) else f"{c.p_value:.3f}"]
        for c in comparisons
    ]  # fmt: skip
    return format_table(headers, rows)


def plot(comparisons: Sequence[Comparison], path: str | os.PathLike[str]) -> None:
    """Metric against epsilon (log scale), one panel per dataset, mean ± std over the paired seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpvr.results import write_figure

    datasets = sorted({c.dataset for c in comparisons})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        cells = sorted((c for c in comparisons if c.dataset == dataset), key=lambda c: c.epsilon)
        eps = [c.epsilon for c in cells]
        for label, values in ((cells[0].method, "method_values"), (cells[0].baseline, "baseline_values")):
            stats = [mean_std(getattr(c, values)) for c in cells]
            ax.errorbar(eps, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3,
                        label=label)
        ax.set_xscale("log")
        ax.set_xlabel("ε")
        ax.set_ylabel(cells[0].metric)
        ax.set_title(dataset)
        ax.legend()
    fig.tight_layout()
    write_figure(path, fig, dpi=120)
    plt.close(fig)


__all__ = ["Comparison", "compare", "load_records", "plot", "table"]
