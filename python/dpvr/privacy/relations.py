"""Neighbouring relations, and how each dp_accounting accountant reads a noise multiplier under them.

dpvr's convention, used by every event it builds or accepts: a Gaussian noise multiplier is the noise
standard deviation divided by the L2 bound ``C`` on one record's contribution to the released sum. This
is ``GaussianDpEvent``'s own definition in dp_accounting, and it is the add/remove sensitivity. Under
replace-one a record can move the sum by ``2C``, so the same release costs more.

dp_accounting's two accountants do not read the multiplier the same way under ``REPLACE_ONE``:

- ``PLDAccountant`` follows the event definition: for ``GaussianDpEvent`` and ``PoissonSampledDpEvent`` it
  shifts the noise by ``+C`` for one dataset and ``-C`` for the other (a total of ``2C``). It has no
  ``SampledWithoutReplacementDpEvent`` and no ``ZCDpEvent``. dpvr prices a
  ``SampledWithoutReplacementDpEvent`` of a ``GaussianDpEvent`` under replace-one with its own PLD
  (:mod:`dpvr.privacy.subsampling`, same convention), composed alongside dp_accounting's.
- ``RdpAccountant`` prices ``GaussianDpEvent`` at ``alpha / (2 z**2)`` whatever the relation (and
  ``LaplaceDpEvent`` at its add/remove value), and ``SampledWithoutReplacementDpEvent`` with Wang, Balle
  and Kasiviswanathan (2019), Theorem 27, whose base mechanism is measured against the *replace-one*
  sensitivity. All of these treat ``z`` as relative to ``2C`` under ``REPLACE_ONE``. It refuses
  ``PoissonSampledDpEvent`` under ``REPLACE_ONE``, and takes ``SampledWithoutReplacementDpEvent`` only under
  ``REPLACE_ONE``.

:func:`for_accountant` rewrites an event in dpvr's convention into what the chosen accountant needs: under
replace-one it halves every Gaussian and Laplace noise multiplier handed to the RDP accountant (noise of
scale ``s`` against a shift of ``2C`` is noise of scale ``s/2`` against ``C``). Everything else passes through
unchanged; dp_accounting's remaining events are either relation-aware or refused under replace-one.
:func:`unsupported_reason` explains, in words, a combination that cannot be accounted.
"""

from __future__ import annotations

from collections.abc import Iterator

import attr
import dp_accounting as dpa
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from .random_allocation import RandomAllocationDpEvent, is_random_allocation
from .subsampling import PLD_DISCRETIZATION

REPLACE_ONE = "replace-one"
ADD_REMOVE = "add-remove"
NEIGHBOURING = (REPLACE_ONE, ADD_REMOVE)
ACCOUNTANTS = ("rdp", "pld")

DEFAULT_ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)

_RELATIONS = {
    REPLACE_ONE: dpa.NeighboringRelation.REPLACE_ONE,
    ADD_REMOVE: dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
}


def check_neighbouring(neighbouring: str) -> str:
    """Return ``neighbouring`` if it names a supported relation, else raise ``ValueError``."""
    if neighbouring not in _RELATIONS:
        raise ValueError(f"neighbouring must be one of {NEIGHBOURING}, got {neighbouring!r}")
    return neighbouring


def check_accountant(accountant: str) -> str:
    """Return ``accountant`` if it names a supported accountant, else raise ``ValueError``."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return accountant


def relation(neighbouring: str) -> dpa.NeighboringRelation:
    """dp_accounting's enum for a dpvr relation name."""
    return _RELATIONS[check_neighbouring(neighbouring)]


def scale_noise(event: dpa.DpEvent, factor: float) -> dpa.DpEvent:
    """``event`` with every Gaussian and Laplace noise multiplier multiplied by ``factor``.

    Events that wrap another (sampling, self-composition, repeat-and-select) are rewritten inside.
    """
    if isinstance(event, (dpa.GaussianDpEvent, dpa.LaplaceDpEvent)):
        return attr.evolve(event, noise_multiplier=event.noise_multiplier * factor)
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([scale_noise(e, factor) for e in event.events])
    inner = getattr(event, "event", None)
    if isinstance(inner, dpa.DpEvent):
        return attr.evolve(event, event=scale_noise(inner, factor))
    return event


def for_accountant(event: dpa.DpEvent, accountant: str, neighbouring: str) -> dpa.DpEvent:
    """Rewrite ``event`` (dpvr's convention) so that ``accountant`` prices it right under ``neighbouring``."""
    if check_accountant(accountant) == "rdp" and check_neighbouring(neighbouring) == REPLACE_ONE:
        return scale_noise(event, 0.5)
    return event


def make_accountant(
    accountant: str,
    neighbouring: str,
    orders: tuple[float, ...] | None = None,
    interval: float = PLD_DISCRETIZATION,
) -> dpa.PrivacyAccountant:
    """A fresh dp_accounting accountant of the given kind (``orders`` for RDP, the loss grid's width
    ``interval`` for PLD)."""
    if check_accountant(accountant) == "rdp":
        return rdp_privacy_accountant.RdpAccountant(
            orders=list(orders or DEFAULT_ORDERS), neighboring_relation=relation(neighbouring)
        )
    return pld_privacy_accountant.PLDAccountant(
        neighboring_relation=relation(neighbouring), value_discretization_interval=interval
    )


def walk(event: dpa.DpEvent) -> Iterator[dpa.DpEvent]:
    """``event`` and every event nested in it, depth first."""
    yield event
    inner = getattr(event, "event", None)
    for sub in event.events if isinstance(event, dpa.ComposedDpEvent) else [inner]:
        if isinstance(sub, dpa.DpEvent):
            yield from walk(sub)


def is_wor_gaussian(event: dpa.DpEvent) -> bool:
    """Whether ``event`` is a Gaussian release on a batch drawn without replacement (dpvr builds its PLD)."""
    return isinstance(event, dpa.SampledWithoutReplacementDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    )


def pld_stand_in(event: dpa.DpEvent) -> dpa.DpEvent:
    """``event`` with every sampled-without-replacement or randomly allocated Gaussian replaced by its inner
    Gaussian.

    dp_accounting's PLD accountant supports the result exactly when it supports everything in ``event`` that
    dpvr does not price itself (:mod:`dpvr.privacy.subsampling`, :mod:`dpvr.privacy.random_allocation`);
    used only to ask that question."""
    if is_wor_gaussian(event) or is_random_allocation(event):
        return event.event
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([pld_stand_in(e) for e in event.events])
    if isinstance(event, dpa.SelfComposedDpEvent):
        return attr.evolve(event, event=pld_stand_in(event.event))
    return event


def rdp_proxy(event: dpa.DpEvent, neighbouring: str) -> tuple[dpa.DpEvent, str] | None:
    """An RDP stand-in for an event the RDP accountant cannot price, used only to split a budget between
    streams or to attribute a spend to them, never as a bound: a random-allocation step is read as Poisson
    sampling at rate ``1/t`` (Feldman and Shenfeld 2025 bound it by Poisson at rate ``(1 + o(1))/t``), and
    Poisson sampling under replace-one as add/remove at twice the sensitivity. ``(event, relation)`` in
    dpvr's convention, or ``None`` when there is no stand-in."""
    if isinstance(event, RandomAllocationDpEvent):
        event = dpa.PoissonSampledDpEvent(1.0 / event.num_steps, event.event)
    elif isinstance(event, dpa.ComposedDpEvent):
        parts = [rdp_proxy(e, neighbouring) for e in event.events]
        if any(p is None for p in parts) or len({p[1] for p in parts}) > 1:
            return None
        return dpa.ComposedDpEvent([p[0] for p in parts]), parts[0][1] if parts else neighbouring
    elif isinstance(event, dpa.SelfComposedDpEvent):
        inner = rdp_proxy(event.event, neighbouring)
        return None if inner is None else (attr.evolve(event, event=inner[0]), inner[1])
    if unsupported_reason(event, "rdp", neighbouring) is None:
        return event, neighbouring
    if neighbouring == REPLACE_ONE and unsupported_reason(scale_noise(event, 0.5), "rdp", ADD_REMOVE) is None:
        return scale_noise(event, 0.5), ADD_REMOVE
    return None


def unsupported_reason(event: dpa.DpEvent, accountant: str, neighbouring: str) -> str | None:
    """Why ``accountant`` cannot account ``event`` under ``neighbouring``, or ``None`` if it can."""
    for sub in walk(event):
        if isinstance(sub, RandomAllocationDpEvent):
            if neighbouring == REPLACE_ONE:
                return (
                    "random allocation is accounted only under neighbouring='add-remove'; use "
                    "sampling='wor' for replace-one"
                )
            if accountant == "rdp":
                return "random allocation is priced by dpvr's PLD only; use accountant='pld'"
            if not isinstance(sub.event, dpa.GaussianDpEvent):
                return "dpvr's random-allocation PLD prices a Gaussian release only"
        if isinstance(sub, dpa.SampledWithoutReplacementDpEvent) and neighbouring == ADD_REMOVE:
            return (
                "fixed-size sampling without replacement is accounted only under neighbouring='replace-one' "
                "(the dataset size is public); use Poisson sampling for add/remove"
            )
        if (
            isinstance(sub, dpa.SampledWithoutReplacementDpEvent)
            and accountant == "pld"
            and not isinstance(sub.event, dpa.GaussianDpEvent)
        ):
            return (
                "the PLD accountant prices sampling without replacement only for a Gaussian release; "
                "use accountant='rdp'"
            )
        if isinstance(sub, dpa.PoissonSampledDpEvent) and accountant == "rdp" and neighbouring == REPLACE_ONE:
            return (
                "dp_accounting's RDP accountant does not support Poisson sampling under replace-one; "
                "use accountant='pld' or neighbouring='add-remove'"
            )
        if isinstance(sub, dpa.ZCDpEvent) and accountant == "pld":
            return (
                "this release is an RDP (zCDP-form) curve, which dp_accounting's PLD accountant cannot "
                "compose; use accountant='rdp'"
            )
    probe = make_accountant(accountant, neighbouring, orders=(2.0,))
    if accountant == "pld":
        event = pld_stand_in(event)
    if not probe.supports(for_accountant(event, accountant, neighbouring)):
        return f"dp_accounting's {accountant.upper()} accountant does not support {type(event).__name__}"
    return None


def tightest_accountant(event: dpa.DpEvent, neighbouring: str) -> str:
    """``"pld"`` where the PLD accountant (with dpvr's PLDs for fixed-size batches and random allocation)
    prices ``event`` under ``neighbouring``, else ``"rdp"``.

    Where both apply, PLD is the tighter: it is exact up to a pessimistic discretisation, where RDP loses in
    its conversion to ``(epsilon, delta)`` and, for fixed-size batches, in dp_accounting's generic bound
    (about twice PLD's noise for the same budget)."""
    return "pld" if unsupported_reason(event, "pld", neighbouring) is None else "rdp"


def require_supported(event: dpa.DpEvent, accountant: str, neighbouring: str) -> None:
    """Raise ``ValueError`` naming the problem if ``event`` cannot be accounted."""
    reason = unsupported_reason(event, accountant, neighbouring)
    if reason is not None:
        raise ValueError(f"cannot account {type(event).__name__} under {neighbouring}: {reason}")
