"""DESIGN.md's layer rule, executed: the import contracts of ``[tool.importlinter]`` in pyproject.toml.

Dependencies point down the layers (ops, privacy, problems, grads, optim, objectives, ...), never up, and
``privacy`` imports no torch, and the library imports nothing of its examples (``dpvr_lab``, the separate
distribution in ``lab/``). The contracts include imports under ``TYPE_CHECKING``: a type is a dependency.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is not installed (it is in the 'test' extra)")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def lint_imports(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` (import-linter's command line, its supported interface) on ``config``, uncached."""
    exe = shutil.which("lint-imports", path=sysconfig.get_path("scripts")) or shutil.which("lint-imports")
    assert exe is not None, "import-linter is installed but its lint-imports command is not on the path"
    return subprocess.run([exe, "--config", str(config), "--no-cache", "--no-logo"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def broken_part(result: subprocess.CompletedProcess[str]) -> str:
    """The report from its list of broken contracts on (the violating imports), or all of it."""
    start = result.stdout.find("Broken contracts")
    return (result.stdout[start:] if start >= 0 else result.stdout) + result.stderr


def test_the_package_keeps_its_import_contracts():
    result = lint_imports(PYPROJECT, ROOT)
    assert result.returncode == 0, "dpvr breaks DESIGN.md's layer rule:\n" + broken_part(result)
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_the_contracts_catch_an_upward_import_torch_in_privacy_and_the_lab(tmp_path: Path):
    """The same contracts on a copy of the package renamed ``layered`` (so that the installed ``dpvr``
    cannot shadow it), with the cycle this layer split removed put back, a torch import in privacy and an
    import of the examples' package in the command line."""
    text = PYPROJECT.read_text(encoding="utf-8")
    config = re.search(r"^\[tool\.importlinter\]$.*?(?=^\[tool\.(?!importlinter))", text, re.M | re.S)
    assert config is not None, "pyproject.toml has no [tool.importlinter] section"
    (tmp_path / "pyproject.toml").write_text(re.sub(r"\bdpvr\b", "layered", config.group()), encoding="utf-8")
    copy = tmp_path / "layered"
    shutil.copytree(ROOT / "python" / "dpvr", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "optim" / "_upward.py").write_text("from ..objectives import KL\n", encoding="utf-8")
    (copy / "privacy" / "_model.py").write_text("from torch import nn\n", encoding="utf-8")
    (copy / "cli" / "_lab_import.py").write_text("from dpvr_lab import experiments\n", encoding="utf-8")

    result = lint_imports(tmp_path / "pyproject.toml", tmp_path)
    report = broken_part(result)
    assert result.returncode != 0, report
    assert "layered.optim._upward -> layered.objectives (l.1)" in report
    assert "layered.privacy._model -> torch (l.1)" in report
    assert "layered.cli._lab_import -> dpvr_lab (l.1)" in report
