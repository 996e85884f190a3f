"""DP-SGDA's audit games (``dp-sgda``): each a canary on two neighbouring
datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds them)."""

from __future__ import annotations

from ...audit.games import (
    CanaryMinimax,
)
from ...audit.targets import (
    MINIMAX,
    MIRRORED,
    CanaryGame,
    builder,
    games,
)
from .algorithm import DPSGDA

GAMES = games(
    # On the mirrored records, full batches, scored by the released x-moves projected on e: the canary's whole
    # influence is in the x estimator; the other blocks (y, eta, lambda, s) are the same on both sides at the
    # start. A caller's noise is per stream of the run (DP-SGDA's x and y, PrivateDiff's checkpoint and y).
    CanaryGame(
        "dp-sgda", "DP-SGDA", "DP-SGDA, white-box gradient canary in x", DPSGDA, MIRRORED,
        {**MINIMAX, "steps": 2, "clip": {"x": 1.0, "y": 1.0}},
        loss=CanaryMinimax(), noise_form="sigmas",
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
dp_sgda = builder(GAMES["dp-sgda"])
