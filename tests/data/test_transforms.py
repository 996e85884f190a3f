"""Bundled datasets, the Dataset container, preprocessing, client splits and imbalance construction."""

from __future__ import annotations

import numpy as np
import pytest

from dpvr.data import (
    DATASET_NAMES,
    DIGITS_RANGE,
    Dataset,
    DeclaredRange,
    PublicScaling,
    Standardizer,
    TargetScaler,
    binarize,
    load,
    long_tail,
    split_classes,
    split_clients,
    split_public,
    subsample_to_ratio,
    train_test_split,
    unit_norm,
)
from neighbours import one_record_moved


@pytest.mark.parametrize(("name", "shape", "task", "num_classes"), [
    ("diabetes", (442, 10), "regression", None),
    ("breast_cancer", (569, 30), "classification", 2),
    ("wine", (178, 13), "classification", 3),
    ("digits", (1797, 64), "classification", 10),
])
def test_bundled(name: str, shape: tuple[int, int], task: str, num_classes: int | None) -> None:
    data = load(name)
    assert data.features.shape == shape and data.features.dtype == np.float64
    assert data.task == task and data.num_classes == num_classes and data.name == name
    assert np.all(np.isfinite(data.features))
    if task == "classification":
        assert set(np.unique(data.targets)) == set(range(num_classes))


def test_bundled_details() -> None:
    assert load("breast_cancer").classes == ("malignant", "benign")
    assert abs(load("diabetes").features[:, 0].mean()) > 1  # raw ages, not sklearn's pre-scaled copy
    digits = load("Digits")
    inputs, targets = digits.tensors()
    assert digits.sample_shape == (1, 8, 8) and tuple(inputs.shape) == (1797, 1, 8, 8)
    assert str(inputs.dtype) == "torch.float64" and str(targets.dtype) == "torch.int64"
    assert set(DATASET_NAMES) == {
        "breast_cancer", "diabetes", "digits", "wine", "mnist", "fashion_mnist", "mnist_5k"
    }
    with pytest.raises(ValueError, match="unknown dataset 'iris'.*read_csv"):
        load("iris")
    with pytest.raises(ValueError, match="no published train/test split"):
        load("wine", split="train")
    with pytest.raises(ValueError, match="split must be"):
        load("wine", split="valid")


def test_dataset_validates_its_fields() -> None:
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match="2-D floating"):
        Dataset(np.zeros((3, 2), np.int64), np.zeros(3), "regression", "t")
    with pytest.raises(ValueError, match=r"targets must have shape \(3,\)"):
        Dataset(x, np.zeros(4), "regression", "t")
    with pytest.raises(ValueError, match="task must be one of"):
        Dataset(x, np.zeros(3), "ranking", "t")
    with pytest.raises(ValueError, match=r"class codes must lie in \[0, 2\)"):
        Dataset(x, np.array([0, 1, 2]), "classification", "t", num_classes=2)
    with pytest.raises(ValueError, match="integer class codes"):
        Dataset(x, np.array([0.0, 1.0, 0.5]), "classification", "t", num_classes=2)
    with pytest.raises(ValueError, match="needs num_classes"):
        Dataset(x, np.zeros(3, np.int64), "classification", "t")
    with pytest.raises(ValueError, match="no num_classes"):
        Dataset(x, np.zeros(3), "regression", "t", num_classes=2)
    with pytest.raises(ValueError, match="sample_shape"):
        Dataset(x, np.zeros(3), "regression", "t", sample_shape=(3,))


def test_train_test_split_is_a_seeded_partition() -> None:
    data = load("wine")
    train, test = train_test_split(data, seed=3)
    assert (len(train), len(test)) == (142, 36)
    rows = np.concatenate([train.features, test.features])
    assert sorted(map(tuple, rows)) == sorted(map(tuple, data.features))
    again, _ = train_test_split(data, seed=3)
    other, _ = train_test_split(data, seed=4)
    assert np.array_equal(train.features, again.features)
    assert not np.array_equal(train.features, other.features)
    with pytest.raises(ValueError, match="test_fraction must lie in"):
        train_test_split(data, test_fraction=1.0, seed=0)
    with pytest.raises(ValueError, match="both must be >= 1"):
        train_test_split(data.subset([0, 1]), test_fraction=0.1, seed=0)


def test_standardizer_fits_on_the_data_it_is_given_only() -> None:
    train, test = train_test_split(load("digits"), seed=0)
    standardize = Standardizer.fit(train)
    train_z, test_z = standardize(train), standardize(test)
    varying = train.features.std(axis=0) > 0
    np.testing.assert_allclose(train_z.features.mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(train_z.features[:, varying].std(axis=0), 1, rtol=1e-12)
    assert np.all(train_z.features[:, ~varying] == 0) and np.all(np.isfinite(test_z.features))
    np.testing.assert_allclose(test_z.features, (test.features - standardize.mean) / standardize.scale)
    assert not np.allclose(test_z.features.mean(axis=0), 0, atol=1e-3)  # test statistics were not used
    assert train_z.sample_shape == (1, 8, 8) and np.array_equal(train_z.targets, train.targets)
    with pytest.raises(ValueError, match="has 13 features, the standardizer was fitted on 64"):
        standardize(load("wine"))


def test_target_scaler() -> None:
    train, test = train_test_split(load("diabetes"), seed=0)
    scaler = TargetScaler.fit(train)
    assert np.abs(scaler(train).targets).max() == 1.0
    assert TargetScaler.fit(train, test).scale == np.abs(load("diabetes").targets).max()
    with pytest.raises(ValueError, match="applies to regression"):
        TargetScaler.fit(load("wine"))
    with pytest.raises(ValueError, match="positive finite"):
        TargetScaler(0.0)


def test_split_public_holds_out_a_value_independent_share() -> None:
    data = load("diabetes")
    public, rest = split_public(data, seed=0)
    assert (len(public), len(rest)) == (44, 398)
    assert sorted(map(tuple, np.concatenate([public.features, rest.features]))) == sorted(
        map(tuple, data.features))
    changed = data.subset(np.arange(len(data)))
    changed.features[:] = changed.features * 2 + 1  # other values, same records by position
    public_changed, _ = split_public(changed, seed=0)
    np.testing.assert_array_equal(public_changed.features, public.features * 2 + 1)


def _rows(data: Dataset) -> np.ndarray:
    return np.column_stack([data.features, data.targets])


@pytest.mark.parametrize("name", ["diabetes", "breast_cancer"])
def test_public_scaling_moves_only_the_changed_private_record(name: str) -> None:
    public, private = split_public(load(name), seed=0)
    changed = one_record_moved(private, 3, 100.0)
    scale = PublicScaling.fit(public)
    differs = np.any(_rows(scale(private)) != _rows(scale(changed)), axis=1)
    assert np.flatnonzero(differs).tolist() == [3]
    # What it replaces: fitted on the private records, the statistics move every record.
    on_private = PublicScaling.fit(private)(private)
    assert np.any(_rows(on_private) != _rows(PublicScaling.fit(changed)(changed)), axis=1).all()


def test_public_scaling_standardises_and_scales_regression_targets() -> None:
    public, private = split_public(load("diabetes"), seed=1)
    scaled = PublicScaling.fit(public)(public)
    np.testing.assert_allclose(scaled.features.mean(axis=0), 0, atol=1e-12)
    assert np.abs(scaled.targets).max() == 1.0
    assert PublicScaling.fit(split_public(load("wine"), seed=0)[0]).targets is None
    assert "public split: 10% of the records" in PublicScaling.description()


def test_declared_range_and_unit_norm_are_per_record() -> None:
    digits = load("digits")
    mapped = DIGITS_RANGE(digits)
    np.testing.assert_array_equal(mapped.features, digits.features / 16.0)
    assert mapped.features.min() == 0.0 and mapped.features.max() == 1.0
    np.testing.assert_allclose(DeclaredRange(-1.0, 3.0)(digits).features, (digits.features + 1) / 4)
    assert DIGITS_RANGE.description == "features mapped from their declared range [0, 16] onto [0, 1]"
    with pytest.raises(ValueError, match="finite low < high"):
        DeclaredRange(1.0, 1.0)
    wine = load("wine")
    normed = unit_norm(wine)
    np.testing.assert_allclose(np.linalg.norm(normed.features, axis=1), 1.0)
    for transform in (DIGITS_RANGE, unit_norm):
        data = digits if transform is DIGITS_RANGE else wine
        moved = transform(one_record_moved(data, 5, 100.0))
        differs = np.any(transform(data).features != moved.features, axis=1)
        assert np.flatnonzero(differs).tolist() == [5]
    zero = Dataset(np.zeros((2, 3)), np.zeros(2), "regression", "zeros")
    assert np.all(unit_norm(zero).features == 0)


def test_split_clients_equal_disjoint_shards() -> None:
    data = load("wine")  # 178 samples
    shards = split_clients(data, 10, seed=0)
    assert [len(s) for s in shards] == [17] * 10  # the 8 left over are dropped
    rows = [tuple(r) for s in shards for r in s.features]
    assert len(set(rows)) == 170 and set(rows) <= {tuple(r) for r in data.features}
    assert all(s.num_classes == 3 and s.name == "wine" for s in shards)
    with pytest.raises(ValueError, match="cannot fill 200 client shards"):
        split_clients(data, 200, seed=0)
    with pytest.raises(ValueError, match="num_clients must be >= 1"):
        split_clients(data, 0, seed=0)


def test_binarize_with_random_class_groups() -> None:
    positive = split_classes(10, seed=1)
    assert len(positive) == 5 and positive == split_classes(10, seed=1)
    assert positive != split_classes(10, seed=2)
    digits = load("digits")
    binary = binarize(digits, positive)
    assert binary.num_classes == 2 and binary.classes[1] == positive
    np.testing.assert_array_equal(binary.targets, np.isin(digits.targets, positive))
    assert len(binarize(load("wine"), split_classes(3, seed=0)).classes[1]) == 1
    for bad in ([], range(10), [10]):
        with pytest.raises(ValueError, match="non-empty proper subset"):
            binarize(digits, bad)
    with pytest.raises(ValueError, match="num_classes >= 2"):
        split_classes(1, seed=0)
    with pytest.raises(ValueError, match="needs a classification dataset"):
        binarize(load("diabetes"), [0])


def test_subsample_to_ratio() -> None:
    binary = binarize(load("digits"), range(5, 10))  # MNIST-ST style: digits 5-9 positive
    train, test = train_test_split(binary, seed=0)
    imbalanced = subsample_to_ratio(train, 0.1, seed=0)
    counts = imbalanced.class_counts()
    assert counts[0] == train.class_counts()[0]  # the majority is kept whole
    assert abs(counts[1] / counts.sum() - 0.1) < 1 / counts.sum()
    balanced = subsample_to_ratio(test, 0.5, seed=0)
    assert balanced.class_counts()[0] == balanced.class_counts()[1] == test.class_counts().min()
    majority = subsample_to_ratio(train, 0.9, seed=0)  # too few positives: negatives are cut instead
    assert majority.class_counts()[1] == train.class_counts()[1]
    with pytest.raises(ValueError, match="needs 2 classes"):
        subsample_to_ratio(load("wine"), 0.1, seed=0)
    with pytest.raises(ValueError, match="positive_ratio must lie in"):
        subsample_to_ratio(train, 0.0, seed=0)
    with pytest.raises(ValueError, match="keeps no sample"):
        few = np.concatenate([np.flatnonzero(train.targets == 0)[:3], np.flatnonzero(train.targets == 1)[:1]])
        subsample_to_ratio(train.subset(few), 0.01, seed=0)


def test_long_tail() -> None:
    digits = load("digits")
    tail = long_tail(digits, 5)
    counts = tail.class_counts()
    assert list(counts[:5]) == [5] * 5 and list(counts[5:]) == list(digits.class_counts()[5:])
    last_zeros = np.flatnonzero(digits.targets == 0)[-5:]
    np.testing.assert_array_equal(tail.features[tail.targets == 0], digits.features[last_zeros])
    custom = long_tail(digits, 2, classes=[9])
    assert custom.class_counts()[9] == 2 and custom.class_counts()[0] == digits.class_counts()[0]
    with pytest.raises(ValueError, match="keep_per_class must be >= 1"):
        long_tail(digits, 0)
    with pytest.raises(ValueError, match="class codes 0..9"):
        long_tail(digits, 3, classes=[10])
