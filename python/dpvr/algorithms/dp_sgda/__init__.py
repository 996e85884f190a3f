"""DP-SGDA: noisy stochastic gradient descent-ascent for minimax problems (an x and a y stream).

Privacy: ``(epsilon, delta)``-DP under the plan's relation (:class:`dpvr.algorithms.DPSGDAPlan`) for every
released x and y, both streams clipped per sample and accounted together.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...registry import AlgorithmSpec, Sigma, all_reduced, register, schema_arguments, setting
from .. import _help
from .plan import DPSGDAPlan

_SAMPLING = ("wor", "poisson", "full")


@dataclass(frozen=True)
class DPSGDASettings:
    """The settings of a DP-SGDA plan."""

    dataset_size: int = setting(_help.DATASET_SIZE)
    batch_size: int = setting(_help.BATCH_SIZE)
    steps: int = setting(_help.STEPS)
    sampling: str = setting(_help.sampling(_SAMPLING), "wor", choices=_SAMPLING)
    shared_batch: bool = setting("x and y draw independent batches", True)


SPEC = register(
    AlgorithmSpec(
        "dp-sgda",
        "DP-SGDA: noisy stochastic gradient descent-ascent (x and y streams)",
        DPSGDAPlan,
        DPSGDAPlan,
        schema_arguments(DPSGDASettings),
        "dpvr.algorithms.dp_sgda.algorithm:DPSGDA",
        sigmas=(
            Sigma("x", "sigma_x", "noise std over C1 on the x-gradient batch mean"),
            Sigma("y", "sigma_y", "noise std over C2 on the y-gradient batch mean"),
        ),
        layout="sampled",
        problem="minimax",
        audit_games=("dp-sgda",),
        audit_module="dpvr.algorithms.dp_sgda.audit",
        data_parallel=all_reduced,
    )
)
