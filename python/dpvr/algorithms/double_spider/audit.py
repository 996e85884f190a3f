"""Double-SPIDER's audit games (``double-spider``, ``double-spider-difference``, ``double-spider-eta``): each
a canary on two neighbouring datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds
them)."""

from __future__ import annotations

from functools import partial

from ...audit.games import (
    double_spider_releases,
    gaussian_score,
    scalar_model,
)
from ...audit.targets import (
    DRIVEN,
    LINEAR,
    MIRRORED,
    CanaryGame,
    builder,
    full_batches,
    games,
)
from ...objectives.divergences import KL
from .algorithm import DoubleSpider

# Double-SPIDER (KL): max_move is out of reach, so the x-step is lr v.
_DOUBLE_SPIDER = {"divergence": KL(), "steps": 2, "max_move": 1e9}


GAMES = games(
    # Two refresh steps (restart=1). lam is large so the canary's dual weight exp((l - eta) / lam) stays near
    # 1 and its clipped x-gradient at the full radius as x moves.
    CanaryGame(
        "double-spider", "Double-SPIDER", "Double-SPIDER (KL-DRO), white-box gradient canary in x",
        DoubleSpider, MIRRORED,
        {**full_batches(MIRRORED), **_DOUBLE_SPIDER, "lr": 1.0, "lam": 1e5, "restart": 1, "lr_eta": 1.0,
         "clip": {"eta-refresh": 1.0, "eta-difference": (1.0, 1.0), "x-refresh": 1.0,
                  "x-difference": (1.0, 1.0)}},
    ),
    # The canary in the second step's x-difference. As in double-spider, lam is large (the canary's dual
    # weight stays near 1, and its loss moves the eta-difference by about 1% of that radius); the x-difference
    # radius is ||x_1 - x_0|| (clip (1e-3, 1): eta's move is negligible).
    CanaryGame(
        "double-spider-difference", "Double-SPIDER (x-difference)",
        "Double-SPIDER (KL-DRO), difference canary in the x-difference step", DoubleSpider, DRIVEN,
        {**full_batches(DRIVEN), **_DOUBLE_SPIDER, "lr": 1.0, "lam": 1e5, "restart": 2, "lr_eta": 1.0,
         "clip": {"eta-refresh": 1.0, "eta-difference": (1.0, 1.0), "x-refresh": 1.0,
                  "x-difference": (1e-3, 1.0)}},
        score=gaussian_score(double_spider_releases(0.0), {"x-difference": 1.0}), audited=("x-difference",),
    ),
    # lam = 1, a loss-value canary in both eta streams: the linear record with loss -G w (neighbour: +G w)
    # from w = -0.005. Its eta-term 1 - exp(l - eta) is 1 - e^5 against 1 - e^-5 at the refresh, clipped to
    # -C1 against +C1 (C1 = 0.5); the drivers then move w to about +0.005, where the terms change places, so
    # the same-sample difference is clipped to + against - the whole radius (100 ||x_1 - x_0|| ~ 0.95; lr_eta
    # is small, so eta's move and the refresh's leak through it are negligible). Both eta releases are scored
    # with equal weights (the default calibration gives them the same noise). The canary's x-gradient also
    # leaks, at full sensitivity, into the x-streams, which take a FREE_SHARE each and are not scored.
    CanaryGame(
        "double-spider-eta", "Double-SPIDER (eta)",
        "Double-SPIDER (KL-DRO), loss-value canary in the dual eta's refresh and difference", DoubleSpider,
        LINEAR,
        {**full_batches(LINEAR), **_DOUBLE_SPIDER, "lr": 0.01, "lam": 1.0, "restart": 2, "lr_eta": 0.01,
         "clip": {"eta-refresh": 0.5, "eta-difference": (1.0, 100.0), "x-refresh": 1.0,
                  "x-difference": (1.0, 1.0)}},
        model=partial(scalar_model, -0.005),
        score=gaussian_score(double_spider_releases(0.0), {"eta-refresh": -1.0, "eta-difference": 1.0}),
        audited=("eta-refresh", "eta-difference"),
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
double_spider = builder(GAMES["double-spider"])
double_spider_difference = builder(GAMES["double-spider-difference"])
double_spider_eta = builder(GAMES["double-spider-eta"])
