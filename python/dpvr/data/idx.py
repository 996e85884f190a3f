"""IDX files (the MNIST / Fashion-MNIST distribution format), parsed with numpy.

An IDX file is: two zero bytes, a type byte, a byte holding the number of dimensions ``k``, ``k`` big-endian
uint32 sizes, then the values in C order, big-endian. Files may be gzip-compressed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

import numpy as np

from ._files import DataFileError, read_bytes
from .dataset import Dataset

_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

MNIST_CLASSES: tuple[str, ...] = tuple(str(digit) for digit in range(10))
FASHION_MNIST_CLASSES: tuple[str, ...] = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

# Official names, then the dotted spelling some mirrors use; each may also carry a ".gz" suffix.
_MNIST_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images{}idx3-ubyte", "train-labels{}idx1-ubyte"),
    "test": ("t10k-images{}idx3-ubyte", "t10k-labels{}idx1-ubyte"),
}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (optionally gzipped) into a native-byte-order array of its stored shape and type.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        DataFileError: bad magic number, unknown type code, truncated header or data, or trailing bytes.
    """
    raw = read_bytes(path)
    if len(raw) < 4:
        raise DataFileError(path, f"too short for an IDX header ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise DataFileError(path, f"not an IDX file (magic number starts {raw[:2].hex()}, expected 0000)")
    if raw[2] not in _IDX_TYPES:
        raise DataFileError(path, f"unknown IDX type code 0x{raw[2]:02x}")
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    if ndim == 0:
        raise DataFileError(path, "IDX header declares 0 dimensions")
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataFileError(path, f"truncated header: {ndim} dimensions need {header_size} bytes, "
                                  f"file has {len(raw)}")
    shape = tuple(int(size) for size in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = math.prod(shape) * dtype.itemsize
    found = len(raw) - header_size
    if found < expected:
        raise DataFileError(path, f"truncated data: shape {shape} of {dtype.name} needs {expected} bytes, "
                                  f"found {found}")
    if found > expected:
        raise DataFileError(path, f"{found - expected} unexpected bytes after the data of shape {shape}")
    values = np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape)
    return values.astype(dtype.newbyteorder("="))


def _find(data_dir: Path, pattern: str) -> Path:
    candidates = [data_dir / (pattern.format(sep) + gz) for sep in ("-", ".") for gz in ("", ".gz")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{data_dir}: none of {', '.join(c.name for c in candidates)} found")


def read_mnist(data_dir: str | os.PathLike[str], split: Literal["train", "test"] = "train", *,
               name: str = "mnist", classes: tuple[str, ...] = MNIST_CLASSES) -> Dataset:
    """Read an MNIST-format split (MNIST, Fashion-MNIST, …) from the IDX files in ``data_dir``.

    Looks for ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte`` (``t10k-…`` for ``split="test"``),
    each optionally ``.gz``. Features are pixel/255 as float32, flattened, with ``sample_shape``
    ``(1, rows, cols)``; targets are the labels as class codes.
    """
    if split not in _MNIST_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: no such directory (expected the {name} IDX files there)")
    images_path, labels_path = (_find(data_dir, pattern) for pattern in _MNIST_FILES[split])
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataFileError(images_path, f"expected a 3-D unsigned-byte image array, got {images.dtype.name} "
                                         f"of shape {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataFileError(labels_path, f"expected a 1-D unsigned-byte label array, got {labels.dtype.name} "
                                         f"of shape {labels.shape}")
    if labels.shape[0] != images.shape[0]:
        raise DataFileError(labels_path, f"{labels.shape[0]} labels for {images.shape[0]} images in "
                                         f"{images_path.name}")
    if labels.size and labels.max() >= len(classes):
        raise DataFileError(labels_path, f"label {labels.max()} outside the {len(classes)} classes")
    n, rows, cols = images.shape
    features = images.reshape(n, rows * cols).astype(np.float32) / np.float32(255)
    return Dataset(features, labels.astype(np.int64), "classification", name, num_classes=len(classes),
                   classes=classes, sample_shape=(1, rows, cols))
