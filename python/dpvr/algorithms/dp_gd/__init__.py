"""DP-GD: DP-SGD on the full batch every step.

Privacy: ``(epsilon, delta)``-DP under the plan's neighbouring relation, for every released iterate: ``steps``
full-batch Gaussian releases of the clipped gradient sum (:class:`dpvr.algorithms.DPSGDPlan`, ``"full"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...registry import AlgorithmSpec, Argument, all_reduced, register, schema_arguments, setting
from .. import _help
from ..dp_sgd.plan import DPSGDPlan


@dataclass(frozen=True)
class DPGDSettings:
    """The settings of a DP-GD plan."""

    steps: int = setting(_help.STEPS)


def plan(steps: int, neighbouring: str) -> DPSGDPlan:
    """DP-SGD on the full batch."""
    return DPSGDPlan(steps, "full", neighbouring=neighbouring)


SPEC = register(
    AlgorithmSpec(
        "dp-gd",
        "DP-GD: DP-SGD on the full batch every step",
        DPSGDPlan,
        plan,
        schema_arguments(DPGDSettings),
        "dpvr.algorithms.dp_gd.algorithm:DPGD",
        algorithm_options={"sampling": "full"},
        noise=Argument("noise_multiplier", float, _help.NOISE_MULTIPLIER),
        layout="full-batch",
        audit_games=("dp-gd", "dp-gd-input"),
        audit_module="dpvr.algorithms.dp_gd.audit",
        data_parallel=all_reduced,
    )
)
