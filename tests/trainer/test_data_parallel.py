"""Data-parallel private training over a gloo process group (two processes on this machine): one logical
run, the same on every process, whose clipped sums are the one-process run's to float rounding."""

from __future__ import annotations

import contextlib
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
from dpvr import registry
from dpvr.objectives import ChiSquare
from dpvr.objectives.auc import AUCMargin, AUCModel
from dpvr.optim.gradients import ClippedGradients
from dpvr.trainer.losses import per_sample
from tests.privacy.test_noise_drawn import assert_standard_normal, drawn_noise

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
            infos = trainer.run()
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
                        lambda: _train(runtime=_runtime(seed=5 + rank))):
            try:
                attempt()
            except (ValueError, TypeError) as err:
                refusals.append(str(err))
        torch.save({"params": [p.detach() for p in trainer.model.parameters()], "sums": sums,
                    "epsilon": trainer.privacy_spent().epsilon, "refusals": refusals,
                    "resumed": [p.detach() for p in resumed.model.parameters()],
                    "resumed_epsilon": resumed.privacy_spent().epsilon, "noise": torch.as_tensor(noise),
                    "infos": infos},
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
    alone_infos = alone.run()
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
    # Each step reports the whole batch's size and mean loss (the first one at the one-process run's point).
    for r in ranks:
        assert [info["batch"] for info in r["infos"]] == [info["batch"] for info in alone_infos]
        torch.testing.assert_close(r["infos"][0]["loss"], alone_infos[0]["loss"], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a["loss"], b["loss"]) for a, b in zip(ranks[0]["infos"], ranks[1]["infos"]))
    messages = ranks[0]["refusals"]
    assert len(messages) == 2
    assert "DistributedDataParallel" in messages[0] and "ddp_model.module" in messages[0]
    assert "the same sampler_seed and noise generator on every process" in messages[1]


# ---- every supported algorithm of the front door: DIFF2's rounds, the minimax y-releases -----------------
def _auc() -> nn.Module:
    torch.manual_seed(0)
    return AUCModel(nn.Linear(8, 1))


_CROSS = (_model, nn.CrossEntropyLoss())
_SPIDER = {"steps": 4, "restart": 2, "batch_sizes": (40, 20, 40, 20), "lr": 0.1}
_MINIMAX = (_auc, AUCMargin(0.5))
_DIFF2 = {"algorithm": "diff2", "steps": 4, "restart": 2, "lr": 0.5,
          "clip": {"restart": 1.0, "difference": 1.0}}
# Each case: (model, criterion) and make_private's keywords.
CASES = {
    "diff2": (_CROSS, _DIFF2),
    "diff2-bvr-l-sgd": (_CROSS, {**_DIFF2, "routine": "bvr-l-sgd", "local_steps": 2, "local_batch": 20,
                                 "clip": {"restart": 1.0, "difference": 1.0, "local": 1.0}}),
    # two clients, each keeping its own recording (an engine each, all-reduced from construction)
    "diff2-two-clients": (_CROSS, _DIFF2),
    "dp-sgda": (_MINIMAX, {"algorithm": "dp-sgda", "batch_size": 40, "steps": 4, "lr": 0.1, "lr_y": 0.1,
                           "clip": {"x": 1.0, "y": 1.0}}),
    "private-diff": (_MINIMAX, {"algorithm": "private-diff", "batch_size": 40, "steps": 4, "restart": 2,
                                "y_steps": 2, "lr": 0.1, "lr_y": 0.1,
                                "clip": {"checkpoint": 1.0, "difference": (1.0, 0.0), "y": 1.0}}),
    "last-iterate": (_CROSS, {"algorithm": "last-iterate", "batch_size": 40, "epochs": 1, "lr": 0.1,
                              "clip": 1.0, "weak_convexity": 1.0, "smoothness": 1.0}),
    "double-spider": (_CROSS, {**_SPIDER, "algorithm": "double-spider", "divergence": ChiSquare(), "lam": 1.0,
                               "lr_eta": 0.1, "max_move": 1.0,
                               "clip": {"eta-refresh": 1.0, "eta-difference": (1.0, 1.0), "x-refresh": 1.0,
                                        "x-difference": (1.0, 1.0)}}),
    "recursive-spider": (_CROSS, {**_SPIDER, "algorithm": "recursive-spider", "rho": 0.5, "lam0": 0.1,
                                  "lr_lam": 0.05, "beta": 0.5, "loss_bound": 10.0,
                                  "clip": dict.fromkeys(("v-refresh", "v-difference", "u-refresh",
                                                         "u-difference", "s"), 1.0)}),
}


def _case(name: str, data=None, **changes) -> dpvr.PrivateTrainer:
    (model, criterion), settings = CASES[name]
    if data is None:
        data = [_data(), _data()] if name == "diff2-two-clients" else _data()
    return dpvr.make_private(model(), criterion, data, epsilon=2.0,
                             runtime=_runtime(), **{**settings, **changes})


@contextlib.contextmanager
def _releases():
    """Every release's stream, signal (what its noise is added to), drawn noise and noise std, in order."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor, float]] = []
    original = dpvr.ops.noisy_update

    def flat(arrays) -> torch.Tensor:
        return torch.cat([torch.as_tensor(a).detach().double().reshape(-1) for a in arrays])

    def intercepted(v, **kwargs):
        before = flat(v).clone()
        signal = flat(kwargs["sum"]) * kwargs.get("scale", 1.0)
        result = original(v, **kwargs)
        base = 0.0 if kwargs.get("reset", False) else before
        seen.append((kwargs["stream"], signal, flat(v) - base - signal, float(kwargs["sigma"])))
        return result

    dpvr.ops.noisy_update = intercepted
    try:
        yield seen
    finally:
        dpvr.ops.noisy_update = original


def _recordings(trainer: dpvr.PrivateTrainer) -> list[int]:
    """A counter of the forward and backward passes the algorithm's ghost clipper records."""
    engine = trainer.algorithm.gradients
    ghost = getattr(engine, "engine", engine)._ghost
    count, run = [0], ghost._run

    def counted(*args, **kwargs):
        count[0] += 1
        return run(*args, **kwargs)

    ghost._run = counted
    return count


class _Checked:
    """The data-parallel engine, each of whose sums is checked against one process's: the same engine
    unwrapped, over the whole batch (the processes' shares gathered) at the same point."""

    def __init__(self, reduced, world: int) -> None:
        self.reduced, self.world, self.model, self.mode = reduced, world, reduced.model, reduced.mode
        self.reference = ClippedGradients(reduced.model, reduced.engine.loss_fn)
        self.seen: list[tuple[str, float, float]] = []  # (method, largest deviation, largest value)

    def _whole(self, share: torch.Tensor | None) -> torch.Tensor | None:
        if share is None:
            return None
        shares: list = [None] * self.world
        dist.all_gather_object(shares, share)
        whole = share.new_empty((sum(len(s) for s in shares), *share.shape[1:]))
        for rank, s in enumerate(shares):
            whole[rank :: self.world] = s
        return whole

    def _check(self, method: str, out, compute, reference, *rows, replace: bool = False) -> int:
        before = [torch.zeros_like(o) if replace else o.clone() for o in out]
        dropped = compute()
        want = [torch.zeros_like(o) for o in out]
        assert reference(want, *(self._whole(r) for r in rows)) == dropped
        got = [o - b for o, b in zip(out, before)]
        deviation = max(float((g - w).abs().max()) for g, w in zip(got, want))
        self.seen.append((method, deviation, max(float(w.abs().max()) for w in want)))
        return dropped

    def sum(self, inputs, targets, clip, out, point=None, norms=None, weights=None, losses=None, *,
            replace=False) -> int:
        return self._check(
            "sum", out,
            lambda: self.reduced.sum(inputs, targets, clip, out, point=point, weights=weights,
                                     replace=replace),
            lambda want, x, y, w: self.reference.sum(x, y, clip, want, point=point, weights=w),
            inputs, targets, weights, replace=replace)

    def diff_sum(self, inputs, targets, point, previous, clip, out, a=None, b=None) -> int:
        return self._check(
            "diff_sum", out,
            lambda: self.reduced.diff_sum(inputs, targets, point, previous, clip, out, a=a, b=b),
            lambda want, x, y, a, b: self.reference.diff_sum(x, y, point, previous, clip, want, a=a, b=b),
            inputs, targets, a, b)

    def batch_mean(self, losses, count):
        return self.reduced.batch_mean(losses, count)

    def rows(self, values, clip, out) -> int:
        return self._check("rows", out, lambda: self.reduced.rows(values, clip, out),
                           lambda want, v: self.reference.rows(v, clip, want), values)

    def clamped_diff_sum(self, now, before, low, high, out, weight=1.0) -> int:
        return self._check(
            "clamped_diff_sum", out,
            lambda: self.reduced.clamped_diff_sum(now, before, low, high, out, weight=weight),
            lambda want, a, b: self.reference.clamped_diff_sum(a, b, low, high, want, weight=weight),
            now, before)


def _run_case(name: str) -> dict:
    trainer = _case(name)
    recordings = _recordings(trainer) if name == "diff2" else [0]
    checked: list[_Checked] = []
    if dist.is_initialized():
        algorithm = trainer.algorithm
        clients = getattr(getattr(algorithm, "transport", None), "gradients", [])
        if len({id(engine) for engine in clients}) > 1:  # each client's own engine, each one checked
            checked = [_Checked(engine, dist.get_world_size()) for engine in clients]
            algorithm.transport.gradients = checked
        else:
            checked = [_Checked(algorithm.gradients, dist.get_world_size())]
            algorithm.gradients = checked[0]
    with _releases() as seen:
        infos = trainer.run()
    return {"params": [p.detach().clone() for p in trainer.model.parameters()],
            "epsilon": trainer.privacy_spent().epsilon, "releases": seen, "recordings": recordings[0],
            "nonfinite": [info["nonfinite"] for info in infos], "sums": [s for c in checked for s in c.seen]}


def _refusals() -> list[str]:
    """What a process group refuses, each at make_private, before anything runs."""
    attempts = (
        lambda: _case("private-diff", y_release="output", lr_y=None, clip={"checkpoint": 1.0,
                                                                          "difference": (1.0, 0.0)}),
        lambda: _case("last-iterate", clipping=False),
    )
    refusals = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as err:
            refusals.append(str(err))
    return refusals


def _clamped_values() -> tuple[torch.Tensor, torch.Tensor]:
    """Per-record values at two points, some outside [0, 0.5], record 3's not finite."""
    g = torch.Generator().manual_seed(3)
    now, before = torch.rand(9, generator=g), torch.rand(9, generator=g) - 0.2
    now[3] = float("nan")
    return now, before


def _every_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = {name: _run_case(name) for name in CASES}
        # The all-reduced clipped sums of differences (a DIFF2 difference round's), and the non-finite count
        # of the whole batch: one record of rank 1's share is NaN.
        trainer = _case("diff2")
        engine = trainer.algorithm.gradients
        x, y = _data().tensors
        x = x.clone()
        x[3, 0] = float("nan")
        point = [p.detach() for p in trainer.model.parameters()]
        previous = [q + 0.01 * torch.randn(q.shape, generator=torch.Generator().manual_seed(i))
                    for i, q in enumerate(point)]
        differences = [torch.zeros(p.numel()) for p in point]
        dropped = engine.diff_sum(x[rank::world], y[rank::world], point, previous, 0.5, differences)
        # Recursive-SPIDER's clamped differences (its s term), all-reduced: a NaN record on rank 1, and a draw
        # of one record, which only rank 0 holds.
        now, before = _clamped_values()
        term = [torch.zeros(1)]
        clamped_dropped = engine.clamped_diff_sum(now[rank::world], before[rank::world], 0.0, 0.5, term,
                                                  weight=0.25)
        one = [torch.zeros(1)]
        engine.clamped_diff_sum(now[:1][rank::world], before[:1][rank::world], 0.0, 0.5, one, weight=0.25)
        torch.save({"runs": runs, "differences": differences, "previous": previous, "dropped": dropped,
                    "clamped": (term, clamped_dropped, one), "refusals": _refusals()}, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def every_algorithm(tmp_path_factory) -> tuple[list[dict], dict]:
    out = str(tmp_path_factory.mktemp("parallel") / "rank")
    mp.spawn(_every_rank, args=(2, _free_port(), out), nprocs=2)
    return [torch.load(f"{out}-{r}.pt") for r in range(2)], {name: _run_case(name) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_every_supported_algorithm_runs_one_logical_run(every_algorithm, name) -> None:
    ranks, alone = every_algorithm
    runs, one = [r["runs"][name] for r in ranks], alone[name]
    # One model on every process, bit for bit, at the one-process run's epsilon (the same accountant).
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))
    assert runs[0]["epsilon"] == runs[1]["epsilon"] == pytest.approx(one["epsilon"])
    # Every sum the releases read is the whole batch's: one process's sum over the gathered batch at the
    # same point, to the rounding of the all-reduce's additions (and the same non-finite count).
    for run in runs:
        assert run["sums"] and all(deviation <= 1e-5 * max(1.0, top) for _, deviation, top in run["sums"])
    # The same releases on both processes, in the one-process run's order of streams: each signal, std and
    # noise bit for bit (the noise drawn once), standard normal over that std.
    mine, theirs, alone = runs[0]["releases"], runs[1]["releases"], one["releases"]
    assert [r[0] for r in mine] == [r[0] for r in theirs] == [r[0] for r in alone]
    for (_, signal, noise, std), (_, signal_1, noise_1, std_1) in zip(mine, theirs):
        assert torch.equal(signal, signal_1) and torch.equal(noise, noise_1) and std == std_1
    for stream in {r[0] for r in alone}:
        assert_standard_normal(stream, torch.cat([n / std for s, _, n, std in mine if s == stream]).numpy())
    # The first release is at the one-process run's starting point: the same signal (divided by the same
    # public numbers: a DIFF2 mean is over the client's records, not the process's share) and std. Later
    # ones differ from it, as their noise does (its keys hash the signal, which differs by rounding).
    torch.testing.assert_close(mine[0][1], alone[0][1], rtol=1e-5, atol=1e-7)
    assert mine[0][3] == pytest.approx(alone[0][3], rel=1e-9)
    assert runs[0]["nonfinite"] == runs[1]["nonfinite"] == one["nonfinite"]


def test_diff2_rounds_are_the_whole_batchs(every_algorithm) -> None:
    ranks, alone = every_algorithm
    # Both DIFF2-GD rounds were released, each from the whole batch's sum: restart rounds (clipped
    # gradients) and difference rounds (clipped same-sample differences).
    assert {"restart", "difference"} <= {r[0] for r in alone["diff2"]["releases"]}
    assert {method for method, _, _ in ranks[0]["runs"]["diff2"]["sums"]} == {"sum", "diff_sum"}
    assert {method for method, _, _ in ranks[0]["runs"]["dp-sgda"]["sums"]} == {"sum", "rows"}
    # Each process reuses its recording of its own records: the one-process run's passes, no more.
    assert ranks[0]["runs"]["diff2"]["recordings"] == ranks[1]["runs"]["diff2"]["recordings"]
    assert ranks[0]["runs"]["diff2"]["recordings"] == alone["diff2"]["recordings"] == 4
    # The all-reduced clipped sum of same-sample differences is the whole batch's, its count too.
    x, y = _data().tensors
    x = x.clone()
    x[3, 0] = float("nan")
    model = _model()
    point = [p.detach() for p in model.parameters()]
    expected = [torch.zeros(p.numel()) for p in point]
    dropped = ClippedGradients(model, per_sample(nn.CrossEntropyLoss())).diff_sum(
        x, y, point, ranks[0]["previous"], 0.5, expected)
    assert ranks[0]["dropped"] == ranks[1]["dropped"] == dropped == 1
    for got, got_1, want in zip(ranks[0]["differences"], ranks[1]["differences"], expected):
        assert torch.equal(got, got_1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_spider_streams_are_the_whole_batchs(every_algorithm) -> None:
    ranks, alone = every_algorithm
    # Every stream of both SPIDERs was released, each from an all-reduced sum: the scalar streams (eta, u)
    # through rows, the vector streams through sum and diff_sum, Recursive-SPIDER's s through
    # clamped_diff_sum.
    streams = {"double-spider": {"eta-refresh", "eta-difference", "x-refresh", "x-difference"},
               "recursive-spider": {"v-refresh", "v-difference", "u-refresh", "u-difference", "s"}}
    methods = {"double-spider": {"sum", "diff_sum", "rows"},
               "recursive-spider": {"sum", "diff_sum", "rows", "clamped_diff_sum"}}
    for name in streams:
        assert {r[0] for r in alone[name]["releases"]} == streams[name]
        assert {method for method, _, _ in ranks[0]["runs"][name]["sums"]} == methods[name]
    # s draws one record, which one process holds: its term, all-reduced, is the one-process term bit for
    # bit (the others add exactly zero); the first one is at the one-process run's point.
    first = [next(r for r in run["releases"] if r[0] == "s") for run in
             (ranks[0]["runs"]["recursive-spider"], ranks[1]["runs"]["recursive-spider"],
              alone["recursive-spider"])]
    assert torch.equal(first[0][1], first[2][1]) and torch.equal(first[1][1], first[2][1])
    assert all(deviation == 0 for method, deviation, _ in ranks[0]["runs"]["recursive-spider"]["sums"]
               if method == "clamped_diff_sum")
    # The engine's clamped differences, all-reduced: the whole batch's sum and non-finite count.
    now, before = _clamped_values()
    reference = ClippedGradients(_model(), per_sample(nn.CrossEntropyLoss()))
    want, one = [torch.zeros(1)], [torch.zeros(1)]
    dropped = reference.clamped_diff_sum(now, before, 0.0, 0.5, want, weight=0.25)
    reference.clamped_diff_sum(now[:1], before[:1], 0.0, 0.5, one, weight=0.25)
    assert dropped == 1
    for r in ranks:
        term, count, single = r["clamped"]
        assert count == dropped
        torch.testing.assert_close(term[0], want[0], rtol=1e-6, atol=1e-7)
        assert torch.equal(single[0], one[0])
        assert torch.equal(term[0], ranks[0]["clamped"][0][0])


def test_what_is_not_all_reduced_is_refused(every_algorithm) -> None:
    messages = every_algorithm[0][0]["refusals"]
    assert len(messages) == 2, messages
    assert "y_release: 'output' is not data-parallel" in messages[0]
    assert "clipping: False asserts" in messages[1]
    # Every built-in front-door algorithm states its data-parallel support in its own entry: none is refused
    # whole (private-diff refuses only y_release='output', above).
    for name in registry.front_door():
        assert registry.get(name).data_parallel({}) is None, name
