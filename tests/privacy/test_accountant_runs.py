"""The accountant prices runs separately: two recorded runs are two runs, step-by-step releases belong to
the run the caller names, and states saved without run identities load pessimistically."""

from __future__ import annotations

import json

import dp_accounting as dpa
import pytest

from dpvr.algorithms import DPSGDPlan
from dpvr.privacy import Accountant
from dpvr.privacy.pld.random_allocation import random_allocation_gaussian_pld
from dpvr.privacy.random_allocation import RandomAllocationDpEvent

DELTA = 1e-5


def _epochs(z: float, t: int, epochs: int, delta: float = DELTA) -> float:
    epoch = random_allocation_gaussian_pld(z, t)
    return float((epoch.self_compose(epochs) if epochs > 1 else epoch).get_epsilon_for_delta(delta))


# -- item 5: random-allocation epochs are counted per run ------------------------------------------------


def test_two_recorded_runs_are_priced_as_two_runs():
    """Two runs of 15 steps (t = 10) cost two epochs each; merged, they would pass for three."""
    plan = DPSGDPlan(steps=15, sampling="random-allocation", batch_size=10, dataset_size=100)
    acc = Accountant("pld", "add-remove")
    acc.record_mechanism(plan(1.0))
    acc.record_mechanism(plan(1.0))
    assert acc.epsilon(DELTA) == pytest.approx(_epochs(1.0, 10, 4), rel=1e-9)
    assert acc.epsilon(DELTA) > _epochs(1.0, 10, 3) * 1.05


def test_step_by_step_releases_belong_to_the_run_the_caller_names():
    event = RandomAllocationDpEvent(10, dpa.GaussianDpEvent(1.0))
    acc = Accountant("pld", "add-remove")
    for run in ("", "b", ""):  # the implicit run is one run, interrupted or not
        for _ in range(5):
            acc.record("gradient", event, run=run)
    two = _epochs(1.0, 10, 2)
    assert acc.epsilon(DELTA) == pytest.approx(two, rel=1e-9)
    # The guard prices a release in its own run: run "b" has room in its epoch, the implicit run has none.
    assert not acc.would_exceed("gradient", event, two * (1 + 1e-9), DELTA, run="b")
    assert acc.would_exceed("gradient", event, two * (1 + 1e-9), DELTA)
    assert acc.would_exceed("gradient", event, two * (1 + 1e-9), DELTA, run="c")
    # The run identity survives a checkpoint: "b" still has room after a restore.
    restored = Accountant.from_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.epsilon(DELTA) == acc.epsilon(DELTA)
    restored.record("gradient", event, run="b")
    assert restored.epsilon(DELTA) == pytest.approx(two, rel=1e-9)


def test_a_recorded_mechanism_never_joins_a_run_named_like_it():
    plan = DPSGDPlan(steps=5, sampling="random-allocation", batch_size=10, dataset_size=100)
    acc = Accountant("pld", "add-remove")
    parts, event = plan.step("gradient", 1.0)
    acc.record(parts, event, 5, run="mechanism-1")
    acc.record_mechanism(plan(1.0))
    acc.record_mechanism(plan(1.0))
    assert acc.epsilon(DELTA) == pytest.approx(_epochs(1.0, 10, 3), rel=1e-9)


def test_states_without_run_identities_load_pessimistically():
    """A state saved before runs were recorded cannot tell them apart: each random-allocation entry is charged
    as a run of its own (an upper bound, stated in the report); other ledgers load unchanged."""
    event = RandomAllocationDpEvent(10, dpa.GaussianDpEvent(1.0))
    legacy = {
        "format": "dpvr.privacy.Accountant/1",
        "accountant": "pld",
        "neighbouring": "add-remove",
        "orders": [2.0, 4.0, 8.0, 16.0, 32.0],
        "failure_probability": 0.0,
        "assumptions": [],
        "ledger": [
            {"streams": {"gradient": 1.0}, "count": 5, "event": json.loads(json.dumps(_dict(event)))},
            {"streams": {"gradient": 1.0}, "count": 5, "event": json.loads(json.dumps(_dict(event)))},
        ],
    }
    acc = Accountant.from_state_dict(legacy)
    assert acc.epsilon(DELTA) == pytest.approx(_epochs(1.0, 10, 2), rel=1e-9)
    assert any("run identities" in text for text in acc.report(DELTA).assumptions)
    gaussian = dict(
        legacy, ledger=[{"streams": {"g": 1.0}, "count": 3, "event": _dict(dpa.GaussianDpEvent(2.0))}]
    )
    plain = Accountant.from_state_dict(gaussian)
    fresh = Accountant("pld", "add-remove")
    fresh.record("g", dpa.GaussianDpEvent(2.0), 3)
    assert plain.epsilon(DELTA) == fresh.epsilon(DELTA)
    assert not any("run identities" in text for text in plain.report(DELTA).assumptions)
    with pytest.raises(ValueError, match="format"):
        Accountant.from_state_dict(dict(legacy, format="dpvr.privacy.Accountant/0"))


def _dict(event: dpa.DpEvent) -> dict:
    from dpvr.privacy import event_to_dict

    return event_to_dict(event)
