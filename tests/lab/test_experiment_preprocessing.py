"""Each experiment's preprocessing takes no statistic of the private training split: changing one private
record changes that record's preprocessed value and no other private record's, so the per-record
sensitivity argument covers the pipeline."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable

import numpy as np
import pytest
import torch

from dpvr.data import Dataset, load
from dpvr_lab.experiments import auc, diff2, dro, last_iterate, phased, td, transfer, wgan
from neighbours import one_record_moved


def _indices(part: Dataset, whole: Dataset) -> list[int]:
    """Where the records of ``part`` sit in ``whole`` (matched by value: the bundled records are unique)."""
    position = {row.tobytes(): i for i, row in enumerate(whole.features)}
    return [position[row.tobytes()] for row in part.features]


def _assert_each_change_stays_in_its_record(
    private_rows: Callable[[Dataset], np.ndarray | torch.Tensor], data: Dataset, indices: Iterable[int]
) -> None:
    """Changing any of the records at ``indices`` changes at most one row of the preprocessed private
    training records ``private_rows(data)``; and some of them do reach it."""
    before = np.asarray(private_rows(data))
    reached = 0
    for index in indices:
        after = np.asarray(private_rows(one_record_moved(data, index, 1.0)))
        moved = np.flatnonzero(np.any(after != before, axis=1))
        assert len(moved) <= 1, f"changing record {index} moved {len(moved)} private records"
        reached += len(moved)
    assert reached, "none of the changed records is in the private training split"


def _loading(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> Callable[[Dataset], None]:
    """A setter of what ``module``'s ``load`` returns."""
    def serve(data: Dataset) -> None:
        monkeypatch.setattr(module, "load", lambda name, **options: data)
    return serve


def test_diff2_scales_features_and_targets_with_the_public_split():
    data = load("diabetes")

    def private_rows(d: Dataset) -> torch.Tensor:
        prepared = diff2._prepare(d, seed=0, clients=diff2.CLIENTS)
        return torch.cat(prepared.train, dim=1)

    _public, train, _test = diff2._split(data, seed=0)
    _assert_each_change_stays_in_its_record(private_rows, data, _indices(train, data)[:5])


def test_last_iterate_standardises_with_the_public_split_then_normalises_each_record():
    data = load("breast_cancer")

    def private_rows(d: Dataset) -> torch.Tensor:
        x, y, _, _ = last_iterate._prepare(d, seed=0)
        return torch.cat([x, y[:, None]], dim=1)

    _public, train, _test = last_iterate._split(data, seed=0)
    _assert_each_change_stays_in_its_record(private_rows, data, _indices(train, data)[:5])


def test_phased_logistic_regression_standardises_with_the_public_split():
    data = load("breast_cancer")
    _public, private = phased._split(data, 128, seed=0)
    _assert_each_change_stays_in_its_record(
        lambda d: phased._logistic_problem(d, 128, seed=0).features, data, _indices(private, data)[:5]
    )


@pytest.mark.parametrize(
    ("module", "private_rows"),
    [
        (auc, lambda: auc._prepare("digits-imbalanced", None, seed=0).train[0]),
        (dro, lambda: dro._prepare("digits-st", seed=0).train[0]),
        (wgan, lambda: wgan._data(seed=0)[0]),
        (transfer, lambda: transfer._split("transfer-heavy-tailed", seed=0).private.train[0]),
    ],
    ids=["auc", "dro", "wgan", "transfer"],
)
def test_digits_experiments_map_the_declared_pixel_range(monkeypatch, module, private_rows):
    serve = _loading(monkeypatch, module)

    def rows(d: Dataset) -> torch.Tensor:
        serve(d)
        return private_rows()

    _assert_each_change_stays_in_its_record(rows, load("digits"), range(60))


def test_td_transitions_enter_as_the_environment_gives_them(monkeypatch):
    """No statistic is fitted: each private transition is its own two states, unscaled."""
    observations = np.random.default_rng(0).normal(size=(31, 4))

    class Environment:
        action_space = types.SimpleNamespace(seed=lambda seed: None, sample=lambda: 0)

        def reset(self, seed=None):
            self.t = 0
            return observations[0], {}

        def step(self, action):
            self.t += 1
            return observations[self.t], 1.0, False, False, {}

        def close(self):
            pass

    monkeypatch.setattr(td, "_gymnasium", lambda: types.SimpleNamespace(make=lambda name: Environment()))
    inputs, targets = td.collect("cartpole", 30, seed=0)
    expected = np.concatenate([observations[:-1], observations[1:]], axis=1)
    np.testing.assert_array_equal(inputs.numpy(), expected.astype(np.float32))
    assert torch.equal(targets, torch.tensor([[1.0, 0.0]] * 30))
