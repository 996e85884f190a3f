"""The run ledger: one per run, written ahead of every release; a resume from any checkpoint of the run
charges every release the run made after it; no two releases of a run share a noise key; output releases
(last iterate, phased) go through it too."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import numpy as np
import pytest
import torch

import dpvr
from dpvr.algorithms import DPGD, DPSGD, DPSGDPlan, PhasedOutputPerturbation
from dpvr.objectives import LogisticRegression
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.optim.ledger import LedgerError
from dpvr.privacy import Accountant

logging.getLogger("absl").setLevel(logging.ERROR)


def data(n=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, (x.sum(1) > 0).to(torch.float64)


def logistic(output, target):
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


def dp_gd(x, y, steps=12, seed=1, reproducible=True):
    torch.manual_seed(3)
    generator = dpvr.NoiseGenerator(seed, reproducible=True) if reproducible else dpvr.NoiseGenerator()
    return DPGD(torch.nn.Linear(x.shape[1], 1).double(), logistic, x, y, lr=0.5, clip=1.0, steps=steps,
                noise=3.0, runtime=RuntimeConfig(generator=generator))  # fmt: skip


def epsilon_of(releases: int) -> float:
    """DP-GD's epsilon after ``releases`` full-batch steps (the reference for what must be charged)."""
    acc = Accountant("pld", "replace-one")
    acc.record_mechanism(DPSGDPlan(releases, "full", batch_size=12, dataset_size=12)({"gradient": 3.0}))
    return acc.epsilon(1e-5)


def test_a_resume_from_any_checkpoint_charges_every_later_release(tmp_path):
    """Item 1 of the review: save at step 4 to P and at step 8 to Q (another directory), run to 12, then
    resume from P: the releases made after Q are charged too, as are the re-run branch's when Q is
    resumed later. A per-checkpoint journal charged only those made after the checkpoint file's own save."""
    x, y = data()
    p, q = tmp_path / "a" / "P.ckpt", tmp_path / "b" / "Q.ckpt"
    run = dp_gd(x, y)
    run.run(4)
    run.save_checkpoint(p)
    run.run(4)
    run.save_checkpoint(q)
    run.run(4)  # released 12
    ledgers = [name for name in os.listdir(tmp_path / "a") if name.endswith(".ledger")]
    assert ledgers == [f"dpvr-run-{run.ledger.run}.ledger"] and not any(
        n.endswith(".ledger") for n in os.listdir(tmp_path / "b")
    )  # one ledger per run, beside its first checkpoint
    from_p = dp_gd(x, y)
    from_p.load_checkpoint(p)
    assert from_p.steps_done == 4
    assert from_p.privacy_spent().epsilon == pytest.approx(epsilon_of(12), rel=1e-9)  # 4 + the 8 after P
    from_p.run()  # re-runs 8 steps: released 20 in all
    assert from_p.privacy_spent().epsilon == pytest.approx(epsilon_of(20), rel=1e-9)
    from_q = dp_gd(x, y)
    from_q.load_checkpoint(q)  # 8, the 4 after Q in the first branch, the 8 of the branch from P
    assert from_q.privacy_spent().epsilon == pytest.approx(epsilon_of(20), rel=1e-9)
    from_q.run()
    assert from_q.privacy_spent().epsilon == pytest.approx(epsilon_of(24), rel=1e-9)


def test_a_moved_run_directory_finds_its_ledger_and_a_missing_one_is_refused(tmp_path):
    x, y = data()
    run = dp_gd(x, y)
    run.run(2)
    run.save_checkpoint(tmp_path / "run" / "c.ckpt")
    run.run(3)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    resumed = dp_gd(x, y)
    resumed.load_checkpoint(tmp_path / "moved" / "c.ckpt")
    assert resumed.privacy_spent().epsilon == pytest.approx(epsilon_of(5), rel=1e-9)
    os.remove(tmp_path / "moved" / f"dpvr-run-{run.ledger.run}.ledger")
    fresh = dp_gd(x, y)
    with pytest.raises(LedgerError, match="run ledger .* is missing"):
        fresh.load_checkpoint(tmp_path / "moved" / "c.ckpt")
    assert fresh.steps_done == 0  # nothing changed


def test_an_in_memory_state_of_the_same_object_charges_what_followed_it():
    x, y = data()
    run = dp_gd(x, y)
    run.run(4)
    state = run.state_dict()
    run.run(4)
    run.load_state_dict(state)
    assert run.privacy_spent().epsilon == pytest.approx(epsilon_of(8), rel=1e-9)
    run.run()
    assert run.privacy_spent().epsilon == pytest.approx(epsilon_of(16), rel=1e-9)


def test_an_in_memory_state_from_before_the_first_checkpoint_charges_what_followed_it(tmp_path):
    """State at 2 (in memory), releases 3-4, a checkpoint (the run's ledger file from here), release 5:
    loading the state charges 3, 4 (remembered) and 5 (from the file)."""
    x, y = data()
    run = dp_gd(x, y)
    run.run(2)
    state = run.state_dict()
    run.run(2)
    run.save_checkpoint(tmp_path / "c.ckpt")
    run.run(1)
    run.load_state_dict(state)
    assert run.privacy_spent().epsilon == pytest.approx(epsilon_of(5), rel=1e-9)


def test_no_two_releases_of_a_run_share_a_noise_key_across_resumes(tmp_path, monkeypatch):
    """Item 4: a key must never repeat within a run, whatever the signal, so that the device path (which
    does not hash the signal) is safe. Zero features make every signal identical (all zero): before the
    ledger named each release, a re-run from an older checkpoint redrew the very same keys."""
    x, y = torch.zeros(12, 4, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)
    keys = []
    next_key = dpvr.NoiseGenerator.next_key

    def recording(self, name, inputs=b""):
        key = next_key(self, name, inputs)
        keys.append((key.seed, key.stream, key.step))
        return key

    monkeypatch.setattr(dpvr.NoiseGenerator, "next_key", recording)
    run = dp_gd(x, y)
    run.run(3)
    run.save_checkpoint(tmp_path / "c.ckpt")
    run.run()
    for _ in range(2):  # two re-runs from the same checkpoint
        again = dp_gd(x, y)
        again.load_checkpoint(tmp_path / "c.ckpt")
        again.run()
    assert len(keys) == 12 + 9 + 9 and len(set(keys)) == len(keys)


def test_a_bound_generator_draws_device_noise_only_inside_a_named_release():
    cuda = pytest.importorskip("torch").cuda
    if not cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = dpvr.NoiseGenerator(1, reproducible=True)
    gen.bind(b"context")
    with pytest.raises(ValueError, match="named release"):
        dpvr.ops.noisy_update([torch.zeros(4, device="cuda")], sigma=1.0, generator=gen, stream="s")


# ---- item 2: the last iterate is a release, and goes through the ledger ------------------------------------
def cyclic(x, y, bound="best", steps=6):
    torch.manual_seed(3)
    return DPSGD(torch.nn.Linear(x.shape[1], 1).double(), logistic, x, y, lr=0.1, clip=1.0, steps=steps,
                 batch_size=4, sampling="cyclic", weak_convexity=0.0, smoothness=0.25, bound=bound, noise=4.0,
                 runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(1, reproducible=True)))  # fmt: skip


def test_a_finished_last_iterate_run_is_not_resumed_into_a_second_last_iterate(tmp_path):
    """Item 2: a finished run released X_T; going on from an earlier checkpoint would release a second last
    iterate. The last-iterate bound does not cover two trajectories that share their start: refused."""
    x, y = data()
    run = cyclic(x, y)
    run.run(3)
    run.save_checkpoint(tmp_path / "c.ckpt")
    run.run()
    assert len(run.ledger.releases_after(0)) == 1  # the last iterate, written ahead of its release
    again = cyclic(x, y)
    with pytest.raises(ValueError, match="second trajectory"):
        again.load_checkpoint(tmp_path / "c.ckpt")
    assert again.steps_done == 0


def test_a_crashed_last_iterate_run_resumes_without_charge_and_composition_charges_both(tmp_path):
    """Before its last step a cyclic run has released nothing: a crash-resume is free. With
    ``bound="composition"`` (valid for every iterate) a second trajectory is accounted: both are charged."""
    x, y = data()
    crashed = cyclic(x, y)
    crashed.run(3)
    crashed.save_checkpoint(tmp_path / "c.ckpt")
    crashed.run(2)  # crashed before the last step: no release
    resumed = cyclic(x, y)
    resumed.load_checkpoint(tmp_path / "c.ckpt")
    resumed.run()
    whole = cyclic(x, y)
    whole.run()
    assert resumed.privacy_spent().epsilon == pytest.approx(whole.privacy_spent().epsilon, rel=1e-12)

    first = cyclic(x, y, bound="composition")
    first.run(3)
    first.save_checkpoint(tmp_path / "d.ckpt")
    first.run()
    second = cyclic(x, y, bound="composition")
    second.load_checkpoint(tmp_path / "d.ckpt")
    second.run()
    one = first.privacy_spent().epsilon
    assert second.privacy_spent().epsilon > 1.2 * one
    two = Accountant(first.accountant.accountant, "replace-one")
    for _ in range(2):
        two.record_mechanism(first.plan(first.noise))
    assert second.privacy_spent().epsilon == pytest.approx(two.epsilon(first.delta), rel=1e-6)


# ---- item 3: phased output perturbation keys its noise with the released point --------------------------
def test_a_re_run_phase_draws_fresh_noise_on_another_point_and_is_charged(monkeypatch):
    """Item 3: re-running a released phase from an older state with another solver must not add the same
    noise to a different point (the difference of the two releases would be noise-free), and the second
    release is charged."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(32, 3))
    problem = LogisticRegression(features / np.linalg.norm(features, axis=1, keepdims=True),
                                 rng.random(32) < 0.5, l2=0.5)  # fmt: skip
    alg = PhasedOutputPerturbation(
        "sc", privacy=PrivacyConfig(epsilon=10.0, delta=1e-6), noise=4.0, tolerance=0.05,
        runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(5, reproducible=True), sampler_seed=1),
    )  # fmt: skip
    drawn = []
    original = dpvr.ops.noisy_update

    def recording(v, **kwargs):
        point = np.array(kwargs["sum"], copy=True)
        result = original(v, **kwargs)
        drawn.append((point, np.array(v, copy=True)))
        return result

    monkeypatch.setattr(dpvr.ops, "noisy_update", recording)
    before = alg.state_dict()
    alg.run(problem)
    once = alg.accountant.epsilon(1e-6)
    alg.load_state_dict(before)
    alg.tolerance = 0.01  # another solver's answer: a different certified point
    alg.run(problem)
    (p1, r1), (p2, r2) = drawn
    assert not np.array_equal(p1, p2)
    assert not np.allclose(r1 - p1, r2 - p2)  # fresh noise: the releases' difference is not p1 - p2
    assert alg.accountant.epsilon(1e-6) > 1.2 * once


# ---- item 5: two runs in one accountant are never priced as one --------------------------------------------
def test_random_allocation_runs_recorded_in_one_accountant_are_charged_separately():
    """Two half-epoch random-allocation runs are two allocations: two epochs, not one."""
    half = DPSGDPlan(5, "random-allocation", batch_size=10, dataset_size=100)
    together = Accountant("pld", "add-remove")
    together.record_mechanism(half({"gradient": 1.0}))
    together.record_mechanism(half({"gradient": 1.0}))
    two_epochs = Accountant("pld", "add-remove")
    two_epochs.record_mechanism(dataclasses.replace(half, steps=20)({"gradient": 1.0}))
    assert together.epsilon(1e-5) == pytest.approx(two_epochs.epsilon(1e-5), rel=1e-9)
