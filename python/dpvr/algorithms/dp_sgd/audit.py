"""DP-SGD's audit games (``dp-sgd``): each a canary on two neighbouring
datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds them)."""

from __future__ import annotations

from ...audit.targets import (
    REMOVED,
    CanaryGame,
    builder,
    games,
)
from .algorithm import DPSGD

GAMES = games(
    CanaryGame(
        "dp-sgd", "DP-SGD", "DP-SGD (Poisson, add/remove), white-box gradient canary", DPSGD, REMOVED,
        # Poisson sampling at rate 1/2 of the public size 8 (the canary's side's): the rate, the calibrated
        # noise and the normaliser are the same on the side without the canary, whose size is private.
        {"lr": 1.0, "clip": 1.0, "steps": 2, "batch_size": 4, "sampling": "poisson"},
        accountant="rdp", noise_form="multiplier", trials=2000, public_dataset_size=len(REMOVED[0][0]),
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
dp_sgd = builder(GAMES["dp-sgd"])
