"""Audits: many runs of a game (:func:`audit`), or many canaries in one run (:func:`one_run_audit`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..ops import NoiseGenerator
from .bounds import ThresholdBound, one_run_lower_bound, threshold_lower_bound
from .games import Game


@dataclass(frozen=True)
class AuditResult:
    """The claimed epsilon (from the algorithm's accountant, at ``delta``) and the audited lower bound.

    ``bound.epsilon`` is a lower bound on the true epsilon at ``delta`` holding with probability at least
    ``bound.confidence``; ``bound.epsilon > claimed_epsilon`` means the claim is refuted at that confidence.
    ``inside``/``outside`` are the scores of the runs with the canary and on the neighbour.
    """

    name: str
    claimed_epsilon: float
    delta: float
    bound: ThresholdBound
    inside: np.ndarray
    outside: np.ndarray

    @property
    def epsilon_lower_bound(self) -> float:
        return self.bound.epsilon

    @property
    def refuted(self) -> bool:
        return self.bound.epsilon > self.claimed_epsilon


def _generator(seeds: np.random.SeedSequence | None) -> tuple[NoiseGenerator, int]:
    if seeds is None:  # a private audit: OS entropy, as the algorithms use by default
        return NoiseGenerator(), int.from_bytes(
            np.random.SeedSequence().entropy.to_bytes(16, "little")[:8], "little"
        )
    noise_seed, sampler_seed = seeds.generate_state(2, dtype=np.uint64)
    return NoiseGenerator(int(noise_seed), reproducible=True), int(sampler_seed)


def audit(
    game: Game,
    trials: int,
    *,
    confidence: float = 0.95,
    seed: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> AuditResult:
    """Runs ``game`` ``trials`` times (half with the canary, half on the neighbour) and bounds epsilon.

    Every run gets fresh noise: from the operating system by default, or — with ``seed`` — a reproducible
    noise and sampler seed per run derived from it (``reproducible=True``; the audit is then replayable, and
    the runs are still independent). ``progress`` is called with the number of runs done.

    Args:
        game: the game to play, e.g. ``dpvr.audit.TARGETS["dp-gd"].make(epsilon, delta)``.
        trials: the number of runs (at least 4), half with the canary and half on the neighbour.
        confidence: the confidence of the lower bound, in (0, 1).
        seed: derives every run's noise and sampler seed (replayable audits); default fresh OS entropy.
        progress: called with the number of runs done.

    Returns:
        An :class:`AuditResult`: the claimed epsilon (the algorithm's own accountant) and the lower bound.

    Raises:
        ValueError: fewer than 4 trials, or a confidence outside (0, 1).

    Guarantee:
        ``epsilon_lower_bound`` is a lower bound on the true epsilon at ``delta`` with probability at least
        ``confidence`` (Clopper–Pearson on both error rates of a threshold chosen on the other half of the
        runs). A bound above the claim refutes it; a bound below it proves nothing about privacy.
    """
    if trials < 4:
        raise ValueError(f"trials: at least 4, got {trials}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    master = np.random.SeedSequence(seed) if seed is not None else None
    children = master.spawn(trials) if master is not None else [None] * trials
    scores: list[list[float]] = [[], []]
    claimed = 0.0
    for i in range(trials):
        side = i % 2
        generator, sampler_seed = _generator(children[i])
        score, spent = game.play(side, generator, sampler_seed, i < 2)
        scores[side].append(score)
        if spent is not None:
            claimed = max(claimed, spent)
        if progress is not None:
            progress(i + 1)
    inside, outside = np.array(scores[0]), np.array(scores[1])
    rng = np.random.default_rng(master.spawn(1)[0] if master is not None else None)
    bound = threshold_lower_bound(inside, outside, delta=game.delta, confidence=confidence, rng=rng)
    return AuditResult(game.name, claimed, game.delta, bound, inside, outside)


@dataclass(frozen=True)
class OneRunResult:
    """A one-run audit: ``guesses`` membership guesses on ``canaries`` canaries, ``correct`` of them right,
    and the pure-DP epsilon lower bound they imply at ``confidence``."""

    canaries: int
    guesses: int
    correct: int
    epsilon_lower_bound: float
    confidence: float


def one_run_audit(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    guesses: int,
    confidence: float = 0.95,
) -> OneRunResult:
    """The one-run audit's guessing step and bound (Steinke, Nasr and Jagielski, 2023).

    ``included[i]`` says whether canary ``i`` was in the training set — each must have been included
    independently with probability 1/2 *before* the run — and ``scores[i]`` is the score of canary ``i`` in
    the one released output (higher means "in"). The auditor guesses "in" for the ``guesses // 2`` highest
    scores and "out" for as many lowest, abstaining on the rest, and :func:`~dpvr.audit.bounds.
    one_run_lower_bound` turns the number of correct guesses into an epsilon lower bound.

    The bound is the theorem's pure epsilon-DP statement: it refutes an epsilon-DP claim at ``confidence``.
    For an (epsilon, delta) claim the theorem adds a delta-dependent failure probability that this function
    does not include, so a bound only slightly above such a claim is not a refutation.
    """
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError("scores and included: one value per canary")
    half = guesses // 2
    if half < 1 or 2 * half > len(scores):
        raise ValueError(f"guesses: between 2 and the number of canaries ({len(scores)}), got {guesses}")
    order = np.argsort(scores, kind="stable")
    correct = int(included[order[-half:]].sum() + (~included[order[:half]]).sum())
    bound = one_run_lower_bound(correct, 2 * half, confidence=confidence)
    return OneRunResult(len(scores), 2 * half, correct, bound, confidence)
