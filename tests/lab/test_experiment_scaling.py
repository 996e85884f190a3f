"""``dpvr experiment scaling`` and its MNIST-1D data: deterministic local generation (never a download), the
statistics of the answer, and a tiny run end to end."""

import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("mnist1d")

from dpvr.cli.experiment import parse  # noqa: E402
from dpvr.data import load, load_mnist1d  # noqa: E402
from dpvr.data import mnist1d as m1d  # noqa: E402
from dpvr.trainer.defaults import noise_constant  # noqa: E402
from dpvr_lab.experiments import scaling  # noqa: E402


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Small chunks in a private cache; any attempt to download fails the test."""
    import mnist1d.data
    import requests

    def refuse(*args, **kwargs):
        raise AssertionError("MNIST-1D must be generated locally, never downloaded")

    monkeypatch.setattr(mnist1d.data, "get_dataset", refuse)
    monkeypatch.setattr(requests, "get", refuse)
    monkeypatch.setattr(requests.Session, "request", refuse)
    monkeypatch.setenv("DPVR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(m1d, "CHUNK", 200)
    monkeypatch.setattr(m1d, "TEST_SIZE", 300)
    monkeypatch.setattr(m1d, "VALIDATION_SIZE", 200)
    return tmp_path / "cache"


def test_generation_is_deterministic_nested_local_and_leaves_numpy_state_alone(offline):
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    first = load_mnist1d(300, "train", cache=False)
    assert np.array_equal(np.random.get_state()[1], before)
    again = load_mnist1d(300, "train", cache=False)
    assert np.array_equal(first.features, again.features) and np.array_equal(first.targets, again.targets)
    assert first.features.shape == (300, 40) and first.features.dtype == np.float64
    assert set(np.unique(first.targets)) <= set(range(10)) and first.num_classes == 10
    smaller = load_mnist1d(150, "train")  # nested: the first records of the larger set; now cached
    assert np.array_equal(smaller.features, first.features[:150])
    assert any(name.endswith(".npz") for name in os.listdir(offline / "mnist1d"))
    assert np.array_equal(load_mnist1d(150, "train").features, smaller.features)  # from the cache
    public = load_mnist1d(300, "public")
    assert not np.allclose(public.features[:10], first.features[:10])  # its own seeds
    assert len(load_mnist1d(300, "test")) == 300 and len(load_mnist1d(10, "validation")) == 200
    assert np.array_equal(load_mnist1d(10, "test").features, load_mnist1d(300, "test").features)
    via_registry = load("mnist1d-300", split="train")  # a name any size can take
    assert np.array_equal(via_registry.features, first.features)
    with pytest.raises(ValueError, match="split"):
        load_mnist1d(10, "everything")  # type: ignore[arg-type]


def test_crossover_and_exponent():
    assert scaling.crossover([1, 2, 4], [0.5, 0.01, 0.02]) == 2
    assert scaling.crossover([1, 2, 4], [0.01, 0.5, 0.02]) == 4
    assert scaling.crossover([1, 2, 4], [0.01, 0.01, 0.2]) is None
    assert scaling.fitted_exponent([1, 4, 16], [1.0, 0.5, 0.25]) == pytest.approx(-0.5)
    summary = scaling.paired_summary([1.0, 2.0, 3.0], [2.0, 3.5, 4.0], lower_is_better=True)
    assert summary["mean"] == pytest.approx(-3.5 / 3)
    assert summary["ci_low"] < summary["mean"] < summary["ci_high"]
    assert summary["p"] < 0.05
    assert scaling.paired_summary([1.0, 2.0, 3.0], [2.0, 3.5, 4.0], lower_is_better=False)["p"] > 0.5


def test_diff2_restart_is_a_tenth_of_the_rounds_or_the_theorems():
    """R / 10 by default; with --restart theorem, Theorem 4.3's max(1, tau R) at the cell's n, d, epsilon and
    radii (1 at n = 64k with R = 50: DIFF2 is DP-GD there), and a different protocol key."""
    from torch import nn

    from dpvr.trainer.defaults import noise_constant

    model = nn.Sequential(nn.Linear(40, 16), nn.Softplus(), nn.Linear(16, 10))  # d = 826
    radii = {"restart": 1.0, "difference": 2.0}
    fraction = scaling.Protocol((4000,), 5, 50, 64)
    theorem = scaling.Protocol((4000,), 5, 400, 64, "theorem")
    assert scaling.diff2_restart(fraction, radii, 4000, model, 1.0) == 5
    # the proof's tau with the accountant's constant c (dpvr.trainer.defaults), at the experiment's delta
    c = noise_constant(1.0, scaling.DELTA)
    tau = (math.sqrt(2 * c) * math.sqrt(826) / (2.0 * 4000)) ** (2 / 3)
    assert scaling.diff2_restart(theorem, radii, 4000, model, 1.0) == round(tau * 400) == 49
    short = scaling.Protocol((64000,), 5, 50, 64, "theorem")
    assert scaling.diff2_restart(short, radii, 64000, model, 1.0) == 1
    key = fraction.key("diff2", 1.0, 4000)
    assert key != scaling.Protocol((4000,), 5, 50, 64, "theorem").key("diff2", 1.0, 4000)
    assert key == scaling.Protocol((4000,), 5, 50, 64).key("diff2", 1.0, 4000)  # earlier cells still read


def test_the_dro_task_is_long_tailed_nested_and_tested_on_balanced_data(offline):
    """The DRO paper's "-ST" construction on MNIST-1D: n training records with a tenth positive (digits 5-9),
    the first of each class in generation order (so the sets nest), a balanced test set, and the schedule
    that make_private derives from DP-DRO Theorems 7 and 8."""
    from torch import nn

    small, large = scaling._data("dro", 100), scaling._data("dro", 200)
    for data, n in ((small, 100), (large, 200)):
        x, y = data.train
        assert x.shape == (n, 40) and int(y.sum()) == n // 10 and set(y.tolist()) == {0, 1}
        assert int(data.twin[1].sum()) == n // 10 and not np.allclose(data.twin[0][:5], x[:5])
    test_labels = small.test[1]
    assert 2 * int(test_labels.sum()) == len(test_labels) > 0  # balanced
    assert all(len(data.validation[0]) == 100 for data in (small, large))  # half the 200 validation records
    rows = {tuple(r.tolist()) for r in large.train[0]}
    assert all(tuple(r.tolist()) in rows for r in small.train[0])  # nested
    raw = load_mnist1d(200, "train")
    positives = np.isin(raw.targets, scaling.DRO_POSITIVE)
    assert np.allclose(small.train[0][small.train[1] == 1].numpy(), raw.features[positives][:10])
    with pytest.raises(ValueError, match="needs"):
        scaling._first_of_each_class(np.array([0, 0, 1]), {0: 1, 1: 2}, "toy")

    model = nn.Sequential(nn.Linear(40, 16), nn.Softplus(), nn.Linear(16, 2))  # d = 690
    radii = {"eta-refresh": 1.0, "eta-difference": (2.0, 2.0), "x-refresh": 1.0, "x-difference": (2.0, 2.0)}
    restart, sizes = scaling.spider_schedule(scaling.Protocol((16000,), 5, 50, 64), radii, 16000, model, 1.0)
    # Theorems 7/8 with log(1/delta)/eps^2 read as k c: k = 4 streams share the budget, c the squared noise
    # multiplier of one Gaussian release spending (1, 1e-6) under PLD (71.4; trainer.defaults).
    kc = 4 * noise_constant(1.0, 1e-6)
    assert kc == pytest.approx(4 * 71.4, rel=2e-3)
    q = (16000 / math.sqrt(690 * kc)) ** (2 / 3)
    assert restart == round(q) == 11
    b2 = max((16000 / math.sqrt(2 * 690 * kc)) ** (2 / 3), (16000 * 690 * kc) ** (1 / 3) / 2 ** (1 / 6))
    assert sizes == {"eta-refresh": 16000, "x-refresh": 16000, "eta-difference": math.ceil(b2),
                     "x-difference": math.ceil(b2)}


@pytest.mark.slow  # an experiment end to end (about 50 s on two shared cores)
def test_tiny_run_end_to_end(offline, tmp_path):
    out = tmp_path / "out"
    options = ["--quick", "--sizes", "64", "128", "--seeds", "2", "--rounds", "3", "--steps", "2",
               "--epsilon", "4", "--out", str(out)]
    doc = scaling.run(parse("scaling", options))
    assert len(doc["records"]) == 3 * 2 * 2 * 2  # papers x sizes x methods x seeds
    for record in doc["records"]:
        assert record["spent_epsilon"] <= 4 + 1e-6
        assert record["metrics"]["diagnostics"]["private"] is False
        assert math.isfinite(record["metrics"]["diagnostics"]["grad_norm"])
    for key in ("diff2/eps4", "privatediff/eps4", "dro/eps4"):
        found = doc["analysis"][key]
        assert [row["n"] for row in found["rows"]] == [64, 128]
        assert set(found["exponent"]) == set(scaling.PAPERS[key.split("/")[0]])
    assert all("worst_class_accuracy" in r["metrics"] for r in doc["records"] if r["dataset"].endswith("_st"))
    figures = [f"scaling-{paper}.png" for paper in scaling.PAPERS]
    for name in ("scaling.json", "scaling.csv", *figures):
        assert (out / name).is_file()
    assert json.loads((out / "scaling.json").read_text())["experiment"] == "scaling"
    cells = sorted(os.listdir(out / "cells"))
    assert len(cells) == 6
    again = scaling.run(parse("scaling", options))  # every cell read back, nothing recomputed
    assert json.dumps(again["analysis"]) == json.dumps(doc["analysis"])
