"""DP-GD's audit games (``dp-gd``, ``dp-gd-input``): each a canary on two neighbouring
datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds them)."""

from __future__ import annotations

import torch

from ...audit.games import (
    logistic_loss,
    logit_score,
)
from ...audit.targets import (
    INPUT,
    INPUT_CANARY,
    MIRRORED,
    CanaryGame,
    builder,
    games,
)
from .algorithm import DPGD


def _logistic_model() -> torch.nn.Module:
    model = torch.nn.Linear(INPUT_CANARY.shape[1], 1).double()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    return model


GAMES = games(
    CanaryGame(
        "dp-gd", "DP-GD", "DP-GD (replace-one), white-box gradient canary", DPGD, MIRRORED,
        {"lr": 1.0, "clip": 1.0, "steps": 2}, noise_form="multiplier",
    ),
    # End to end: logistic regression on 32 ordinary records plus an outlier input labelled 1 (neighbour:
    # labelled 0); the score is the released model's logit on the outlier.
    CanaryGame(
        "dp-gd-input", "DP-GD (input canary)", "DP-GD logistic regression, input-space canary (end to end)",
        DPGD, INPUT, {"lr": 4.0, "clip": 1.0, "steps": 3},
        model=_logistic_model, loss=logistic_loss, score=logit_score(INPUT_CANARY), noise_form="multiplier",
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
dp_gd = builder(GAMES["dp-gd"])
dp_gd_input = builder(GAMES["dp-gd-input"])
