"""dpvr's accountant backends, RDP and PLD, registered under ``"rdp"`` and ``"pld"``.

Each is an :class:`~dpvr.privacy.relations.AccountantBackend`: it says which events it accounts under which
relation (and why not), rewrites an event in dpvr's noise-multiplier convention for its dp_accounting
accountant (:mod:`dpvr.privacy.relations`), composes a ledger and calibrates noise. Everything that depends on
which accountant is used lives here, behind that protocol; another accountant is added with
:func:`~dpvr.privacy.relations.register_accountant`, and :func:`~dpvr.privacy.relations.tightest_accountant`
ranks them by ``tightness``.

- :data:`RDP` (``"rdp"``): dp_accounting's ``RdpAccountant`` over the RDP orders; fast, accounts every dpvr
  event except Poisson sampling under replace-one and random allocation. A ledger's total RDP curve is
  converted by dp_accounting's ``compute_epsilon``/``compute_delta``. Its :meth:`RdpBackend.proxy` is the
  RDP stand-in for what it cannot price, used only to split a budget between streams or attribute a spend to
  them (by any accountant: stream shares are always measured on RDP curves).
- :data:`PLD` (``"pld"``, the tighter): dp_accounting's ``PLDAccountant``, with dpvr's own PLDs for a
  Gaussian on a batch drawn without replacement and for random allocation; a ledger is composed as a multiset
  of releases (:mod:`dpvr.privacy.accountant`), and a calibration scales the RDP design to the PLD's epsilon
  (:mod:`dpvr.privacy.calibration`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import attr
import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from .random_allocation import RandomAllocationDpEvent
from .relations import (
    ADD_REMOVE,
    DEFAULT_ORDERS,
    REPLACE_ONE,
    Composition,
    Design,
    Ledger,
    check_neighbouring,
    first_reason,
    pld_stand_in,
    register_accountant,
    relation,
    scale_noise,
)
from .subsampling import PLD_DISCRETIZATION


@dataclass(frozen=True)
class RdpComposition:
    """A total RDP curve over ``orders``, converted to ``(epsilon, delta)`` by dp_accounting."""

    orders: tuple[float, ...]
    rdp: np.ndarray

    def epsilon(self, delta: float) -> tuple[float, float | None]:
        eps, order = rdp_privacy_accountant.compute_epsilon(self.orders, self.rdp, delta)
        return float(eps), float(order)

    def delta(self, epsilon: float) -> float:
        return float(rdp_privacy_accountant.compute_delta(self.orders, self.rdp, epsilon)[0])

    def notes(self) -> list[str]:
        return []


class _DpAccountingBackend:
    """What a backend over a dp_accounting accountant shares: an event is refused by the backend's own rules
    (:meth:`_refuses`, on every nested event), else by what its accountant supports."""

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


class RdpBackend(_DpAccountingBackend):
    """dp_accounting's RDP accountant (see the module documentation)."""

    name = "rdp"
    label = "RDP"
    tightness = 0

    @staticmethod
    def _refuses(event: dpa.DpEvent, neighbouring: str) -> str | None:
        if isinstance(event, RandomAllocationDpEvent):
            return "random allocation is priced by dpvr's PLD only; use accountant='pld'"
        if isinstance(event, dpa.PoissonSampledDpEvent) and neighbouring == REPLACE_ONE:
            return (
                "dp_accounting's RDP accountant does not support Poisson sampling under replace-one; "
                "use accountant='pld' or neighbouring='add-remove'"
            )
        return None

    def rewrite(self, event: dpa.DpEvent, neighbouring: str) -> dpa.DpEvent:
        """Under replace-one, every Gaussian and Laplace noise multiplier halved: dp_accounting's RDP prices
        them (and sampling without replacement) against the replace-one sensitivity ``2C``."""
        if check_neighbouring(neighbouring) == REPLACE_ONE:
            return scale_noise(event, 0.5)
        return event

    def make(
        self, neighbouring: str, *, orders: Sequence[float] | None = None, interval: float | None = None
    ) -> dpa.PrivacyAccountant:
        return rdp_privacy_accountant.RdpAccountant(
            orders=list(orders or DEFAULT_ORDERS), neighboring_relation=relation(neighbouring)
        )

    def proxy(self, event: dpa.DpEvent, neighbouring: str) -> tuple[dpa.DpEvent, str] | None:
        """An RDP stand-in for an event the RDP accountant cannot price, used only to split a budget between
        streams or to attribute a spend to them, never as a bound: a random-allocation step is read as
        Poisson sampling at rate ``1/t`` (Feldman and Shenfeld 2025 bound it by Poisson at rate
        ``(1 + o(1))/t``), and Poisson sampling under replace-one as add/remove at twice the sensitivity.
        ``(event, relation)`` in dpvr's convention, or ``None`` when there is no stand-in."""
        if isinstance(event, RandomAllocationDpEvent):
            event = dpa.PoissonSampledDpEvent(1.0 / event.num_steps, event.event)
        elif isinstance(event, dpa.ComposedDpEvent):
            parts = [self.proxy(e, neighbouring) for e in event.events]
            if any(p is None for p in parts) or len({p[1] for p in parts}) > 1:
                return None
            return dpa.ComposedDpEvent([p[0] for p in parts]), parts[0][1] if parts else neighbouring
        elif isinstance(event, dpa.SelfComposedDpEvent):
            inner = self.proxy(event.event, neighbouring)
            return None if inner is None else (attr.evolve(event, event=inner[0]), inner[1])
        if self.unsupported_reason(event, neighbouring) is None:
            return event, neighbouring
        if (
            neighbouring == REPLACE_ONE
            and self.unsupported_reason(scale_noise(event, 0.5), ADD_REMOVE) is None
        ):
            return scale_noise(event, 0.5), ADD_REMOVE
        return None

    def compose(self, ledger: Ledger) -> Composition:
        return RdpComposition(ledger.orders, ledger.rdp())

    def calibrate(self, design: Design, epsilon: float, delta: float) -> dict[str, float]:
        """The RDP design itself, exact: the run spends ``epsilon`` at its optimal order."""
        return design(epsilon, exact=True)


class PldBackend(_DpAccountingBackend):
    """dp_accounting's privacy-loss-distribution accountant, with dpvr's PLDs (see the module
    documentation)."""

    name = "pld"
    label = "PLD"
    tightness = 1

    @staticmethod
    def _stand_in(event: dpa.DpEvent) -> dpa.DpEvent:
        return pld_stand_in(event)  # what dpvr prices itself, replaced by what dp_accounting must take

    @staticmethod
    def _refuses(event: dpa.DpEvent, neighbouring: str) -> str | None:
        if isinstance(event, RandomAllocationDpEvent) and not isinstance(event.event, dpa.GaussianDpEvent):
            return "dpvr's random-allocation PLD prices a Gaussian release only"
        if isinstance(event, dpa.SampledWithoutReplacementDpEvent) and not isinstance(
            event.event, dpa.GaussianDpEvent
        ):
            return (
                "the PLD accountant prices sampling without replacement only for a Gaussian release; "
                "use accountant='rdp'"
            )
        if isinstance(event, dpa.ZCDpEvent):
            return (
                "this release is an RDP (zCDP-form) curve, which dp_accounting's PLD accountant cannot "
                "compose; use accountant='rdp'"
            )
        return None

    def rewrite(self, event: dpa.DpEvent, neighbouring: str) -> dpa.DpEvent:
        """``event`` unchanged: dp_accounting's PLDs shift the noise by the relation's own sensitivity."""
        return event

    def make(
        self, neighbouring: str, *, orders: Sequence[float] | None = None, interval: float | None = None
    ) -> dpa.PrivacyAccountant:
        return pld_privacy_accountant.PLDAccountant(
            neighboring_relation=relation(neighbouring),
            value_discretization_interval=PLD_DISCRETIZATION if interval is None else interval,
        )

    def compose(self, ledger: Ledger) -> Composition:
        """The ledger's PLD, composed as a multiset of releases (cached for the process)."""
        from .accountant import _ComposedPLD  # the ledger's PLD composition lives with the ledger

        return _ComposedPLD.of(ledger.entries, ledger.neighbouring)

    def calibrate(self, design: Design, epsilon: float, delta: float) -> dict[str, float]:
        """The RDP design fixes the ratios between streams (for an epsilon below RDP's conversion floor, they
        are designed just above it: PLD has no such floor) and the PLD sets their common scale."""
        from .calibration import _pld_scale  # the PLD search lives with the RDP design it scales

        floor = design.floor
        ratios = design(epsilon if epsilon > floor else 2 * floor, exact=False)
        return _pld_scale(design.factory, ratios, epsilon, delta)


#: dpvr's RDP backend (also the one every accountant's stream shares and calibration designs are measured on).
RDP = RdpBackend()
#: dpvr's PLD backend.
PLD = PldBackend()
register_accountant(RDP)
register_accountant(PLD)

__all__ = ["PLD", "RDP", "PldBackend", "RdpBackend", "RdpComposition"]
