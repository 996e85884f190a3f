"""MNIST-1D (Greydanus and Ferrari, 2024): a procedurally generated 10-class set of 40-sample 1-D signals, as
datasets of any size that grow by nesting (``pip install "dpvr[mnist1d]"``).

The package's generator (``mnist1d.data.make_dataset``) is run locally, never its ``get_dataset``, which
downloads. Records are generated in chunks of :data:`CHUNK` with a seed per chunk, so a set of ``n``
training records is the first ``n`` of chunks ``0, 1, ...`` of the training seed range and the set of
``4n`` records contains the set of ``n``. Four disjoint seed ranges give four independent draws from the
same distribution:

- ``"train"``: the ``n`` (private) training records;
- ``"test"``: a fixed held-out set of :data:`TEST_SIZE` records, the same for every ``n``;
- ``"public"``: ``n`` records of a *public twin* of the training set (its own seeds): a stand-in on which
  hyper-parameters can be chosen without reading the private records;
- ``"validation"``: a fixed public validation set of :data:`VALIDATION_SIZE` records.

The generator standardises each chunk with that chunk's own mean and standard deviation (one pair of
scalars over its ``4,000 x 40`` values; the signals are synthetic and these constants are the same to
three digits in every chunk). Chunks are cached as ``.npz`` files under :func:`cache_dir` (generation takes
about 0.5 ms per record), never in the working tree.
"""

from __future__ import annotations

import os
import re
from typing import Literal

import numpy as np

from .dataset import Dataset

CHUNK = 4000
"""Records generated per seed."""
TEST_SIZE = 8000
VALIDATION_SIZE = 4000
VERSION = 1  # bump when the generation below changes: it names the cache files
_SEED_BASE = {"train": 1_000_000, "test": 2_000_000, "public": 3_000_000, "validation": 4_000_000}
CLASSES: tuple[int, ...] = tuple(range(10))
NAME_PATTERN = re.compile(r"^mnist1d_(\d+)(k?)$")
SIZES: tuple[str, ...] = ("mnist1d_4k", "mnist1d_16k", "mnist1d_64k", "mnist1d_256k")
"""The registered names (:func:`dpvr.data.load`); any ``mnist1d_<n>`` or ``mnist1d_<n>k`` is accepted."""

Split = Literal["train", "test", "public", "validation"]


def cache_dir() -> str:
    """Where generated chunks are kept: ``$DPVR_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpvr``, else
    ``~/.cache/dpvr``."""
    if os.environ.get("DPVR_CACHE_DIR"):
        return os.environ["DPVR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dpvr")


def generate_chunk(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """:data:`CHUNK` records generated with ``seed``: float64 ``(CHUNK, 40)`` signals, int64 labels.

    Deterministic, and the global numpy random state is restored afterwards (the generator seeds it)."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset  # optional: the "mnist1d" extra
    except ImportError as err:
        raise ImportError('MNIST-1D datasets need the mnist1d package: pip install "dpvr[mnist1d]"') from err
    args = get_dataset_args()
    args.num_samples, args.train_split, args.seed = CHUNK, 1.0, int(seed)
    state = np.random.get_state()
    try:
        generated = make_dataset(args)
    finally:
        np.random.set_state(state)
    return np.asarray(generated["x"], dtype=np.float64), np.asarray(generated["y"], dtype=np.int64)


def _chunk(seed: int, cache: bool) -> tuple[np.ndarray, np.ndarray]:
    path = os.path.join(cache_dir(), "mnist1d", f"v{VERSION}-chunk{CHUNK}-seed{seed}.npz")
    if cache and os.path.isfile(path):
        with np.load(path) as stored:
            return stored["x"], stored["y"]
    x, y = generate_chunk(seed)
    if cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(temporary, x=x, y=y)
        os.replace(temporary, path)
    return x, y


def parse_size(name: str) -> int | None:
    """The training size a name such as ``mnist1d_16k`` (16,000) or ``mnist1d_5000`` asks for; ``None`` if
    ``name`` is not an MNIST-1D name."""
    match = NAME_PATTERN.match(name.lower().replace("-", "_"))
    if match is None:
        return None
    return int(match.group(1)) * (1000 if match.group(2) else 1)


def load_mnist1d(n: int, split: Split = "train", *, cache: bool = True) -> Dataset:
    """MNIST-1D's ``split`` for a training size of ``n`` records (module documentation): ``n`` records for
    ``"train"`` and ``"public"``, :data:`TEST_SIZE` for ``"test"``, :data:`VALIDATION_SIZE` for
    ``"validation"``. Features are float64 ``(len, 40)``; targets the digit classes 0..9."""
    if split not in _SEED_BASE:
        raise ValueError(f"split must be one of {tuple(_SEED_BASE)}, got {split!r}")
    if not n >= 1:
        raise ValueError(f"n must be at least 1, got {n}")
    size = {"test": TEST_SIZE, "validation": VALIDATION_SIZE}.get(split, int(n))
    chunks = [_chunk(_SEED_BASE[split] + i, cache) for i in range(-(-size // CHUNK))]
    x = np.concatenate([c[0] for c in chunks])[:size]
    y = np.concatenate([c[1] for c in chunks])[:size]
    name = f"mnist1d_{n}" if split in ("train", "public") else "mnist1d"
    return Dataset(x, y, "classification", f"{name}_{split}", num_classes=len(CLASSES), classes=CLASSES)


__all__ = [
    "CHUNK",
    "SIZES",
    "TEST_SIZE",
    "VALIDATION_SIZE",
    "cache_dir",
    "generate_chunk",
    "load_mnist1d",
    "parse_size",
]
