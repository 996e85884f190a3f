"""The processes of a data-parallel run agree on the whole run before the first release, or it is refused on
every process (two gloo processes on this machine).

Why: each process loads every ``world``-th index of a drawn batch from its *own* dataset, so a dataset that
another process holds in another order (or with one record more) lets one record be loaded by two processes
and counted twice in the all-reduced sum; a process with another clip radius or budget releases what the
accountant does not price. The first test measures that hazard on the data-parallel pieces themselves (noise
off, as the sensitivity harness measures); the second checks that ``make_private`` refuses each kind of
mismatch, naming what differs and where, and that a process failing on its own stops every process instead of
leaving them waiting in a collective.
"""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dpvr
from dpvr.optim.gradients import ClippedGradients
from dpvr.optim.records import TensorRecords
from dpvr.trainer.losses import per_sample
from dpvr.trainer.parallel import DataParallel

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")]

CLIP = 1.0
TIMEOUT = datetime.timedelta(seconds=60)  # a collective that one process never joins fails, not hangs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, tmp_path) -> list[dict]:
    out = str(tmp_path / "rank")
    mp.spawn(target, args=(2, _free_port(), out), nprocs=2)
    return [torch.load(f"{out}-{r}.pt") for r in range(2)]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)


# ---- the hazard: a record at another index on another process is counted twice ----------------------------
def _regression() -> nn.Module:
    model = nn.Linear(3, 1).double()
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


def _squared(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.squeeze(-1) - target) ** 2).sum()


def _huge(sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A record whose gradient at the zero model is far beyond the clip radius, pointing along ``sign``."""
    return torch.tensor([1e3, 2e3, -1e3], dtype=torch.float64), torch.tensor(sign * 1e6, dtype=torch.float64)


def _dataset(first: tuple[torch.Tensor, torch.Tensor] | None, swapped: bool) -> TensorRecords:
    """Three benign records (target 0: zero gradient at the zero model) after ``first`` when given; with
    ``swapped``, the first two records in the other order (what a per-process shuffle does)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 3, generator=g, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    if first is not None:
        x, y = torch.cat([first[0][None], x]), torch.cat([first[1][None], y])
    if swapped:
        x, y = x[[1, 0, *range(2, len(x))]], y[[1, 0, *range(2, len(y))]]
    return TensorRecords(x, y)


def _full_sum(records, engine) -> torch.Tensor:
    """The released sum of a full-batch step (DP-GD's), noise off: the engine's clipped sum of every index."""
    out = [torch.zeros(p.numel(), dtype=torch.float64) for p in engine.model.parameters()]
    engine.sum(*records.batch(range(len(records))), CLIP, out)
    return torch.cat(out)


def _hazard(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port)
    try:
        model = _regression()
        parallel = DataParallel.detect()
        reduced = parallel.gradients(ClippedGradients(model, per_sample(_squared)))
        alone = ClippedGradients(model, per_sample(_squared))
        moved = {}
        # Neighbours under add/remove (the huge record there or not) and under replace-one (it, or its
        # opposite); rank 1 holds the same records with the first two swapped.
        for relation, (one, other) in {"add-remove": (_huge(1.0), None),
                                       "replace-one": (_huge(1.0), _huge(-1.0))}.items():
            mismatched = [_full_sum(parallel.records(_dataset(d, swapped=rank == 1)), reduced)
                          for d in (one, other)]
            single = [_full_sum(_dataset(d, swapped=False), alone) for d in (one, other)]
            moved[relation] = (float((mismatched[0] - mismatched[1]).norm()),
                               float((single[0] - single[1]).norm()))
        torch.save(moved, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_mismatched_data_counts_a_record_twice(tmp_path) -> None:
    """What the agreement prevents, measured: with rank 1 holding the same records in another order, the
    all-reduced clipped sum of a full batch moves by 2C between add/remove neighbours (C priced) and by 4C
    between replace-one neighbours (2C priced); one process's moves by C and 2C."""
    for moved in _spawn(_hazard, tmp_path):
        mismatched, single = moved["add-remove"]
        assert single == pytest.approx(CLIP, rel=1e-12) and mismatched == pytest.approx(2 * CLIP, rel=1e-12)
        mismatched, single = moved["replace-one"]
        assert single == pytest.approx(2 * CLIP, rel=1e-12)
        assert mismatched == pytest.approx(4 * CLIP, rel=1e-12)


# ---- make_private refuses every mismatch, on every process, before the first release -----------------------
def _data(extra: int = 0, reordered: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200 + extra, 8, generator=g)
    if reordered:
        x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(1))]
    return TensorDataset(x, (x[:, 0] > 0).long())


class _Unreadable(Dataset):
    """The records of :func:`_data`, but record ``bad`` fails to load (a file missing on one node): the
    set-up checks read the first records only, the agreement reads every one."""

    def __init__(self, bad: int | None) -> None:
        self.records, self.bad = _data(), bad

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        if i == self.bad:
            raise OSError(f"record {i}: file not found")
        return self.records[i]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _runtime() -> dpvr.RuntimeConfig:
    return dpvr.RuntimeConfig(sampler_seed=5, generator=dpvr.NoiseGenerator(7, reproducible=True))


def _train(data=None, algorithm: str = "dp-sgd", **changes) -> dpvr.PrivateTrainer:
    settings = {"epsilon": 2.0, "delta": 1e-5, "steps": 3, "lr": 0.5, "clip": CLIP, "runtime": _runtime(),
                **({"batch_size": 40} if algorithm == "dp-sgd" else {}), **changes}
    return dpvr.make_private(_model(), nn.CrossEntropyLoss(), _data() if data is None else data,
                             algorithm=algorithm, **settings)


def _scenarios(rank: int) -> dict:
    """Each scenario: what rank 1 holds differently (rank 0 holds the reference run)."""
    other = rank == 1
    return {
        "reordered": lambda: _train(data=_data(reordered=other)),
        "extra record": lambda: _train(data=_data(extra=int(other))),
        # add/remove with the size stated public: the plans agree (both read N = 200), the data do not
        "extra record, add/remove": lambda: _train(data=_data(extra=int(other)), public_dataset_size=200),
        "reordered, dp-gd": lambda: _train(data=_data(reordered=other), algorithm="dp-gd"),
        "clip": lambda: _train(clip=4.0 if other else CLIP),
        "epsilon": lambda: _train(epsilon=20.0 if other else 2.0),
        "delta": lambda: _train(delta=1e-3 if other else 1e-5),
        "parameters": lambda: _train(lr=0.5) if not other else dpvr.make_private(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), nn.CrossEntropyLoss(), _data(),
            algorithm="dp-sgd", epsilon=2.0, steps=3, lr=0.5, clip=CLIP, batch_size=40, runtime=_runtime()),
        # One process fails on its own: before the first collective (a bad setting), inside the algorithm's
        # construction, and while the agreement reads its data (after the first collective).
        "fails: bad steps": lambda: _train(steps=0 if other else 3),
        "fails: bad clip": lambda: _train(clip=-1.0 if other else CLIP),
        "fails: unreadable record": lambda: _train(data=_Unreadable(150 if other else None)),
    }


def _agreement(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port)
    try:
        outcomes = {}
        for name, attempt in _scenarios(rank).items():
            try:
                attempt()
                outcomes[name] = ("accepted", "")
            except Exception as err:  # noqa: BLE001 - the outcome is what is compared
                outcomes[name] = (type(err).__name__, str(err))
        # After every refusal the group is still in step: the same processes, matching, train one run.
        trainer = _train()
        trainer.run()
        params = [p.detach().clone() for p in trainer.model.parameters()]
        readable = _train(data=_Unreadable(None))  # a Dataset (read record by record) agrees too
        torch.save({"outcomes": outcomes, "params": params, "epsilon": trainer.privacy_spent().epsilon,
                    "readable": readable.total_steps}, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def agreement(tmp_path_factory) -> list[dict]:
    return _spawn(_agreement, tmp_path_factory.mktemp("agreement"))


@pytest.mark.parametrize("name, differing", [
    ("reordered", ["data"]),
    ("extra record", ["data", "plan.dataset_size"]),
    ("extra record, add/remove", ["data"]),
    ("reordered, dp-gd", ["data"]),
    ("clip", ["setting.clip: 1.0 on rank 0; 4.0 on rank 1"]),
    ("epsilon", ["privacy.epsilon: 2.0 on rank 0; 20.0 on rank 1", "noise.gradient"]),
    ("delta", ["privacy.delta: 1e-05 on rank 0; 0.001 on rank 1", "noise.gradient"]),
    ("parameters", ["value.0.weight", "value.2.bias"]),
])
def test_a_mismatch_is_refused_on_every_process(agreement, name, differing) -> None:
    for rank in agreement:
        kind, message = rank["outcomes"][name]
        assert kind == "ValueError", (kind, message)
        assert "the processes do not hold the same run" in message and "nothing was released" in message
        for text in differing:
            assert f"  - {text}" in message, message
        assert "on rank 0;" in message and "on rank 1" in message
    # Both processes name the same settings (they compared the same gathered values).
    assert agreement[0]["outcomes"][name] == agreement[1]["outcomes"][name]


def test_only_what_differs_is_named(agreement) -> None:
    # The clip radius alone (the noise multiplier is per unit of clip: the same); the budget alone with the
    # noise multiplier calibrated to it; the data alone when the same records are in another order.
    named = {name: [line.split(": ")[0].strip(" -") for line in message.splitlines()[1:]]
             for name, (_, message) in agreement[0]["outcomes"].items() if _ == "ValueError"}
    assert named["clip"] == ["setting.clip"]
    assert named["epsilon"] == ["noise.gradient", "privacy.epsilon"]
    assert named["delta"] == ["noise.gradient", "privacy.delta"]
    assert named["reordered"] == named["reordered, dp-gd"] == named["extra record, add/remove"] == ["data"]
    assert named["parameters"] == ["value.0.bias", "value.0.weight", "value.2.bias", "value.2.weight"]


@pytest.mark.parametrize("name, error", [
    ("fails: bad steps", "steps: the number of steps must be a whole number >= 1"),
    ("fails: bad clip", "clip"),
    ("fails: unreadable record", "record 150: file not found"),
])
def test_a_process_failing_alone_stops_every_process(agreement, name, error) -> None:
    own_kind, own = agreement[1]["outcomes"][name]
    kind, message = agreement[0]["outcomes"][name]
    assert own_kind != "accepted" and error in own
    assert kind == "RuntimeError" and "failed on another process (rank 1:" in message and error in message
    assert "nothing was released on any process" in message


def test_matching_processes_still_train_one_run(agreement) -> None:
    zero, one = agreement
    assert all(torch.equal(a, b) for a, b in zip(zero["params"], one["params"]))
    assert zero["epsilon"] == one["epsilon"] > 0
    assert zero["readable"] == one["readable"] == 3
