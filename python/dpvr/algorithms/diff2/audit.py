"""DIFF2's audit games (``diff2-gd``, ``diff2-bvr-l-sgd``): each a canary on two neighbouring
datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds them)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from ...audit.games import (
    descent_score,
    gaussian_score,
    round_releases,
    scalar_model,
)
from ...audit.targets import (
    FLIP,
    FLIP_START,
    CanaryGame,
    Score,
    builder,
    games,
)
from .algorithm import DIFF2


def _diff2_gd_score(sigma: Mapping[str, float]) -> Score:
    """The white-box likelihood-ratio score over both rounds: the flip canary's clipped gradient points
    along -e at x_0 and its difference along +e, each over its sigma squared (the same unit for both: n P
    sigma is z)."""
    signs = {"restart": -1.0, "difference": 1.0}
    releases = round_releases("restart", ("restart", "difference"))
    return gaussian_score(releases, {s: sign / sigma[s] ** 2 for s, sign in signs.items()})


GAMES = games(
    CanaryGame(
        "diff2-gd", "DIFF2-GD", "DIFF2-GD, flip canary through a restart and a difference round", DIFF2,
        FLIP,
        {"lr": 1.0, "steps": 2, "restart": 2, "clip": {"restart": 1.0, "difference": 1.0}, "routine": "gd"},
        model=partial(scalar_model, FLIP_START), noise_score=_diff2_gd_score, noise_form="sigmas",
    ),
    # One round: the restart, then a local minibatch difference step. The restart pushes the canary's side
    # up along e, so the final iterate is the score. Audited against its (looser) RDP claim.
    CanaryGame(
        "diff2-bvr-l-sgd", "DIFF2-BVR-L-SGD", "DIFF2-BVR-L-SGD, restart plus a local difference step", DIFF2,
        FLIP,
        {"lr": 1.0, "steps": 1, "restart": 2, "clip": {"restart": 1.0, "difference": 1.0, "local": 1.0},
         "routine": "bvr-l-sgd", "local_steps": 2, "local_batch": 20},
        accountant="rdp", model=partial(scalar_model, FLIP_START), score=descent_score([-1.0]),
        noise_form="sigmas", trials=1000,
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
diff2_gd = builder(GAMES["diff2-gd"])
diff2_bvr = builder(GAMES["diff2-bvr-l-sgd"])
