"""A new algorithm through the documented extension points only: its plan (a :class:`dpvr.privacy.Plan`), its
class (a :class:`dpvr.optim.PrivateAlgorithm`) and one registry entry (:func:`dpvr.registry.register`) whose
arguments come from a settings schema, with its own theorem rules and its own statement of data-parallel
support, as each built-in algorithm's module in :mod:`dpvr.algorithms` has.

Nothing else in dpvr knows about it, yet it runs through ``make_private`` (which reads its layout, its rules
and its data-parallel support from the entry, so it gets theorem defaults and runs split over a process
group, or is refused with the message it states), ``dpvr account|calibrate`` (whose flags come from the
entry), ``shares="auto"`` (which reads the plan's error proxy) and the sensitivity harness (lockstep runs on
neighbouring datasets, accounting and resume checks), and the harness' coverage check names it until it has a
harness entry.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
import sensitivity as harness
from dpvr import cli, registry
from dpvr.algorithms.theorems import Derived, Missing, Public
from dpvr.optim import (
    ClippedSum,
    DifferenceEstimator,
    PrivacyConfig,
    PrivateAlgorithm,
    RuntimeConfig,
    check_loss,
)
from dpvr.optim.records import Records, as_records
from dpvr.optim.sampling import BatchSampler
from dpvr.privacy import REPLACE_ONE, Accountant, Plan, Sampling, Stream, calibrate
from dpvr.privacy.allocation import stream_dimensions
from dpvr.registry import AlgorithmSpec, Argument, Sigma, all_reduced, refuses, schema_arguments, setting
from dpvr.trainer.parallel import AllReducedGradients, ShardedRecords
from tests.privacy.test_sensitivity import (
    dpsgd_configs,  # DP-SGD's generated configurations fit the toy's keywords
)

NAME = "toy-momentum-sgd"
DEFAULT_PRIVACY, DEFAULT_RUNTIME = PrivacyConfig(), RuntimeConfig()


# ---- 1. the plan: what a run releases ----------------------------------------------------------------------
@dataclass(frozen=True)
class MomentumPlan(Plan):
    """``steps`` releases of a clipped gradient mean over ``batch_size`` of ``dataset_size`` records drawn
    without replacement, plus ``N(0, (sigma C)^2 I)``: one stream ``"gradient"`` whose noise multiplier is
    ``sigma * batch_size``. The momentum is post-processing, so it does not enter the plan."""

    dataset_size: int
    batch_size: int
    steps: int
    sampling: str = "wor"
    neighbouring: str = REPLACE_ONE

    _all_streams: ClassVar = ("gradient",)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps}")
        self.batch_sampling.check(self.neighbouring)

    @property
    def batch_sampling(self) -> Sampling:
        return Sampling.make(self.sampling, batch_size=self.batch_size, dataset_size=self.dataset_size)

    def _streams(self, noise: Mapping[str, float]) -> list[Stream]:
        if self.steps == 0:
            return []
        return [Stream("gradient", noise.get("gradient", 1.0), self.steps, self.batch_sampling)]

    def _unit(self, stream: str) -> float:
        return float(self.batch_size)  # sigma times the clip radius is the noise std on the batch mean

    def exposures(self) -> dict[str, float]:
        return {"gradient": 1.0}  # the error proxy of shares="auto": a fresh estimate every step


# ---- 2. the class: what a run does ------------------------------------------------------------------------
class MomentumSGD(PrivateAlgorithm):
    """DP-SGD with heavy-ball momentum: each step releases the clipped gradient mean of a batch drawn without
    replacement plus Gaussian noise (the estimator ``v``), then steps ``x <- x - lr m`` with
    ``m <- momentum m + v`` (post-processing of the releases)."""

    name = NAME
    #: The settings its constructor takes no default for: make_private lists each one missing, with the
    #: others' problems, before it builds the run (as for the built-in algorithms).
    required_settings = ("lr", "clip", "steps", "batch_size")

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Any,
        inputs: torch.Tensor | Records,
        targets: torch.Tensor | None = None,
        *,
        lr: float,
        clip: float,
        steps: int,
        batch_size: int,
        momentum: float = 0.5,
        sampling: str = "wor",
        noise: float | dict[str, float] | None = None,
        privacy: PrivacyConfig = DEFAULT_PRIVACY,
        runtime: RuntimeConfig = DEFAULT_RUNTIME,
    ) -> None:
        # What the run's binding records: every argument that shapes a release (the model, loss and data are
        # bound on their own), as given; a checkpoint loads only into a run with the same settings.
        settings = dict(
            lr=lr, clip=clip, steps=steps, batch_size=batch_size, momentum=momentum, sampling=sampling,
            noise=noise, privacy=privacy, runtime=runtime,
        )  # fmt: skip
        records = as_records(inputs, targets)  # tensors, or a Dataset loaded per batch (the front door's)
        n = len(records)
        plan = MomentumPlan(n, batch_size, steps, sampling, privacy.neighbouring or REPLACE_ONE)
        self.sampler = BatchSampler.for_stream(plan, "gradient", n, runtime.sampler_seed)
        check_loss(model, loss_fn, *records.probe(1))
        super().__init__(
            model, loss_fn, plan=plan, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
            data=records,  # hashed into the binding
        )  # fmt: skip
        self.records = records
        self.lr, self.clip, self.momentum = float(lr), float(clip), float(momentum)
        self.gradients = runtime.clipped_gradients(model, loss_fn)  # all-reduced under data parallelism
        self._sum = [torch.zeros_like(f) for f in self.flat]
        self.v = DifferenceEstimator(self.flat)
        self.velocity = [torch.zeros_like(f) for f in self.flat]

    def _step(self) -> dict[str, float]:
        with self.releasing("gradient"):
            inputs, targets = self.records.draw(self.sampler)
            for s in self._sum:
                s.zero_()
            dropped = self.gradients.sum(inputs, targets, self.clip, self._sum)
            self.v.release(
                "gradient",
                ClippedSum(self._sum, self.clip, self.sampler.batch_size),
                noise_multiplier=self.noise["gradient"],
                reset=True,
                generator=self.generator,
            )
        with torch.no_grad():
            for m, v, x in zip(self.velocity, self.v.value, self.flat):
                m.mul_(self.momentum).add_(v)
                x.sub_(self.lr * m)
        return {"batch": len(inputs), "nonfinite": dropped}

    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        return {"v": self.v.value, "velocity": self.velocity}

    def _extra_state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


# ---- 3. the registry entry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class MomentumSettings:
    """The toy plan's settings: one schema, from which the entry's arguments (and so its flags) come."""

    dataset_size: int = setting("number of records n")
    batch_size: int = setting("batch size b, drawn without replacement")
    steps: int = setting("number of steps T")
    sampling: str = setting("batch sampling: wor", "wor", choices=("wor",))


def toy_lr(settings: Mapping[str, Any], p: Public) -> Derived | None:
    """The toy's "theorem": ``eta = 1 / (C sqrt(d))``, from the clip radius and the model's size only."""
    clip = settings.get("clip")
    if not isinstance(clip, (int, float)) or not clip > 0:
        raise Missing("the toy theorem, eta = 1 / (C sqrt(d))) needs clip > 0")
    return Derived(1 / (clip * math.sqrt(p.dimension)), f"toy theorem: C={clip:g}, d={p.dimension}")


def toy_steps(settings: Mapping[str, Any], p: Public) -> Derived:
    """The toy's run length ``R = ceil(n epsilon / 4)``: public sizes and the budget only."""
    return Derived(math.ceil(p.n * p.epsilon / 4), f"toy theorem: n={p.n}, epsilon={p.epsilon:g}")


SPEC = AlgorithmSpec(
    NAME,
    "toy: DP-SGD with heavy-ball momentum on fixed-size batches",
    MomentumPlan,
    MomentumPlan,
    schema_arguments(MomentumSettings),
    f"{__name__}:MomentumSGD",
    sigmas=(Sigma("gradient", "sigma", "noise std over C on the batch mean"),),
    layout="sampled",
    rules={"lr": toy_lr},
    steps_rule=toy_steps,
    # Every release is a clipped sum of the drawn batch (self.gradients.sum), which the split all-reduces.
    data_parallel=all_reduced,
)
#: The same toy, stating nothing about data parallelism (refused whole), or refusing in its own words.
SILENT = dataclasses.replace(SPEC, data_parallel=registry.undeclared)
REFUSING = dataclasses.replace(SPEC, data_parallel=refuses("keeps a momentum per process"))


def test_the_toys_arguments_come_from_its_schema():
    assert SPEC.arguments == (
        Argument("dataset_size", int, "number of records n", required=True),
        Argument("batch_size", int, "batch size b, drawn without replacement", required=True),
        Argument("steps", int, "number of steps T", required=True),
        Argument("sampling", str, "batch sampling: wor", default="wor", choices=("wor",)),
    )


@pytest.fixture
def toy():
    with registry.registered(SPEC) as spec:
        yield spec
    assert NAME not in registry.REGISTRY


# ---- the front door, the command line, the calibration -----------------------------------------------------
def test_the_registry_checks_hold_for_the_toy(toy):
    from tests.algorithms import test_registry

    test_registry.test_each_entrys_layout_fits_its_class(NAME)
    assert NAME in registry.front_door()
    plan = toy.make_plan({"dataset_size": 100, "batch_size": 10, "steps": 20})
    assert plan == MomentumPlan(100, 10, 20) and toy.default_neighbouring() == REPLACE_ONE
    assert plan.sigma(plan.noise_multiplier(0.5)) == pytest.approx(0.5)


def _squared(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (0.5 * (output.squeeze(-1) - target) ** 2).mean()


def test_make_private_runs_the_toy(toy):
    x, y = harness.REGRESSION.records(40, torch.Generator().manual_seed(0))
    model = harness.REGRESSION.model(True)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = dpvr.make_private(
        model,
        _squared,
        TensorDataset(x, y),
        algorithm=NAME,
        epsilon=1.0,
        batch_size=8,
        epochs=2,
        lr=0.1,
        clip=1.0,
        momentum=0.9,
    )
    assert isinstance(trainer.algorithm, MomentumSGD)
    assert trainer.steps_per_epoch == 5 and trainer.total_steps == 10  # the sampler's epoch: n / b
    assert trainer.algorithm.plan == MomentumPlan(40, 8, 10)
    trainer.run()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    report = trainer.privacy_spent()
    assert report.epsilon <= 1.0 * (1 + 1e-9) and report.epsilon == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(ValueError, match="batch_size: 'toy-momentum-sgd' samples a batch each step"):
        dpvr.make_private(
            model, _squared, TensorDataset(x, y), algorithm=NAME, epsilon=1.0, steps=2, lr=0.1, clip=1.0
        )


def test_the_toy_gets_the_front_doors_setting_checks(toy):
    """What the toy's class declares (its required settings, the streams it clips) gives it the messages
    the built-in algorithms get, listed with the run's other problems."""
    x, y = harness.REGRESSION.records(40, torch.Generator().manual_seed(0))

    def refusal(name: str, **given: Any) -> str:
        with pytest.raises(ValueError) as err:
            dpvr.make_private(harness.REGRESSION.model(True), _squared, TensorDataset(x, y), algorithm=name,
                              epsilon=1.0, batch_size=8, lr=0.1, **given)
        return str(err.value)

    said = refusal(NAME, steps=0)
    assert "2 problems" in said and "clip: 'toy-momentum-sgd' needs this setting" in said
    streamed = dataclasses.replace(SPEC, name="toy-streamed", algorithm=f"{__name__}:StreamedMomentumSGD")
    with registry.registered(streamed):
        for given, why in (({"clip": 1.0}, "clips each stream with its own radius, so it takes a mapping: "),
                           ({}, "needs this setting: ")):
            said = refusal("toy-streamed", steps=2, **given)
            assert f"clip: 'toy-streamed' {why}" in said
            assert '{"gradient": C1, "momentum": (C2, C3)}' in said
            assert f"(see {__name__}.StreamedMomentumSGD)" in said


class StreamedMomentumSGD(MomentumSGD):
    """The toy as an algorithm that clips two streams with radii of their own (only its declaration is used:
    make_private stops at the settings check)."""

    clip_streams = ("gradient", "momentum")
    clip_pairs = ("momentum",)


def _toy_trainer(**options: Any) -> dpvr.PrivateTrainer:
    x, y = harness.REGRESSION.records(40, torch.Generator().manual_seed(0))
    arguments = {"epsilon": 1.0, "batch_size": 8, "clip": 1.0, "momentum": 0.9, **options}
    return dpvr.make_private(harness.REGRESSION.model(True), _squared, TensorDataset(x, y), algorithm=NAME,
                             **arguments)


def test_the_toy_gets_its_theorem_defaults(toy):
    """lr and the run's length come from the toy's own rules, as DIFF2's do from its module's."""
    trainer = _toy_trainer()
    d = sum(p.numel() for p in trainer.model.parameters())
    assert d == 4 and set(trainer.derived) == {"lr", "steps"}
    assert trainer.algorithm.lr == 0.5 and trainer.derived["lr"].value == 0.5  # 1 / (1 * sqrt(4))
    assert trainer.total_steps == 10 and trainer.algorithm.plan == MomentumPlan(40, 8, 10)  # ceil(40 * 1 / 4)
    given = _toy_trainer(lr=0.05, epochs=1)  # given settings are not derived
    assert given.algorithm.lr == 0.05 and given.total_steps == 5 and not given.derived
    expected = r"make_private\('toy-momentum-sgd'\): lr: not given, and its default \(the toy theorem"
    with pytest.raises(ValueError, match=expected):
        _toy_trainer(clip={"gradient": 1.0}, steps=2)


def _toy_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with registry.registered(SPEC):
            trainer = _toy_trainer(steps=6, lr=0.1, runtime=_toy_runtime())
            split = (isinstance(trainer.algorithm.gradients, AllReducedGradients)
                     and isinstance(trainer.algorithm.records, ShardedRecords))
            infos = trainer.run()
        refusals = []
        for spec in (SILENT, REFUSING):
            with registry.registered(spec):
                try:
                    _toy_trainer(steps=6, lr=0.1)
                except ValueError as err:
                    refusals.append(str(err))
        torch.save({"params": [p.detach().clone() for p in trainer.model.parameters()], "split": split,
                    "infos": infos,
                    "epsilon": trainer.privacy_spent().epsilon, "refusals": refusals}, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _toy_runtime() -> RuntimeConfig:
    return RuntimeConfig(sampler_seed=5, generator=dpvr.NoiseGenerator(7, reproducible=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes
def test_the_toy_runs_data_parallel_or_is_refused_as_it_states(toy, tmp_path):
    """Two processes run the toy as one logical run (its entry states that every release is all-reduced): each
    loads its half of each batch and the clipped sums are all-reduced, the same model on both, at the
    one-process run's epsilon. Without that statement it is refused whole; with a refusal of its own, in
    its own words."""
    out = str(tmp_path / "rank")
    mp.spawn(_toy_rank, args=(2, _free_port(), out), nprocs=2)
    ranks = [torch.load(f"{out}-{r}.pt") for r in range(2)]
    alone = _toy_trainer(steps=6, lr=0.1, runtime=_toy_runtime())
    alone_infos = alone.run()
    start = harness.REGRESSION.model(True).parameters()
    assert ranks[0]["split"] and ranks[1]["split"]
    for p0, p1, p in zip(ranks[0]["params"], ranks[1]["params"], start):
        assert torch.equal(p0, p1) and not torch.equal(p0, p.detach())
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] == alone.privacy_spent().epsilon
    for r in ranks:  # the toy reports the records it loaded: each rank its half of the one-process batch
        assert [i["batch"] for i in r["infos"]] == [4] * 6 and [i["batch"] for i in alone_infos] == [8] * 6
    for r in ranks:
        silent, refusing = r["refusals"]
        assert "does not state that its releases are all-reduced (AlgorithmSpec.data_parallel)" in silent
        assert "it keeps a momentum per process; run it in one process" in refusing


def _json(capsys, argv: list[str]) -> dict:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_dpvr_account_and_calibrate_read_the_toys_entry(toy, capsys):
    run = ["--dataset-size", "1000", "--batch-size", "50", "--steps", "100"]
    accounted = _json(capsys, ["account", NAME, *run, "--sigma", "0.04", "--delta", "1e-5", "--json"])
    plan = MomentumPlan(1000, 50, 100)
    z = plan.noise_multiplier(0.04)
    accountant = Accountant(accounted["accountant"], REPLACE_ONE)
    accountant.record_mechanism(plan({"gradient": z}))
    assert accounted["algorithm"] == NAME
    assert accounted["epsilon"] == pytest.approx(accountant.epsilon(1e-5), rel=1e-12)
    assert (
        accounted["streams"][0]["sigma"] == pytest.approx(0.04) and accounted["streams"][0]["releases"] == 100
    )
    calibrated = _json(capsys, ["calibrate", NAME, *run, "--epsilon", "1.5", "--delta", "1e-5", "--json"])
    assert calibrated["spent_epsilon"] == pytest.approx(1.5, rel=1e-3)
    assert calibrated["noise_multiplier"] == pytest.approx(
        calibrate(plan, 1.5, 1e-5, accountant=calibrated["accountant"])["gradient"], rel=1e-12
    )


def test_without_its_entry_the_toy_is_unknown(capsys):
    """Registered for a block only: afterwards neither the command line nor make_private knows it."""
    with registry.registered(SPEC):
        assert NAME in registry.REGISTRY
    assert NAME not in registry.REGISTRY
    with pytest.raises(SystemExit):  # argparse: invalid choice
        cli.main(
            ["account", NAME, "--dataset-size", "10", "--batch-size", "2", "--steps", "1", "--sigma", "1"]
        )
    assert NAME in capsys.readouterr().err
    x, y = harness.REGRESSION.records(8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="algorithm: must be one of"):
        dpvr.make_private(
            harness.REGRESSION.model(True),
            _squared,
            TensorDataset(x, y),
            algorithm=NAME,
            epsilon=1.0,
            steps=1,
        )


def test_auto_shares_read_the_toys_plan(toy):
    """The error proxy of ``shares="auto"`` needs nothing from dpvr beyond the plan's own methods."""
    plan = MomentumPlan(1000, 50, 100)
    assert stream_dimensions(plan, 7) == {"gradient": 7}
    assert plan.stream_scale("gradient") == pytest.approx(1 / 50)
    auto = calibrate(plan, 1.0, 1e-5, shares="auto", dimensions={"gradient": 7})
    assert auto == pytest.approx(calibrate(plan, 1.0, 1e-5), rel=1e-9)


# ---- the sensitivity harness ------------------------------------------------------------------------------
ENTRY = harness.Algorithm(NAME, harness.registry_factory(NAME), harness.REGRESSION, tight=("gradient",))


@pytest.fixture
def covered(toy, monkeypatch):
    """The toy registered, and given its harness entry (before which the coverage check names it)."""
    assert harness.uncovered() == [NAME]
    monkeypatch.setitem(harness.ALGORITHMS, NAME, ENTRY)
    assert not harness.uncovered()
    return ENTRY


def _config(**options: Any) -> dict:
    return {
        "n": 6,
        "seed": 0,
        "index": 1,
        "adversary": "opposed",
        "relation": REPLACE_ONE,
        "options": {"batch_size": 3, "steps": 3, "lr": 0.1, "clip": 0.5, "momentum": 0.5, **options},
    }


def test_the_toy_keeps_its_charged_sensitivity_tightly(covered):
    outcome = harness.lockstep(covered, _config())
    harness.assert_within_sensitivity(outcome)
    harness.assert_accounting_matches(covered, outcome)
    assert outcome.ratios()["gradient"] > 0.5  # the opposed record attains the charge


def test_the_harness_catches_a_toy_that_leaks(covered, monkeypatch):
    """A momentum buffer fed by the private sum, not the release, is private data reaching the state."""

    honest = MomentumSGD._step

    def leaky(self):
        info = honest(self)
        with torch.no_grad():
            for m, s in zip(self.velocity, self._sum):
                m.add_(1e-3 * s)
        return info

    monkeypatch.setattr(MomentumSGD, "_step", leaky)
    with pytest.raises(AssertionError, match="without a release"):
        harness.lockstep(covered, _config())


def test_a_resumed_toy_run_releases_what_the_uninterrupted_run_releases(covered):
    config = _config(steps=4)
    original = harness.neighbours(covered.task, config).original
    assert not harness.resume_differences(covered, config, original, 2)
    assert not harness.older_resume_problems(covered, config, original, 2)


@given(data=st.data())
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
def test_generated_toy_configurations_keep_sensitivity_and_accounting(data):
    config = data.draw(dpsgd_configs(sampling="wor"), label="config")
    config["options"]["momentum"] = data.draw(st.sampled_from([0.0, 0.9]), label="momentum")
    with registry.registered(SPEC):
        outcome = harness.lockstep(ENTRY, config)
    harness.assert_within_sensitivity(outcome)
    harness.assert_accounting_matches(ENTRY, outcome)
    assert all(math.isfinite(c.gap) for c in outcome.comparisons)
