"""The datasets that ship with scikit-learn (no download): diabetes, breast cancer, wine and digits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn import datasets as sk

from .dataset import Dataset
from .preprocess import DeclaredRange


def _diabetes() -> Dataset:
    # Raw values: sklearn's default copy is already centred and scaled with statistics of all 442 samples,
    # private and test records included; dpvr's experiments standardise with a public split instead.
    bunch = sk.load_diabetes(scaled=False)
    return Dataset(bunch.data.astype(np.float64), bunch.target.astype(np.float64), "regression", "diabetes")


def _classification(loader: Callable[[], Any], name: str, sample_shape: tuple[int, ...] = ()) -> Dataset:
    bunch = loader()
    classes = tuple(c.item() for c in np.asarray(bunch.target_names))
    return Dataset(bunch.data.astype(np.float64), bunch.target.astype(np.int64), "classification", name,
                   num_classes=len(classes), classes=classes, sample_shape=sample_shape)


BUNDLED: dict[str, Callable[[], Dataset]] = {
    "breast_cancer": functools.partial(_classification, sk.load_breast_cancer, "breast_cancer"),
    "diabetes": _diabetes,
    "digits": functools.partial(_classification, sk.load_digits, "digits", (1, 8, 8)),
    "wine": functools.partial(_classification, sk.load_wine, "wine"),
}
"""Loader of each bundled dataset by name. Digits are 8×8 images with values 0..16 (``sample_shape``
``(1, 8, 8)``); breast cancer is binary (0 = malignant, 1 = benign); wine has three classes."""

DIGITS_RANGE = DeclaredRange(0.0, 16.0)
"""The documented range of the digits' pixels: the map onto [0, 1] that needs no statistic of the data."""
