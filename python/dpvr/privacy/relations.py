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
  (:mod:`dpvr.privacy.pld.subsampling`, same convention), composed alongside dp_accounting's.
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

Accountants are backends (:class:`AccountantBackend`) in a registry: :func:`register_accountant` adds one,
:func:`accountant_backend` finds one by name, and ``ACCOUNTANTS`` lists the registered names. The functions
here that take an accountant's name (:func:`for_accountant`, :func:`make_accountant`,
:func:`unsupported_reason`, :func:`tightest_accountant`) ask its backend; dpvr's own, RDP
(:mod:`dpvr.privacy.rdp`) and PLD (:mod:`dpvr.privacy.pld`), derive from :class:`DpAccountingBackend` and
are registered by :mod:`dpvr.privacy.backends`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attr
import dp_accounting as dpa
from dp_accounting.rdp import rdp_privacy_accountant

from .random_allocation import RandomAllocationDpEvent, is_random_allocation

if TYPE_CHECKING:
    import numpy as np

REPLACE_ONE = "replace-one"
ADD_REMOVE = "add-remove"
NEIGHBOURING = (REPLACE_ONE, ADD_REMOVE)

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


def relation(neighbouring: str) -> dpa.NeighboringRelation:
    """dp_accounting's enum for a dpvr relation name."""
    return _RELATIONS[check_neighbouring(neighbouring)]


# -- accountant backends -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ledger:
    """What an :class:`~dpvr.privacy.Accountant` has recorded, as a backend composes it: its ``entries``
    (each with ``parts``, ``event``, ``count`` and ``run``), its relation and RDP orders, and ``rdp()``, the
    total RDP curve over the orders (dpvr keeps it for every accountant: stream shares are measured on it)."""

    entries: Sequence[Any]
    neighbouring: str
    orders: tuple[float, ...]
    rdp: Callable[[], np.ndarray]


class Composition(Protocol):
    """A ledger composed by one accountant (:meth:`AccountantBackend.compose`)."""

    def epsilon(self, delta: float) -> tuple[float, float | None]:
        """epsilon at ``delta``, and the RDP order of the conversion (``None`` if not an RDP conversion)."""
        ...

    def delta(self, epsilon: float) -> float:
        """delta at ``epsilon``."""
        ...

    def notes(self) -> list[str]:
        """Assumptions the answers rest on beyond the ledger's own (e.g. a coarsened loss grid)."""
        ...


class Design(Protocol):
    """The RDP design of a calibration (:mod:`dpvr.privacy.calibration`), handed to a backend's
    :meth:`AccountantBackend.calibrate`: ``design(epsilon, exact)`` is the noise of every stream that spends
    ``epsilon`` by the RDP accountant with the requested shares (``exact=False``: only the ratios between
    streams are meant); ``floor`` is the epsilon below which RDP's conversion certifies nothing at the
    calibration's delta; ``factory`` builds the run from noise multipliers."""

    factory: Any
    floor: float

    def __call__(self, epsilon: float, exact: bool) -> dict[str, float]: ...


@runtime_checkable
class AccountantBackend(Protocol):
    """One accountant: how it prices dpvr's events (in dpvr's noise-multiplier convention), composes a ledger
    and calibrates noise to a target.

    - ``name``: what users pass as ``accountant=``; ``tightness``: its rank among the registered backends
      (a number), higher for a tighter bound (:func:`tightest_accountant` picks the tightest that supports a
      run).
    - :meth:`unsupported_reason`: ``None`` if the backend accounts ``event`` under ``neighbouring``, else why
      not, in words.
    - :meth:`rewrite`: ``event`` rewritten into what the dp_accounting accountant of :meth:`make` needs to
      price it right under ``neighbouring``.
    - :meth:`make`: a fresh dp_accounting accountant (``orders`` for RDP, the loss grid's width ``interval``
      for PLD; each backend ignores what it does not use, and ``None`` is its default).
    - :meth:`compose`: the recorded :class:`Ledger` composed, to answer epsilon and delta.
    - :meth:`calibrate`: noise multipliers spending at most ``epsilon`` at ``delta`` by this accountant,
      from the RDP :class:`Design`.
    """

    name: str
    tightness: float

    def unsupported_reason(self, event: dpa.DpEvent, neighbouring: str) -> str | None: ...

    def rewrite(self, event: dpa.DpEvent, neighbouring: str) -> dpa.DpEvent: ...

    def make(
        self, neighbouring: str, *, orders: Sequence[float] | None = None, interval: float | None = None
    ) -> dpa.PrivacyAccountant: ...

    def compose(self, ledger: Ledger) -> Composition: ...

    def calibrate(self, design: Design, epsilon: float, delta: float) -> dict[str, float]: ...


_BACKENDS: dict[str, AccountantBackend] = {}


class _AccountantNames(Sequence):
    """The names of the registered accountants, in order of registration: a live, read-only view that
    compares, prints and iterates as a tuple (``("rdp", "pld")`` with dpvr's own)."""

    def __getitem__(self, index):
        return tuple(_BACKENDS)[index]

    def __len__(self) -> int:
        return len(_BACKENDS)

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, _AccountantNames) else other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


#: Names of the registered accountants (a live view of the registry; ``("rdp", "pld")`` with dpvr's own).
ACCOUNTANTS: Sequence[str] = _AccountantNames()


def register_accountant(backend: AccountantBackend, *, replace: bool = False) -> AccountantBackend:
    """Register ``backend`` under ``backend.name``; returns it. A name already registered is refused unless
    ``replace=True``."""
    if not isinstance(backend, AccountantBackend):
        raise TypeError(
            f"an accountant backend must implement AccountantBackend, got {type(backend).__name__}"
        )
    name = backend.name
    if not (isinstance(name, str) and name):
        raise ValueError(f"an accountant backend needs a non-empty name, got {name!r}")
    if isinstance(backend.tightness, bool) or not isinstance(backend.tightness, (int, float)):
        raise TypeError(f"tightness of accountant {name!r} must be a number, got {backend.tightness!r}")
    if name in _BACKENDS and not replace:
        raise ValueError(f"an accountant named {name!r} is already registered (pass replace=True)")
    _BACKENDS[name] = backend
    return backend


def unregister_accountant(name: str) -> AccountantBackend:
    """Remove the accountant registered as ``name``; returns its backend."""
    backend = accountant_backend(name)
    del _BACKENDS[name]
    return backend


def accountant_backend(accountant: str) -> AccountantBackend:
    """The backend registered as ``accountant``; ``ValueError`` if there is none."""
    backend = _BACKENDS.get(accountant) if isinstance(accountant, str) else None
    if backend is None:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return backend


def accountant_backends() -> tuple[AccountantBackend, ...]:
    """The registered backends, tightest first (ties in order of registration)."""
    return tuple(sorted(_BACKENDS.values(), key=lambda backend: -backend.tightness))


def check_accountant(accountant: str) -> str:
    """Return ``accountant`` if it names a registered accountant, else raise ``ValueError``."""
    accountant_backend(accountant)
    return accountant


# -- events ------------------------------------------------------------------------------------------------


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
    return accountant_backend(accountant).rewrite(event, neighbouring)


def make_accountant(
    accountant: str,
    neighbouring: str,
    orders: tuple[float, ...] | None = None,
    interval: float | None = None,
) -> dpa.PrivacyAccountant:
    """A fresh dp_accounting accountant of the given kind (``orders`` for RDP, the loss grid's width
    ``interval`` for PLD; ``None``: the backend's default, dp_accounting's ``1e-4`` for PLD)."""
    return accountant_backend(accountant).make(neighbouring, orders=orders, interval=interval)


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
    dpvr does not price itself (:mod:`dpvr.privacy.pld.subsampling`,
    :mod:`dpvr.privacy.pld.random_allocation`); used only to ask that question."""
    if is_wor_gaussian(event) or is_random_allocation(event):
        return event.event
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([pld_stand_in(e) for e in event.events])
    if isinstance(event, dpa.SelfComposedDpEvent):
        return attr.evolve(event, event=pld_stand_in(event.event))
    return event


def relation_reason(event: dpa.DpEvent, neighbouring: str) -> str | None:
    """Why no accountant accounts ``event`` (one event, not those nested in it) under ``neighbouring``, or
    ``None``: random allocation is accounted only under add/remove, sampling without replacement only under
    replace-one. Every backend's :meth:`~AccountantBackend.unsupported_reason` asks this first."""
    if isinstance(event, RandomAllocationDpEvent) and neighbouring == REPLACE_ONE:
        return (
            "random allocation is accounted only under neighbouring='add-remove'; use "
            "sampling='wor' for replace-one"
        )
    if isinstance(event, dpa.SampledWithoutReplacementDpEvent) and neighbouring == ADD_REMOVE:
        return (
            "fixed-size sampling without replacement is accounted only under neighbouring='replace-one' "
            "(the dataset size is public); use Poisson sampling for add/remove"
        )
    return None


def first_reason(
    event: dpa.DpEvent, neighbouring: str, refuses: Callable[[dpa.DpEvent, str], str | None]
) -> str | None:
    """The first reason, depth first through ``event``, that an accountant refusing what ``refuses(sub,
    neighbouring)`` names cannot account it: :func:`relation_reason`, then ``refuses``, for each event."""
    for sub in walk(event):
        reason = relation_reason(sub, neighbouring)
        if reason is None:
            reason = refuses(sub, neighbouring)
        if reason is not None:
            return reason
    return None


def unsupported_reason(event: dpa.DpEvent, accountant: str, neighbouring: str) -> str | None:
    """Why ``accountant`` cannot account ``event`` under ``neighbouring``, or ``None`` if it can."""
    return accountant_backend(accountant).unsupported_reason(event, neighbouring)


def tightest_accountant(event: dpa.DpEvent, neighbouring: str) -> str:
    """The tightest registered accountant (highest ``tightness``) that accounts ``event`` under
    ``neighbouring``; the loosest if none of the others does (its refusal then explains why). With dpvr's
    own backends: ``"pld"`` where the PLD accountant (with dpvr's PLDs for fixed-size batches and random
    allocation) prices ``event``, else ``"rdp"``.

    Where both apply, PLD is the tighter: it is exact up to a pessimistic discretisation, where RDP loses in
    its conversion to ``(epsilon, delta)`` and, for fixed-size batches, in dp_accounting's generic bound
    (about twice PLD's noise for the same budget)."""
    ranked = accountant_backends()
    if not ranked:
        raise ValueError("no accountant is registered")
    for backend in ranked[:-1]:
        if backend.unsupported_reason(event, neighbouring) is None:
            return backend.name
    return ranked[-1].name


def require_supported(event: dpa.DpEvent, accountant: str, neighbouring: str) -> None:
    """Raise ``ValueError`` naming the problem if ``event`` cannot be accounted."""
    reason = unsupported_reason(event, accountant, neighbouring)
    if reason is not None:
        raise ValueError(f"cannot account {type(event).__name__} under {neighbouring}: {reason}")


class DpAccountingBackend:
    """What a backend over a dp_accounting accountant shares (dpvr's RDP and PLD backends derive from it): an
    event is refused by :func:`relation_reason` and the backend's own rules (:meth:`_refuses`, on every nested
    event), else by what its accountant (:meth:`make`, given :meth:`rewrite`) supports."""

    label = ""  # the accountant's name in messages

    def unsupported_reason(self, event: dpa.DpEvent, neighbouring: str) -> str | None:
        reason = first_reason(event, neighbouring, self._refuses)
        if reason is not None:
            return reason
        event = self._stand_in(event)
        if not self.make(neighbouring, orders=(2.0,)).supports(self.rewrite(event, neighbouring)):
            return f"dp_accounting's {self.label} accountant does not support {type(event).__name__}"
        return None

    @staticmethod
    def _stand_in(event: dpa.DpEvent) -> dpa.DpEvent:
        """What dp_accounting is asked to support in place of ``event``."""
        return event
