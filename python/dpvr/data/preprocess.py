"""Preprocessing whose constants are public, so that the per-record sensitivity argument covers it.

A transform fitted on the private training split (its mean, its largest target) changes every record when
one record changes: the replace-one neighbour of the raw data is then no neighbour of the data the private
method sees. Every transform here takes its constants from somewhere else, so that changing one private
record changes that record's preprocessed value and no other's:

- declared ranges (:class:`DeclaredRange`): documented bounds of the features, e.g. digits' pixels 0..16;
- a public split (:func:`split_public`, :class:`PublicScaling`): records held out before anything else,
  never part of the private training data or of the test split, on which standardisation and target
  scaling are fitted (the statistics are released without noise; the split is public by assumption);
- per-record maps (:func:`unit_norm`): each record scaled by its own norm.

:class:`Standardizer` and :class:`TargetScaler` fit their statistics without noise: fit them on public data.
Each source has a ``description`` for the protocol an experiment reports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .dataset import Dataset

PUBLIC_FRACTION = 0.1
"""Share of the records the experiments hold out as their public split."""


def train_test_split(dataset: Dataset, *, test_fraction: float = 0.2, seed: int) -> tuple[Dataset, Dataset]:
    """Split uniformly at random into ``(train, test)`` with ``round(test_fraction * n)`` test samples.

    Both parts are in the shuffled order of one permutation drawn from ``seed``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    n_test = round(test_fraction * len(dataset))
    if not 0 < n_test < len(dataset):
        raise ValueError(f"{dataset.name}: test_fraction {test_fraction} of {len(dataset)} samples leaves "
                         f"{n_test} test and {len(dataset) - n_test} training samples; both must be >= 1")
    order = np.random.default_rng(seed).permutation(len(dataset))
    return dataset.subset(order[n_test:]), dataset.subset(order[:n_test])


def split_public(
    dataset: Dataset, *, fraction: float = PUBLIC_FRACTION, seed: int
) -> tuple[Dataset, Dataset]:
    """``(public, rest)``: ``round(fraction * n)`` records drawn uniformly at random with ``seed`` to serve as
    public data; the private training split and the test split are to be drawn from ``rest``.

    The draw does not look at the values, so which records are public does not depend on any private one.
    """
    rest, public = train_test_split(dataset, test_fraction=fraction, seed=seed)
    return public, rest


@dataclass(frozen=True, eq=False)
class Standardizer:
    """Per-feature affine map to mean 0 and standard deviation 1, fitted on one dataset.

    Fit it on public data (:func:`split_public`): fitted on the private training split, its statistics
    change with every private record. Constant features get scale 1, so they map to 0 instead of dividing
    by zero (e.g. the border pixels of digits).
    """

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, data: Dataset) -> Standardizer:
        """Fit on ``data`` only; apply the result to every split alike."""
        if len(data) == 0:
            raise ValueError(f"{data.name}: cannot fit a standardizer on an empty dataset")
        features = data.features.astype(np.float64, copy=False)
        constant = np.ptp(features, axis=0) == 0
        return cls(mean=features.mean(axis=0), scale=np.where(constant, 1.0, features.std(axis=0)))

    def __call__(self, dataset: Dataset) -> Dataset:
        if dataset.num_features != self.mean.shape[0]:
            raise ValueError(f"{dataset.name} has {dataset.num_features} features, the standardizer was "
                             f"fitted on {self.mean.shape[0]}")
        features = ((dataset.features - self.mean) / self.scale).astype(dataset.features.dtype)
        return dataclasses.replace(dataset, features=features)


@dataclass(frozen=True)
class TargetScaler:
    """Division of regression targets by one positive constant: the largest absolute target of the data it
    is fitted on (fit it on public data, as :class:`Standardizer`)."""

    scale: float

    def __post_init__(self) -> None:
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"target scale must be a positive finite number, got {self.scale}")

    @classmethod
    def fit(cls, *datasets: Dataset) -> TargetScaler:
        """The largest absolute target over ``datasets`` (1 if they are all zero)."""
        if not datasets:
            raise ValueError("TargetScaler.fit needs at least one dataset")
        for dataset in datasets:
            _require_regression(dataset)
        largest = max((float(np.abs(d.targets).max()) for d in datasets if len(d)), default=0.0)
        return cls(largest if largest > 0 else 1.0)

    def __call__(self, dataset: Dataset) -> Dataset:
        _require_regression(dataset)
        return dataclasses.replace(dataset, targets=dataset.targets / self.scale)


@dataclass(frozen=True, eq=False)
class PublicScaling:
    """Standardisation, and for regression division of the targets by their largest absolute value, with
    the statistics of a public split: the DIFF2 papers' preprocessing without reading private records."""

    features: Standardizer
    targets: TargetScaler | None

    @classmethod
    def fit(cls, public: Dataset) -> PublicScaling:
        targets = TargetScaler.fit(public) if public.task == "regression" else None
        return cls(Standardizer.fit(public), targets)

    def __call__(self, dataset: Dataset) -> Dataset:
        dataset = self.features(dataset)
        return dataset if self.targets is None else self.targets(dataset)

    @staticmethod
    def description(fraction: float = PUBLIC_FRACTION) -> str:
        return (f"features standardised (regression targets divided by their largest absolute value) with "
                f"the statistics of a public split: {fraction:.0%} of the records, drawn at random per seed "
                "and held out of the private training split and the test split")


@dataclass(frozen=True)
class DeclaredRange:
    """The affine map of the documented feature range ``[low, high]`` onto ``[0, 1]``: constants fixed before
    any record is seen."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (np.isfinite(self.low) and np.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"a declared range needs finite low < high, got [{self.low}, {self.high}]")

    def __call__(self, dataset: Dataset) -> Dataset:
        features = (dataset.features - self.low) / (self.high - self.low)
        return dataclasses.replace(dataset, features=features.astype(dataset.features.dtype))

    @property
    def description(self) -> str:
        return f"features mapped from their declared range [{self.low:g}, {self.high:g}] onto [0, 1]"


UNIT_NORM = "each record scaled to unit L2 norm (a per-record map)"
"""The description of :func:`unit_norm`."""


def unit_norm(dataset: Dataset) -> Dataset:
    """Each record divided by its own L2 norm (an all-zero record stays zero): no other record enters."""
    norms = np.linalg.norm(dataset.features, axis=1, keepdims=True)
    features = dataset.features / np.maximum(norms, np.finfo(dataset.features.dtype).tiny)
    return dataclasses.replace(dataset, features=features)


def _require_regression(dataset: Dataset) -> None:
    if dataset.task != "regression":
        raise ValueError(f"{dataset.name}: target scaling applies to regression, not {dataset.task}")
