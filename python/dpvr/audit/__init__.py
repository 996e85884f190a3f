"""Empirical privacy auditing: lower bounds on epsilon by the canary method.

An audit runs an algorithm many times on two neighbouring datasets that differ in one crafted canary,
scores each output, and turns the best distinguishing test into a lower bound on epsilon that holds with a
stated confidence (Clopper–Pearson). A lower bound above the algorithm's claimed epsilon refutes the claim
(an implementation or accounting bug); a lower bound below it proves nothing about privacy — it only says
that this canary and this score found no violation. The one-run audit bounds epsilon from many canaries in
a single run.

This package is the method: games, scores, bounds and the runner. Each algorithm's games live in its home
(``dpvr.algorithms.<name>.audit``); :func:`dpvr.registry.audit_targets` gathers them by name.
"""

from .bounds import (
    ThresholdBound,
    clopper_pearson,
    epsilon_from_rates,
    one_run_lower_bound,
    threshold_lower_bound,
)
from .games import AlgorithmGame, Game, Trace
from .run import AuditResult, OneRunResult, audit, one_run_audit
from .targets import DEFAULT_DELTA, CanaryGame, Target

__all__ = [
    "DEFAULT_DELTA",
    "AlgorithmGame",
    "AuditResult",
    "CanaryGame",
    "Game",
    "OneRunResult",
    "Target",
    "ThresholdBound",
    "Trace",
    "audit",
    "clopper_pearson",
    "epsilon_from_rates",
    "one_run_audit",
    "one_run_lower_bound",
    "threshold_lower_bound",
]
