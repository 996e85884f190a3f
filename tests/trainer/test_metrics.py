"""Issue 48, item 7 (small parts): a one-line privacy_spent() print, metrics to the ``dpvr`` logger and to a
TensorBoard-style ``SummaryWriter``.

Before: ``print(trainer.privacy_spent())`` printed the whole dataclass (every assumption, ~900 characters),
and metrics were in the step dictionaries only.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpvr

N = 64
G = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(N, 3, generator=G), torch.randint(0, 2, (N,), generator=G))


def _trainer(steps: int = 3, **kw) -> dpvr.PrivateTrainer:
    return dpvr.make_private(nn.Linear(3, 2), nn.CrossEntropyLoss(), DATA, algorithm="dp-sgd", batch_size=8,
                             steps=steps, lr=0.1, clip=1.0, **{"epsilon": 1.0, **kw})


def test_privacy_spent_prints_on_one_line() -> None:
    trainer = _trainer()
    trainer.run()
    report = trainer.privacy_spent()
    line = str(report)
    assert "\n" not in line and len(line) < 120
    assert line.startswith(f"epsilon={report.epsilon:.4g} at delta=1e-05 (PLD, replace-one")
    assert f"gradient: noise multiplier {report.noise_multipliers['gradient']:.4g}" in line
    assert "epsilon=inf (unbounded)" in str(_ran(_trainer(steps=1, epsilon=None, noise_multiplier=1e-6)))


def _ran(trainer: dpvr.PrivateTrainer):
    trainer.run()
    return trainer.privacy_spent()


class _Writer:
    """What TensorBoard's SummaryWriter offers that the trainer uses."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))


def test_one_log_line_per_step_at_info_and_none_by_default(caplog) -> None:
    trainer = _trainer()
    with caplog.at_level(logging.WARNING, logger="dpvr"):
        trainer.step()
    assert not [r for r in caplog.records if r.name == "dpvr"]
    with caplog.at_level(logging.INFO, logger="dpvr"):
        trainer.run()
    lines = [r.getMessage() for r in caplog.records if r.name == "dpvr"]
    assert [line.split(":")[0] for line in lines] == ["DP-SGD step 2/3", "DP-SGD step 3/3"]


def test_a_writer_gets_each_steps_scalars_and_the_epsilon_spent() -> None:
    trainer, writer = _trainer(), _Writer()
    infos = trainer.run(writer=writer)
    numeric = [k for k, v in infos[0].items() if isinstance(v, (int, float, torch.Tensor))]
    assert numeric
    for step in (1, 2, 3):
        assert {t for t, _, s in writer.scalars if s == step} >= {f"dpvr/{k}" for k in numeric}
    assert writer.scalars[-1] == ("dpvr/epsilon", trainer.privacy_spent().epsilon, 3)
