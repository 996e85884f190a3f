"""Datasets by name: the bundled sets (scikit-learn's; ``mnist_5k`` with the ``mnist`` extra), the generated
MNIST-1D sets of any size (``mnist1d_4k`` ... with the ``mnist1d`` extra) and MNIST-format sets read from a
directory."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import numpy as np

from .bundled import BUNDLED
from .dataset import Dataset
from .idx import FASHION_MNIST_CLASSES, MNIST_CLASSES, read_mnist
from .mnist1d import SIZES as MNIST1D_SIZES
from .mnist1d import load_mnist1d, parse_size

__all__ = ["DATASET_NAMES", "MNIST1D_SIZES", "load"]

_IDX_SETS: dict[str, tuple[str, ...]] = {"fashion_mnist": FASHION_MNIST_CLASSES, "mnist": MNIST_CLASSES}

DATASET_NAMES: tuple[str, ...] = tuple(sorted(BUNDLED)) + tuple(sorted(_IDX_SETS))
"""Names :func:`load` accepts (hyphens and upper case are accepted too: ``"Fashion-MNIST"``), besides the
generated MNIST-1D sets of any size (:data:`MNIST1D_SIZES` and every other ``mnist1d_<n>[k]``)."""


def load(name: str, *, data_dir: str | os.PathLike[str] | None = None,
         split: Literal["all", "train", "test"] = "all") -> Dataset:
    """Load a dataset by name.

    Args:
        name: one of :data:`DATASET_NAMES`, or ``mnist1d_<n>`` / ``mnist1d_<n>k``: MNIST-1D with ``n``
            (thousand) training records (:func:`~dpvr.data.mnist1d.load_mnist1d`, which also gives its public
            splits).
        data_dir: the directory holding the IDX files of ``mnist`` / ``fashion_mnist``
            (``train-images-idx3-ubyte[.gz]`` …); ignored for the bundled sets.
        split: ``"train"`` or ``"test"`` selects the published split of an IDX set; ``"all"`` (default) is
            both, training samples first. Bundled sets have no published split: use
            :func:`~dpvr.data.train_test_split`. MNIST-1D's ``"train"`` is its ``n`` generated training
            records and ``"test"`` its fixed held-out set.
    """
    key = name.lower().replace("-", "_")
    if split not in ("all", "train", "test"):
        raise ValueError(f"split must be 'all', 'train' or 'test', got {split!r}")
    if key in BUNDLED:
        if split != "all":
            raise ValueError(f"{key} has no published train/test split; load it whole and use "
                             "train_test_split")
        return BUNDLED[key]()
    size = parse_size(key)
    if size is not None:
        parts = [load_mnist1d(size, part) for part in (("train", "test") if split == "all" else (split,))]
        return parts[0] if len(parts) == 1 else _concatenate(parts)
    if key not in _IDX_SETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}, mnist1d_<n>[k] "
                         "(read CSV or LIBSVM files with read_csv / read_libsvm)")
    if data_dir is None:
        raise ValueError(f"{key} is not bundled: pass data_dir, the directory holding its IDX files "
                         "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-…, optionally .gz)")
    parts = [read_mnist(data_dir, part, name=key, classes=_IDX_SETS[key])
             for part in (("train", "test") if split == "all" else (split,))]
    return parts[0] if len(parts) == 1 else _concatenate(parts)


def _concatenate(parts: list[Dataset]) -> Dataset:
    return dataclasses.replace(parts[0], features=np.concatenate([p.features for p in parts]),
                               targets=np.concatenate([p.targets for p in parts]))
