"""Readers of user-supplied files: CSV, LIBSVM and IDX (MNIST format), including broken files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dpvr.data import DataFileError, load, read_csv, read_idx, read_libsvm, read_mnist

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
             np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D, np.dtype(np.float64): 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, IDX_CODES[array.dtype], array.ndim]) + np.array(array.shape, ">u4").tobytes()
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path: Path, data: bytes, *, gz: bool = False) -> Path:
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# --- CSV --------------------------------------------------------------------------------------------------

def test_csv_with_header_and_string_labels(tmp_path: Path) -> None:
    path = tmp_path / "flowers.csv"
    path.write_text("length,width,species\n1.5,0.2,setosa\n\n4.7,1.4,versicolor\n1.3,0.3,setosa\n")
    data = read_csv(path, task="classification")
    assert data.name == "flowers" and data.num_classes == 2 and data.classes == ("setosa", "versicolor")
    np.testing.assert_array_equal(data.features, [[1.5, 0.2], [4.7, 1.4], [1.3, 0.3]])
    np.testing.assert_array_equal(data.targets, [0, 1, 0])


def test_csv_without_header_target_column_and_numeric_classes(tmp_path: Path) -> None:
    path = tmp_path / "plain.csv"
    path.write_text("10,1.0,2.0\n2,3.0,4.0\n10,5.0,6.0\n")
    data = read_csv(path, task="classification", target_column=0)
    assert data.classes == (2, 10)  # numeric order, not text order
    np.testing.assert_array_equal(data.targets, [1, 0, 1])
    np.testing.assert_array_equal(data.features, [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def test_csv_regression_by_column_name_gzipped_and_delimiter(tmp_path: Path) -> None:
    path = write(tmp_path / "houses.csv.gz", b"price;rooms;area\n100.5;3;70\n80;2;55\n", gz=True)
    data = read_csv(path, task="regression", target_column="price", delimiter=";")
    assert data.task == "regression" and data.num_classes is None and data.name == "houses"
    np.testing.assert_array_equal(data.targets, [100.5, 80.0])
    np.testing.assert_array_equal(data.features, [[3.0, 70.0], [2.0, 55.0]])


def test_csv_numeric_header_can_be_forced(tmp_path: Path) -> None:
    path = tmp_path / "numeric_header.csv"
    path.write_text("1,2,3\n4,5,6\n")
    assert len(read_csv(path, task="regression")) == 2
    assert len(read_csv(path, task="regression", header=True)) == 1


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty file"),
    ("a,b,c\n", "no data rows after the header"),
    ("1,2,3\n4,5\n", "line 2 has 2 fields, line 1 has 3"),
    ("1\n2\n", "at least two columns"),
    ("x,y,t\n1,2,0\n3,oops,1\n", "line 3, column 'y': 'oops' is not a finite number"),
    ("1,2,0\n3,,1\n", "line 2, column 2: is empty"),
    ("1,nan,0\n", "line 1, column 2: 'nan' is not a finite number"),
])
def test_csv_errors_name_file_and_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(DataFileError, match=message) as info:
        read_csv(path, task="classification")
    assert str(path) in str(info.value)


def test_csv_bad_arguments_and_files(tmp_path: Path) -> None:
    path = tmp_path / "ok.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="target column 'c' is not a name"):
        read_csv(path, task="regression", target_column="c")
    with pytest.raises(ValueError, match="target_column 5 out of range for 2 columns"):
        read_csv(path, task="regression", target_column=5)
    with pytest.raises(ValueError, match="task must be one of"):
        read_csv(path, task="ranking")
    with pytest.raises(DataFileError, match="line 2, column 'b': 'x' is not a finite number"):
        write(path, b"a,b\n1,x\n")
        read_csv(path, task="regression")
    with pytest.raises(DataFileError, match="line 2: field larger than field limit"):
        read_csv(write(path, b"a,b\n1," + b"9" * 200_000 + b"\n"), task="regression")
    with pytest.raises(DataFileError, match="not UTF-8"):
        read_csv(write(path, b"a,b\n1,\xff\n"), task="classification")
    with pytest.raises(FileNotFoundError, match="missing.csv: no such file"):
        read_csv(tmp_path / "missing.csv", task="regression")
    with pytest.raises(FileNotFoundError, match="is a directory"):
        read_csv(tmp_path, task="regression")
    with pytest.raises(DataFileError, match="corrupt or truncated gzip"):
        read_csv(write(path, gzip.compress(b"a,b\n1,2\n")[:-6]), task="regression")


# --- LIBSVM -----------------------------------------------------------------------------------------------

def test_libsvm_sparse_lines_become_dense(tmp_path: Path) -> None:
    path = tmp_path / "toy.libsvm"
    path.write_text("+1 1:0.5 3:2\n-1 2:1.5\n+1 1:1 2:1 3:1\n")
    data = read_libsvm(path, task="classification")
    assert data.name == "toy" and data.classes == (-1, 1)
    np.testing.assert_array_equal(data.targets, [1, 0, 1])
    np.testing.assert_array_equal(data.features, [[0.5, 0, 2], [0, 1.5, 0], [1, 1, 1]])
    wide = read_libsvm(write(tmp_path / "toy.gz", path.read_bytes(), gz=True), task="regression",
                       num_features=5)
    assert wide.features.shape == (3, 5) and wide.task == "regression"
    np.testing.assert_array_equal(wide.targets, [1.0, -1.0, 1.0])


@pytest.mark.parametrize(("text", "message"), [
    ("1 1:0.5\n0 a:b\n", "not valid LIBSVM data"),
    ("", "no samples"),
    ("1 1:inf\n", "non-finite feature value in sample 1"),
])
def test_libsvm_errors_name_file_and_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.svm"
    path.write_text(text)
    with pytest.raises(DataFileError, match=message) as info:
        read_libsvm(path, task="classification")
    assert str(path) in str(info.value)


# --- IDX / MNIST ------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(array=hnp.arrays(st.sampled_from(sorted(IDX_CODES, key=str)),
                       hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5)),
       gz=st.booleans())
def test_idx_round_trip(array: np.ndarray, gz: bool, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = write(tmp_path_factory.mktemp("idx") / "array.idx", idx_bytes(array), gz=gz)
    np.testing.assert_array_equal(read_idx(path), array)
    assert read_idx(path).dtype == array.dtype


@pytest.mark.parametrize(("data", "message"), [
    (b"\x00\x00", "too short for an IDX header"),
    (b"\x01\x00\x08\x01" + bytes(8), "not an IDX file"),
    (b"\x00\x00\x07\x01" + bytes(8), "unknown IDX type code 0x07"),
    (b"\x00\x00\x08\x00", "0 dimensions"),
    (b"\x00\x00\x08\x03\x00\x00\x00\x02", "truncated header"),
    (idx_bytes(np.arange(6, dtype=np.int32).reshape(2, 3))[:-1], r"truncated data: shape \(2, 3\) of int32"),
    (idx_bytes(np.arange(6, dtype=np.uint8)) + b"\x00\x00", "2 unexpected bytes after the data"),
])
def test_idx_corrupt_files(tmp_path: Path, data: bytes, message: str) -> None:
    path = write(tmp_path / "broken-idx3-ubyte", data)
    with pytest.raises(DataFileError, match=message) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_idx_truncated_gzip(tmp_path: Path) -> None:
    path = tmp_path / "images.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros((3, 4, 4), np.uint8)))[:-10])
    with pytest.raises(DataFileError, match="corrupt or truncated gzip"):
        read_idx(path)


def write_mnist(directory: Path, images: np.ndarray, labels: np.ndarray, prefix: str, gz: bool) -> None:
    suffix = ".gz" if gz else ""
    write(directory / f"{prefix}-images-idx3-ubyte{suffix}", idx_bytes(images), gz=gz)
    write(directory / f"{prefix}-labels-idx1-ubyte{suffix}", idx_bytes(labels), gz=gz)


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    write_mnist(tmp_path, rng.integers(0, 256, (6, 4, 3), dtype=np.uint8), np.arange(6, dtype=np.uint8),
                "train", gz=True)
    write_mnist(tmp_path, np.full((2, 4, 3), 255, np.uint8), np.array([9, 0], np.uint8), "t10k", gz=False)
    return tmp_path


def test_mnist_splits_and_load(mnist_dir: Path) -> None:
    train = read_mnist(mnist_dir)
    assert train.features.shape == (6, 12) and train.features.dtype == np.float32
    assert train.sample_shape == (1, 4, 3) and train.num_classes == 10
    assert train.features.min() >= 0.0 and train.features.max() <= 1.0
    np.testing.assert_array_equal(train.targets, np.arange(6))
    test = load("MNIST", data_dir=mnist_dir, split="test")
    np.testing.assert_array_equal(test.features, np.ones((2, 12)))
    fashion = load("fashion-mnist", data_dir=mnist_dir)
    assert len(fashion) == 8 and fashion.name == "fashion_mnist" and fashion.classes[9] == "Ankle boot"
    np.testing.assert_array_equal(fashion.targets, [0, 1, 2, 3, 4, 5, 9, 0])
    inputs, targets = fashion.tensors()
    assert tuple(inputs.shape) == (8, 1, 4, 3) and str(targets.dtype) == "torch.int64"


def test_mnist_errors(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    with pytest.raises(ValueError, match="pass data_dir"):
        load("mnist")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        read_mnist(mnist_dir / "nowhere")
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte, train-images-idx3-ubyte.gz"):
        read_mnist(empty)
    write_mnist(empty, np.zeros((3, 2, 2), np.uint8), np.zeros(2, np.uint8), "train", gz=False)
    with pytest.raises(DataFileError, match="2 labels for 3 images"):
        read_mnist(empty)
    write_mnist(empty, np.zeros((2, 2, 2), np.uint8), np.array([3, 10], np.uint8), "train", gz=False)
    with pytest.raises(DataFileError, match="label 10 outside the 10 classes"):
        read_mnist(empty)
    write_mnist(empty, np.zeros((2, 4), np.uint8), np.zeros(2, np.uint8), "train", gz=False)
    with pytest.raises(DataFileError, match="expected a 3-D unsigned-byte image array"):
        read_mnist(empty)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        read_mnist(mnist_dir, split="validation")
