"""Privacy accounting for dpvr's algorithms, on dp_accounting's events and accountants.

- :class:`Accountant` records what an algorithm releases, stream by stream, and answers ``epsilon(delta)``,
  ``delta(epsilon)`` and a :class:`PrivacyReport`; it checkpoints to JSON.
- :class:`Plan` (:mod:`~dpvr.privacy.events`) is what every algorithm's plan (mechanism factory) is built
  on; the plans themselves live with their algorithms (``dpvr.algorithms.DPSGDPlan``, ``DIFF2Plan``, ...).
  :mod:`~dpvr.privacy.last_iterate` has the last-iterate bounds of cyclic DP-SGD.
- :func:`calibrate` finds the noise for a target ``(epsilon, delta)``, jointly over all streams, or returns
  the paper's closed form.
- The accountants are backends behind one protocol (:mod:`~dpvr.privacy.relations`), registered by
  :mod:`~dpvr.privacy.backends`: RDP (:mod:`~dpvr.privacy.rdp`) and PLD, one package
  (:mod:`~dpvr.privacy.pld`: composition, caches, dpvr's own PLDs, calibration hook, and the one module that
  reads dp_accounting's internals).

Noise multipliers are the noise std over the L2 bound on one record's contribution to the released sum
(:mod:`~dpvr.privacy.relations` explains how each accountant is made to price that correctly under
replace-one and add/remove neighbours).
"""

from .accountant import Accountant, PrivacyReport, account, event_from_dict, event_to_dict, spend_curves
from .calibration import MechanismFactory, calibrate
from .events import PaperSigmas, Plan, output_perturbation_multiplier
from .last_iterate import l_lambda, theorem_2_2_rho, theorem_2_3_rho, theta
from .mechanism import Mechanism, Release, Sampling, Stream
from .relations import (
    ACCOUNTANTS,
    ADD_REMOVE,
    NEIGHBOURING,
    REPLACE_ONE,
    AccountantBackend,
    accountant_backend,
    register_accountant,
    unregister_accountant,
)

__all__ = [
    "ACCOUNTANTS",
    "ADD_REMOVE",
    "NEIGHBOURING",
    "REPLACE_ONE",
    "Accountant",
    "AccountantBackend",
    "Mechanism",
    "MechanismFactory",
    "PaperSigmas",
    "Plan",
    "PrivacyReport",
    "Release",
    "Sampling",
    "Stream",
    "account",
    "spend_curves",
    "accountant_backend",
    "calibrate",
    "event_from_dict",
    "event_to_dict",
    "l_lambda",
    "output_perturbation_multiplier",
    "register_accountant",
    "theorem_2_2_rho",
    "theorem_2_3_rho",
    "theta",
    "unregister_accountant",
]
