"""DIFF2 (Murata and Suzuki): the restarted gradient-difference estimator over clients, with the GD routine or
BVR-L-SGD local steps.

Privacy: record-level ``(epsilon, delta)``-DP with respect to each client's data under the plan's relation
(:class:`dpvr.algorithms.DIFF2Plan`), every round's release priced: restart rounds (clip ``C1``), difference
rounds (radius ``C2 ||x_r - x_{r-1}||`` from released iterates only) and BVR-L-SGD's local steps.

Theorem defaults (DIFF2 Theorem 4.3, from its proof; :mod:`dpvr.algorithms.theorems`): the restart period,
the step size and the number of rounds, from public quantities and the user's clip radii only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...registry import AlgorithmSpec, Sigma, all_reduced, register, schema_arguments, setting
from ..theorems import (
    Derived,
    Missing,
    Public,
    diff2_lr,
    diff2_noise,
    diff2_protocol,
    diff2_tau,
    difference_multiplier,
    noise_constant,
    radius,
    restart_period,
)
from .plan import DIFF2Plan


@dataclass(frozen=True)
class DIFF2Settings:
    """The settings of a DIFF2 plan."""

    dataset_size: int = setting("records per client: the smallest local dataset size n_min")
    clients: int = setting("number of clients P")
    steps: int = setting("communication rounds R")
    restart: int = setting("restart period T: rounds r with (r - 1) mod T = 0 restart")
    local_steps: int = setting("BVR-L-SGD local steps K per round (1: the GD routine)", 1)
    local_batch: int | None = setting("BVR-L-SGD local batch b, drawn without replacement", None)


@dataclass(frozen=True)
class DIFF2PaperNoise:
    """The options of DIFF2's paper calibration (``calibration="paper"``)."""

    u: float = setting("budget split u of Proposition 4.1 (GD routine)", 1.25)
    u1: float = setting("u1 of Proposition E.2 (BVR-L-SGD)", 3.0)
    u2: float = setting("u2 of Proposition E.2 (BVR-L-SGD)", 3.0)


def restart_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """DIFF2-GD, Theorem 4.3 (its proof, with the accountant's constant): ``T = max(1, tau R)``,
    ``tau = (sqrt(2 c) C1^2 sqrt(d) / (C2 n P))^(2/3)`` (:func:`diff2_tau`, ``f(x0) - f* = 1``)."""
    theorem = ("DIFF2 Theorem 4.3 (proof), T = max(1, tau R), tau = (sqrt(2c) C1^2 sqrt(d) / (C2 n P))^(2/3),"
               " c = z^2/R of the accountant")
    c1, c2 = radius(settings, "restart", theorem), radius(settings, "difference", theorem)
    c = noise_constant(p.epsilon, p.delta)
    tau = diff2_tau(p.n * p.clients, p.dimension, c, c1, c2)
    value = restart_period(tau, p.steps)
    return Derived(value, f"{theorem}: C1={c1:g}, C2={c2:g}, d={p.dimension}, n={p.n}, P={p.clients}, "
                          f"epsilon={p.epsilon:g}, delta={p.delta:g}, c={c:.4g}, R={p.steps}: tau={tau:.3g}, "
                          f"T={value}")


def lr_rule(settings: Mapping[str, Any], p: Public) -> Derived | None:
    """DIFF2-GD, Theorem 4.3: ``eta = 1 / (C2 max(1, sqrt(T d) z2 / (n P)))`` (:func:`diff2_lr`), ``C2``
    standing in for ``L``; ``z2`` the given difference multiplier, else the calibration's (equal shares)."""
    if settings.get("optimizer") is not None:
        return None  # the user's optimizer takes the step
    if settings.get("routine", "gd") != "gd":
        raise Missing("Theorem 4.3's step size is DIFF2-GD's; give lr for the BVR-L-SGD routine")
    theorem = "DIFF2 Theorem 4.3, eta = 1 / (C2 max(1, sqrt(T d) z2 / (n P)))"
    c2 = radius(settings, "difference", theorem)
    restart = int(settings["restart"])
    z2, source = difference_multiplier(settings, p, restart, diff2_noise, "2c(R - ceil(R/T))")
    value = diff2_lr(p.n * p.clients, p.dimension, restart, z2, c2)
    return Derived(value, f"{theorem}: C2={c2:g} (for L), T={restart}, d={p.dimension}, n={p.n}, "
                          f"P={p.clients}, z2={z2:.4g} ({source}): eta={value:.4g}")


def rounds_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """DIFF2-GD, Theorem 4.3 (its proof, the accountant's constant): ``R = max(1/tau, N / sqrt(2 c d tau))``
    (:func:`diff2_protocol`), the fewest rounds past which the theorem's bound stops falling."""
    theorem = "DIFF2 Theorem 4.3 (proof), R = max(1/tau, N / sqrt(2 c d tau)), c = z^2/R of the accountant"
    c1, c2 = radius(settings, "restart", theorem), radius(settings, "difference", theorem)
    protocol = diff2_protocol(p.n, p.clients, p.dimension, p.epsilon, p.delta, lipschitz=c1, smoothness=c2)
    return Derived(protocol.rounds, f"{theorem}: C1={c1:g} (for G), C2={c2:g} (for L), f(x0) - f* = 1, "
                                    f"d={p.dimension}, n={p.n}, P={p.clients}, epsilon={p.epsilon:g}, "
                                    f"delta={p.delta:g}, c={protocol.noise_constant:.4g}: "
                                    f"tau={protocol.tau:.3g}, R={protocol.rounds}")


SPEC = register(
    AlgorithmSpec(
        "diff2",
        "DIFF2 with the GD routine, or the BVR-L-SGD routine when --local-steps is above 1 (record-level DP "
        "w.r.t. each client)",
        DIFF2Plan,
        DIFF2Plan,
        schema_arguments(DIFF2Settings),
        "dpvr.algorithms.diff2.algorithm:DIFF2",
        sigmas=(
            Sigma("restart", "sigma1", "noise std over C1 on the average over clients"),
            Sigma("difference", "sigma2", "noise std over the radius C2,r"),
            Sigma("local", "sigma3", "BVR-L-SGD local steps: noise std over the radius C3,k,r"),
        ),
        paper_options=schema_arguments(DIFF2PaperNoise),
        layout="full-batch",
        federated=True,
        audit_games=("diff2-gd", "diff2-bvr-l-sgd"),
        audit_module="dpvr.algorithms.diff2.audit",
        rules={"restart": restart_rule, "lr": lr_rule},
        steps_rule=rounds_rule,
        data_parallel=all_reduced,
    )
)
