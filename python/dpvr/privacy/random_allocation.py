"""Random allocation (balls-in-bins batches) as a dp_accounting event: what dpvr's accountants record.

An epoch has ``t`` steps and every record is used in exactly one of them, chosen uniformly at random and
independently of the other records (Chua et al. 2025, "Balls-and-bins sampling for DP-SGD"; Feldman and
Shenfeld 2025, "Privacy amplification by random allocation"). dp_accounting has no such event; dpvr's PLD
accountant prices it (:mod:`dpvr.privacy.pld.random_allocation` builds its privacy loss distribution, and
explains why it is accounted under add/remove only), by epoch: ``c`` releases from the start of a run cost
``ceil(c / t)`` epochs.
"""

from __future__ import annotations

import attr
import dp_accounting as dpa


@attr.define(frozen=True)
class RandomAllocationDpEvent(dpa.DpEvent):
    """One step of an epoch of ``num_steps`` steps in which every record is used in exactly one step, chosen
    uniformly at random; the step applies ``event`` to its batch.

    dp_accounting has no such event. dpvr prices a stream's releases by epoch: ``c`` releases of this event
    from the start of a run cost ``ceil(c / num_steps)`` epochs (a partial epoch is a prefix of a full one:
    post-processing). A lone release is charged a whole epoch.
    """

    num_steps: int
    event: dpa.DpEvent


def is_random_allocation(event: dpa.DpEvent) -> bool:
    """Whether ``event`` is one random-allocation step of a Gaussian release (dpvr builds its PLD)."""
    return isinstance(event, RandomAllocationDpEvent) and isinstance(event.event, dpa.GaussianDpEvent)


def epochs(releases: int, num_steps: int) -> int:
    """Epochs spanned by ``releases`` consecutive releases from the start of an epoch of ``num_steps``."""
    return -(-releases // num_steps)


__all__ = ["RandomAllocationDpEvent", "epochs", "is_random_allocation"]
