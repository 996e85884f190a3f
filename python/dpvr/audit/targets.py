"""The audit registry: one entry per ``dpvr audit ALGORITHM``.

Each entry builds a :class:`~dpvr.audit.games.Game` at a small configuration (tiny models, one to a few
steps) so that thousands of runs take seconds to minutes on two cores. ``algorithm`` lets a caller (the
tests) substitute a subclass — e.g. a deliberately broken variant — into the same game. An algorithm's games
are :data:`TARGETS` entries, named by its registry spec (``audit_games``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..objectives.divergences import KL
from ..ops import NoiseGenerator
from ..optim import (
    DIFF2,
    DPGD,
    DPSGD,
    DPSGDA,
    DoubleSpider,
    PhasedOutputPerturbation,
    PrivacyConfig,
    PrivateDiff,
    RecursiveSpider,
    RuntimeConfig,
)
from ..privacy import PaperSigmas
from ..privacy.calibration import calibrate
from .games import (
    AlgorithmGame,
    CanaryMinimax,
    CanaryOutputY,
    Game,
    canary_loss,
    descent_score,
    double_spider_releases,
    gaussian_score,
    input_canary_data,
    logistic_loss,
    logit_score,
    output_y_records,
    recursive_spider_releases,
    recursive_spider_step,
    released_score,
    round_releases,
    scalar_model,
    white_box_records,
)

DEFAULT_DELTA = (
    1e-2  # large enough that a few thousand runs can test the claim; the guarantee holds at every delta
)


@dataclass(frozen=True)
class Target:
    """``make(epsilon, delta, algorithm)`` builds the game; ``algorithm`` defaults to the real class."""

    name: str
    help: str
    make: Callable[..., Game]
    trials: int = 4000


FREE_SHARE = 0.01  # an unaudited stream's RDP budget, per unit of an audited stream's


def _configs(
    generator: NoiseGenerator, seed: int, delta: float, accountant: str, epsilon: float | None = None
) -> dict[str, Any]:
    """The ``privacy`` and ``runtime`` keywords of one run of a game: its noise source and sampler seed, the
    game's ``delta`` and accountant, and a budget ``epsilon`` only when probing the calibration."""
    return {
        "privacy": PrivacyConfig(epsilon=epsilon, delta=delta, accountant=accountant),
        "runtime": RuntimeConfig(generator=generator, sampler_seed=seed),
    }


def _calibrated(
    cls: type,
    build: Callable[..., Any],
    epsilon: float,
    delta: float,
    attribute: str = "noise",
    audited: Sequence[str] = (),
) -> dict[str, float]:
    """The noise the real algorithm calibrates for ``epsilon`` at this configuration (calibrated once), per
    stream: its noise multipliers (``attribute="noise"``) or the paper's sigmas (``"sigma"``).

    ``build(cls, generator, seed, epsilon=...)`` builds the algorithm with that budget (see :func:`_configs`).
    With ``audited`` streams the run's budget is split by the library's calibration with shares: each
    other stream gets ``FREE_SHARE`` of an audited stream's share, so that the whole run's epsilon (the
    claim an audit is compared with) is nearly that of the streams the canary is scored in. ``build`` then
    takes an ``accountant`` override and names its own as ``build.accountant``."""
    if audited:
        plan = build(cls, NoiseGenerator(), 0, epsilon=epsilon, accountant="rdp").plan  # RDP: a fast probe
        shares = {s: 1.0 if s in audited else FREE_SHARE for s in plan.streams}
        noise = calibrate(plan, epsilon, delta, shares=shares, accountant=build.accountant)
    else:
        probe = build(cls, NoiseGenerator(), 0, epsilon=epsilon)
        plan, noise = probe.plan, probe.noise
    return dict(noise) if attribute == "noise" else {s: plan.sigma(z, s) for s, z in noise.items()}


def _gradient_canary_game(
    name: str,
    cls: type,
    algorithm: type,
    epsilon: float,
    delta: float,
    noise: dict[str, float],
    *,
    neighbour: tuple[float, float] | None,
    accountant: str,
    **settings: Any,
) -> Game:
    """A DP-(S)GD game on 8 one-feature records: the canary (gradient ``+C e``, C = 1) against its mirror
    (``-C e``) or its removal (``neighbour=None``), lr 1, scored by how far the last iterate moved against
    ``e``; ``settings`` are the algorithm's own (steps, sampling, ...). The noise is ``noise_multiplier`` or
    what the real ``cls`` calibrates for ``epsilon``."""
    data = white_box_records(8, canary=(1.0, 0.0), neighbour=neighbour)

    def build(cls, generator, seed, side=0, epsilon=None, **options):
        x, y = data[side]
        return cls(
            scalar_model(), canary_loss, x, y, lr=1.0, clip=1.0, **settings,
            **_configs(generator, seed, delta, accountant, epsilon), **options,
        )  # fmt: skip

    z = noise.get("noise_multiplier") or _calibrated(cls, build, epsilon, delta)["gradient"]
    return AlgorithmGame(
        name, delta, lambda side, gen, seed: build(algorithm, gen, seed, side, noise=z), descent_score([1.0])
    )


def dp_gd(epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPGD, **noise: float) -> Game:
    """DP-GD, replace-one: the canary (gradient ``+C e``) vs its mirror (``-C e``), 8 records, 2 steps."""
    return _gradient_canary_game(
        "DP-GD", DPGD, algorithm, epsilon, delta, noise, neighbour=(-1.0, 0.0), accountant="pld", steps=2
    )


def dp_sgd(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPSGD, **noise: float
) -> Game:
    """DP-SGD, Poisson sampling (rate 1/2), add/remove: the canary in or removed, 8 records, 2 steps."""
    return _gradient_canary_game(
        "DP-SGD", DPSGD, algorithm, epsilon, delta, noise, neighbour=None, accountant="rdp", steps=2,
        batch_size=4,  # a public normaliser: the same without the canary
        sampling="poisson",
    )  # fmt: skip


def last_iterate(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPSGD, **noise: float
) -> Game:
    """Cyclic DP-SGD releasing only its last iterate (Kong & Ribero), replace-one: the canary (gradient
    ``+C e``) vs its mirror (``-C e``), 8 records in cyclic batches of 4, two passes. The losses are linear
    (0-weakly convex, 0-smooth), so the last-iterate bound applies at any step size; the score reads only the
    last iterate, the one release the bound covers."""
    return _gradient_canary_game(
        "last-iterate", DPSGD, algorithm, epsilon, delta, noise, neighbour=(-1.0, 0.0), accountant="rdp",
        steps=4, batch_size=4, sampling="cyclic", weak_convexity=0.0, smoothness=0.0,
    )  # fmt: skip


def _diff2(routine: str, epsilon: float, delta: float, algorithm: type, noise: dict[str, float]) -> Game:
    # The flip canary: w starts at -a; 190 drivers move it to about +a in the restart round (far more than
    # the noise), so the canary's |o| gradient flips from -G e to +G e and its same-sample difference in the
    # next round is 2 G e, clipped to the whole difference radius.
    n, drivers, lr = 200, 190, 1.0
    start = -0.5 * lr * drivers / n
    data = white_box_records(n, canary=(0.0, 1.0), neighbour=(0.0, -1.0), drivers=drivers)
    local = {"local_steps": 2, "local_batch": 20} if routine == "bvr-l-sgd" else {}
    clip = {"restart": 1.0, "difference": 1.0, **({"local": 1.0} if local else {})}
    steps = 2 if routine == "gd" else 1
    accountant = "pld" if routine == "gd" else "rdp"  # BVR-L-SGD is audited against its (looser) RDP claim

    def build(cls, generator, seed, side=0, epsilon=None, **options):
        return cls(
            scalar_model(start),
            canary_loss,
            [data[side]],
            lr=lr,
            steps=steps,
            restart=2,
            clip=clip,
            routine=routine,
            **_configs(generator, seed, delta, accountant, epsilon),
            **local,
            **options,
        )

    sigma = noise or _calibrated(DIFF2, build, epsilon, delta, "sigma")
    options = {"noise": PaperSigmas(sigma)}
    # GD: the white-box likelihood-ratio score over both rounds. BVR-L-SGD: one round (restart, then a local
    # difference step); the restart pushes the canary's side up along e, so the final iterate is the score.
    # The flip canary's clipped gradient points along -e at x_0 and its difference along +e.
    signs = {"restart": -1.0, "difference": 1.0}
    score = (
        gaussian_score(
            round_releases("restart", ("restart", "difference")),
            {s: signs[s] / sigma[s] ** 2 for s in signs},  # the same unit for both: n P sigma is z
        )
        if routine == "gd"
        else lambda trace, _: float(trace.params[-1][0] - trace.params[0][0])
    )
    name = "DIFF2-GD" if routine == "gd" else "DIFF2-BVR-L-SGD"
    return AlgorithmGame(
        name, delta, lambda side, gen, seed: build(algorithm, gen, seed, side, **options), score
    )


def diff2_gd(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DIFF2, **noise: float
) -> Game:
    """DIFF2-GD, 200 records, a restart round and a difference round, against the flip canary."""
    return _diff2("gd", epsilon, delta, algorithm, noise)


def diff2_bvr(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DIFF2, **noise: float
) -> Game:
    """DIFF2-BVR-L-SGD, one round: restart plus a local minibatch difference step."""
    return _diff2("bvr-l-sgd", epsilon, delta, algorithm, noise)


def dp_gd_input(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPGD, **noise: float
) -> Game:
    """End-to-end input-space canary: DP-GD logistic regression on 32 ordinary records plus an outlier
    input labelled 1 (neighbour: labelled 0); the score is the released model's logit on the outlier."""
    features, labels, canary = input_canary_data(32, 4, seed=0)
    sides = [
        (torch.cat([features, canary]), torch.cat([labels, torch.ones(1, 1, dtype=labels.dtype)])),
        (torch.cat([features, canary]), torch.cat([labels, torch.zeros(1, 1, dtype=labels.dtype)])),
    ]

    def build(cls, generator, seed, side=0, epsilon=None, **options):
        model = torch.nn.Linear(features.shape[1], 1).double()
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        x, y = sides[side]
        return cls(
            model,
            logistic_loss,
            x,
            y,
            lr=4.0,
            clip=1.0,
            steps=3,
            **_configs(generator, seed, delta, "pld", epsilon),
            **options,
        )

    z = noise.get("noise_multiplier") or _calibrated(DPGD, build, epsilon, delta)["gradient"]
    return AlgorithmGame(
        "DP-GD (input canary)",
        delta,
        lambda side, gen, seed: build(algorithm, gen, seed, side, noise=z),
        logit_score(canary),
    )


# ---- white-box canaries of the minimax and DRO algorithms ----------------------------------------------
# Each runs on the replace-one records of dp_gd (canary gradient +C e against its mirror -C e, 8 records,
# full batches) and scores the released x-moves projected on e: the canary's whole influence is in the x
# estimator; the other blocks (y, eta, lambda, s) are the same on both sides at the start.

_RECORDS = white_box_records(8, canary=(1.0, 0.0), neighbour=(-1.0, 0.0))


def _white_box_game(
    name: str,
    delta: float,
    real: type,
    algorithm: type,
    build: Callable[..., Any],
    epsilon: float,
    noise: dict[str, float],
    keywords: Callable[[dict[str, float]], dict[str, Any]],
    score: Callable[..., float],
    attribute: str = "noise",
    audited: Sequence[str] = (),
) -> Game:
    """A game on ``build(cls, generator, seed, side, **options)``: the noise is ``noise`` (per stream) or
    what ``real`` calibrates for ``epsilon`` (with the budget on the ``audited`` streams, see
    :func:`_calibrated`); ``keywords`` turns it into the constructor's options."""
    options = keywords(noise or _calibrated(real, build, epsilon, delta, attribute, audited))
    return AlgorithmGame(
        name, delta, lambda side, gen, seed: build(algorithm, gen, seed, side, **options), score
    )


def _as_noise(noise: dict[str, float]) -> dict[str, Any]:
    return {"noise": noise}


def _as_paper_sigmas(sigma: dict[str, float]) -> dict[str, Any]:
    return {"noise": PaperSigmas(sigma)}


def _builder(
    model: Callable[[], Any], loss: Any, records: tuple, delta: float, accountant: str, **config: Any
) -> Callable[..., Any]:
    """``build(algorithm, generator, seed, side=0, epsilon=None, accountant=..., **options)``: ``algorithm``
    on ``records[side]`` with a fresh ``model()``, ``config`` and ``options`` (which may override
    ``config``), accounted at ``delta`` (see :func:`_configs`); ``build.accountant`` is the configured
    accountant."""
    configured = accountant

    def build(algorithm, generator, seed, side=0, epsilon=None, accountant=configured, **options):
        x, y = records[side]
        settings = {**config, **options, **_configs(generator, seed, delta, accountant, epsilon)}
        return algorithm(model(), loss, x, y, **settings)

    build.accountant = configured
    return build


def _minimax(delta: float, records: tuple = _RECORDS, **config: Any) -> Callable[..., Any]:
    return _builder(
        scalar_model,
        CanaryMinimax(),
        records,
        lr=1.0,
        lr_y=1.0,
        batch_size=None,
        sampling="full",
        delta=delta,
        accountant="pld",
        **config,
    )


def dp_sgda(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPSGDA, **noise: float
) -> Game:
    """DP-SGDA, full batch, 2 steps; the canary's gradient is in x (noise per stream: ``x``, ``y``)."""
    build = _minimax(delta, steps=2, clip={"x": 1.0, "y": 1.0})
    return _white_box_game(
        "DP-SGDA", delta, DPSGDA, algorithm, build, epsilon, noise, _as_paper_sigmas, descent_score([1.0]),
        "sigma",
    )  # fmt: skip


def private_diff(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = PrivateDiff, **noise: float
) -> Game:
    """PrivateDiff, full batch, 2 checkpoint rounds (``restart=1``) of one y-ascent step and an x-step
    each (noise per stream: ``checkpoint``, ``y``). Its difference rounds: :func:`private_diff_difference`."""
    clip = {"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.0)}
    build = _minimax(delta, steps=2, restart=1, y_steps=1, clip=clip)
    return _white_box_game(
        "PrivateDiff",
        delta,
        PrivateDiff,
        algorithm,
        build,
        epsilon,
        noise,
        _as_paper_sigmas,
        descent_score([1.0]),
        "sigma",
    )


def private_diff_y_output(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = PrivateDiff, **noise: float
) -> Game:
    """PrivateDiff with ``y_release="output"``, one checkpoint round on 8 records of
    :class:`~dpvr.audit.games.CanaryOutputY`: the canary moves the inner maximiser by exactly its stated
    sensitivity ``2 / n`` (``y_tolerance`` is negligible) and nothing else, and the score is the released
    ``y`` (noise per stream: ``checkpoint``, ``y``; the x-stream, which the canary does not touch, takes a
    ``FREE_SHARE`` of the budget)."""
    build = _builder(
        scalar_model,
        CanaryOutputY(),
        output_y_records(8),
        lr=1.0,
        steps=1,
        restart=1,
        y_steps=2,
        y_release="output",
        y_tolerance=1e-9,
        batch_size=None,
        sampling="full",
        clip={"checkpoint": 1.0, "difference": (1.0, 0.0)},
        delta=delta,
        accountant="pld",
    )
    return _white_box_game(
        "PrivateDiff (y output)",
        delta,
        PrivateDiff,
        algorithm,
        build,
        epsilon,
        noise,
        _as_noise,
        lambda _, alg: float(alg.y[0]),
        audited=("y",),
    )


def _spider(
    delta: float,
    accountant: str,
    records: tuple = _RECORDS,
    weight: float = 0.0,
    lr: float = 1.0,
    **config: Any,
) -> Callable[..., Any]:
    return _builder(
        lambda: scalar_model(weight),
        canary_loss,
        records,
        batch_sizes=(len(records[0][0]),) * 4,
        lr=lr,
        delta=delta,
        accountant=accountant,
        **config,
    )


def double_spider(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DoubleSpider, **noise: float
) -> Game:
    """Double-SPIDER (KL), full batches, 2 refresh steps (``restart=1``). ``lam`` is large so the
    canary's dual weight ``exp((l - eta) / lam)`` stays near 1 and its clipped x-gradient at the full radius
    as x moves; ``max_move`` is out of reach, so the step is ``lr v`` (noise per stream: ``eta-refresh``,
    ``x-refresh``). Difference steps and eta: :func:`double_spider_difference`, :func:`double_spider_eta`."""
    build = _spider(
        delta,
        "pld",
        divergence=KL(),
        lam=1e5,
        steps=2,
        restart=1,
        lr_eta=1.0,
        max_move=1e9,
        clip={"eta-refresh": 1.0, "eta-difference": (1.0, 1.0), "x-refresh": 1.0, "x-difference": (1.0, 1.0)},
    )
    return _white_box_game(
        "Double-SPIDER",
        delta,
        DoubleSpider,
        algorithm,
        build,
        epsilon,
        noise,
        _as_noise,
        descent_score([1.0]),
    )


def recursive_spider(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = RecursiveSpider, **noise: float
) -> Game:
    """Recursive-SPIDER, one refresh step (full batches; ``s`` from one sampled record, RDP accounting).
    With ``lam = lam0 = 1`` and the loss cap ``B = 1`` the canary's weight ``exp(-1)`` leaves its clipped
    x-gradient at the full radius; the x-step is ``lr (lam / s') v`` with the released ``s``, so the score
    divides it out (noise per stream: ``v-refresh``, ``u-refresh``, ``s``). Difference steps, ``u`` and
    ``s``: :func:`recursive_spider_difference`, :func:`recursive_spider_u`, :func:`recursive_spider_s`."""
    build = _spider(
        delta,
        "rdp",
        rho=0.1,
        lam0=1.0,
        lam_init=1.0,
        steps=1,
        restart=1,
        lr_lam=1.0,
        beta=1.0,
        loss_bound=1.0,
        clip={"v-refresh": 1.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1.0},
    )
    return _white_box_game(
        "Recursive-SPIDER",
        delta,
        RecursiveSpider,
        algorithm,
        build,
        epsilon,
        noise,
        _as_noise,
        descent_score([1.0], recursive_spider_step(1.0)),
    )


# ---- difference steps and the DRO dual variables -----------------------------------------------------
# Two steps, full batches: a refresh, then a difference step. The difference canary of dpvr.audit.games
# (the |o| record at w = 0, 190 drivers that move w to about +0.95 lr C in the refresh, far beyond its
# noise) adds nothing to the refresh and a same-sample difference clipped to the whole radius to the
# difference step. The score reads the audited streams' releases back from the run (gaussian_score). The
# claim is the whole run's epsilon, every stream together; the unaudited streams' noise is calibrated to a
# FREE_SHARE of the budget each, so that the claim is nearly the audited streams' own.

_DRIVEN = white_box_records(200, canary=(0.0, 1.0), neighbour=(0.0, -1.0), drivers=190)


def private_diff_difference(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = PrivateDiff, **noise: float
) -> Game:
    """PrivateDiff, a checkpoint round and a difference round (``restart=2``, one y-step each), the
    difference canary in round 2's x-difference (noise per stream: ``checkpoint``, ``difference``, ``y``;
    the y-gradients are public). The radius ``C2 ||x_2 - x_1||`` is released in the step's information."""
    build = _minimax(
        delta,
        records=_DRIVEN,
        steps=2,
        restart=2,
        y_steps=1,
        clip={"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.0)},
    )
    score = gaussian_score(round_releases("checkpoint", ("checkpoint", "difference")), {"difference": 1.0})
    return _white_box_game(
        "PrivateDiff (difference)",
        delta,
        PrivateDiff,
        algorithm,
        build,
        epsilon,
        noise,
        _as_paper_sigmas,
        score,
        "sigma",
        audited=("difference",),
    )


def double_spider_difference(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DoubleSpider, **noise: float
) -> Game:
    """Double-SPIDER (KL), the difference canary in the second step's x-difference. As in
    :func:`double_spider`, ``lam`` is large (the canary's dual weight stays near 1, and its loss moves the
    eta-difference by about 1% of that radius) and the step is ``lr v``; the x-difference radius is
    ``||x_1 - x_0||`` (``clip["x-difference"] = (1e-3, 1)``: eta's move is negligible)."""
    build = _spider(
        delta,
        "pld",
        records=_DRIVEN,
        divergence=KL(),
        lam=1e5,
        steps=2,
        restart=2,
        lr_eta=1.0,
        max_move=1e9,
        clip={
            "eta-refresh": 1.0, "eta-difference": (1.0, 1.0), "x-refresh": 1.0, "x-difference": (1e-3, 1.0),
        },  # fmt: skip
    )
    return _white_box_game(
        "Double-SPIDER (x-difference)",
        delta,
        DoubleSpider,
        algorithm,
        build,
        epsilon,
        noise,
        _as_noise,
        gaussian_score(double_spider_releases(0.0), {"x-difference": 1.0}),
        audited=("x-difference",),
    )


_LINEAR = white_box_records(200, canary=(-1.0, 0.0), neighbour=(1.0, 0.0), drivers=190)


def double_spider_eta(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DoubleSpider, **noise: float
) -> Game:
    """Double-SPIDER (KL, ``lam = 1``), a loss-value canary in both eta streams: the linear record with loss
    ``-G w`` (neighbour: ``+G w``) from ``w = -0.005``. Its eta-term ``1 - exp(l - eta)`` is ``1 - e^5``
    against ``1 - e^-5`` at the refresh, clipped to ``-C1`` against ``+C1`` (``C1 = 0.5``); the drivers then
    move ``w`` to about ``+0.005``, where the terms change places, so the same-sample difference is clipped
    to ``+`` against ``-`` the whole radius (``100 ||x_1 - x_0|| ~ 0.95``; ``lr_eta`` is small, so eta's move
    and the refresh's leak through it are negligible). Both eta releases are scored with equal weights (the
    default calibration gives them the same noise). The canary's x-gradient also leaks, at full
    sensitivity, into the x-streams, which take a ``FREE_SHARE`` each and are not scored."""
    build = _spider(
        delta,
        "pld",
        records=_LINEAR,
        weight=-0.005,
        lr=0.01,
        divergence=KL(),
        lam=1.0,
        steps=2,
        restart=2,
        lr_eta=0.01,
        max_move=1e9,
        clip={
            "eta-refresh": 0.5, "eta-difference": (1.0, 100.0), "x-refresh": 1.0, "x-difference": (1.0, 1.0),
        },  # fmt: skip
    )
    return _white_box_game(
        "Double-SPIDER (eta)",
        delta,
        DoubleSpider,
        algorithm,
        build,
        epsilon,
        noise,
        _as_noise,
        gaussian_score(double_spider_releases(0.0), {"eta-refresh": -1.0, "eta-difference": 1.0}),
        audited=("eta-refresh", "eta-difference"),
    )


def _recursive_spider_driven(delta: float, lr: float, bound: float, clip: float) -> Callable[..., Any]:
    """Recursive-SPIDER on the driven records, ``lam = 1`` (``lam0 = 0.5``, ``lr_lam = 1e-5``: lambda
    moves by about 1e-5, never onto ``lam0``) and ``s`` public in effect: ``beta = 1``, ``C5 = 1e-6`` and
    ``s_floor = 1`` make ``s' = 1`` whatever ``s``'s noise, so the step is ``lr v``. The difference radii are
    ``clip`` times the move, about ``0.95 lr clip``. The v- and u-streams are full-batch."""
    return _spider(
        delta,
        "rdp",  # s samples one record: PLD has no sampling without replacement
        records=_DRIVEN,
        lr=lr,
        rho=0.1,
        lam0=0.5,
        lam_init=1.0,
        steps=2,
        restart=2,
        lr_lam=1e-5,
        beta=1.0,
        loss_bound=bound,
        clip={"v-refresh": 1.0, "v-difference": clip, "u-refresh": 1.0, "u-difference": clip, "s": 1e-6},
        s0=1.0,
        s_floor=1.0,
    )


def recursive_spider_difference(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = RecursiveSpider, **noise: float
) -> Game:
    """Recursive-SPIDER, the difference canary in the second step's v-difference. With the loss cap
    ``B = 1`` and ``|w_1| ~ 5e-4`` the canary's loss ``+-G |w_1| ~ +-0.5`` stays below the cap on both
    sides, so its x-gradient ``exp((l - B) / lam) (+-G)`` is clipped to ``+-`` the radius (``s`` is sampled
    from the 200 records: RDP accounting, the slow part of a run)."""
    return _white_box_game(
        "Recursive-SPIDER (v-difference)",
        delta,
        RecursiveSpider,
        algorithm,
        _recursive_spider_driven(delta, lr=5e-4, bound=1.0, clip=200.0),
        epsilon,
        noise,
        _as_noise,
        gaussian_score(recursive_spider_releases(1.0), {"v-difference": 1.0}),
        audited=("v-difference",),
    )


def recursive_spider_u(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = RecursiveSpider, **noise: float
) -> Game:
    """Recursive-SPIDER, the difference canary in the second step's u-difference (lambda's gradient
    estimator). The canary's term ``t e^-t / lam``, ``t = (B - min(l, B)) / lam``, is ``0.129`` at ``w = 0``
    (``B = 0.15``) on both sides; at ``w_1 ~ 8.5e-4`` it is 0 (loss ``+0.85`` above the cap) against
    about ``e^-1`` (loss ``-0.85``, ``t ~ 1``), so the difference, ``-0.129`` against ``+0.24``, is clipped
    to ``-+`` the radius ``~ 0.085``."""
    return _white_box_game(
        "Recursive-SPIDER (u-difference)",
        delta,
        RecursiveSpider,
        algorithm,
        _recursive_spider_driven(delta, lr=9e-4, bound=0.15, clip=100.0),
        epsilon,
        noise,
        _as_noise,
        gaussian_score(recursive_spider_releases(1.0), {"u-difference": -1.0}),
        audited=("u-difference",),
    )


_ALONE = white_box_records(1, canary=(0.0, 1.0), neighbour=(0.0, -1.0))


def recursive_spider_s(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = RecursiveSpider, **noise: float
) -> Game:
    """Recursive-SPIDER, one step on the canary alone (``n = 1``: every stream full-batch, PLD accounting)
    from ``w = 1``, where the ``|o|`` record's loss ``+-G`` is far above the cap ``B = 1`` or far below it:
    its inner value ``g = exp((min(l, B) - B) / lam)`` is 1 against ``exp(-1001) = 0``, while its x- and
    lambda-gradients vanish on both sides. Only ``s`` carries the canary (``beta = 1``: ``s = clip_{C5}(g)
    + noise``, ``C5`` against 0: the whole replace-one sensitivity ``(2 - beta) C5``); the score is the
    released ``s``."""
    build = _spider(
        delta,
        "pld",
        records=_ALONE,
        weight=1.0,
        rho=0.1,
        lam0=1.0,
        lam_init=1.0,
        steps=1,
        restart=1,
        lr_lam=1.0,
        beta=1.0,
        loss_bound=1.0,
        clip={"v-refresh": 1.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1.0},
    )
    return _white_box_game(
        "Recursive-SPIDER (s)",
        delta,
        RecursiveSpider,
        algorithm,
        build,
        epsilon,
        noise,
        _as_noise,
        released_score("s"),
        audited=("s",),
    )


@dataclass
class PhasedGame:
    """Phased output perturbation (setting ``sc``) on logistic regression with ridge ``l2 = 1``: 16 records,
    the canary ``e`` labelled +1 against labelled -1, the rest zero features; the score is the released x."""

    epsilon: float
    delta: float
    algorithm: type = PhasedOutputPerturbation
    name: str = "phased (sc)"

    def play(
        self, side: int, generator: NoiseGenerator, seed: int, account: bool
    ) -> tuple[float, float | None]:
        from ..objectives.phased_problems import LogisticRegression

        features = np.zeros((16, 1))
        features[0, 0] = 1.0
        labels = np.ones(16)
        labels[0] = 1.0 if side == 0 else -1.0
        run = self.algorithm(
            "sc",
            privacy=PrivacyConfig(epsilon=self.epsilon, delta=self.delta),
            runtime=RuntimeConfig(generator=generator, sampler_seed=seed),
        )
        result = run.run(LogisticRegression(features, labels, l2=1.0))
        return float(result.x[0]), float(result.spent_epsilon()) if account else None


def phased(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = PhasedOutputPerturbation
) -> Game:
    return PhasedGame(epsilon, delta, algorithm)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("dp-sgd", "DP-SGD (Poisson, add/remove), white-box gradient canary", dp_sgd, trials=2000),
        Target("dp-gd", "DP-GD (replace-one), white-box gradient canary", dp_gd),
        Target("dp-gd-input", "DP-GD logistic regression, input-space canary (end to end)", dp_gd_input),
        Target("last-iterate", "cyclic DP-SGD, white-box canary, only the last iterate scored", last_iterate),
        Target("diff2-gd", "DIFF2-GD, flip canary through a restart and a difference round", diff2_gd),
        Target(
            "diff2-bvr-l-sgd", "DIFF2-BVR-L-SGD, restart plus a local difference step", diff2_bvr, trials=1000
        ),
        Target("phased", "phased output perturbation (sc), logistic regression", phased, trials=2000),
        Target("dp-sgda", "DP-SGDA, white-box gradient canary in x", dp_sgda),
        Target(
            "private-diff", "PrivateDiff, white-box gradient canary in x (checkpoint rounds)", private_diff
        ),
        Target("double-spider", "Double-SPIDER (KL-DRO), white-box gradient canary in x", double_spider),
        Target(
            "recursive-spider",
            "Recursive-SPIDER (KL-DRO), white-box gradient canary in x",
            recursive_spider,
            trials=1000,  # the sampled s-stream's RDP accounting, recorded every run, is the slow part
        ),
        Target(
            "private-diff-difference",
            "PrivateDiff, difference canary in a difference round's x-release",
            private_diff_difference,
        ),
        Target(
            "private-diff-y-output",
            "PrivateDiff with y by output perturbation, canary in the inner maximiser",
            private_diff_y_output,
        ),
        Target(
            "double-spider-difference",
            "Double-SPIDER (KL-DRO), difference canary in the x-difference step",
            double_spider_difference,
        ),
        Target(
            "double-spider-eta",
            "Double-SPIDER (KL-DRO), loss-value canary in the dual eta's refresh and difference",
            double_spider_eta,
        ),
        Target(
            "recursive-spider-difference",
            "Recursive-SPIDER (KL-DRO), difference canary in the v-difference step",
            recursive_spider_difference,
            trials=1000,
        ),
        Target(
            "recursive-spider-u",
            "Recursive-SPIDER (KL-DRO), difference canary in lambda's u-difference step",
            recursive_spider_u,
            trials=1000,
        ),
        Target(
            "recursive-spider-s",
            "Recursive-SPIDER (KL-DRO), inner-value canary in the s (STORM) release",
            recursive_spider_s,
        ),
    )
}
