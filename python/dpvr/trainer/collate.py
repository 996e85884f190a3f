"""Collate functions a private run may use: those that treat each record on its own.

dpvr applies a ``DataLoader``'s ``collate_fn`` to every batch it draws. A collate that mixes records (mixup,
cutmix, batch-level normalisation) makes each collated record a function of others, so one record then
moves several clipped terms and the sensitivity bound is broken. Which collates are record-wise cannot be
read off the code, so it is declared: torch's ``default_collate`` is, :func:`pad_collate`'s collates are,
and any other must be marked with :func:`recordwise` (a promise the run's guarantee rests on, spot-checked
by :func:`check_collate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten
from torch.utils.data.dataloader import default_collate
from torch.utils.data.dataset import Dataset

_MARK = "__dpvr_recordwise__"
F = TypeVar("F", bound=Callable[..., Any])


def recordwise(collate: F) -> F:
    """Declares ``collate`` record-wise: each record's part of its output depends on that record only (and
    on public constants). Returns ``collate`` itself, marked.

    Args:
        collate: a ``DataLoader`` collate function; :func:`dpvr.make_private` spot-checks the declaration.

    Returns:
        ``collate``, marked (or, for a builtin or bound method that cannot carry the mark, a marked wrapper).

    Raises:
        TypeError: ``collate`` is not callable.
    """
    if not callable(collate):
        raise TypeError(f"recordwise: expected a collate function, got {type(collate).__name__}")
    try:
        setattr(collate, _MARK, True)
    except AttributeError:  # a builtin or a bound method: wrap it
        def wrapped(batch: Sequence[Any]) -> Any:
            return collate(batch)

        setattr(wrapped, _MARK, True)
        return wrapped  # type: ignore[return-value]
    return collate


def pad_collate(length: int, value: float = 0) -> Callable[[Sequence[Any]], tuple[Tensor, Tensor]]:
    """A record-wise collate for ``(sequence, target)`` records of different lengths: each sequence (first
    dimension) is cut or padded with ``value`` to ``length``; targets are collated by ``default_collate``.

    The length is fixed and public on purpose: padding to the longest sequence of the batch would make each
    record's input depend on the others' lengths, which is record-wise only for a model that ignores
    padding, something dpvr cannot check.

    Args:
        length: the public sequence length every record is cut or padded to.
        value: the padding value.

    Returns:
        A record-wise collate function ``batch -> (sequences, targets)``.

    Raises:
        ValueError: ``length`` is not a positive integer.
    """
    if not (isinstance(length, int) and length > 0):
        raise ValueError(f"length: must be a positive integer, got {length!r}")

    def collate(batch: Sequence[Any]) -> tuple[Tensor, Tensor]:
        sequences, targets = zip(*batch)
        out = []
        for s in sequences:
            s = torch.as_tensor(s)[:length]
            pad = s.new_full((length - len(s), *s.shape[1:]), value)
            out.append(torch.cat([s, pad]))
        return torch.stack(out), default_collate(list(targets))

    return recordwise(collate)


def is_recordwise(collate: Callable[..., Any]) -> bool:
    return collate is default_collate or bool(getattr(collate, _MARK, False))


def check_collate(collate: Callable[..., Any], dataset: Dataset, count: int = 4) -> None:
    """Refuses a ``collate`` not declared record-wise, and one declared so whose output for the first
    ``count`` records differs from collating them one at a time (it mixes records, or draws randomness per
    batch: move random augmentation into the ``Dataset``). Reads a few private records; the error is a
    diagnostic for the data holder."""
    if not is_recordwise(collate):
        raise ValueError(
            f"collate_fn: {getattr(collate, '__name__', type(collate).__name__)} is applied to every batch, "
            "and dpvr cannot tell whether it treats each record on its own; one that mixes records (mixup, "
            "cutmix, batch statistics) breaks the privacy guarantee. If it is record-wise, declare it with "
            "dpvr.recordwise(collate_fn); for variable-length records use dpvr.pad_collate(length)"
        )
    records = [dataset[i] for i in range(min(count, len(dataset)))]
    if len(records) < 2:
        return
    batch = _tensors(collate(records))
    alone = [_tensors(collate([r])) for r in records]
    for k, leaf in enumerate(batch):
        parts = [a[k] for a in alone]
        if any(p.shape[1:] != leaf.shape[1:] for p in parts):
            continue  # shapes depend on the batch (declared record-wise): nothing to compare
        joined = torch.cat(parts)
        if joined.shape == leaf.shape and not torch.equal(joined, leaf):
            raise ValueError(
                "collate_fn: declared record-wise, but a record collated in a batch differs from the same "
                "record collated alone, so it mixes records (mixup, cutmix?) or draws randomness per batch; "
                "do per-record augmentation in the Dataset's __getitem__"
            )


def _tensors(output: Any) -> list[Tensor]:
    return [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.dim() > 0]
