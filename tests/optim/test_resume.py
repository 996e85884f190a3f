"""Resuming, hardened (issue 43, items 4, 5 and 7): an in-memory state is charged every release its run
made after it, or refused; the ledger file is owner-only and tells nothing about a re-run's batches; a
fixed sampler seed needs the same opt-in as a fixed noise seed."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import shutil
import stat

import pytest
import torch

import dpvr
from dpvr.algorithms import DPGD, DPSGD, DPSGDPlan
from dpvr.optim import RuntimeConfig
from dpvr.optim.ledger import LedgerError
from dpvr.optim.sampling import BatchSampler
from dpvr.privacy import Accountant

logging.getLogger("absl").setLevel(logging.ERROR)


def data(n=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, (x.sum(1) > 0).to(torch.float64)


def logistic(output, target):
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


def dp_gd(x, y, *, reproducible, steps=30):
    torch.manual_seed(3)
    generator = dpvr.NoiseGenerator(1, reproducible=True) if reproducible else dpvr.NoiseGenerator()
    return DPGD(torch.nn.Linear(x.shape[1], 1).double(), logistic, x, y, lr=0.5, clip=1.0, steps=steps,
                noise=3.0, runtime=RuntimeConfig(generator=generator))  # fmt: skip


def epsilon_of(releases: int) -> float:
    """DP-GD's epsilon after ``releases`` full-batch steps on 12 records (what must be charged)."""
    acc = Accountant("pld", "replace-one")
    acc.record_mechanism(DPSGDPlan(releases, "full", batch_size=12, dataset_size=12)({"gradient": 3.0}))
    return acc.epsilon(1e-5)


# ---- item 4: an in-memory state loaded into another object ---------------------------------------------


@pytest.mark.parametrize("reproducible", [False, True])
def test_an_in_memory_state_loaded_into_a_new_object_is_charged_every_later_release(reproducible):
    """The review's case: 18 releases made, a state taken after 10 loaded into a new object. It was charged
    the state's 10 (a reproducible run's new object shares the run id, but not the releases its writer
    made after the state). Now the writer's ledger is found (it is alive in this process): all 18."""
    x, y = data()
    writer = dp_gd(x, y, reproducible=reproducible)
    writer.run(10)
    state = writer.state_dict()
    writer.run(8)  # released 18
    reader = dp_gd(x, y, reproducible=reproducible)
    reader.load_state_dict(state)
    assert reader.steps_done == 10
    spent = writer.privacy_spent().epsilon
    assert spent == pytest.approx(epsilon_of(18), rel=1e-9)
    assert reader.privacy_spent().epsilon == pytest.approx(spent, rel=1e-9)  # charged == spent
    assert reader.ledger.segment != writer.ledger.segment  # what follows is a re-run: a new segment
    reader.run(8)
    assert reader.privacy_spent().epsilon == pytest.approx(epsilon_of(26), rel=1e-9)


@pytest.mark.parametrize("reproducible", [False, True])
def test_an_in_memory_state_whose_run_is_not_known_here_is_refused(reproducible):
    """The writer is gone (or in another process) and the run never had a ledger file: what it released
    after the state cannot be known, so the state is refused, naming the way that charges it, and the
    reader is left as it was."""
    x, y = data()
    writer = dp_gd(x, y, reproducible=reproducible)
    writer.run(10)
    state = writer.state_dict()
    writer.run(8)
    del writer
    gc.collect()
    reader = dp_gd(x, y, reproducible=reproducible)
    reader.run(2)
    before = [p.detach().clone() for p in reader.params]
    with pytest.raises(LedgerError, match="save_checkpoint.*load_checkpoint"):
        reader.load_state_dict(state)
    assert reader.steps_done == 2 and all(torch.equal(p, q) for p, q in zip(reader.params, before))
    assert reader.privacy_spent().epsilon == pytest.approx(epsilon_of(2), rel=1e-9)


def test_an_in_memory_state_of_a_run_with_a_ledger_file_is_charged_from_it(tmp_path):
    """A state taken after the run's first checkpoint names its ledger file: any object, in any process,
    reads from it what the run released after the state."""
    x, y = data()
    writer = dp_gd(x, y, reproducible=False)
    writer.run(4)
    writer.save_checkpoint(tmp_path / "c.ckpt")
    writer.run(2)
    state = writer.state_dict()
    writer.run(5)
    del writer
    gc.collect()
    reader = dp_gd(x, y, reproducible=False)
    reader.load_state_dict(state)
    assert reader.privacy_spent().epsilon == pytest.approx(epsilon_of(11), rel=1e-9)


# ---- item 5: the ledger file is owner-only; a re-run's batches are keyed by a secret -------------------


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_ledger_file_is_readable_by_its_owner_only(tmp_path):
    x, y = data()
    old = os.umask(0o022)  # the usual umask: a file created without a mode is 0644
    try:
        run = dp_gd(x, y, reproducible=False)
        run.run(2)
        run.save_checkpoint(tmp_path / "c.ckpt")
        ledger = tmp_path / f"dpvr-run-{run.ledger.run}.ledger"
        assert _mode(ledger) == 0o600
        run.run(2)
        assert _mode(ledger) == 0o600 and len(ledger.read_bytes().splitlines()) == 2
        # A file re-created by an append (removed by hand mid-run) is owner-only too.
        os.remove(ledger)
        run.run(1)
        assert _mode(ledger) == 0o600
        # A ledger left with a looser mode (an older dpvr, a copy) is made owner-only when a resume opens it.
        os.chmod(ledger, 0o644)
        resumed = dp_gd(x, y, reproducible=False)
        resumed.load_checkpoint(tmp_path / "c.ckpt")
        assert _mode(ledger) == 0o600
        resumed.run(1)
        assert _mode(ledger) == 0o600
    finally:
        os.umask(old)


def _sampled(seed=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 4, generator=g, dtype=torch.float64)
    y = (x.sum(1) > 0).to(torch.float64)
    torch.manual_seed(3)
    return DPSGD(torch.nn.Linear(4, 1).double(), logistic, x, y, lr=0.5, clip=1.0, steps=12, batch_size=40,
                 sampling="poisson", noise=2.0,
                 runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed, reproducible=True),
                                       sampler_seed=7))  # fmt: skip


def _batches(alg, steps):
    drawn, draw = [], alg.sampler.draw

    def recording():
        indices = draw()
        drawn.append(indices.tolist())
        return indices

    alg.sampler.draw = recording
    alg.run(steps)
    return drawn


def test_a_re_run_s_batches_cannot_be_predicted_from_the_ledger(tmp_path):
    """The review's attack: in a reproducible run (every data-parallel run is one) a re-run's sampler
    seed was a hash of its segment id, which every ledger line prints; the three batches after a re-run
    were predicted from the ledger alone (3 of 3). Now the seed is keyed by the noise generator's secret
    seed: 0 of 3, and a reproducible re-run still re-runs identically."""
    run = _sampled()
    run.run(4)
    run.save_checkpoint(tmp_path / "a" / "c.ckpt")
    run.run(4)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the run directory as it stands, kept aside
    batches = []
    for where in ("a", "b"):
        resumed = _sampled()
        resumed.load_checkpoint(tmp_path / where / "c.ckpt")  # a re-run of steps 5-8
        batches.append(_batches(resumed, 3))
        if where == "a":  # the copy's checkpoint names a's ledger: gone, it reads the one beside it
            shutil.move(tmp_path / "a", tmp_path / "a-after")
    assert batches[0] == batches[1]  # reproducible: the re-run is the same in both copies
    assert all(len(b) > 0 for b in batches[0])
    # The attacker reads the ledger: the re-run's entries name its segment.
    ledger = tmp_path / "a-after" / f"dpvr-run-{run.ledger.run}.ledger"
    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    segment = entries[-1]["segment"]
    assert segment != entries[0]["segment"]
    guess = BatchSampler("poisson", 400, 40, seed=0)
    guess.restart(int.from_bytes(hashlib.sha256(f"{segment}/0".encode()).digest()[:8], "little"))
    predicted = [guess.draw().tolist() for _ in range(3)]
    matches = sum(p == b for p, b in zip(predicted, batches[0]))
    assert matches == 0


# ---- item 7: a fixed sampler seed needs the opt-in a fixed noise seed needs ----------------------------


def test_a_fixed_sampler_seed_needs_the_reproducible_opt_in():
    for runtime in (dict(), dict(generator=dpvr.NoiseGenerator())):
        with pytest.raises(dpvr.PredictableNoiseError, match=r"sampler_seed: .*reproducible=True"):
            RuntimeConfig(sampler_seed=3, **runtime)
    with pytest.raises(dpvr.PredictableNoiseError, match="sampler_seed"):
        dataclasses.replace(RuntimeConfig(), sampler_seed=3)
    reproducible = RuntimeConfig(generator=dpvr.NoiseGenerator(1, reproducible=True), sampler_seed=3)
    assert reproducible.sampler_seed_for(2) == 5
    assert RuntimeConfig().sampler_seed_for(2) is None  # private sampling needs no opt-in
