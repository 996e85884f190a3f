"""Datasets for dpvr's experiments: bundled and user-supplied data, preprocessing, client splits and
imbalance construction.

Everything here is numpy; :meth:`Dataset.tensors` hands a dataset to torch. Every random choice takes an
explicit ``seed`` so that experiments are reproducible. Preprocessing takes its constants from public
sources only (:mod:`dpvr.data.preprocess`).
"""

from ._files import DataFileError
from .bundled import DIGITS_RANGE, MNIST_RANGE
from .clients import split_clients
from .dataset import Dataset, Task
from .idx import FASHION_MNIST_CLASSES, MNIST_CLASSES, read_idx, read_mnist
from .imbalance import binarize, long_tail, split_classes, subsample_to_ratio
from .libsvm import read_libsvm
from .mnist1d import load_mnist1d
from .preprocess import (
    PUBLIC_FRACTION,
    UNIT_NORM,
    DeclaredRange,
    PublicScaling,
    Standardizer,
    TargetScaler,
    split_public,
    train_test_split,
    unit_norm,
)
from .registry import DATASET_NAMES, load
from .tabular import read_csv

__all__ = [
    "DATASET_NAMES",
    "DIGITS_RANGE",
    "PUBLIC_FRACTION",
    "UNIT_NORM",
    "FASHION_MNIST_CLASSES",
    "MNIST_CLASSES",
    "MNIST_RANGE",
    "DataFileError",
    "Dataset",
    "DeclaredRange",
    "PublicScaling",
    "Standardizer",
    "TargetScaler",
    "Task",
    "binarize",
    "load",
    "load_mnist1d",
    "long_tail",
    "read_csv",
    "read_idx",
    "read_libsvm",
    "read_mnist",
    "split_classes",
    "split_clients",
    "split_public",
    "subsample_to_ratio",
    "train_test_split",
    "unit_norm",
]
