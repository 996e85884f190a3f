"""dpvr's PLD accountant (``accountant="pld"``), in one package behind the backend protocol
(:class:`~dpvr.privacy.relations.AccountantBackend`).

dp_accounting's ``PLDAccountant``, with dpvr's own PLDs for what it cannot price, composed and cached as a
multiset of releases, and a calibration that scales the RDP design to the PLD's epsilon. Tighter than RDP
(exact up to a pessimistic discretisation of the privacy loss), slower.

- :mod:`~dpvr.privacy.pld.composition`: a ledger's PLD (:class:`ComposedPLD`), the per-release PLD cache,
  the loss grid and its coarsening, :func:`pld_epsilon` of a whole run;
- :mod:`~dpvr.privacy.pld.calibration`: the calibration hook,
  :func:`~dpvr.privacy.pld.calibration.pld_scale`;
- :mod:`~dpvr.privacy.pld.subsampling`: the tight PLD of a Gaussian on a batch drawn without replacement
  (replace-one) and dp_accounting's Gaussian PLD, built vectorised;
- :mod:`~dpvr.privacy.pld.random_allocation`: the PLD of an epoch of random allocation;
- :mod:`~dpvr.privacy.pld.numerics`: dp_accounting's per-point loops, vectorised;
- :mod:`~dpvr.privacy.pld.adapter`: every read of a private dp_accounting field (version-pinned, tested).

:data:`PLD` is registered by :mod:`dpvr.privacy.backends`.
"""

from __future__ import annotations

from collections.abc import Sequence

import dp_accounting as dpa

from ..random_allocation import RandomAllocationDpEvent
from ..relations import Composition, Design, DpAccountingBackend, Ledger, pld_stand_in, require_supported
from .calibration import pld_scale
from .composition import ComposedPLD, pld_accountant, pld_epsilon
from .subsampling import PLD_DISCRETIZATION


class PldBackend(DpAccountingBackend):
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
        return pld_accountant(neighbouring, PLD_DISCRETIZATION if interval is None else interval)

    def compose(self, ledger: Ledger) -> Composition:
        """The ledger's PLD, composed as a multiset of releases (cached for the process)."""
        return ComposedPLD.of(ledger.entries, ledger.neighbouring)

    def calibrate(self, design: Design, epsilon: float, delta: float) -> dict[str, float]:
        """The RDP design fixes the ratios between streams (for an epsilon below RDP's conversion floor, they
        are designed just above it: PLD has no such floor) and the PLD sets their common scale."""
        floor = design.floor
        ratios = design(epsilon if epsilon > floor else 2 * floor, exact=False)
        probe = design.factory(ratios)
        require_supported(probe.event, self.name, probe.neighbouring)
        return pld_scale(design.factory, ratios, epsilon, delta)


#: dpvr's PLD backend.
PLD = PldBackend()

__all__ = ["PLD", "PLD_DISCRETIZATION", "ComposedPLD", "PldBackend", "pld_epsilon"]
