"""Checkpoints: atomic, versioned, checksummed files that resume a run exactly, or are refused clearly."""

import json
import os

import pytest
import torch

import dpvr
from dpvr import PaperSigmas
from dpvr.algorithms import DIFF2, DPSGD
from dpvr.optim import BudgetExhaustedError, PrivacyConfig, RuntimeConfig


def data(n=24, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(
        n, 1, generator=g, dtype=torch.float64
    )


def make(kind):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    loss = lambda o, t: ((o - t) ** 2).sum()  # noqa: E731
    gen = dpvr.NoiseGenerator(seed=11, reproducible=True)
    x, y = data()
    if kind == "dpsgd":
        return DPSGD(
            model,
            loss,
            x,
            y,
            lr=0.1,
            clip=1.0,
            steps=6,
            batch_size=8,
            noise=1.0,
            runtime=RuntimeConfig(generator=gen, sampler_seed=3),
        )
    return DIFF2(
        model,
        loss,
        [(x[:12], y[:12]), (x[12:], y[12:])],
        lr=0.1,
        steps=6,
        restart=3,
        clip={"restart": 1.0, "difference": 1.0, "local": 1.0},
        noise=PaperSigmas(restart=0.1, difference=0.1, local=0.5),
        routine="bvr-l-sgd",
        local_steps=2,
        local_batch=4,
        privacy=PrivacyConfig(accountant="rdp"),
        runtime=RuntimeConfig(generator=gen, sampler_seed=3),
    )


@pytest.mark.parametrize("kind", ["dpsgd", "diff2"])
def test_resume_is_exact(tmp_path, kind):
    straight = make(kind)
    straight.run(progress=False)
    first = make(kind)
    first.run(3, progress=False)
    path = tmp_path / "ckpt"
    first.save_checkpoint(path)
    # no temporary file left behind; the run's ledger is empty until a release follows the checkpoint
    ledger = f"dpvr-run-{first.ledger.run}.ledger"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", ledger])
    assert (tmp_path / ledger).read_bytes() == b""
    resumed = make(kind)
    resumed.generator = dpvr.NoiseGenerator(seed=99, reproducible=True)  # the checkpoint must override it
    resumed.load_checkpoint(path)
    assert resumed.steps_done == 3
    assert resumed.accountant.state_dict() == first.accountant.state_dict()
    assert resumed.generator.state_dict() == first.generator.state_dict()
    resumed.run(progress=False)
    for a, b in zip(straight.params, resumed.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert resumed.privacy_spent().epsilon == pytest.approx(straight.privacy_spent().epsilon, rel=1e-12)


def test_damaged_checkpoints_are_refused(tmp_path):
    alg = make("dpsgd")
    alg.run(2, progress=False)
    path = tmp_path / "ckpt"
    alg.save_checkpoint(path)
    raw = path.read_bytes()
    magic, rest = raw.split(b"\n", 1)
    header, payload = rest.split(b"\n", 1)
    cases = {
        "truncated": (raw[:-10], "truncated"),
        "header cut": (raw[: len(magic) + 10], "header"),
        "altered": (raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:], "checksum"),
        "version": (
            magic + b"\n" + json.dumps({**json.loads(header), "version": 99}).encode() + b"\n" + payload,
            "version",
        ),
        "not a checkpoint": (b"hello", "magic"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        fresh = make("dpsgd")
        before = [p.clone() for p in fresh.params]
        with pytest.raises(ValueError, match=message):
            fresh.load_checkpoint(bad)
        assert fresh.steps_done == 0 and all(torch.equal(a, b) for a, b in zip(before, fresh.params)), name
    with pytest.raises(ValueError, match="written by .DP-SGD"):
        make("diff2").load_checkpoint(path)


def test_failed_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    alg = make("dpsgd")
    path = tmp_path / "ckpt"
    alg.save_checkpoint(path)
    old = path.read_bytes()
    alg.run(1, progress=False)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        alg.save_checkpoint(path)
    assert path.read_bytes() == old
    ledger = f"dpvr-run-{alg.ledger.run}.ledger"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", ledger])
    # the run's ledger still holds the release made since the old checkpoint
    assert len((tmp_path / ledger).read_bytes().splitlines()) == 1


def test_budget_guard_holds_across_a_resume(tmp_path):
    def guarded():
        x, y = data()
        torch.manual_seed(0)
        return DPSGD(
            torch.nn.Linear(3, 1).double(),
            lambda o, t: ((o - t) ** 2).sum(),
            x,
            y,
            lr=0.1,
            clip=1.0,
            steps=50,
            batch_size=8,
            noise=4.0,
            privacy=PrivacyConfig(epsilon=1.0, delta=1e-5),
            runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed=1, reproducible=True), sampler_seed=2),
        )

    alg = guarded()
    with pytest.raises(BudgetExhaustedError, match=r"spent so far: epsilon=0\.\d+") as refused:
        alg.run(progress=False)
    spent, steps = alg.privacy_spent().epsilon, alg.steps_done
    assert 0 < steps < 50 and spent <= 1.0 and f"after {steps} steps" in str(refused.value)
    path = tmp_path / "ckpt"
    alg.save_checkpoint(path)
    resumed = guarded()
    resumed.load_checkpoint(path)
    before = [p.clone() for p in resumed.params]
    with pytest.raises(BudgetExhaustedError, match=f"{spent:.4g}"):
        resumed.step()
    assert resumed.steps_done == steps and all(torch.equal(a, b) for a, b in zip(before, resumed.params))


def test_a_budget_refusal_after_a_resume_names_the_releases_the_ledger_charged(tmp_path):
    """A resume from an earlier checkpoint charges what the run released after it; when the budget then runs
    out, the refusal says so, rather than leaving the user to wonder why fewer steps fit."""
    x, y = data()

    def guarded():
        return DPSGD(
            torch.nn.Linear(3, 1).double(), lambda o, t: ((o - t) ** 2).sum(), x, y, lr=0.1, clip=1.0,
            steps=12, batch_size=8, noise=4.0, sampling="wor", privacy=PrivacyConfig(epsilon=2.5, delta=1e-5),
            runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed=1, reproducible=True), sampler_seed=2),
        )  # fmt: skip

    alg = guarded()
    alg.step()
    path = tmp_path / "ckpt"
    alg.save_checkpoint(path)
    for _ in range(3):
        alg.step()
    resumed = guarded()
    resumed.load_checkpoint(path)
    with pytest.raises(BudgetExhaustedError, match=r"includes 3 release\(s\) made after the checkpoint"):
        resumed.run(progress=False)
    assert 1 <= resumed.steps_done < 12
