"""DP Recursive-SPIDER for KL-DRO in its compositional form (v, u and s streams), as intended rather than as
printed (accumulated estimators, lambda projected onto [lambda0, inf), s clamped to a public floor).

Privacy: ``(epsilon, delta)``-DP under the plan's relation (:class:`dpvr.algorithms.RecursiveSpiderPlan`), the
five streams accounted together in one accountant.

Theorem defaults (DP-DRO Theorem 8; :mod:`dpvr.algorithms.theorems`): the period, the batch sizes and the
step size (its ``T`` is :func:`~dpvr.algorithms.theorems.spider_protocol`'s; ``make_private`` asks a
per-stream algorithm for ``steps=``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...registry import AlgorithmSpec, Argument, all_reduced, floats, register, schema_arguments, setting
from .. import _help
from ..theorems import Derived, Public, noise_constant, radius, spider_batch_sizes
from .plan import RecursiveSpiderPlan

STREAMS = ("v-refresh", "v-difference", "u-refresh", "u-difference", "s")


@dataclass(frozen=True)
class RecursiveSpiderSettings(_help.SpiderSettings):
    """The settings of a Recursive-SPIDER plan."""

    batch_sizes: tuple[int, ...] = setting(
        "b1,b2,b3,b4: the batch size of each stream in the paper's order (a batch equal to the dataset size "
        "is the full batch)"
    )


def restart_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """DP-DRO Theorem 8's period ``q = floor(n^2 / (L^2 R d k c))`` (``L`` the v-difference radius),
    ``log(1/delta) / eps^2`` read as ``k c`` (``k = 5``: the streams share the budget equally)."""
    k, c = len(STREAMS), noise_constant(p.epsilon, p.delta)
    theorem = "DP-DRO Theorem 8, q = floor(n^2 / (L^2 R d k c))"
    lip = radius(settings, "v-difference", theorem)
    value = int(min(p.steps, max(1, math.floor(p.n**2 / (lip**2 * p.steps * p.dimension * k * c)))))
    return Derived(value, f"{theorem}, log(1/delta)/eps^2 read as k c: L={lip:g} (v-difference radius), "
                          f"n={p.n}, R={p.steps}, d={p.dimension}, k={k}, c={c:.4g}: q={value}")


def lr_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """DP-DRO Theorem 8's ``eta = 1 / (2 L)``, ``L`` the v-difference radius."""
    theorem = "DP-DRO Theorem 8, eta = 1 / (2 L)"
    lip = radius(settings, "v-difference", theorem)
    return Derived(1 / (2 * lip), f"{theorem}: L={lip:g} (v-difference radius): eta={1 / (2 * lip):.4g}")


SPEC = register(
    AlgorithmSpec(
        "recursive-spider",
        "DP Recursive-SPIDER for KL-DRO (five streams)",
        RecursiveSpiderPlan,
        RecursiveSpiderPlan,
        schema_arguments(RecursiveSpiderSettings),
        "dpvr.algorithms.recursive_spider.algorithm:RecursiveSpider",
        noise=Argument(
            "noise_multipliers",
            floats,
            f"noise multipliers, one per stream in this order: {','.join(STREAMS)}",
        ),
        layout="per-stream",
        audit_games=(
            "recursive-spider",
            "recursive-spider-difference",
            "recursive-spider-u",
            "recursive-spider-s",
        ),
        audit_module="dpvr.algorithms.recursive_spider.audit",
        rules={
            "restart": restart_rule,
            "batch_sizes": spider_batch_sizes(
                len(STREAMS), ("v-refresh", "v-difference", "u-refresh", "u-difference"),
                ("v-refresh", "u-refresh"),
            ),
            "lr": lr_rule,
        },
        data_parallel=all_reduced,
    )
)
