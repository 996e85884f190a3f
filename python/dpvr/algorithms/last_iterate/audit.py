"""Last-iterate DP-SGD's audit games (``last-iterate``): each a canary on two neighbouring
datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds them)."""

from __future__ import annotations

from ...audit.targets import (
    MIRRORED,
    CanaryGame,
    builder,
    games,
)
from ..dp_sgd.algorithm import DPSGD

GAMES = games(
    # Cyclic DP-SGD releasing only its last iterate (Kong & Ribero): batches of 4, two passes. The losses are
    # linear (0-weakly convex, 0-smooth), so the last-iterate bound applies at any step size; the score reads
    # only the last iterate, the one release the bound covers.
    CanaryGame(
        "last-iterate", "last-iterate", "cyclic DP-SGD, white-box canary, only the last iterate scored",
        DPSGD, MIRRORED,
        {"lr": 1.0, "clip": 1.0, "steps": 4, "batch_size": 4, "sampling": "cyclic", "weak_convexity": 0.0,
         "smoothness": 0.0},
        accountant="rdp", noise_form="multiplier",
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
last_iterate = builder(GAMES["last-iterate"])
