"""Argument checks shared by the privacy modules; each error names the offending argument."""

from __future__ import annotations

import math
import numbers


def positive(name: str, value: float) -> float:
    """``value`` as a float if it is finite and > 0."""
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def non_negative(name: str, value: float) -> float:
    """``value`` as a float if it is finite and >= 0."""
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def delta(value: float, name: str = "delta") -> float:
    """A delta strictly inside (0, 1)."""
    value = float(value)
    if not 0 < value < 1:
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    return value


def rate(name: str, value: float) -> float:
    """A sampling rate in (0, 1]."""
    value = float(value)
    if not 0 < value <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return value


def count(name: str, value: int, minimum: int = 0) -> int:
    """An integer >= ``minimum`` (bools and non-integral floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or int(value) != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
