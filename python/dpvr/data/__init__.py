"""Datasets for dpvr's experiments: bundled and user-supplied data, preprocessing, client splits and
imbalance construction.

Everything here is numpy; :meth:`Dataset.tensors` hands a dataset to torch. Every random choice takes an
explicit ``seed`` so that experiments are reproducible.
"""

from ._files import DataFileError
from .clients import split_clients
from .dataset import Dataset, Task
from .idx import FASHION_MNIST_CLASSES, MNIST_CLASSES, read_idx, read_mnist
from .imbalance import binarize, long_tail, split_classes, subsample_to_ratio
from .libsvm import read_libsvm
from .preprocess import Standardizer, TargetScaler, train_test_split
from .registry import DATASET_NAMES, load
from .tabular import read_csv

__all__ = [
    "DATASET_NAMES",
    "FASHION_MNIST_CLASSES",
    "MNIST_CLASSES",
    "DataFileError",
    "Dataset",
    "Standardizer",
    "TargetScaler",
    "Task",
    "binarize",
    "load",
    "long_tail",
    "read_csv",
    "read_idx",
    "read_libsvm",
    "read_mnist",
    "split_classes",
    "split_clients",
    "subsample_to_ratio",
    "train_test_split",
]
