"""DP Double-SPIDER for psi-divergence DRO (the dual's eta and the model's x, each a refresh and a difference
stream).

Privacy: ``(epsilon, delta)``-DP under the plan's relation (:class:`dpvr.algorithms.DoubleSpiderPlan`), the
four streams accounted together in one accountant (the paper calibrates each to the whole budget); per-sample
clipping everywhere (the paper's pseudocode clips the batch mean, which is not DP).

Theorem defaults (DP-DRO Theorem 7; :mod:`dpvr.algorithms.theorems`): the period, the batch sizes and the
dual step size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...registry import AlgorithmSpec, Argument, all_reduced, floats, register, schema_arguments, setting
from .. import _help
from ..theorems import Derived, Public, noise_constant, radius, spider_batch_sizes, spider_period_theorem7
from .plan import DoubleSpiderPlan

STREAMS = ("eta-refresh", "eta-difference", "x-refresh", "x-difference")


@dataclass(frozen=True)
class DoubleSpiderSettings(_help.SpiderSettings):
    """The settings of a Double-SPIDER plan."""

    batch_sizes: tuple[int, ...] = setting(
        "N1,N2,N3,N4: the batch size of each stream in the paper's order (a batch equal to the dataset size "
        "is the full batch)"
    )


def restart_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """DP-DRO Theorem 7's period ``q = (n / sqrt(k c d))^(2/3)``, ``log(1/delta) / eps^2`` read as ``k c``
    (``k = 4``: the streams share the budget equally)."""
    k, c = len(STREAMS), noise_constant(p.epsilon, p.delta)
    value = min(p.steps, spider_period_theorem7(p.n, p.dimension, c, k))
    return Derived(value, f"DP-DRO Theorem 7, q = (n / sqrt(k c d))^(2/3), log(1/delta)/eps^2 read "
                          f"as k c: n={p.n}, d={p.dimension}, k={k}, epsilon={p.epsilon:g}, "
                          f"delta={p.delta:g}, c={c:.4g}: q={value}")


def lr_eta_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """DP-DRO Theorem 7's ``alpha = 1 / (4 L2)``, ``L2`` (the dual variable's smoothness) taken as the
    eta-difference radius' eta coefficient (``k2_eta``)."""
    theorem = "DP-DRO Theorem 7, alpha = 1 / (4 L2)"
    lip = radius(settings, "eta-difference", theorem)
    return Derived(1 / (4 * lip), f"{theorem}: L2={lip:g} (eta-difference radius' eta coefficient): "
                                  f"lr_eta={1 / (4 * lip):.4g}")


SPEC = register(
    AlgorithmSpec(
        "double-spider",
        "DP Double-SPIDER for psi-divergence DRO (four streams)",
        DoubleSpiderPlan,
        DoubleSpiderPlan,
        schema_arguments(DoubleSpiderSettings),
        "dpvr.algorithms.double_spider.algorithm:DoubleSpider",
        noise=Argument(
            "noise_multipliers",
            floats,
            f"noise multipliers, one per stream in this order: {','.join(STREAMS)}",
        ),
        layout="per-stream",
        audit_games=("double-spider", "double-spider-difference", "double-spider-eta"),
        audit_module="dpvr.algorithms.double_spider.audit",
        rules={
            "restart": restart_rule,
            "batch_sizes": spider_batch_sizes(len(STREAMS), STREAMS, ("eta-refresh", "x-refresh")),
            "lr_eta": lr_eta_rule,
        },
        data_parallel=all_reduced,
    )
)
