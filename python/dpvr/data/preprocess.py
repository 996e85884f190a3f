"""Preprocessing as in the DIFF2 experiments: a seeded train/test split, feature standardisation fitted on
the training split, and target scaling for regression.

The statistics these transforms fit (feature means and scales, the target scale) come from the data without
noise. Like the papers, dpvr treats preprocessing as outside the privacy guarantee; a run that must cover it
should fit them on public data or use data-independent constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .dataset import Dataset


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


@dataclass(frozen=True, eq=False)
class Standardizer:
    """Per-feature affine map to mean 0 and standard deviation 1, fitted on one (training) dataset.

    Constant features get scale 1, so they map to 0 instead of dividing by zero (e.g. the border pixels of
    digits).
    """

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, train: Dataset) -> Standardizer:
        """Fit on ``train`` only; apply the result to the training and the test split alike."""
        if len(train) == 0:
            raise ValueError(f"{train.name}: cannot fit a standardizer on an empty dataset")
        features = train.features.astype(np.float64, copy=False)
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
    """Division of regression targets by one positive constant.

    The DIFF2 experiments divide by the largest absolute target "in the whole dataset"
    (``TargetScaler.fit(train, test)``); fitting on the training split alone (``TargetScaler.fit(train)``)
    keeps the test split out of preprocessing.
    """

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


def _require_regression(dataset: Dataset) -> None:
    if dataset.task != "regression":
        raise ValueError(f"{dataset.name}: target scaling applies to regression, not {dataset.task}")
