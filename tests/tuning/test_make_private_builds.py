"""Issue 48, item 3: dpvr.tuning.tune takes a make_private build, and cleans each trial up.

Before: ``build must return a dpvr PrivateAlgorithm, got PrivateTrainer``; the workaround (``.algorithm``,
epsilon/delta/accountant mapped by hand) left every trial's DataLoader workers alive (16 worker processes
after a search of 10 trials with 2 workers), and a later trial's worker that collected an earlier trial's
loader printed ``AssertionError: can only test a child process``.
"""

from __future__ import annotations

import copy
import gc
import multiprocessing
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dpvr
from dpvr.optim import PrivacyConfig
from dpvr.tuning import tune

N, DELTA = 64, 1e-5


class _Records(Dataset):
    """A map-style dataset (not a TensorDataset), so that it is loaded through DataLoader workers."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 3, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _collect_in_worker(_: int) -> None:
    # What a worker's own garbage collector may do at any time: collect what its parent left in cycles.
    gc.collect()


def _loader(**options) -> DataLoader:
    return DataLoader(_Records(), batch_size=16, num_workers=2, multiprocessing_context="fork", **options)


TEMPLATE = nn.Linear(3, 2)


def _build(loader: DataLoader, *, unwrap: bool = False):
    """A make_private build; ``unwrap``: the earlier workaround, its ``.algorithm`` with the privacy mapped
    by hand."""
    def build(lr: float, privacy: PrivacyConfig):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the DataLoader's sampler is replaced: announced, expected
            if unwrap:
                return dpvr.make_private(
                    copy.deepcopy(TEMPLATE), nn.CrossEntropyLoss(), loader, algorithm="dp-sgd",
                    epsilon=privacy.epsilon, delta=privacy.delta, accountant=privacy.accountant,
                    public_dataset_size=privacy.public_dataset_size, clip=1.0, lr=lr, steps=3,
                ).algorithm
            return dpvr.make_private(copy.deepcopy(TEMPLATE), nn.CrossEntropyLoss(), loader,
                                     algorithm="dp-sgd", privacy=privacy, clip=1.0, lr=lr, steps=3)
    return build


def _score(run) -> float:
    with torch.no_grad():
        return -float(nn.functional.cross_entropy(run.model(_Records().x), _Records().y))


def _workers() -> int:
    return len(multiprocessing.active_children())


def test_tune_takes_a_make_private_build_and_keeps_its_accounting() -> None:
    privacy = PrivacyConfig(public_dataset_size=N)  # RDP (the search's accountant) prices Poisson add/remove
    result = tune(_build(_loader()), [0.05, 0.5], epsilon=2.0, delta=DELTA, score=_score, trials_mean=3,
                  distribution="poisson", privacy=privacy, seed=0, reproducible=True)
    assert result.trials_drawn >= 1
    assert isinstance(result.trainer, dpvr.PrivateTrainer)
    assert result.algorithm is result.trainer.algorithm
    assert result.best in (0.05, 0.5) and result.trainer.algorithm.lr == result.best
    # The trial ran at the calibrated per-trial noise, and spent no more than the per-trial budget.
    assert result.trainer.algorithm.noise == result.noise
    assert result.trainer.privacy_spent(DELTA).epsilon <= result.per_trial_epsilon * (1 + 1e-9)
    assert result.epsilon <= 2.0


@pytest.mark.parametrize("unwrap", [False, True], ids=["trainer", "algorithm"])
def test_each_trial_is_closed_no_worker_outlives_the_search(unwrap: bool, capfd) -> None:
    before = _workers()
    build = _build(_loader(worker_init_fn=_collect_in_worker), unwrap=unwrap)
    privacy = PrivacyConfig(public_dataset_size=N)
    result = tune(build, [0.05, 0.5], epsilon=2.0, delta=DELTA, score=_score, trials_mean=4,
                  distribution="poisson", privacy=privacy, seed=1, reproducible=True)
    assert result.trials_drawn >= 2  # so that a later trial's workers were forked after an earlier trial
    assert _workers() == before  # every trial's workers (the best one's too) shut down
    err = capfd.readouterr().err
    assert "can only test a child process" not in err
    assert "Exception ignored" not in err
    # The best trial stays usable: its workers start again when it is read.
    result.algorithm.records.batch([0, 1, 2])
    assert _workers() > before
    result.algorithm.close()
    assert _workers() == before


def test_make_private_privacy_argument_and_its_conflicts() -> None:
    data = torch.utils.data.TensorDataset(_Records().x, _Records().y)
    privacy = PrivacyConfig(epsilon=1.0, delta=1e-6, accountant="rdp", public_dataset_size=N)
    trainer = dpvr.make_private(copy.deepcopy(TEMPLATE), nn.CrossEntropyLoss(), data, algorithm="dp-sgd",
                                privacy=privacy, batch_size=8, clip=1.0, lr=0.1, steps=3)
    assert trainer.algorithm.privacy == privacy
    report = trainer.privacy_spent()
    assert (report.accountant, report.neighbouring, report.delta) == ("rdp", "add-remove", 1e-6)
    with pytest.raises(ValueError, match="epsilon: given twice"):
        dpvr.make_private(copy.deepcopy(TEMPLATE), nn.CrossEntropyLoss(), data, algorithm="dp-sgd",
                          privacy=privacy, epsilon=2.0, batch_size=8, clip=1.0, lr=0.1, steps=3)
    with pytest.raises(ValueError, match="accountant: 'pld' differs from privacy.accountant='rdp'"):
        dpvr.make_private(copy.deepcopy(TEMPLATE), nn.CrossEntropyLoss(), data, algorithm="dp-sgd",
                          privacy=privacy, accountant="pld", batch_size=8, clip=1.0, lr=0.1, steps=3)
    with pytest.raises(TypeError, match="privacy: expected a dpvr.optim.PrivacyConfig"):
        dpvr.make_private(copy.deepcopy(TEMPLATE), nn.CrossEntropyLoss(), data, algorithm="dp-sgd",
                          privacy={"epsilon": 1.0}, batch_size=8, clip=1.0, lr=0.1, steps=3)


def test_a_build_returning_something_else_is_named() -> None:
    with pytest.raises(TypeError, match="PrivateAlgorithm .* or a make_private trainer, got str"):
        tune(lambda lr, privacy: "model", [0.1], epsilon=1.0, delta=DELTA, score=_score, trials_mean=2,
             seed=0, reproducible=True)
