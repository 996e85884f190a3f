"""dpvr.privacy.pld.adapter: the one module that reads dp_accounting's private fields.

Each field it reads exists, with the type and shape it relies on, in the installed dp_accounting (a release
that moves one fails here, naming it); its accessors agree with dp_accounting's public answers on small
PLDs; and no other dpvr module reads a private dp_accounting name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

import dpvr
from dpvr.privacy.pld import adapter
from dpvr.privacy.pld.composition import pld_accountant


@pytest.mark.parametrize("field", adapter.FIELDS, ids=lambda f: f"{f.owner}.{f.name}")
def test_every_private_field_read_is_there_with_its_type(field):
    problem = adapter.check_field(field)
    assert problem is None, problem


def test_a_moved_field_is_reported_by_name(monkeypatch):
    samples = adapter._samples()  # noqa: SLF001
    del samples["PLDAccountant"]._pld  # noqa: SLF001 - as if a release renamed it
    monkeypatch.setattr(adapter, "_samples", lambda: samples)
    assert adapter.check_fields() == [
        "dp_accounting's PLDAccountant._pld is missing (dpvr.privacy.pld.adapter reads it)"
    ]


def test_a_missing_module_constant_stops_the_import_by_name(monkeypatch):
    monkeypatch.delattr(pld_pmf, "_DELTA_DIFF_TOLERANCE")
    expected = r"has no pld_pmf\._DELTA_DIFF_TOLERANCE.*dp-accounting>=0\.6\.0,<0\.7"
    with pytest.raises(ImportError, match=expected):
        adapter._constant("_DELTA_DIFF_TOLERANCE")  # noqa: SLF001 - what the import runs


def test_the_supported_range_is_pyprojects():
    pyproject = (Path(dpvr.__file__).resolve().parents[2] / "pyproject.toml")
    if not pyproject.exists():
        pytest.skip("an installed dpvr without its source tree")
    assert f'"{adapter.SUPPORTED}"' in pyproject.read_text()


def test_a_field_of_another_type_is_reported_by_name(monkeypatch):
    samples = adapter._samples()  # noqa: SLF001
    dense = samples["DensePLDPmf"]
    monkeypatch.setattr(dense, "_probs", list(dense._probs))  # noqa: SLF001
    field = next(f for f in adapter.FIELDS if f.name == "_probs")
    assert adapter.check_field(field, samples) == (
        "dp_accounting's DensePLDPmf._probs is a list, not a 1-d float64 ndarray "
        "(dpvr.privacy.pld.adapter relies on it)"
    )


def test_dense_parts_hold_the_pmf():
    # A Poisson-subsampled Gaussian: two directions, each a PMF whose masses and infinity mass sum to one.
    pld = pld_lib.from_gaussian_mechanism(1.0, sampling_prob=0.2, value_discretization_interval=1e-3)
    remove, add = adapter.directions(pld)
    assert remove is not add and adapter.pmfs(pld) == [remove, add]
    for pmf in (remove, add):
        lower, probs, infinity = adapter.dense_parts(pmf)
        assert isinstance(lower, int) and probs.ndim == 1 and probs.dtype == np.float64
        assert probs.sum() + infinity == pytest.approx(1.0, abs=1e-9)  # connect-the-dots rounding
        # The delta at epsilon = 0 from the fields: sum over losses > 0 of (1 - e^-loss) p, plus infinity.
        losses = (lower + np.arange(probs.size)) * 1e-3
        mine = float(np.sum(np.where(losses > 0, -np.expm1(-losses) * probs, 0.0))) + infinity
        assert mine == pytest.approx(pmf.get_delta_for_epsilon(0.0), rel=1e-9)
    fields = adapter.dense_fields(remove.to_dense_pmf())
    assert fields.discretization == 1e-3 and fields.pessimistic is True
    # A symmetric PLD (an unsampled Gaussian) has one PMF for both directions.
    symmetric = pld_lib.from_gaussian_mechanism(1.0, value_discretization_interval=1e-3)
    assert len(adapter.pmfs(symmetric)) == 1


def test_accountant_pld_is_the_accountants_composition():
    accountant = pld_accountant("add-remove", 1e-3)
    event = dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.2))
    accountant.compose(event, 10)
    pld = adapter.accountant_pld(accountant)
    assert pld.get_epsilon_for_delta(1e-5) == accountant.get_epsilon(1e-5)
    noiseless = pld_accountant("add-remove", 1e-3)
    noiseless.compose(dpa.GaussianDpEvent(0.0))
    assert adapter.accountant_pld(noiseless) is None


def _dp_accounting_private_names() -> set[str]:
    names: set[str] = set()
    for path in Path(dpa.__file__).parent.rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"self\.(_[a-z]\w*)\s*=", text))  # instance fields
        names |= set(re.findall(r"^(_[A-Za-z]\w*)\s*[:=]", text, re.M))  # module constants
    return names


def test_no_other_module_reads_a_private_dp_accounting_name():
    private = _dp_accounting_private_names()
    assert {"_probs", "_pmf_remove", "_pld", "_MAX_PMF_SPARSE_SIZE"} <= private
    root = Path(dpvr.__file__).parent
    reads = []
    for path in sorted(root.rglob("*.py")):
        if path == Path(adapter.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # dpvr's own objects' fields are read through self; anything else named like a dp_accounting
            # field is a read of dp_accounting's internals.
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reads.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert reads == [], "read dp_accounting's private fields through dpvr.privacy.pld.adapter:\n" + "\n".join(
        reads
    )


def test_only_the_pld_package_imports_dp_accountings_pld():
    """The PLD accountant is one package: no other dpvr module imports dp_accounting's PLD code."""
    root = Path(dpvr.__file__).parent
    package = root / "privacy" / "pld"
    importers = []
    for path in sorted(root.rglob("*.py")):
        if package in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(name.startswith("dp_accounting.pld") for name in names):
                importers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert importers == []

