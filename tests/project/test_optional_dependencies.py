"""The library without its examples: ``dpvr`` imports neither scikit-learn nor matplotlib, and each command or
function that needs one of them (or the experiments and benchmarks of ``dpvr_lab``, the separate distribution
in ``lab/``) says what to install when it is missing, before it does any work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpvr.cli import main
from dpvr.data import load, read_libsvm


def hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` (and its submodules) unimportable in this process, as if it were not installed."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


def test_no_module_of_the_library_imports_sklearn_or_matplotlib():
    """Every module of dpvr (its command line's parser included), imported with dpvr_lab hidden: neither
    optional package is loaded, so ``pip install dpvr`` can leave them out."""
    script = textwrap.dedent("""
        import importlib, pkgutil, sys
        sys.modules["dpvr_lab"] = None
        import dpvr, dpvr.cli
        for info in pkgutil.walk_packages(dpvr.__path__, "dpvr."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
        dpvr.cli.build_parser()
        print(sorted(m for m in ("sklearn", "matplotlib", "dpvr_lab") if sys.modules.get(m) is not None))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("argv", [
    ["experiment", "auc", "--quick"],
    ["bench", "step", "--quick", "--case", "mlp"],
    ["compare", "missing.json", "--method", "A", "--baseline", "B", "--metric", "m"],
])
def test_the_lab_commands_without_the_lab_say_what_to_install(argv, monkeypatch, capsys, tmp_path):
    hide(monkeypatch, "dpvr_lab")
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"dpvr {argv[0]}: error:" in err and "dpvr-lab" in err and "pip install ./lab" in err
    assert list(tmp_path.iterdir()) == []  # refused before any work: no results directory


def test_the_lab_commands_parse_their_names_from_the_lab():
    """With dpvr_lab installed the parser still lists (and checks) the experiments and cases."""
    pytest.importorskip("dpvr_lab")
    with pytest.raises(SystemExit):
        main(["experiment", "no-such-experiment"])
    with pytest.raises(SystemExit):
        main(["bench", "step", "--case", "no-such-case"])


@pytest.mark.parametrize("name", ["breast_cancer", "diabetes", "digits", "wine"])
def test_a_bundled_set_without_sklearn_names_the_package(name, monkeypatch):
    hide(monkeypatch, "sklearn")
    with pytest.raises(ImportError, match=r"scikit-learn.*pip install"):
        load(name)


def test_read_libsvm_without_sklearn_names_the_package(monkeypatch, tmp_path):
    path = tmp_path / "a.svm"
    path.write_text("1 1:0.5\n-1 2:1.0\n")
    assert read_libsvm(path, task="classification").features.shape == (2, 2)  # with sklearn: read
    hide(monkeypatch, "sklearn")
    with pytest.raises(ImportError, match=r"scikit-learn.*pip install"):
        read_libsvm(path, task="classification")


@pytest.mark.parametrize("command", ["account", "calibrate"])
def test_plot_without_matplotlib_names_the_package(command, monkeypatch, capsys, tmp_path):
    hide(monkeypatch, "matplotlib")
    png = tmp_path / "spent.png"
    budget = ["--noise-multiplier", "1.0"] if command == "account" else ["--epsilon", "1.0"]
    argv = [command, "dp-sgd", "--steps", "100", "--sample-rate", "0.01", *budget,
            "--plot", str(png)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "matplotlib" in captured.err and "pip install" in captured.err
    assert captured.out == "" and not png.exists()  # refused before the table is printed


def test_the_dpvr_sources_hold_no_experiments_or_benchmarks():
    package = Path(__file__).resolve().parents[2] / "python" / "dpvr"
    assert package.is_dir()
    assert not (package / "experiments").exists() and not (package / "bench").exists()
