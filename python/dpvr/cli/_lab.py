"""The experiments and benchmarks behind ``dpvr experiment``, ``dpvr bench`` and ``dpvr compare``.

They live in the separate distribution ``dpvr-lab`` (the package :mod:`dpvr_lab`, in the ``lab/`` folder of a
dpvr checkout), so that the library does not pull matplotlib and scikit-learn. The command line finds it by
name at run time; nothing in :mod:`dpvr` imports it otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

INSTALL = "pip install ./lab  (from a dpvr source checkout; it installs the package dpvr_lab)"


class LabMissing(ModuleNotFoundError):
    """``dpvr_lab`` is not installed: the message says what to install."""


def available() -> bool:
    """Whether :mod:`dpvr_lab` can be imported (without importing it)."""
    return importlib.util.find_spec("dpvr_lab") is not None


def lab(module: str, command: str) -> ModuleType:
    """``dpvr_lab.<module>``, or :class:`LabMissing` naming what ``dpvr <command>`` needs installed."""
    if not available():
        raise LabMissing(
            f"'dpvr {command}' runs the experiments and benchmarks of the separate distribution dpvr-lab, "
            f"which is not installed: {INSTALL}",
            name="dpvr_lab",
        )
    # A dependency missing inside an installed lab raises its own error, which names that dependency.
    return importlib.import_module(f"dpvr_lab.{module}")
