"""Data-parallel private training over a gloo process group (two processes on this machine): one logical
run, the same on every process, whose clipped sums are the one-process run's to float rounding."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.optim.gradients import ClippedGradients
from dpvr.trainer.losses import per_sample
from test_noise_drawn import assert_standard_normal, drawn_noise

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _runtime(seed: int = 5) -> dpvr.RuntimeConfig:
    return dpvr.RuntimeConfig(sampler_seed=seed, generator=dpvr.NoiseGenerator(7, reproducible=True))


def _train(process_group=None, runtime=None, algorithm="dp-sgd", module=None) -> dpvr.PrivateTrainer:
    return dpvr.make_private(module or _model(), nn.CrossEntropyLoss(), _data(), algorithm=algorithm,
                             epsilon=2.0, batch_size=40, steps=5, lr=0.5, clip=1.0, runtime=runtime,
                             process_group=process_group)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer = _train(runtime=_runtime())
        x, y = _data().tensors
        engine = trainer.algorithm.gradients  # the all-reduced clipped sums, on this rank's share
        sums = [torch.zeros(p.numel()) for p in trainer.model.parameters()]
        engine.sum(x[rank::world], y[rank::world], 0.5, sums)
        with drawn_noise() as draws:  # every release's noise, recovered from its inputs and output
            trainer.run()
        priced = trainer.algorithm.noise["gradient"] * 1.0 / 40  # z C / b: the std the accountant prices
        noise = np.concatenate([drawn / priced for drawn, _ in draws["gradient"]])
        stopped = _train(runtime=_runtime())  # the same run, stopped after two steps
        stopped.run(2)
        stopped.save_checkpoint(f"{out}.ckpt")  # rank 0 writes it, every rank waits
        resumed = _train(runtime=_runtime())
        resumed.load_checkpoint(f"{out}.ckpt")  # every rank loads it and goes on in step
        resumed.run()
        refusals = []
        for attempt in (lambda: _train(module=nn.parallel.DistributedDataParallel(_model())),
                        lambda: _train(algorithm="dp-sgda"),
                        lambda: _train(runtime=_runtime(seed=5 + rank))):
            try:
                attempt()
            except (ValueError, TypeError) as err:
                refusals.append(str(err))
        torch.save({"params": [p.detach() for p in trainer.model.parameters()], "sums": sums,
                    "epsilon": trainer.privacy_spent().epsilon, "refusals": refusals,
                    "resumed": [p.detach() for p in resumed.model.parameters()],
                    "resumed_epsilon": resumed.privacy_spent().epsilon, "noise": torch.as_tensor(noise)},
                   f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_run_one_logical_run(tmp_path) -> None:
    out = str(tmp_path / "rank")
    mp.spawn(_rank, args=(2, _free_port(), out), nprocs=2)
    ranks = [torch.load(f"{out}-{r}.pt") for r in range(2)]
    alone = _train(runtime=_runtime())
    alone.run()
    # Every process holds the same model, bit for bit, and reports the one-process run's epsilon.
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] == pytest.approx(alone.privacy_spent().epsilon)
    # The all-reduced clipped sum is the whole batch's (one process), to the rounding of the additions.
    x, y = _data().tensors
    model = _model()
    expected = [torch.zeros(p.numel()) for p in model.parameters()]
    ClippedGradients(model, per_sample(nn.CrossEntropyLoss())).sum(x, y, 0.5, expected)
    for got, want in zip(ranks[0]["sums"], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Stopped after two steps, checkpointed by rank 0, resumed on both ranks: the uninterrupted run.
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], ranks[0]["params"]))
        assert r["resumed_epsilon"] == pytest.approx(r["epsilon"])
    # The noise is drawn once per release (the same draw on both ranks), at the std its accountant prices.
    assert torch.equal(ranks[0]["noise"], ranks[1]["noise"])
    assert_standard_normal("gradient", ranks[0]["noise"].numpy())
    messages = ranks[0]["refusals"]
    assert len(messages) == 3
    assert "DistributedDataParallel" in messages[0] and "ddp_model.module" in messages[0]
    assert "supports ['dp-sgd', 'dp-gd']" in messages[1]
    assert "the same sampler_seed and noise generator on every process" in messages[2]
