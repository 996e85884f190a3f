"""PrivateDiff's audit games (``private-diff``, ``private-diff-difference``, ``private-diff-y-output``): each
a canary on two neighbouring datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds
them)."""

from __future__ import annotations

from ...audit.games import (
    CanaryMinimax,
    CanaryOutputY,
    gaussian_score,
    output_y_records,
    round_releases,
)
from ...audit.targets import (
    DRIVEN,
    MINIMAX,
    MIRRORED,
    CanaryGame,
    builder,
    games,
)
from .algorithm import PrivateDiff

GAMES = games(
    # Two checkpoint rounds (restart=1) of one y-ascent step and an x-step each.
    CanaryGame(
        "private-diff", "PrivateDiff", "PrivateDiff, white-box gradient canary in x (checkpoint rounds)",
        PrivateDiff, MIRRORED,
        {**MINIMAX, "steps": 2, "restart": 1, "y_steps": 1,
         "clip": {"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.0)}},
        loss=CanaryMinimax(), noise_form="sigmas",
    ),
    # Two steps, full batches: a refresh, then a difference step, on the difference canary unless said. The
    # score reads the audited streams' releases back from the run (gaussian_score, weighed by the canary's
    # sign). The claim is the whole run's epsilon, every stream together; the unaudited streams' noise takes a
    # FREE_SHARE of the budget each, so that the claim is nearly the audited streams' own.
    #
    # A checkpoint round and a difference round (restart=2, one y-step each), the canary in round 2's
    # x-difference; the y-gradients are public. The radius C2 ||x_2 - x_1|| is released in the step's info.
    CanaryGame(
        "private-diff-difference", "PrivateDiff (difference)",
        "PrivateDiff, difference canary in a difference round's x-release", PrivateDiff, DRIVEN,
        {**MINIMAX, "steps": 2, "restart": 2, "y_steps": 1,
         "clip": {"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.0)}},
        loss=CanaryMinimax(),
        score=gaussian_score(round_releases("checkpoint", ("checkpoint", "difference")), {"difference": 1.0}),
        noise_form="sigmas", audited=("difference",),
    ),
    # y by output perturbation, one checkpoint round on 8 records of CanaryOutputY: the canary moves the inner
    # maximiser by exactly its stated sensitivity 2 / n (y_tolerance is negligible) and nothing else; the
    # score is the released y. The x-stream, which the canary does not touch, takes a FREE_SHARE.
    CanaryGame(
        "private-diff-y-output", "PrivateDiff (y output)",
        "PrivateDiff with y by output perturbation, canary in the inner maximiser", PrivateDiff,
        output_y_records(8),
        {"lr": 1.0, "steps": 1, "restart": 1, "y_steps": 2, "y_release": "output", "y_tolerance": 1e-9,
         "batch_size": None, "sampling": "full", "clip": {"checkpoint": 1.0, "difference": (1.0, 0.0)}},
        loss=CanaryOutputY(), score=lambda _, alg: float(alg.y[0]), audited=("y",),
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
private_diff = builder(GAMES["private-diff"])
private_diff_difference = builder(GAMES["private-diff-difference"])
private_diff_y_output = builder(GAMES["private-diff-y-output"])
