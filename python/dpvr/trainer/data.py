"""A user's ``Dataset`` or ``DataLoader`` as the records dpvr's samplers draw from.

dpvr draws every batch itself, from the scheme its accountant prices (Poisson, fixed-size without
replacement, random allocation, cyclic, full batch), so a ``DataLoader``'s own sampler, shuffling, batch size
and ``drop_last`` are not used: its dataset, its ``collate_fn`` and its loading options (workers, pinned
memory, prefetching, worker init function, generator) are. That replacement is announced once with a
warning.

:func:`dataset_records` reads no more than a fixed handful of records at set-up: each step then loads exactly
the records drawn (:class:`~dpvr.optim.records.DatasetRecords`), so random augmentations in ``__getitem__``
are fresh at every access, datasets larger than memory work and ``collate_fn`` runs per batch. A plain
``TensorDataset`` (with the default collate) is already in memory: its tensors are indexed directly
(:class:`~dpvr.optim.records.TensorRecords`), as fast as before and with DIFF2's full-batch recording reuse.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.dataloader import default_collate

from ..optim.records import DatasetRecords, Records, TensorRecords


def dataset_records(
    data: Dataset | DataLoader | Records,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    *,
    cache_full: bool = False,
    fingerprint: str | None = None,
    stacklevel: int = 3,
    batched: bool = True,
) -> Records:
    """The records of ``data`` for an algorithm of :mod:`dpvr.optim`, loaded on ``device`` with floating-point
    tensors cast to ``dtype`` (the model's, so that a float64 dataset does not meet a float32 model).

    - a :class:`~dpvr.optim.records.Records`: as it is;
    - a ``TensorDataset`` of two tensors, with the default collate: :class:`~dpvr.optim.records.TensorRecords`
      over its tensors (moved to ``device``; cast per batch);
    - any other map-style ``Dataset``, or a ``DataLoader`` of one:
      :class:`~dpvr.optim.records.DatasetRecords`, with the loader's ``collate_fn`` and loading options;
      ``cache_full`` and ``fingerprint`` are passed to it (see there).

    Each record must collate to an ``(input, target)`` pair of tensors (checked on the first records);
    an iterable dataset and an empty one are refused. ``stacklevel``: of the warning that a ``DataLoader``'s
    sampler is replaced, for the caller (3: the caller of the function calling this one); ``batched``: whether
    the loader's batch size is used (as the expected batch size: the algorithm draws one batch per step), as
    that warning says."""
    if isinstance(data, Records):
        return data
    collate: Any = default_collate
    loader: DataLoader | None = None
    if isinstance(data, DataLoader):
        size = ("its batch size becomes the expected batch size unless batch_size= is given" if batched else
                "its batch size is not used: this algorithm's batches are the full dataset or its per-stream "
                "batch_sizes")
        warnings.warn(
            "make_private: dpvr samples batches itself (the scheme its accountant prices), so the "
            f"DataLoader's sampler and shuffling are replaced ({size}); its dataset, collate_fn and loading "
            "options (workers, pinned memory, prefetching) stay",
            stacklevel=stacklevel,
        )
        loader, collate, data = data, data.collate_fn, data.dataset
    if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        raise TypeError(
            "data: a map-style Dataset (with __len__ and __getitem__) is required; an iterable dataset has "
            "no fixed size to sample from, so its privacy cannot be accounted"
        )
    if len(data) == 0:
        raise ValueError("data: the dataset is empty")
    if type(data) is TensorDataset and len(data.tensors) == 2 and collate is default_collate:
        x, y = (t if device is None else t.to(device) for t in data.tensors)
        return TensorRecords(x, y, dtype=dtype)
    options: dict[str, Any] = {"dtype": dtype, "device": device, "cache_full": cache_full,
                               "fingerprint": fingerprint}
    if loader is not None:
        return DatasetRecords.from_loader(loader, **options)
    return DatasetRecords(data, collate, **options)
