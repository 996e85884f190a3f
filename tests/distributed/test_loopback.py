"""Distributed DIFF2 on loopback gloo: bitwise equivalence with the simulation, failures, resume."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import dpvr
from dpvr import PaperSigmas
from dpvr.algorithms import DIFF2
from dpvr.distributed import ClientPool, DistributedError, launch
from dpvr.distributed.protocol import KEY_BYTES, pack_run, unpack_run
from dpvr.ops import torch_threads
from dpvr.optim import RuntimeConfig
from dpvr.optim.base import read_checkpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")

GD = dict(lr=0.2, steps=8, restart=3, clip={"restart": 0.5, "difference": 1.0},
          noise=PaperSigmas(restart=0.01, difference=0.02))
BVR = dict(GD, routine="bvr-l-sgd", local_steps=3, local_batch=4,
           clip={"restart": 0.5, "difference": 1.0, "local": 1.0},
           noise=PaperSigmas(restart=0.01, difference=0.02, local=0.05))


def model_fn():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.Softplus(), torch.nn.Linear(10, 1)).double()


def loss(output, target):
    return 0.5 * (output.squeeze() - target) ** 2


class Faulty:
    """The loss, except on one client rank, which exits, raises or hangs after ``after`` calls."""

    def __init__(self, rank, after, how):
        self.rank, self.after, self.how, self.calls = rank, after, how, 0

    def __call__(self, output, target):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == self.rank:
            self.calls += 1
            if self.calls > self.after:
                if self.how == "exit":
                    os._exit(3)
                if self.how == "hang":
                    time.sleep(60)
                raise RuntimeError("injected fault")
        return loss(output, target)


@pytest.fixture
def shards():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 5, generator=g, dtype=torch.float64)
    y = torch.randn(60, generator=g, dtype=torch.float64)
    return [(x[i * 20 : (i + 1) * 20], y[i * 20 : (i + 1) * 20]) for i in range(3)]


def gen():
    return dpvr.NoiseGenerator(7, reproducible=True)


def runtime(generator=None):
    """A run's own noise generator (``gen()`` unless given) and the sampler seed of the BVR-L-SGD local
    batches (the GD routine draws none)."""
    return RuntimeConfig(generator=gen() if generator is None else generator, sampler_seed=3)


def simulate(shards, options, rounds=None):
    """The in-process run, single-threaded like the launched ranks, with its iterate after every round."""
    alg = DIFF2(model_fn(), loss, shards, **options, runtime=runtime())
    iterates = []
    with torch_threads(1):
        for _ in range(rounds or alg.total_steps):
            alg.step()
            iterates.append(torch.cat([f.clone() for f in alg.flat]))
    return alg, iterates


@pytest.mark.parametrize("options", [GD, BVR], ids=["gd", "bvr-l-sgd"])
def test_distributed_run_releases_the_simulated_iterates(shards, options):
    alg, iterates = simulate(shards, options)
    out = launch(model_fn(), loss, shards, runtime=runtime(), keep_iterates=True, **options)
    run = out.result
    assert out.ranks == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}
    assert len(run.iterates) == len(iterates) == 8
    for r, (a, b) in enumerate(zip(run.iterates, iterates), 1):
        assert torch.equal(a, b), f"round {r}"
    assert run.epsilon == alg.privacy_spent().epsilon
    # Per client and step, one d-vector down (x_{r-1}; the final x_R too) and one up, plus small headers:
    # 7 float64 down (and b int64 indices for a local step), 2 float64 up; 2 float64 up at the handshake.
    d, clients, rounds, local = iterates[0].numel(), 3, 8, (16 if options is BVR else 0)
    assert run.traffic.steps == {"round": rounds, "local": local}
    assert run.traffic.down == clients * (rounds + 1) * (56 + 8 * d) + local * (56 + 4 * 8 + 8 * d)
    assert run.traffic.up == clients * 16 + (clients * rounds + local) * (16 + 8 * d)


@pytest.mark.parametrize(
    "how", ["exit", "raise", pytest.param("hang", marks=pytest.mark.slow)]  # hang: waits out the timeout
)
def test_a_failing_client_ends_the_run_on_every_rank(shards, tmp_path, how):
    path = tmp_path / "run.ckpt"
    start = time.monotonic()
    with pytest.raises(DistributedError) as caught:
        launch(model_fn(), Faulty(2, 6, how), shards, runtime=runtime(), checkpoint=path, timeout=2.0, **GD)
    assert time.monotonic() - start < 20
    message = str(caught.value)
    expected = {
        "exit": r"client 1 \(rank 2\) was lost in round (\d+)",
        "raise": r"client 1 \(rank 2\) failed in round (\d+): RuntimeError: injected fault",
        "hang": r"client 1 \(rank 2\) did not answer in round (\d+) within 2 s",
    }[how]
    found = re.match(expected, message)
    assert found, message
    failed = int(found.group(1))
    assert failed == 7  # the loss runs once per round: a difference round reuses the last round's recording
    survivors = [0, 1, 3] if how != "raise" else [0, 1, 2, 3]
    for rank in survivors:  # every surviving rank raised with the same reason
        assert caught.value.ranks[rank] == message
    # No checkpoint for the failed round: the last complete one, intact, and no temporary file. The run's
    # ledger holds the failed round, admitted before it failed: a resume charges it (conservatively).
    ledger = [name for name in os.listdir(tmp_path) if name != "run.ckpt"]
    assert len(ledger) == 1 and ledger[0].startswith("dpvr-run-") and ledger[0].endswith(".ledger")
    state = read_checkpoint(path)["ledger"]
    assert state["path"].endswith(ledger[0])
    entries = map(json.loads, (tmp_path / ledger[0]).read_bytes().splitlines())
    assert len([e for e in entries if e["seq"] > state["seq"]]) == 1
    assert read_checkpoint(path)["steps_done"] == failed - 1


@pytest.mark.parametrize("options", [GD, pytest.param(BVR, marks=pytest.mark.slow)], ids=["gd", "bvr-l-sgd"])
def test_resume_from_a_checkpoint_continues_the_same_run(shards, tmp_path, options):
    alg, iterates = simulate(shards, options)
    path = tmp_path / "run.ckpt"
    first = launch(model_fn(), loss, shards, runtime=runtime(), checkpoint=path, run_steps=3, **options)
    assert first.result.steps_done == 3
    # A fresh generator seed: the noise counters and seed must come from the checkpoint.
    other = dpvr.NoiseGenerator(99, reproducible=True)
    rest = launch(
        model_fn(), loss, shards, runtime=runtime(other), checkpoint=path, resume=True, keep_iterates=True,
        **options,
    )
    assert rest.result.steps_done == 8 and len(rest.result.iterates) == 5
    for a, b in zip(rest.result.iterates, iterates[3:]):
        assert torch.equal(a, b)
    assert rest.result.epsilon == alg.privacy_spent().epsilon
    assert read_checkpoint(path)["steps_done"] == 8


def test_checkpoint_of_other_clients_is_refused(shards, tmp_path):
    path = tmp_path / "run.ckpt"
    launch(model_fn(), loss, shards, runtime=runtime(), checkpoint=path, run_steps=2, **GD)
    with pytest.raises(ValueError, match=r"plan\.clients"):
        launch(model_fn(), loss, shards[:2], runtime=runtime(), checkpoint=path, resume=True, **GD)


def pooled_run(pool, shards, options, loss_fn=loss):
    """A DIFF2 run through ``pool``, single-threaded like the simulation, with its iterate per round."""
    model = model_fn()
    iterates = []
    with torch_threads(1), pool.connect(model, loss_fn, shards) as clients:
        alg = DIFF2(model, loss_fn, clients, **options, runtime=runtime())
        for _ in range(alg.total_steps):
            alg.step()
            iterates.append(torch.cat([f.clone() for f in alg.flat]))
    return alg, iterates


@pytest.mark.slow  # a pool through several runs (its runs' iterates are checked in the tests above)
def test_a_pool_serves_run_after_run_and_outlives_an_aggregator_error(shards):
    other = [(x[:15], y[:15]) for x, y in reversed(shards)]  # each run ships its own shards
    with ClientPool(3) as pool:
        for data, options in ((shards, GD), (other, BVR), (shards, BVR)):
            expected, iterates = simulate(data, options)
            alg, got = pooled_run(pool, data, options)
            assert len(got) == len(iterates)
            assert all(torch.equal(a, b) for a, b in zip(got, iterates))
            assert alg.privacy_spent().epsilon == expected.privacy_spent().epsilon
            assert alg.transport.traffic.shipped > 0
        # An error of the aggregator's own between two steps ends its run, not the pool.
        with pytest.raises(RuntimeError, match="all 1 planned steps have run"):
            model = model_fn()
            with pool.connect(model, loss, shards) as clients:
                alg = DIFF2(model, loss, clients, **dict(GD, steps=1), runtime=runtime())
                alg.step()
                alg.step()
        with pytest.raises(ValueError, match="the pool has 3 clients, got 2 shards"), pool.connect(
            model_fn(), loss, shards[:2]
        ):
            pass
        _, again = pooled_run(pool, shards, GD)
        assert torch.equal(again[-1], simulate(shards, GD)[1][-1])
        assert pool.broken is None
    assert pool.reports == {1: "ok", 2: "ok", 3: "ok"}


def test_a_client_failure_breaks_the_pool_on_every_rank(shards):
    with ClientPool(3, timeout=2.0) as pool:
        with pytest.raises(DistributedError) as caught:
            pooled_run(pool, shards, GD, loss_fn=Faulty(2, 6, "raise"))
        message = str(caught.value)
        assert re.match(r"client 1 \(rank 2\) failed in round 7: RuntimeError: injected fault", message)
        with pytest.raises(DistributedError, match=re.escape(message)):
            pooled_run(pool, shards, GD)
    assert pool.broken == message
    assert pool.reports == {1: message, 2: message, 3: message}


def test_a_run_ships_only_its_shard_and_only_with_the_pools_key(shards):
    x, y = torch.randn(10_000, 5, dtype=torch.float64), torch.randn(10_000, dtype=torch.float64)
    key = bytes(range(KEY_BYTES))
    packed = pack_run(model_fn(), loss, (x[:20], y[:20]), grad_mode="auto", chunk_size=None, key=key)
    assert len(packed) < x.numel() * 8 // 10  # a view would have pickled the whole training set
    run = unpack_run(packed, key)
    assert torch.equal(run["shard"][0], x[:20]) and run["loss_fn"] is loss
    assert run["model"].state_dict().keys() == model_fn().state_dict().keys()
    forged = packed[:-1] + bytes([packed[-1] ^ 1])
    for data, other in ((packed, bytes(KEY_BYTES)), (forged, key)):
        with pytest.raises(ValueError, match="not sent by this pool's aggregator"):
            unpack_run(data, other)


@pytest.mark.slow  # torchrun starts its own processes
def test_torchrun_runs_the_demo_problem_to_its_budget(tmp_path):
    """``python -m dpvr.distributed`` under torchrun: an aggregator and two clients on the bundled demo."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    command += ["-m", "dpvr.distributed", "--steps", "4", "--restart", "2", "--lr", "0.5"]
    command += ["--clip-restart", "1", "--clip-difference", "1", "--epsilon", "3", "--backend", "gloo"]
    command += ["--checkpoint", str(tmp_path / "run.ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"rounds 4, epsilon 3 at delta 1e-05", done.stdout), done.stdout
    assert read_checkpoint(tmp_path / "run.ckpt")["steps_done"] == 4
