"""dpvr's accountant backends, RDP and PLD, registered under ``"rdp"`` and ``"pld"``.

Each is an :class:`~dpvr.privacy.relations.AccountantBackend`: it says which events it accounts under which
relation (and why not), rewrites an event in dpvr's noise-multiplier convention for its dp_accounting
accountant (:mod:`dpvr.privacy.relations`), composes a ledger and calibrates noise. Everything that depends on
which accountant is used lives behind that protocol, one module or package per accountant:

- :data:`RDP` (``"rdp"``, :mod:`dpvr.privacy.rdp`): dp_accounting's ``RdpAccountant``; fast;
- :data:`PLD` (``"pld"``, :mod:`dpvr.privacy.pld`, the tighter): dp_accounting's ``PLDAccountant`` with
  dpvr's own PLDs for a Gaussian on a batch drawn without replacement and for random allocation.

Another accountant is added with :func:`~dpvr.privacy.relations.register_accountant`, and
:func:`~dpvr.privacy.relations.tightest_accountant` ranks them by ``tightness``.
"""

from __future__ import annotations

from .pld import PLD, PldBackend
from .rdp import RDP, RdpBackend, RdpComposition
from .relations import register_accountant

register_accountant(RDP)
register_accountant(PLD)

__all__ = ["PLD", "RDP", "PldBackend", "RdpBackend", "RdpComposition"]
