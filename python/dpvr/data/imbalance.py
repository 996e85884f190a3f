"""Binary and imbalanced variants of classification data, for the AUC-maximisation and DRO experiments.

* PrivateDiff's AUC experiments: classes split at random into two groups (:func:`split_classes`,
  :func:`binarize`), then positives subsampled to a ratio of 0.1 in training and 0.5 in testing
  (:func:`subsample_to_ratio`).
* The DRO paper's "-ST" sets: the first half of the classes cut to a few training examples each
  (:func:`long_tail`); MNIST-ST is ``binarize(…, positive_classes=range(5, 10))`` then a positive ratio.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from .dataset import Dataset


def _require_classification(dataset: Dataset, num_classes: int | None = None) -> None:
    if dataset.task != "classification":
        raise ValueError(f"{dataset.name}: needs a classification dataset, got {dataset.task}")
    if num_classes is not None and dataset.num_classes != num_classes:
        raise ValueError(f"{dataset.name}: needs {num_classes} classes, has {dataset.num_classes}")


def split_classes(num_classes: int, *, seed: int) -> tuple[int, ...]:
    """A uniformly random set of ``num_classes // 2`` class codes (sorted) to serve as the positive group.

    Pass the result to :func:`binarize` for the training and the test split alike.
    """
    if num_classes < 2:
        raise ValueError(f"splitting classes into two groups needs num_classes >= 2, got {num_classes}")
    chosen = np.random.default_rng(seed).choice(num_classes, size=num_classes // 2, replace=False)
    return tuple(int(c) for c in np.sort(chosen))


def binarize(dataset: Dataset, positive_classes: Iterable[int]) -> Dataset:
    """Relabel to a binary task: code 1 for ``positive_classes``, 0 for the rest.

    ``classes`` of the result is ``(original labels of the negatives, original labels of the positives)``.
    """
    _require_classification(dataset)
    positive = sorted({int(c) for c in positive_classes})
    num_classes = dataset.num_classes
    if not positive or positive[0] < 0 or positive[-1] >= num_classes or len(positive) == num_classes:
        raise ValueError(f"{dataset.name}: positive_classes {positive} must be a non-empty proper subset of "
                         f"the class codes 0..{num_classes - 1}")
    original = dataset.classes or tuple(range(num_classes))
    negatives = tuple(original[c] for c in range(num_classes) if c not in positive)
    return dataclasses.replace(dataset, targets=np.isin(dataset.targets, positive).astype(np.int64),
                               num_classes=2, classes=(negatives, tuple(original[c] for c in positive)))


def subsample_to_ratio(dataset: Dataset, positive_ratio: float, *, seed: int) -> Dataset:
    """Subsample one class of a binary dataset so that positives (code 1) make up ``positive_ratio``.

    Only the over-represented class is subsampled (uniformly, with ``seed``), so the result is the largest
    subset with that ratio up to rounding of the kept count; sample order is preserved.
    """
    _require_classification(dataset, num_classes=2)
    if not 0.0 < positive_ratio < 1.0:
        raise ValueError(f"positive_ratio must lie in (0, 1), got {positive_ratio}")
    positives, negatives = np.flatnonzero(dataset.targets == 1), np.flatnonzero(dataset.targets == 0)
    if len(positives) == 0 or len(negatives) == 0:
        raise ValueError(f"{dataset.name}: needs samples of both classes, has {len(positives)} positive and "
                         f"{len(negatives)} negative")
    odds = positive_ratio / (1.0 - positive_ratio)
    if len(positives) > odds * len(negatives):
        fixed, pool, keep = negatives, positives, round(odds * len(negatives))
    else:
        fixed, pool, keep = positives, negatives, round(len(positives) / odds)
    if keep < 1:
        raise ValueError(f"{dataset.name}: ratio {positive_ratio} with {len(fixed)} samples of the other "
                         "class keeps no sample of the subsampled class")
    kept = np.random.default_rng(seed).choice(pool, size=keep, replace=False)
    return dataset.subset(np.sort(np.concatenate([fixed, kept])))


def long_tail(dataset: Dataset, keep_per_class: int, *, classes: Iterable[int] | None = None) -> Dataset:
    """Keep only the last ``keep_per_class`` samples (in dataset order) of each class in ``classes``.

    ``classes`` defaults to the first half of the class codes, ``0 .. num_classes // 2 - 1``, as in CIFAR10-ST
    ("keep the last 100 images of each class for the first half of the classes"); other classes are kept
    whole. Apply it to the training split only; sample order is preserved.
    """
    _require_classification(dataset)
    if keep_per_class < 1:
        raise ValueError(f"keep_per_class must be >= 1, got {keep_per_class}")
    cut = sorted(set(range(dataset.num_classes // 2) if classes is None else (int(c) for c in classes)))
    if any(not 0 <= c < dataset.num_classes for c in cut):
        raise ValueError(f"{dataset.name}: classes {cut} must be class codes 0..{dataset.num_classes - 1}")
    keep = ~np.isin(dataset.targets, cut)
    for c in cut:
        keep[np.flatnonzero(dataset.targets == c)[-keep_per_class:]] = True
    return dataset.subset(np.flatnonzero(keep))
