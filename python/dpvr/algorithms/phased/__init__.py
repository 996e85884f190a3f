"""Phased output perturbation (bring your own algorithm): any base solver accurate enough, made DP by noise on
each phase's output (SC, C, SC-SC, C-C and C-SC settings).

Privacy: ``(epsilon, delta + failure_probability)``-DP under replace-one
(:class:`dpvr.algorithms.PhasedPlan`), resting on the base solver's accuracy: dpvr requires a certificate and
fails loudly when it is not reached. ``make_private`` does not run it (the phases call the user's own
solver), so it states no data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...registry import AlgorithmSpec, Sigma, register, schema_arguments
from ...registry import setting as declare  # a field of the schema is itself named setting
from .plan import PhasedPlan


@dataclass(frozen=True)
class PhasedSettings:
    """The settings of a phased plan."""

    setting: str = declare(
        "sc, c (Algorithms 1, 2), sc-sc (Algorithm 3), c-c (Algorithms 4, 5) or c-sc",
        choices=("sc", "c", "sc-sc", "c-c", "c-sc"),
    )
    failure_probability: float = declare(
        "probability that the base solver misses its accuracy target (added to delta; 0 with certificates)",
        0.0,
    )


@dataclass(frozen=True)
class PhasedPaperNoise:
    """The options of the phased framework's paper calibration (``calibration="paper"``)."""

    gaussian: str = declare(
        "the paper calibration's Gaussian mechanism: classic (the paper's, epsilon < 1) or analytic",
        "analytic",
        choices=("classic", "analytic"),
    )


SPEC = register(
    AlgorithmSpec(
        "phased",
        "phased output perturbation (bring your own algorithm)",
        PhasedPlan,
        PhasedPlan,
        schema_arguments(PhasedSettings),
        "dpvr.algorithms.phased.algorithm:PhasedOutputPerturbation",
        layout=None,  # make_private does not run it: the phases call the user's own solver
        sigmas=(
            Sigma("x", "sigma_x", "noise std over the replace-one sensitivity of x"),
            Sigma("y", "sigma_y", "noise std over the replace-one sensitivity of y"),
        ),
        paper_options=schema_arguments(PhasedPaperNoise),
        audit_games=("phased",),
        audit_module="dpvr.algorithms.phased.audit",
    )
)
