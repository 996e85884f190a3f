"""dpvr's RDP backend: dp_accounting's ``RdpAccountant`` over the RDP orders (``accountant="rdp"``).

Fast; accounts every dpvr event except Poisson sampling under replace-one and random allocation. A ledger's
total RDP curve is converted by dp_accounting's ``compute_epsilon``/``compute_delta``; a calibration is the
RDP design itself (:mod:`dpvr.privacy.calibration`). Its :meth:`RdpBackend.proxy` is the RDP stand-in for
what it cannot price, used only to split a budget between streams or attribute a spend to them (by any
accountant: stream shares are always measured on RDP curves). Registered by :mod:`dpvr.privacy.backends`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import attr
import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from .random_allocation import RandomAllocationDpEvent
from .relations import (
    ADD_REMOVE,
    DEFAULT_ORDERS,
    REPLACE_ONE,
    Composition,
    Design,
    DpAccountingBackend,
    Ledger,
    check_neighbouring,
    relation,
    scale_noise,
)


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


class RdpBackend(DpAccountingBackend):
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


#: dpvr's RDP backend (also the one every accountant's stream shares and calibration designs are measured on).
RDP = RdpBackend()

__all__ = ["RDP", "RdpBackend", "RdpComposition"]
