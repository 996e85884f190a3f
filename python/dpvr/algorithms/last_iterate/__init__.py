"""Last-iterate DP-SGD (Kong and Ribero): cyclic, clipped DP-SGD with a proximal term that releases only its
last iterate.

Privacy: ``(epsilon, delta)``-DP for the last iterate only, under replace-one
(:class:`dpvr.algorithms.CyclicDPSGDPlan`): Theorem 2.3 with its stated constant (or Theorem 2.2
with ``sqrt(2) L_lambda`` where clipping may be active), or the composition of the passes, or the smaller;
the step sizes the theorems do not cover are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...registry import AlgorithmSpec, Sigma, all_reduced, register, schema_arguments, setting
from .plan import CyclicDPSGDPlan


@dataclass(frozen=True)
class LastIterateSettings:
    """The settings of a last-iterate plan."""

    dataset_size: int = setting("number of records k")
    batch_size: int = setting("batch size b (must divide k)")
    epochs: int = setting("passes E over the data (T = E k / b steps)")
    lr: float = setting("step size lambda")
    clip: float = setting("clip norm C")
    weak_convexity: float = setting("weak convexity m of the losses")
    smoothness: float = setting("upper smoothness M of the losses")
    domain_diameter: float = setting("diameter of the domain of h", math.inf)
    clipping: bool = setting(
        "assert that no per-example gradient norm ever exceeds C (Theorem 2.3, eq. 19)", True
    )
    bound: str = setting(
        "last-iterate (the theorems; refuses step sizes they do not cover), composition (of the passes) or "
        "best (the smaller)",
        "last-iterate",
        choices=("last-iterate", "composition", "best"),
    )


def plan(epochs: int, dataset_size: int, batch_size: int, **options: Any) -> CyclicDPSGDPlan:
    """Cyclic DP-SGD over ``epochs`` passes of ``dataset_size / batch_size`` steps."""
    steps = epochs * (dataset_size // batch_size) if batch_size > 0 else 0  # the plan refuses batch_size <= 0
    return CyclicDPSGDPlan(dataset_size, batch_size, steps, **options)


SPEC = register(
    AlgorithmSpec(
        "last-iterate",
        "cyclic DP-SGD releasing only its last iterate (Kong and Ribero, Theorems 2.2 and 2.3)",
        CyclicDPSGDPlan,
        plan,
        schema_arguments(LastIterateSettings),
        "dpvr.algorithms.dp_sgd.algorithm:DPSGD",
        algorithm_options={"sampling": "cyclic"},
        sigmas=(Sigma("gradient", "sigma", "noise std in parameter space"),),
        layout="sampled",
        audit_games=("last-iterate",),
        audit_module="dpvr.algorithms.last_iterate.audit",
        data_parallel=all_reduced,
    )
)
