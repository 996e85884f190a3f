"""Named, reproducible experiments: ``dpvr experiment NAME``.

Each experiment is a module of this package with

- a module docstring (what ``dpvr experiment NAME --help`` shows),
- ``add_arguments(parser)``: its own flags, beside the shared ones that :mod:`dpvr.cli.experiment` adds
  (``--quick``, ``--epsilon``, ``--seeds``, ``--dataset``, ``--data-dir``, ``--out``, ``--json``),
- ``run(args) -> dict``: runs it, prints its table, writes its CSV, JSON and PNG files under ``args.out``
  and returns the result document (:func:`dpvr.results.document`).

Register a new experiment by adding its name and module to :data:`EXPERIMENTS`; modules are imported only
when their experiment is asked for, so the command line starts fast.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXPERIMENTS: dict[str, str] = {
    "diff2": "dpvr_lab.experiments.diff2",
    "auc": "dpvr_lab.experiments.auc",
    "last-iterate": "dpvr_lab.experiments.last_iterate",
    "phased": "dpvr_lab.experiments.phased",
    "dro": "dpvr_lab.experiments.dro",
    "transfer": "dpvr_lab.experiments.transfer",
    "wgan": "dpvr_lab.experiments.wgan",
    "td": "dpvr_lab.experiments.td",
    "scaling": "dpvr_lab.experiments.scaling",
    "regime": "dpvr_lab.experiments.regime",
}
"""Experiment name -> module that implements it."""


def get(name: str) -> ModuleType:
    """The module of experiment ``name``."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(sorted(EXPERIMENTS))}")
    return importlib.import_module(EXPERIMENTS[name])


__all__ = ["EXPERIMENTS", "get"]
