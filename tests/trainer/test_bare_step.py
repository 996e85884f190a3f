"""A step of the trainer ``make_private`` returns is the bare algorithm's step: the same binding and, with the
same seeds, the same released parameters bit for bit, whatever the front door does around it (loading the
records, turning the batched criterion into a per-record loss, checks, logging)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import grad, vmap
from torch.utils.data import Dataset, TensorDataset

import dpvr
from dpvr.algorithms import DPSGD
from dpvr.optim import RuntimeConfig
from dpvr.optim.records import DatasetRecords
from dpvr.trainer.losses import TokenLoss, per_sample

STEPS = 6


class _Pairs(Dataset):
    """A map-style dataset that is not a ``TensorDataset``: loaded per batch through a ``DataLoader``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _seeded(**options: str) -> RuntimeConfig:
    return RuntimeConfig(generator=dpvr.NoiseGenerator(5, reproducible=True), sampler_seed=9, **options)


def _data(kind: str) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(160, 12)
    if kind == "regression":
        model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, nn.MSELoss(), x, torch.randn(160, 1)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, nn.CrossEntropyLoss(), x, torch.randint(0, 3, (160,))


@pytest.mark.parametrize("kind, data, options", [
    ("classes", "tensors", {}),
    ("regression", "tensors", {}),
    ("classes", "dataset", {}),
    ("classes", "tensors", {"clipping": "adaptive"}),
    ("classes", "tensors", {"sampling": "wor"}),
    ("classes", "tensors", {"optimizer": "adam"}),
])
def test_make_private_releases_what_the_bare_algorithm_releases(kind: str, data: str, options: dict) -> None:
    model, criterion, x, y = _data(kind)
    settings = dict(options)
    twin = copy.deepcopy(model)
    if settings.pop("optimizer", None):
        mine, theirs = (dict(optimizer=torch.optim.Adam(m.parameters(), lr=0.01)) for m in (model, twin))
    else:
        mine = theirs = dict(lr=0.1)
    records = _Pairs(x, y) if data == "dataset" else TensorDataset(x, y)
    trainer = dpvr.make_private(model, criterion, records, algorithm="dp-sgd", epsilon=4.0, batch_size=24,
                                steps=STEPS, clip=1.0, runtime=_seeded(), **settings, **mine)
    inputs = DatasetRecords(_Pairs(x, y), dtype=torch.float32) if data == "dataset" else x
    chosen = trainer.algorithm.settings["runtime"].grad_mode  # make_private's choice after its checks
    bare = DPSGD(twin, per_sample(criterion), inputs, None if data == "dataset" else y, clip=1.0,
                 steps=STEPS, batch_size=24, privacy=trainer.algorithm.settings["privacy"],
                 runtime=_seeded(grad_mode=chosen), **settings, **theirs)
    assert trainer.algorithm.binding() == bare.binding()
    sizes = set()
    for _ in range(STEPS):
        info, bare_info = trainer.step(), bare.step()
        assert info["batch"] == bare_info["batch"]
        sizes.add(info["batch"])
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
    assert trainer.privacy_spent().epsilon == bare.privacy_spent().epsilon
    if settings.get("sampling", "poisson") == "poisson":
        assert len(sizes) > 1  # the batches' sizes vary, as Poisson draws do


@pytest.mark.parametrize("criterion, target", [
    (nn.CrossEntropyLoss(), lambda: torch.randint(0, 5, (7,))),
    (nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 5)), lambda: torch.randint(0, 5, (7,))),
    (nn.MSELoss(reduction="sum"), lambda: torch.randn(7, 5)),
    (TokenLoss(), lambda: torch.randint(0, 5, (7, 3))),
])
def test_the_per_record_loss_of_a_tensor_output_is_the_criterion_on_one_record(criterion, target) -> None:
    """Each record's loss and its gradient are the (rewritten, for a class-weighted mean) criterion's on a
    batch of that one record, bit for bit, under ``vmap`` as the clipper calls it."""
    torch.manual_seed(1)
    y = target()
    output = torch.randn(*y.shape, 5) if isinstance(criterion, TokenLoss) else torch.randn(7, 5)
    weighted = getattr(criterion, "weight", None) is not None
    loss = _quiet_per_sample(criterion) if weighted else per_sample(criterion)
    reference = copy.copy(criterion)
    if weighted:
        reference.reduction = "sum"  # the public normaliser (losses.per_sample)
    one = [reference(o.unsqueeze(0), t.unsqueeze(0)) for o, t in zip(output, y)]
    assert torch.equal(vmap(loss)(output, y), torch.stack(one))
    each = vmap(grad(loss))(output, y)
    for o, t, g in zip(output, y, each):
        assert torch.equal(g, grad(lambda u, t=t: reference(u.unsqueeze(0), t.unsqueeze(0)))(o))


def _quiet_per_sample(criterion: nn.Module):
    with pytest.warns(UserWarning, match="public normaliser|batch's total class weight"):
        return per_sample(criterion)
