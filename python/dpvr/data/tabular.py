"""CSV files: one sample per row, numeric feature columns and one target column."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np

from ._files import DataFileError, read_bytes
from .dataset import Dataset, Task, check_task, labelled_dataset


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def _parse_numbers(path: Path, rows: list[list[str]], line_numbers: list[int], columns: list[int],
                   headings: list[str]) -> np.ndarray:
    """Parse ``rows[:, columns]`` as finite float64, naming the first offending line and column."""
    table = [[row[column] for column in columns] for row in rows]
    try:
        values = np.array(table, dtype=np.float64)  # numpy applies float() to each field
        bad = np.argwhere(~np.isfinite(values))
    except ValueError:
        bad = [(i, j) for i, fields in enumerate(table) for j, field in enumerate(fields)
               if not _is_number(field)]
    if len(bad) == 0:
        return values
    i, j = bad[0]
    field = table[i][j].strip()
    problem = "is empty" if not field else f"{field!r} is not a finite number"
    raise DataFileError(path, f"line {line_numbers[i]}, column {headings[columns[j]]}: {problem}")


def _class_labels(raw: list[str]) -> np.ndarray:
    """Numeric labels when every field is a number (so that "2" sorts before "10"), else strings."""
    stripped = [field.strip() for field in raw]
    if all(_is_number(field) for field in stripped):
        numbers = np.array([float(field) for field in stripped])
        return numbers.astype(np.int64) if np.all(numbers == np.round(numbers)) else numbers
    return np.array(stripped)


def _locate_target(path: Path, first_row: list[str], target_column: int | str,
                   header: bool | None) -> tuple[int, bool]:
    """The target's column index, and whether ``first_row`` is a header (detected when ``header`` is None)."""
    width = len(first_row)
    if isinstance(target_column, str):
        if header is False or target_column not in first_row:
            raise ValueError(f"{path}: target column {target_column!r} is not a name in the header row")
        return first_row.index(target_column), True
    if not -width <= target_column < width:
        raise ValueError(f"{path}: target_column {target_column} out of range for {width} columns")
    target = target_column % width
    if header is None:
        header = not all(_is_number(field) for column, field in enumerate(first_row) if column != target)
    return target, header


def read_csv(path: str | os.PathLike[str], *, task: Task, target_column: int | str = -1,
             header: bool | None = None, delimiter: str = ",", name: str | None = None) -> Dataset:
    """Read a CSV file (optionally gzipped) into a :class:`Dataset`.

    Args:
        path: the file. Blank lines are skipped; every other row must have the same number of fields.
        task: ``"classification"`` (target values of any text are encoded as class codes in sorted order;
            ``Dataset.classes`` keeps the originals) or ``"regression"`` (targets must be numbers).
        target_column: index of the target column (negative counts from the end; default the last) or its
            name in the header row.
        header: whether the first row is a header. ``None`` detects it: the first row is a header when one
            of its feature fields is not a number.
        delimiter: the field separator.
        name: the dataset name; default the file name up to its first dot.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        DataFileError: the file is empty, not UTF-8, ragged, has fewer than two columns, or holds a feature
            (or regression target) that is not a finite number; the message gives the line and column.
        ValueError: ``target_column`` is out of range or not a header name, or ``task`` is unknown.
    """
    check_task(task)
    path = Path(path)
    try:
        text = read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataFileError(path, f"not UTF-8 text ({err})") from err
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    rows, line_numbers = [], []
    try:
        for row in reader:
            if any(field.strip() for field in row):
                rows.append(row)
                line_numbers.append(reader.line_num)
    except csv.Error as err:
        raise DataFileError(path, f"line {reader.line_num}: {err}") from err
    if not rows:
        raise DataFileError(path, "empty file")
    width = len(rows[0])
    for row, line in zip(rows, line_numbers):
        if len(row) != width:
            raise DataFileError(path, f"line {line} has {len(row)} fields, "
                                      f"line {line_numbers[0]} has {width}")
    if width < 2:
        raise DataFileError(path, "needs at least two columns (features and a target)")

    target, header = _locate_target(path, [field.strip() for field in rows[0]], target_column, header)
    feature_columns = [column for column in range(width) if column != target]
    headings = [repr(field.strip()) for field in rows[0]] if header else [str(c + 1) for c in range(width)]
    if header:
        rows, line_numbers = rows[1:], line_numbers[1:]
    if not rows:
        raise DataFileError(path, "no data rows after the header")

    features = _parse_numbers(path, rows, line_numbers, feature_columns, headings)
    if task == "regression":
        targets = _parse_numbers(path, rows, line_numbers, [target], headings)[:, 0]
    else:
        targets = _class_labels([row[target] for row in rows])
    return labelled_dataset(features, targets, task, name or path.name.split(".")[0])
