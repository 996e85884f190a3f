"""The :class:`Dataset` container shared by every loader, reader and transform in :mod:`dpvr.data`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

Task = Literal["regression", "classification"]
TASKS: tuple[str, ...] = ("regression", "classification")


@dataclass(frozen=True, eq=False)
class Dataset:
    """An in-memory supervised dataset.

    Attributes:
        features: ``(n, d)`` floating array. float64 for tabular sources; IDX image sets are float32 in
            [0, 1] (70,000 × 784 images take 220 MB that way). Images are stored flat; ``sample_shape``
            restores them.
        targets: ``(n,)`` array: int64 class codes in ``[0, num_classes)`` for classification, floating
            values for regression.
        task: ``"regression"`` or ``"classification"``.
        name: a short label carried through every transform (used in result files).
        num_classes: number of classes for classification, ``None`` for regression.
        classes: for classification, the original label of each class code (``classes[k]`` is code k).
        sample_shape: the shape of one sample, e.g. ``(1, 28, 28)`` for MNIST; ``(d,)`` for tabular data.
    """

    features: np.ndarray
    targets: np.ndarray
    task: Task
    name: str
    num_classes: int | None = None
    classes: tuple[Any, ...] | None = None
    sample_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        features, targets = np.asarray(self.features), np.asarray(self.targets)
        if features.ndim != 2 or not np.issubdtype(features.dtype, np.floating):
            raise ValueError(f"features must be a 2-D floating array, got {features.dtype} {features.shape}")
        if targets.shape != (features.shape[0],):
            raise ValueError(f"targets must have shape ({features.shape[0]},), got {targets.shape}")
        check_task(self.task)
        sample_shape = tuple(self.sample_shape) or (features.shape[1],)
        if int(np.prod(sample_shape)) != features.shape[1]:
            raise ValueError(f"sample_shape {sample_shape} does not hold {features.shape[1]} features")
        if self.task == "classification":
            targets = self._check_class_codes(targets)
        elif self.num_classes is not None or self.classes is not None:
            raise ValueError("a regression dataset has no num_classes or classes")
        else:
            targets = targets.astype(np.result_type(targets.dtype, np.float32), copy=False)
        object.__setattr__(self, "features", features)
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "sample_shape", sample_shape)

    def _check_class_codes(self, targets: np.ndarray) -> np.ndarray:
        if self.num_classes is None or self.num_classes < 1:
            raise ValueError(f"a classification dataset needs num_classes >= 1, got {self.num_classes}")
        if self.classes is not None and len(self.classes) != self.num_classes:
            raise ValueError(f"classes has {len(self.classes)} entries for {self.num_classes} classes")
        if targets.size and not np.issubdtype(targets.dtype, np.integer):
            raise ValueError(f"classification targets must be integer class codes, got {targets.dtype}")
        targets = targets.astype(np.int64, copy=False)
        if targets.size and (targets.min() < 0 or targets.max() >= self.num_classes):
            raise ValueError(f"class codes must lie in [0, {self.num_classes}), "
                             f"got [{targets.min()}, {targets.max()}]")
        return targets

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def subset(self, indices: np.ndarray | Sequence[int]) -> Dataset:
        """The samples at ``indices`` (in that order), with every other attribute unchanged."""
        indices = np.asarray(indices, dtype=np.int64)
        return dataclasses.replace(self, features=self.features[indices], targets=self.targets[indices])

    def class_counts(self) -> np.ndarray:
        """Number of samples of each class code (classification only)."""
        if self.task != "classification":
            raise ValueError(f"{self.name}: class_counts needs a classification dataset")
        return np.bincount(self.targets, minlength=self.num_classes)

    def tensors(self, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` as torch tensors, inputs reshaped to ``(n, *sample_shape)``.

        Inputs take ``dtype`` (default: the features' dtype); targets are int64 for classification and
        ``dtype`` for regression.
        """
        import torch  # the data layer itself stays numpy-only

        inputs = torch.as_tensor(self.features.reshape(len(self), *self.sample_shape), device=device)
        inputs = inputs.to(dtype) if dtype is not None else inputs
        targets = torch.as_tensor(self.targets, device=device)
        if self.task == "regression":
            targets = targets.to(inputs.dtype)
        return inputs, targets


def check_task(task: str) -> None:
    """Raise ``ValueError`` unless ``task`` is ``"regression"`` or ``"classification"``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def encode_labels(raw: np.ndarray) -> tuple[np.ndarray, tuple[Any, ...]]:
    """Map arbitrary labels to codes ``0..K-1`` in sorted label order; returns ``(codes, classes)``."""
    classes, codes = np.unique(raw, return_inverse=True)
    return codes.astype(np.int64).reshape(-1), tuple(c.item() for c in classes)


def labelled_dataset(features: np.ndarray, raw_targets: np.ndarray, task: Task, name: str) -> Dataset:
    """A :class:`Dataset` from file contents: classification labels are encoded, regression ones parsed."""
    if task == "classification":
        codes, classes = encode_labels(raw_targets)
        return Dataset(features, codes, task, name, num_classes=len(classes), classes=classes)
    return Dataset(features, np.asarray(raw_targets, dtype=np.float64), task, name)
