"""Neighbouring datasets for the preprocessing tests."""

from __future__ import annotations

import numpy as np

from dpvr.data import Dataset


def one_record_moved(data: Dataset, index: int, by: float) -> Dataset:
    """A copy of ``data`` with record ``index`` moved by ``by``: its features, and its target for
    regression."""
    changed = data.subset(np.arange(len(data)))
    changed.features[index] += by
    if data.task == "regression":
        changed.targets[index] += by
    return changed
