"""The dataset size stays public: under add/remove nothing that shapes a release reads the data's size.

Under add/remove adjacency a neighbouring dataset has one record more or less, so its size is private. Every
quantity that shapes a release (sampling rate, random allocation's epoch and divisor, the steps ``epochs``
makes, the calibrated noise, the theorem-derived defaults) must read a size stated public, or the run is
accounted under replace-one, where the size is public by definition. The release-level check (noise off,
``D`` against ``D'`` one record larger, calibrated noise) is in ``test_sensitivity.py``
(``test_a_record_more_changes_no_release_shape_under_add_remove``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpvr
from dpvr.algorithms import DIFF2, DPSGD
from dpvr.optim import PrivacyConfig, RuntimeConfig


def _data(n: int, d: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)


def _dpsgd(n: int, privacy: PrivacyConfig, **options) -> DPSGD:
    x, y = _data(n)
    options = {"lr": 0.1, "clip": 1.0, "steps": 20, "batch_size": 100, **options}
    return DPSGD(nn.Linear(3, 1), nn.MSELoss(), x, y, privacy=privacy, **options)


@pytest.mark.parametrize("sampling", ["poisson", "random-allocation"])
def test_neighbours_one_record_apart_get_the_same_release_shape(sampling):
    """The review's case: random allocation, b = 100, n = 1050 against 1051, 20 steps at epsilon 1. Read from
    the data, the epoch was 10 against 11, the divisor 105 against 96 and the noise multiplier 1.840
    against 1.771 (a hockey-stick lower bound of epsilon >= 91.9 at d = 1000). With N = 1050 stated public,
    every one of them is the same on both datasets."""
    privacy = PrivacyConfig(epsilon=1.0, public_dataset_size=1050)
    a, b = (_dpsgd(n, privacy, sampling=sampling) for n in (1050, 1051))
    assert a.plan == b.plan and a.plan.neighbouring == "add-remove"
    assert a.noise == b.noise
    assert (a.sampler.rate, a.sampler.batch_size, a.sampler.steps_per_epoch) == (
        b.sampler.rate, b.sampler.batch_size, b.sampler.steps_per_epoch,
    )  # fmt: skip
    assert a.sampler.batch_size == (105 if sampling == "random-allocation" else 100)
    # ... and the larger dataset's every record is drawn: each one in one step of an epoch.
    if sampling == "random-allocation":
        epoch = [b.sampler.draw() for _ in range(b.sampler.steps_per_epoch)]
        assert sorted(i for batch in epoch for i in batch) == list(range(1051))


def test_without_a_public_size_poisson_is_accounted_under_replace_one():
    """No public size stated: the size of the data is read, so the run is priced under replace-one (where it
    is public by definition), and privacy_spent() says so."""
    alg = _dpsgd(1050, PrivacyConfig(epsilon=1.0))
    report = alg.privacy_spent()
    assert report.neighbouring == "replace-one" and alg.plan.dataset_size == 1050
    assert any("n = 1050 is public by definition" in a for a in report.assumptions)
    stated = _dpsgd(1050, PrivacyConfig(epsilon=1.0, public_dataset_size=1050)).privacy_spent()
    assert stated.neighbouring == "add-remove"
    assert any("N = 1050 is public (stated)" in a for a in stated.assumptions)


@pytest.mark.parametrize(
    ("privacy", "options", "match"),
    [
        (PrivacyConfig(epsilon=1.0, neighbouring="add-remove"), {}, "public_dataset_size"),
        (PrivacyConfig(epsilon=1.0), {"sampling": "random-allocation"}, "public_dataset_size"),
        (PrivacyConfig(epsilon=1.0, public_dataset_size=1000), {"sampling": "wor"}, "replace-one"),
        (PrivacyConfig(epsilon=1.0, neighbouring="replace-one", public_dataset_size=1000), {}, "1050 rec"),
        (PrivacyConfig(epsilon=1.0, public_dataset_size=1000), {"sampling": "full"}, "add-remove"),
        (PrivacyConfig(epsilon=1.0, accountant="rdp"), {}, "accountant='rdp'"),
    ],
    ids=["add-remove-unstated", "allocation-unstated", "wor-stated", "replace-one-other-size", "full", "rdp"],
)
def test_a_size_the_accounting_cannot_use_is_refused(privacy, options, match):
    with pytest.raises(ValueError, match=match):
        _dpsgd(1050, privacy, **options)


@pytest.mark.parametrize("size", [0, -3, 2.5, True, "1000"])
def test_a_public_size_is_a_whole_number(size):
    with pytest.raises(ValueError, match="public_dataset_size"):
        PrivacyConfig(public_dataset_size=size)


def test_an_algorithm_that_accounts_another_size_refuses_the_stated_one():
    """DIFF2 is accounted under replace-one on its clients' data: a stated size that differs is never
    silently ignored."""
    x, y = _data(40)
    with pytest.raises(ValueError, match="public_dataset_size=50"):
        DIFF2(nn.Linear(3, 1), nn.MSELoss(), [(x, y)], lr=0.1, clip={"restart": 1.0, "difference": 1.0},
              steps=4, restart=2, noise={"restart": 1.0, "difference": 1.0},
              privacy=PrivacyConfig(public_dataset_size=50))


def _trainer(n: int, **kwargs) -> dpvr.PrivateTrainer:
    x, y = _data(n)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=100)
    return dpvr.make_private(model, nn.MSELoss(), loader, algorithm="dp-sgd", epsilon=1.0, lr=0.1, clip=1.0,
                             runtime=RuntimeConfig(grad_mode="materialised"), **kwargs)


def test_make_private_epochs_read_the_public_size():
    """``epochs=2`` at b = 100: 1000 records made 20 steps and 1001 made 22 (the count alone told the
    neighbours apart). With N = 1000 stated public both make 20, with the same noise."""
    a, b = (_trainer(n, epochs=2, public_dataset_size=1000) for n in (1000, 1001))
    assert a.algorithm.steps == b.algorithm.steps == 20
    assert a.algorithm.noise == b.algorithm.noise
    assert a.privacy_spent().neighbouring == "add-remove"
    # Without a public size the data's own is read, under replace-one.
    c = _trainer(1001, epochs=2)
    assert c.algorithm.steps == 22 and c.privacy_spent().neighbouring == "replace-one"
