"""Every read of a private dp_accounting field, in one place.

dpvr's PLD code needs what dp_accounting keeps but does not publish: a dense PMF's grid fields, the two
directions of a privacy-loss distribution, the PLD a ``PLDAccountant`` composed, and two of ``pld_pmf``'s
limits (so that dpvr's vectorised PMFs take exactly the cases dp_accounting's own code takes). Nothing else
in dpvr reads an underscored dp_accounting name; each read here names its field once, in :data:`FIELDS`.

The fields are those of dp_accounting 0.6 (pyproject pins ``>=0.6.0,<0.7``; 0.4.3 and 0.5.0 lack
``pld_pmf._DELTA_DIFF_TOLERANCE``). :func:`check_fields` verifies, on a small PLD, that every one of them
exists with the type and shape this module relies on; the test suite runs it, so a dp_accounting release that
moves a field fails there, naming the field, before it can change an epsilon.

Privacy: these accessors only read; the numbers dpvr computes from them are held to dp_accounting's own
results by the tests of :mod:`dpvr.privacy.pld.numerics`.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, NamedTuple

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_pmf, pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib

SUPPORTED = "dp-accounting>=0.6.0,<0.7"  # pyproject's pin: the releases whose fields these are


def _constant(name: str) -> Any:
    """``pld_pmf.<name>``, or an ``ImportError`` naming it: read when dpvr.privacy is imported, so a release
    without it stops dpvr there rather than in a run."""
    try:
        return getattr(pld_pmf, name)
    except AttributeError:
        version = metadata.version("dp-accounting")
        raise ImportError(
            f"dp_accounting {version} has no pld_pmf.{name}, which dpvr.privacy.pld.adapter reads; "
            f"dpvr supports {SUPPORTED}"
        ) from None


# dp_accounting's limits: PMFs of at most this many points are sparse; deltas may rise by this much.
MAX_SPARSE_POINTS: int = _constant("_MAX_PMF_SPARSE_SIZE")
DELTA_DIFF_TOLERANCE: float = _constant("_DELTA_DIFF_TOLERANCE")


class DenseFields(NamedTuple):
    """A ``DensePLDPmf``'s own fields: the loss grid's width, the lowest loss as a grid index, the probability
    of each grid point from there up, the mass at infinite loss, and whether the PMF is pessimistic."""

    discretization: float
    lower_loss: int
    probs: np.ndarray
    infinity_mass: float
    pessimistic: bool


def dense_fields(pmf: pld_pmf.DensePLDPmf) -> DenseFields:
    """The fields of a dense PMF, as stored (the probability array itself, not a copy)."""
    return DenseFields(
        pmf._discretization,  # noqa: SLF001
        pmf._lower_loss,  # noqa: SLF001
        pmf._probs,  # noqa: SLF001
        pmf._infinity_mass,  # noqa: SLF001
        pmf._pessimistic_estimate,  # noqa: SLF001
    )


def dense_parts(pmf: pld_pmf.PLDPmf) -> tuple[int, np.ndarray, float]:
    """``(lower loss as a grid index, probabilities, infinity mass)`` of ``pmf`` as a dense PMF (a sparse one
    converted, as dp_accounting converts it before a large self-composition)."""
    fields = dense_fields(pmf.to_dense_pmf())
    return int(fields.lower_loss), fields.probs, float(fields.infinity_mass)


def directions(pld: pld_lib.PrivacyLossDistribution) -> tuple[pld_pmf.PLDPmf, pld_pmf.PLDPmf]:
    """The PLD's ``(remove, add)`` PMFs (the same object twice for a symmetric PLD)."""
    return pld._pmf_remove, pld._pmf_add  # noqa: SLF001


def pmfs(pld: pld_lib.PrivacyLossDistribution) -> list[pld_pmf.PLDPmf]:
    """The PMFs of ``pld`` that its epsilon depends on: remove, and add unless the PLD is symmetric."""
    remove, add = directions(pld)
    return [remove] if pld._symmetric else [remove, add]  # noqa: SLF001


def accountant_pld(
    accountant: pld_privacy_accountant.PLDAccountant,
) -> pld_lib.PrivacyLossDistribution | None:
    """The PLD ``accountant`` composed, or ``None`` if it was given a release that is not DP (dp_accounting
    then flags the accountant instead of putting the release in its PLD)."""
    if accountant._contains_non_dp_event:  # noqa: SLF001
        return None
    return accountant._pld  # noqa: SLF001


class Field(NamedTuple):
    """One private field this module reads: where it lives, its name, and what it must be."""

    owner: str
    name: str
    kind: str


#: Every private dp_accounting field read above, with the type (and shape) relied on.
FIELDS: tuple[Field, ...] = (
    Field("pld_pmf", "_MAX_PMF_SPARSE_SIZE", "int"),
    Field("pld_pmf", "_DELTA_DIFF_TOLERANCE", "float"),
    Field("DensePLDPmf", "_discretization", "float"),
    Field("DensePLDPmf", "_lower_loss", "int"),
    Field("DensePLDPmf", "_probs", "1-d float64 ndarray"),
    Field("DensePLDPmf", "_infinity_mass", "float"),
    Field("DensePLDPmf", "_pessimistic_estimate", "bool"),
    Field("PrivacyLossDistribution", "_pmf_remove", "PLDPmf"),
    Field("PrivacyLossDistribution", "_pmf_add", "PLDPmf"),
    Field("PrivacyLossDistribution", "_symmetric", "bool"),
    Field("PLDAccountant", "_pld", "PrivacyLossDistribution"),
    Field("PLDAccountant", "_contains_non_dp_event", "bool"),
)


def _conforms(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (float, np.floating))
    if kind == "bool":
        return isinstance(value, (bool, np.bool_))
    if kind == "1-d float64 ndarray":
        return isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == np.float64
    if kind == "PLDPmf":
        return isinstance(value, pld_pmf.PLDPmf)
    if kind == "PrivacyLossDistribution":
        return isinstance(value, pld_lib.PrivacyLossDistribution)
    raise ValueError(f"unknown field kind {kind!r}")


def _samples() -> dict[str, Any]:
    """One small instance of each owner in :data:`FIELDS`, built through dp_accounting's public API: a
    Poisson-sampled Gaussian's PLD (two directions) on a coarse grid, a dense PMF, and an accountant that
    composed the Gaussian."""
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-2)
    accountant.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)))
    pld = pld_lib.from_gaussian_mechanism(1.0, sampling_prob=0.1, value_discretization_interval=1e-2)
    return {
        "pld_pmf": pld_pmf,
        "DensePLDPmf": pld_pmf.create_pmf({-1: 0.25, 0: 0.5, 2: 0.25}, 1e-2, 0.0, True).to_dense_pmf(),
        "PrivacyLossDistribution": pld,
        "PLDAccountant": accountant,
    }


def check_field(field: Field, samples: dict[str, Any] | None = None) -> str | None:
    """What is wrong with ``field`` on dp_accounting's objects (:func:`_samples`), in words naming it, or
    ``None``: it is missing, or its type or shape is not what the accessors rely on."""
    owner = (samples or _samples())[field.owner]
    if not hasattr(owner, field.name):
        return f"dp_accounting's {field.owner}.{field.name} is missing (dpvr.privacy.pld.adapter reads it)"
    value = getattr(owner, field.name)
    if not _conforms(value, field.kind):
        shape = f" of shape {value.shape} and dtype {value.dtype}" if isinstance(value, np.ndarray) else ""
        return (f"dp_accounting's {field.owner}.{field.name} is a {type(value).__name__}{shape}, not a "
                f"{field.kind} (dpvr.privacy.pld.adapter relies on it)")
    return None


def check_fields() -> list[str]:
    """What is wrong with the private fields this module reads (:func:`check_field` of each); empty if
    nothing."""
    samples = _samples()
    return [problem for field in FIELDS if (problem := check_field(field, samples)) is not None]


__all__ = [
    "DELTA_DIFF_TOLERANCE",
    "SUPPORTED",
    "FIELDS",
    "MAX_SPARSE_POINTS",
    "DenseFields",
    "accountant_pld",
    "check_field",
    "check_fields",
    "dense_fields",
    "dense_parts",
    "directions",
    "pmfs",
]
