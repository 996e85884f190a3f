"""Recursive-SPIDER's audit games (``recursive-spider``, ``recursive-spider-difference``,
``recursive-spider-u``, ``recursive-spider-s``): each a canary on two neighbouring datasets, scored from what
the run released (:mod:`dpvr.audit.targets` builds them)."""

from __future__ import annotations

from functools import partial
from typing import Any

from ...audit.games import (
    descent_score,
    gaussian_score,
    recursive_spider_releases,
    recursive_spider_step,
    released_score,
    scalar_model,
)
from ...audit.targets import (
    ALONE,
    DRIVEN,
    MIRRORED,
    CanaryGame,
    builder,
    full_batches,
    games,
)
from .algorithm import RecursiveSpider

_SPIDER_CLIP = {"v-refresh": 1.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1.0}


_RECURSIVE_SPIDER = {"rho": 0.1, "lam_init": 1.0, "beta": 1.0}


def _driven_recursive_spider(lr: float, bound: float, clip: float) -> dict[str, Any]:
    """Recursive-SPIDER on the driven records, ``lam = 1`` (``lam0 = 0.5``, ``lr_lam = 1e-5``: lambda
    moves by about 1e-5, never onto ``lam0``) and ``s`` public in effect: ``beta = 1``, ``C5 = 1e-6`` and
    ``s_floor = 1`` make ``s' = 1`` whatever ``s``'s noise, so the step is ``lr v``. The difference radii are
    ``clip`` times the move, about ``0.95 lr clip``. The v- and u-streams are full-batch; ``s`` samples one
    record, which PLD does not account for (without replacement): RDP."""
    return {
        **full_batches(DRIVEN), **_RECURSIVE_SPIDER, "lr": lr, "lam0": 0.5, "steps": 2, "restart": 2,
        "lr_lam": 1e-5, "loss_bound": bound, "s0": 1.0, "s_floor": 1.0,
        "clip": {**_SPIDER_CLIP, "v-difference": clip, "u-difference": clip, "s": 1e-6},
    }  # fmt: skip


GAMES = games(
    # One refresh step (s from one sampled record: RDP). With lam = lam0 = 1 and the loss cap B = 1 the
    # canary's weight exp(-1) leaves its clipped x-gradient at the full radius; the x-step is lr (lam / s') v
    # with the released s, so the score divides it out.
    CanaryGame(
        "recursive-spider", "Recursive-SPIDER", "Recursive-SPIDER (KL-DRO), white-box gradient canary in x",
        RecursiveSpider, MIRRORED,
        {**full_batches(MIRRORED), **_RECURSIVE_SPIDER, "lr": 1.0, "lam0": 1.0, "steps": 1, "restart": 1,
         "lr_lam": 1.0, "loss_bound": 1.0, "clip": _SPIDER_CLIP},
        accountant="rdp", score=descent_score([1.0], recursive_spider_step(1.0)),
        trials=1000,  # the sampled s-stream's RDP accounting, recorded every run, is the slow part
    ),
    # The canary in the second step's v-difference. With the loss cap B = 1 and |w_1| ~ 5e-4 the canary's
    # loss +-G |w_1| ~ +-0.5 stays below the cap on both sides, so its x-gradient exp((l - B) / lam) (+-G) is
    # clipped to +- the radius.
    CanaryGame(
        "recursive-spider-difference", "Recursive-SPIDER (v-difference)",
        "Recursive-SPIDER (KL-DRO), difference canary in the v-difference step", RecursiveSpider, DRIVEN,
        _driven_recursive_spider(lr=5e-4, bound=1.0, clip=200.0),
        accountant="rdp", score=gaussian_score(recursive_spider_releases(1.0), {"v-difference": 1.0}),
        audited=("v-difference",), trials=1000,
    ),
    # The canary in the second step's u-difference (lambda's gradient estimator). Its term t e^-t / lam,
    # t = (B - min(l, B)) / lam, is 0.129 at w = 0 (B = 0.15) on both sides; at w_1 ~ 8.5e-4 it is 0 (loss
    # +0.85 above the cap) against about e^-1 (loss -0.85, t ~ 1), so the difference, -0.129 against +0.24,
    # is clipped to -+ the radius ~ 0.085.
    CanaryGame(
        "recursive-spider-u", "Recursive-SPIDER (u-difference)",
        "Recursive-SPIDER (KL-DRO), difference canary in lambda's u-difference step", RecursiveSpider,
        DRIVEN,
        _driven_recursive_spider(lr=9e-4, bound=0.15, clip=100.0),
        accountant="rdp", score=gaussian_score(recursive_spider_releases(1.0), {"u-difference": -1.0}),
        audited=("u-difference",), trials=1000,
    ),
    # One step on the canary alone (n = 1: every stream full-batch, PLD) from w = 1, where the |o| record's
    # loss +-G is far above the cap B = 1 or far below it: its inner value g = exp((min(l, B) - B) / lam) is 1
    # against exp(-1001) = 0, while its x- and lambda-gradients vanish on both sides. Only s carries the
    # canary (beta = 1: s = clip_C5(g) + noise, C5 against 0: the whole replace-one sensitivity
    # (2 - beta) C5); the score is the released s.
    CanaryGame(
        "recursive-spider-s", "Recursive-SPIDER (s)",
        "Recursive-SPIDER (KL-DRO), inner-value canary in the s (STORM) release", RecursiveSpider, ALONE,
        {**full_batches(ALONE), **_RECURSIVE_SPIDER, "lr": 1.0, "lam0": 1.0, "steps": 1, "restart": 1,
         "lr_lam": 1.0, "loss_bound": 1.0, "clip": _SPIDER_CLIP},
        model=partial(scalar_model, 1.0), score=released_score("s"), audited=("s",),
    ),
)  # fmt: skip

# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
recursive_spider = builder(GAMES["recursive-spider"])
recursive_spider_difference = builder(GAMES["recursive-spider-difference"])
recursive_spider_u = builder(GAMES["recursive-spider-u"])
recursive_spider_s = builder(GAMES["recursive-spider-s"])
