"""LIBSVM / SVMlight files (``label idx:val idx:val …`` per line), read into dense arrays."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from ._files import DataFileError, read_bytes
from .dataset import Dataset, Task, check_task, labelled_dataset


def read_libsvm(path: str | os.PathLike[str], *, task: Task, num_features: int | None = None,
                name: str | None = None) -> Dataset:
    """Read a LIBSVM file (optionally gzipped) into a dense :class:`Dataset`.

    Args:
        path: the file; feature indices may be zero- or one-based (detected by scikit-learn).
        task: ``"classification"`` (labels such as -1/+1 are encoded as class codes in sorted order) or
            ``"regression"``.
        num_features: the feature dimension; default the largest index present. Pass it to read a train
            and a test file to the same width.
        name: the dataset name; default the file name up to its first dot.

    The result is dense (n × d float64), so this suits the low-dimensional sets dpvr's experiments use.

    Raises:
        ImportError: scikit-learn (which parses the format) is not installed.
        FileNotFoundError: ``path`` is not a file.
        DataFileError: a malformed line, no samples, or a non-finite value.
    """
    check_task(task)
    try:
        # Imported here, not with dpvr: scikit-learn is no hard dependency of the library.
        from sklearn.datasets import load_svmlight_file
    except ImportError as err:
        raise ImportError("read_libsvm parses with scikit-learn, which is not installed: pip install "
                          'scikit-learn (or "dpvr[datasets]")') from err
    path = Path(path)
    raw = read_bytes(path)
    try:
        sparse, labels = load_svmlight_file(io.BytesIO(raw), n_features=num_features, dtype=np.float64)
    except ValueError as err:
        raise DataFileError(path, f"not valid LIBSVM data ({err})") from err
    if sparse.shape[0] == 0:
        raise DataFileError(path, "no samples")
    features = sparse.toarray()
    for what, values in (("feature", features), ("label", labels)):
        if not np.all(np.isfinite(values)):
            row = int(np.argwhere(~np.isfinite(values.reshape(len(labels), -1)))[0, 0])
            raise DataFileError(path, f"non-finite {what} value in sample {row + 1}")
    if task == "classification" and np.all(labels == np.round(labels)):
        labels = labels.astype(np.int64)
    return labelled_dataset(features, labels, task, name or path.name.split(".")[0])
