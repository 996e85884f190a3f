"""Frictions found by redoing issue 48's new-user trial: each case failed on the code before the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.objectives import AUCMargin, AUCModel


def test_a_plain_list_of_records_is_one_dataset_for_a_non_federated_algorithm() -> None:
    # A Python list of (input, target) records is a map-style dataset; it was read as one client per record
    # and refused ("a list of datasets (one per client) is for the federated algorithms only").
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    records = [(x[i], y[i]) for i in range(64)]
    torch.manual_seed(0)
    trainer = dpvr.make_private(nn.Linear(4, 2), nn.CrossEntropyLoss(), records, algorithm="dp-sgd",
                                epsilon=4.0, steps=3, batch_size=16, lr=0.1, clip=1.0)
    trainer.run()
    assert trainer.algorithm.steps_done == 3


def test_a_list_of_datasets_is_still_refused_outside_the_federated_algorithms() -> None:
    shard = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match="one per client"):
        dpvr.make_private(nn.Linear(4, 2), nn.CrossEntropyLoss(), [shard, shard], algorithm="dp-sgd",
                          epsilon=4.0, steps=3, batch_size=4, lr=0.1, clip=1.0)


def test_passing_what_fix_returns_says_that_fix_works_in_place() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    changes = dpvr.fix(model)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    with pytest.raises(TypeError, match=r"in place .* pass the model itself"):
        dpvr.make_private(changes, nn.CrossEntropyLoss(), data, algorithm="dp-sgd", epsilon=4.0, steps=3,
                          batch_size=8, lr=0.1, clip=1.0)


def test_a_missing_per_stream_clip_names_the_streams() -> None:
    # It said only "clip: 'private-diff' needs this setting".
    data = TensorDataset(torch.randn(200, 5), (torch.rand(200) < 0.5).float())
    with pytest.raises(ValueError, match=r'clip=\{"checkpoint": C1, "difference": \(C2, C3\)'):
        dpvr.make_private(AUCModel(nn.Linear(5, 1)), AUCMargin(positive_ratio=0.5), data,
                          algorithm="private-diff", epsilon=2.0, batch_size=64, epochs=1, lr=0.1, lr_y=0.1)
