"""The one shape of every result file (experiments, benchmarks, audits) and the tables printed beside it."""

from __future__ import annotations

import io
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy

from .persistence import atomic_write


@dataclass
class Record:
    """One row of a result: a method on a dataset (or benchmark case) at a budget and seed.

    ``spent_epsilon`` is what the accountant reported for what the run released, never the target.
    """

    method: str
    dataset: str
    epsilon: float | None = None
    delta: float | None = None
    seed: int | None = None
    spent_epsilon: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def versions() -> dict[str, str]:
    """Versions of dpvr and of the libraries a result depends on."""
    from . import __version__  # at call time: the package's __init__ is still running when this module loads

    out = {"dpvr": __version__, "python": platform.python_version(), "numpy": numpy.__version__}
    for name in ("torch", "dp_accounting", "opacus"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "unknown")
        except ImportError:
            continue
    return out


def document(experiment: str, config: dict[str, Any], records: Sequence[Record]) -> dict[str, Any]:
    return {
        "experiment": experiment,
        "config": config,
        "versions": versions(),
        "records": [asdict(r) for r in records],
    }


def write_json(path: str | os.PathLike, doc: dict[str, Any]) -> None:
    """Writes atomically (:func:`dpvr.persistence.atomic_write`): a reader never sees a half-written file."""
    atomic_write(path, json.dumps(doc, indent=2, default=float).encode())


def write_figure(path: str | os.PathLike, figure: Any, *, dpi: int) -> None:
    """Saves a matplotlib ``figure`` atomically, in the format the suffix of ``path`` names (``.png``,
    ``.pdf``, ``.svg``, ...): rendered in memory first, so a failed render leaves no partial image."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=os.path.splitext(os.fspath(path))[1][1:] or None, dpi=dpi)
    atomic_write(path, buffer.getvalue())


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (also valid Markdown)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"
        return "" if v is None else str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, text)])
