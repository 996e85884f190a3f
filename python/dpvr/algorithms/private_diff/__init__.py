"""PrivateDiff Minimax (Zhang et al., nonconvex-strongly-concave): checkpoint and difference rounds on x, and
a privatised y (noisy clipped ascent, or the paper's output perturbation priced at a worst-case sensitivity).

Privacy: ``(epsilon, delta)``-DP under the plan's relation (:class:`dpvr.algorithms.PrivateDiffPlan`) for
every released x and y: the ascent output ``y_{r+1}`` is released privately before the x-gradients read it.

Theorem defaults (PrivateDiff Theorem 6, from its proof; :mod:`dpvr.algorithms.theorems`): the checkpoint
period, the ascent steps, the step size and the number of rounds. Data parallelism: the ascent release only
(the output perturbation's certified solve is not a sum the processes all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...registry import AlgorithmSpec, Sigma, register, schema_arguments, setting
from .. import _help
from ..theorems import (
    Derived,
    Public,
    difference_multiplier,
    noise_constant,
    private_diff_lr,
    private_diff_noise,
    private_diff_protocol,
    private_diff_tau,
    radius,
    restart_period,
)
from .plan import PrivateDiffPlan

_SAMPLING = ("wor", "poisson", "full")


@dataclass(frozen=True)
class PrivateDiffSettings:
    """The settings of a PrivateDiff plan."""

    dataset_size: int = setting(_help.DATASET_SIZE)
    batch_size: int = setting(_help.BATCH_SIZE)
    steps: int = setting("outer rounds R")
    restart: int = setting("checkpoint period T: rounds r with (r - 1) mod T = 0")
    y_steps: int = setting("T2: ascent steps per round, or the output solver's cap", 1)
    sampling: str = setting(_help.sampling(_SAMPLING), "wor", choices=_SAMPLING)
    y_release: str = setting(
        "how y is made private: ascent (noisy clipped ascent steps, as dpvr runs it) or output (the paper's "
        "output perturbation, priced as a worst-case sensitivity)",
        "ascent",
        choices=("ascent", "output"),
    )


def data_parallel(settings: Mapping[str, Any]) -> str | None:
    """Every release of ``y_release="ascent"`` is a clipped sum the processes all-reduce; the output
    perturbation's is not."""
    if settings.get("y_release") == "output":
        return ("y_release: 'output' is not data-parallel: its y is a certified solve of the inner problem "
                "over every record's model output, not a sum that the processes' shares all-reduce to; use "
                "y_release='ascent' over a process group, or run it in one process")
    return None


def restart_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """PrivateDiff, Theorem 6 (its proof, the accountant's constant): ``T = max(1, tau R)``, ``tau =
    (sqrt(3c/2) C1^2 sqrt(d) / (C2 n))^(2/3)`` (:func:`private_diff_tau`, ``Phi(x0) - min Phi = 1``)."""
    theorem = ("PrivateDiff Theorem 6 (proof), T = max(1, tau R), tau = (sqrt(3c/2) C1^2 sqrt(d) / "
               "(C2 n))^(2/3), c = z^2/R of the accountant")
    c1, c2 = radius(settings, "checkpoint", theorem), radius(settings, "difference", theorem)
    c = noise_constant(p.epsilon, p.delta)
    tau = private_diff_tau(p.n, p.dimension, c, c1, c2)
    value = restart_period(tau, p.steps)
    return Derived(value, f"{theorem}: C1={c1:g} (for G), C2={c2:g} (for l + kappa l), d={p.dimension}, "
                          f"n={p.n}, epsilon={p.epsilon:g}, delta={p.delta:g}, c={c:.4g}, R={p.steps}: "
                          f"tau={tau:.3g}, T={value}")


def lr_rule(settings: Mapping[str, Any], p: Public) -> Derived | None:
    """PrivateDiff, Theorem 6: ``eta = 1 / (2 C2 max(1, sqrt(2 T d) z2 / n))`` (:func:`private_diff_lr`),
    ``C2`` standing in for ``l + kappa l``; ``z2`` the given difference multiplier, else the calibration's
    (three equal shares)."""
    if settings.get("optimizer") is not None:
        return None
    theorem = "PrivateDiff Theorem 6 (proof), eta = 1 / (2 C2 max(1, sqrt(2 T d) z2 / n))"
    c2 = radius(settings, "difference", theorem)
    restart = int(settings["restart"])
    z2, source = difference_multiplier(settings, p, restart, private_diff_noise, "3c(R - ceil(R/T))")
    value = private_diff_lr(p.n, p.dimension, restart, z2, c2)
    return Derived(value, f"{theorem}: C2={c2:g} (for l + kappa l), T={restart}, d={p.dimension}, n={p.n}, "
                          f"z2={z2:.4g} ({source}): eta={value:.4g}")


def y_steps_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """PrivateDiff's ``T2``. With ``y_release="output"``, Theorem 6's iteration count of the inner solve,
    ``T2 = max((n epsilon)^(4/3) / d^(2/3), T R d^(1/3) / (n epsilon)^(2/3))`` (a cap: the solve stops once
    it certifies). With ``"ascent"`` every ascent step is a release of its own, which the theorem does not
    cover; one step per round, as DP-SGDA takes."""
    if settings.get("y_release", "ascent") != "output":
        return Derived(1, "y_release='ascent': one noisy ascent step per round (as DP-SGDA); Theorem 6's "
                          "T2 counts the iterations of the inner solve of y_release='output'")
    ne, d = p.n * p.epsilon, p.dimension
    restart = settings["restart"]
    value = math.ceil(max(ne ** (4 / 3) / d ** (2 / 3), restart * p.steps * d ** (1 / 3) / ne ** (2 / 3)))
    return Derived(value, f"PrivateDiff Theorem 6, T2 = max((n eps)^(4/3) / d^(2/3), T R d^(1/3) / "
                          f"(n eps)^(2/3)): n={p.n}, epsilon={p.epsilon:g}, d={d}, T={restart}, "
                          f"R={p.steps}: T2={value}")


def rounds_rule(settings: Mapping[str, Any], p: Public) -> Derived:
    """PrivateDiff, Theorem 6 (its proof, the accountant's constant): ``R = max(1/tau, n / sqrt(6 c d tau))``
    (:func:`private_diff_protocol` without the problem's constants: the y-release's ``R_y`` needs ``l`` and
    ``mu``, which no clip radius bounds, so a user who knows them passes steps from that function)."""
    theorem = ("PrivateDiff Theorem 6 (proof), R = max(1/tau, n / sqrt(6 c d tau)), "
               "c = z^2/R of the accountant")
    c1, c2 = radius(settings, "checkpoint", theorem), radius(settings, "difference", theorem)
    protocol = private_diff_protocol(p.n, p.dimension, p.epsilon, p.delta, c1, c2)
    return Derived(protocol.rounds, f"{theorem}: C1={c1:g} (for G), C2={c2:g} (for l + kappa l), "
                                    f"Phi(x0) - min Phi = 1, d={p.dimension}, n={p.n}, "
                                    f"epsilon={p.epsilon:g}, delta={p.delta:g}, "
                                    f"c={protocol.noise_constant:.4g}: tau={protocol.tau:.3g}, "
                                    f"R={protocol.rounds}")


SPEC = register(
    AlgorithmSpec(
        "private-diff",
        "PrivateDiff Minimax (checkpoint, difference and y streams)",
        PrivateDiffPlan,
        PrivateDiffPlan,
        schema_arguments(PrivateDiffSettings),
        "dpvr.algorithms.private_diff.algorithm:PrivateDiff",
        sigmas=(
            Sigma("checkpoint", "sigma_x1", "noise std over C1 on the batch mean"),
            Sigma("difference", "sigma_x2", "noise std over the radius C2,r"),
            Sigma(
                "y",
                "sigma_y",
                "ascent: noise std over C0 on the y batch mean; output: noise std over the worst-case "
                "replace-one sensitivity of y",
            ),
        ),
        layout="sampled",
        problem="minimax",
        audit_games=("private-diff", "private-diff-difference", "private-diff-y-output"),
        audit_module="dpvr.algorithms.private_diff.audit",
        rules={"restart": restart_rule, "y_steps": y_steps_rule, "lr": lr_rule},
        steps_rule=rounds_rule,
        data_parallel=data_parallel,
    )
)
