"""Turning a distinguishing test into an empirical lower bound on epsilon.

An (epsilon, delta)-DP mechanism M satisfies, for every pair of neighbouring datasets D, D' and every test
that guesses "D" on the outcome set S: ``P[M(D) in S] <= e^epsilon P[M(D') in S] + delta``. With the test's
false-positive rate FPR = P[M(D') in S] and false-negative rate FNR = P[M(D) not in S] this reads
``epsilon >= log((1 - delta - FNR) / FPR)`` (and the same with FPR and FNR exchanged). The rates are
estimated from independent runs; Clopper–Pearson bounds turn the estimates into a statement that holds with
a stated confidence. What an audit proves is therefore: *with probability at least ``confidence`` over the
audit's own randomness, the mechanism is not (epsilon', delta)-DP for any epsilon' below the reported
bound*. It proves nothing in the other direction: a low bound does not show that the mechanism is private.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats


def _upper(successes: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    """One-sided Clopper–Pearson upper bounds (level ``1 - alpha``) on the rates ``successes / trials``."""
    successes = np.asarray(successes)
    upper = np.ones(successes.shape)
    below = successes < trials
    upper[below] = stats.beta.ppf(1 - alpha, successes[below] + 1, trials - successes[below])
    return upper


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds ``(lower, upper)`` on a binomial rate, each holding with
    probability at least ``1 - alpha``."""
    if not 0 <= successes <= trials or trials < 1:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha: must be in (0, 1), got {alpha}")
    lower = 0.0 if successes == 0 else float(stats.beta.ppf(alpha, successes, trials - successes + 1))
    return lower, float(_upper(np.array([successes]), trials, alpha)[0])


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """``max(0, log((1 - delta - fnr) / fpr))``: the epsilon a test with these error rates rules out."""
    if fpr <= 0:
        return math.inf if 1 - delta - fnr > 0 else 0.0
    value = (1 - delta - fnr) / fpr
    return math.log(value) if value > 1 else 0.0


@dataclass(frozen=True)
class ThresholdBound:
    """The result of a threshold test chosen on one half of the runs and evaluated on the other.

    ``epsilon`` is the lower bound; ``threshold`` and ``orientation`` (``+1``: guess "canary in" when the
    score is above the threshold; ``-1``: below) describe the test; ``fpr_upper``/``fnr_upper`` are the
    Clopper–Pearson upper bounds used; ``trials`` counts runs on both datasets together.
    """

    epsilon: float
    confidence: float
    threshold: float
    orientation: int
    fpr_upper: float
    fnr_upper: float
    trials: int


def _best_threshold(inside: np.ndarray, outside: np.ndarray, delta: float, alpha: float) -> tuple[float, int]:
    """The threshold and orientation whose test has the largest bound on these runs, computed as it will be
    on the evaluation runs: from Clopper–Pearson upper bounds (level ``1 - alpha``) on both error rates.

    Bounding the rates, not their plug-in estimates, keeps the choice off the tails, where one or two
    observed false positives promise a large ratio that fresh runs do not keep. Candidates lie midway
    between neighbouring scores, so a test that separates the two sides keeps a margin on both."""
    best = (-math.inf, 0.0, 1)
    for orientation in (1, -1):
        a, b = np.sort(orientation * inside), np.sort(orientation * outside)
        u = np.unique(np.concatenate([a, b]))
        t = np.concatenate([u[:1], (u[:-1] + u[1:]) / 2])
        tp = len(a) - np.searchsorted(a, t, side="left")
        fp = len(b) - np.searchsorted(b, t, side="left")
        fpr, fnr = _upper(fp, len(b), alpha), _upper(len(a) - tp, len(a), alpha)
        value = np.log(np.maximum(1 - delta - fnr, 1e-300) / fpr)
        k = int(np.argmax(value))
        if value[k] > best[0]:
            best = (float(value[k]), float(orientation * t[k]), orientation)
    return best[1], best[2]


def threshold_lower_bound(
    inside: np.ndarray,
    outside: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    rng: np.random.Generator | None = None,
) -> ThresholdBound:
    """Epsilon lower bound from scores of runs with the canary (``inside``) and on the neighbour
    (``outside``); a higher score should mean "canary in" but both orientations are tried.

    The runs are split at random into halves: the threshold test is chosen on the first half and its error
    rates are bounded on the second, so the choice costs no confidence. FPR and FNR each get a one-sided
    Clopper–Pearson upper bound at ``(1 - confidence) / 2`` (a union bound gives ``confidence`` jointly).
    """
    inside, outside = np.asarray(inside, dtype=np.float64), np.asarray(outside, dtype=np.float64)
    if len(inside) < 2 or len(outside) < 2:
        raise ValueError("need at least two runs on each dataset")
    if not np.all(np.isfinite(inside)) or not np.all(np.isfinite(outside)):
        raise ValueError("scores must be finite")
    rng = rng if rng is not None else np.random.default_rng()
    inside, outside = rng.permutation(inside), rng.permutation(outside)
    ha, hb = len(inside) // 2, len(outside) // 2
    alpha = (1 - confidence) / 2
    threshold, orientation = _best_threshold(inside[:ha], outside[:hb], delta, alpha)
    test_in, test_out = orientation * inside[ha:], orientation * outside[hb:]
    t = orientation * threshold
    fp, fn = int(np.sum(test_out >= t)), int(np.sum(test_in < t))
    fpr_u = clopper_pearson(fp, len(test_out), alpha)[1]
    fnr_u = clopper_pearson(fn, len(test_in), alpha)[1]
    return ThresholdBound(
        epsilon_from_rates(fpr_u, fnr_u, delta),
        confidence,
        threshold,
        orientation,
        fpr_u,
        fnr_u,
        len(inside) + len(outside),
    )


def one_run_lower_bound(correct: int, guesses: int, *, confidence: float = 0.95) -> float:
    """Epsilon lower bound of a one-run audit (Steinke, Nasr and Jagielski, 2023) for pure epsilon-DP.

    In one run, each of ``m`` canaries is included independently with probability 1/2 and the auditor makes
    ``guesses`` membership guesses (abstaining on the rest), ``correct`` of them right. Under epsilon-DP the
    number of correct guesses is stochastically dominated by ``Binomial(guesses, e^eps / (1 + e^eps))``, so
    the smallest epsilon at which ``correct`` or more successes still have probability at least
    ``1 - confidence`` is a lower bound at that confidence. This is the theorem's pure-DP form; the
    approximate-DP version adds a delta-dependent term that :func:`one_run_audit` accounts for separately.
    """
    if not 0 <= correct <= guesses or guesses < 1:
        raise ValueError(f"need 0 <= correct <= guesses and guesses >= 1, got {correct}/{guesses}")
    beta = 1 - confidence

    def tail(eps: float) -> float:  # P[Binomial(guesses, p(eps)) >= correct] - beta, increasing in eps
        p = 1 / (1 + math.exp(-eps))
        return float(stats.binom.sf(correct - 1, guesses, p)) - beta

    if tail(0.0) >= 0:
        return 0.0
    if tail(50.0) < 0:
        return 50.0
    return float(optimize.brentq(tail, 0.0, 50.0, xtol=1e-6))
