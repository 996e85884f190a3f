"""The audit registry: one entry per ``dpvr audit GAME``, each a row of one table.

Every game but one runs a :class:`~dpvr.optim.PrivateAlgorithm` on two neighbouring datasets and scores what
it released, so a game is data: a :class:`CanaryGame` row names the real algorithm class, the two sides' data
(model and loss), the constructor's settings and accountant, the form of its noise, the streams the canary is
scored in (``audited``), the score and the number of trials; :meth:`CanaryGame.make` is the one builder that
turns a row into a :class:`~dpvr.audit.games.AlgorithmGame`. A row's noise is given per stream or calibrated
once, by the real class, for the claimed epsilon; ``algorithm`` lets a caller (the tests) substitute a
subclass — e.g. a deliberately broken variant — into the same game. The configurations are small (tiny
models, one to a few steps) so that thousands of runs take seconds to minutes on two cores.

Phased output perturbation runs a whole solver on a problem, not steps on records, so its row is a plain
:class:`Target` around a builder of its own (:class:`PhasedGame`). :data:`GAMES` holds the other rows,
:data:`TABLE` every game's :class:`Target` and :data:`TARGETS` the same by name; an algorithm's games are
named by its registry spec (``audit_games``). Each builder keeps a Python name (``dp_gd``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any, Literal

import numpy as np
import torch

from ..objectives.divergences import KL
from ..objectives.phased_problems import LogisticRegression
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
    Trace,
    canary_loss,
    descent_score,
    double_spider_releases,
    gaussian_score,
    input_canary_records,
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
FREE_SHARE = 0.01  # an unaudited stream's RDP budget, per unit of an audited stream's

Score = Callable[[Trace, Any], float]
Data = tuple[tuple[Any, ...], tuple[Any, ...]]  # each side's positional data arguments (side 0: canary in)


@dataclass(frozen=True)
class Target:
    """``make(epsilon, delta, algorithm)`` builds the game; ``algorithm`` defaults to the real class."""

    name: str
    help: str
    make: Callable[..., Game]
    trials: int = 4000


@dataclass(frozen=True)
class CanaryGame:
    """A row: ``algorithm(model(), loss, *data[side], **settings, noise=...)`` accounted by ``accountant``,
    scored by ``score`` (or by ``noise_score(noise)``, a score weighed by the game's noise). ``noise_form`` is
    how the constructor takes the noise: noise multipliers per stream, the paper's sigmas per stream
    (:class:`~dpvr.privacy.PaperSigmas`), or a one-stream algorithm's multiplier as one number (a number and
    a one-entry mapping seed the noise differently). ``title`` names the game in an audit's results."""

    name: str
    title: str
    help: str
    algorithm: type  # the real class: it calibrates the noise, and plays unless a caller substitutes one
    data: Data
    settings: Mapping[str, Any]
    accountant: str = "pld"
    model: Callable[[], torch.nn.Module] = scalar_model
    loss: Any = canary_loss
    score: Score = descent_score([1.0])
    noise_score: Callable[[Mapping[str, float]], Score] | None = None
    noise_form: Literal["multipliers", "sigmas", "multiplier"] = "multipliers"
    audited: tuple[str, ...] = ()
    trials: int = 4000
    public_dataset_size: int | None = None

    def _build(
        self,
        algorithm: type,
        delta: float,
        generator: NoiseGenerator,
        seed: int | None,
        side: int = 0,
        epsilon: float | None = None,
        accountant: str | None = None,
        **options: Any,
    ) -> Any:
        """One run on ``side`` with a fresh model; a budget ``epsilon`` only when probing the calibration
        (with the ``"rdp"`` accountant: a fast probe)."""
        return algorithm(
            self.model(), self.loss, *self.data[side], **self.settings, **options,
            privacy=PrivacyConfig(epsilon=epsilon, delta=delta, accountant=accountant or self.accountant,
                                  public_dataset_size=self.public_dataset_size),
            runtime=RuntimeConfig(generator=generator, sampler_seed=seed),
        )  # fmt: skip

    def calibrated(self, epsilon: float, delta: float) -> dict[str, float]:
        """The noise the real algorithm calibrates for ``epsilon`` at this configuration, per stream.

        With ``audited`` streams the budget is split by the library's calibration with shares: each other
        stream gets ``FREE_SHARE`` of an audited stream's share, so that the whole run's epsilon (the claim an
        audit is compared with) is nearly that of the streams the canary is scored in."""
        # a probe releases nothing: private noise and sampling (a fixed sampler seed needs a reproducible run)
        probe = partial(self._build, self.algorithm, delta, NoiseGenerator(), None, epsilon=epsilon)
        if self.audited:
            plan = probe(accountant="rdp").plan
            shares = {s: 1.0 if s in self.audited else FREE_SHARE for s in plan.streams}
            noise = calibrate(plan, epsilon, delta, shares=shares, accountant=self.accountant)
        else:
            built = probe()
            plan, noise = built.plan, built.noise
        return {s: plan.sigma(z, s) for s, z in noise.items()} if self.noise_form == "sigmas" else dict(noise)

    def make(
        self,
        epsilon: float = 2.0,
        delta: float = DEFAULT_DELTA,
        algorithm: type | None = None,
        **noise: float,
    ) -> Game:
        """The game with ``noise`` per stream (a one-stream game's as ``noise_multiplier=z``), else the noise
        calibrated for ``epsilon``."""
        noise = noise or self.calibrated(epsilon, delta)
        given: Any = noise
        if self.noise_form == "sigmas":
            given = PaperSigmas(noise)
        elif self.noise_form == "multiplier":
            (given,) = noise.values()
        player = algorithm or self.algorithm
        return AlgorithmGame(
            self.title,
            delta,
            lambda side, gen, seed: self._build(player, delta, gen, seed, side, noise=given),
            self.noise_score(noise) if self.noise_score else self.score,
        )

    @property
    def target(self) -> Target:
        return Target(self.name, self.help, self.make, self.trials)


# ---- the two sides' data -----------------------------------------------------------------------------
# White-box records (see dpvr.audit.games): the canary's gradient +C e (C = 1) against its mirror -C e, or
# removed (add/remove).
_MIRRORED = white_box_records(8, canary=(1.0, 0.0), neighbour=(-1.0, 0.0))
_REMOVED = white_box_records(8, canary=(1.0, 0.0), neighbour=None)
# The difference canary (the |o| record at w = 0) and 190 drivers that move w to about +0.95 lr C in a
# refresh, far beyond its noise: it adds nothing to the refresh and a same-sample difference clipped to the
# whole radius to the next difference step.
_DRIVEN = white_box_records(200, canary=(0.0, 1.0), neighbour=(0.0, -1.0), drivers=190)
# DIFF2's flip canary: the same records with w started at -a (a = 0.475), which the drivers move to about +a
# in the restart round, so the canary's gradient flips from -G e to +G e and its difference is 2 G e.
# DIFF2 takes a list of clients' shards: here one.
_FLIP = tuple(([side],) for side in _DRIVEN)
_FLIP_START = -0.5 * 190 / 200
_LINEAR = white_box_records(200, canary=(-1.0, 0.0), neighbour=(1.0, 0.0), drivers=190)
_ALONE = white_box_records(1, canary=(0.0, 1.0), neighbour=(0.0, -1.0))
_INPUT, _INPUT_CANARY = input_canary_records(32, 4, seed=0)


def _logistic_model() -> torch.nn.Module:
    model = torch.nn.Linear(_INPUT_CANARY.shape[1], 1).double()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    return model


def _full_batches(data: Data) -> dict[str, Any]:
    """The SPIDERs' four estimators, each over every record."""
    return {"batch_sizes": (len(data[0][0]),) * 4}


def _diff2_gd_score(sigma: Mapping[str, float]) -> Score:
    """The white-box likelihood-ratio score over both rounds: the flip canary's clipped gradient points
    along -e at x_0 and its difference along +e, each over its sigma squared (the same unit for both: n P
    sigma is z)."""
    signs = {"restart": -1.0, "difference": 1.0}
    releases = round_releases("restart", ("restart", "difference"))
    return gaussian_score(releases, {s: sign / sigma[s] ** 2 for s, sign in signs.items()})


_SPIDER_CLIP = {"v-refresh": 1.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1.0}
_MINIMAX = {"lr": 1.0, "lr_y": 1.0, "batch_size": None, "sampling": "full"}
# Double-SPIDER (KL): max_move is out of reach, so the x-step is lr v.
_DOUBLE_SPIDER = {"divergence": KL(), "steps": 2, "max_move": 1e9}
_RECURSIVE_SPIDER = {"rho": 0.1, "lam_init": 1.0, "beta": 1.0}


def _driven_recursive_spider(lr: float, bound: float, clip: float) -> dict[str, Any]:
    """Recursive-SPIDER on the driven records, ``lam = 1`` (``lam0 = 0.5``, ``lr_lam = 1e-5``: lambda
    moves by about 1e-5, never onto ``lam0``) and ``s`` public in effect: ``beta = 1``, ``C5 = 1e-6`` and
    ``s_floor = 1`` make ``s' = 1`` whatever ``s``'s noise, so the step is ``lr v``. The difference radii are
    ``clip`` times the move, about ``0.95 lr clip``. The v- and u-streams are full-batch; ``s`` samples one
    record, which PLD does not account for (without replacement): RDP."""
    return {
        **_full_batches(_DRIVEN), **_RECURSIVE_SPIDER, "lr": lr, "lam0": 0.5, "steps": 2, "restart": 2,
        "lr_lam": 1e-5, "loss_bound": bound, "s0": 1.0, "s_floor": 1.0,
        "clip": {**_SPIDER_CLIP, "v-difference": clip, "u-difference": clip, "s": 1e-6},
    }  # fmt: skip


GAMES: tuple[CanaryGame, ...] = (
    # ---- DP-(S)GD: 8 one-feature records, lr 1, scored by how far the last iterate moved against e --------
    CanaryGame(
        "dp-sgd", "DP-SGD", "DP-SGD (Poisson, add/remove), white-box gradient canary", DPSGD, _REMOVED,
        # Poisson sampling at rate 1/2 of the public size 8 (the canary's side's): the rate, the calibrated
        # noise and the normaliser are the same on the side without the canary, whose size is private.
        {"lr": 1.0, "clip": 1.0, "steps": 2, "batch_size": 4, "sampling": "poisson"},
        accountant="rdp", noise_form="multiplier", trials=2000, public_dataset_size=len(_REMOVED[0][0]),
    ),
    CanaryGame(
        "dp-gd", "DP-GD", "DP-GD (replace-one), white-box gradient canary", DPGD, _MIRRORED,
        {"lr": 1.0, "clip": 1.0, "steps": 2}, noise_form="multiplier",
    ),
    # End to end: logistic regression on 32 ordinary records plus an outlier input labelled 1 (neighbour:
    # labelled 0); the score is the released model's logit on the outlier.
    CanaryGame(
        "dp-gd-input", "DP-GD (input canary)", "DP-GD logistic regression, input-space canary (end to end)",
        DPGD, _INPUT, {"lr": 4.0, "clip": 1.0, "steps": 3},
        model=_logistic_model, loss=logistic_loss, score=logit_score(_INPUT_CANARY), noise_form="multiplier",
    ),
    # Cyclic DP-SGD releasing only its last iterate (Kong & Ribero): batches of 4, two passes. The losses are
    # linear (0-weakly convex, 0-smooth), so the last-iterate bound applies at any step size; the score reads
    # only the last iterate, the one release the bound covers.
    CanaryGame(
        "last-iterate", "last-iterate", "cyclic DP-SGD, white-box canary, only the last iterate scored",
        DPSGD, _MIRRORED,
        {"lr": 1.0, "clip": 1.0, "steps": 4, "batch_size": 4, "sampling": "cyclic", "weak_convexity": 0.0,
         "smoothness": 0.0},
        accountant="rdp", noise_form="multiplier",
    ),
    # ---- DIFF2 on the flip canary ------------------------------------------------------------------------
    CanaryGame(
        "diff2-gd", "DIFF2-GD", "DIFF2-GD, flip canary through a restart and a difference round", DIFF2,
        _FLIP,
        {"lr": 1.0, "steps": 2, "restart": 2, "clip": {"restart": 1.0, "difference": 1.0}, "routine": "gd"},
        model=partial(scalar_model, _FLIP_START), noise_score=_diff2_gd_score, noise_form="sigmas",
    ),
    # One round: the restart, then a local minibatch difference step. The restart pushes the canary's side
    # up along e, so the final iterate is the score. Audited against its (looser) RDP claim.
    CanaryGame(
        "diff2-bvr-l-sgd", "DIFF2-BVR-L-SGD", "DIFF2-BVR-L-SGD, restart plus a local difference step", DIFF2,
        _FLIP,
        {"lr": 1.0, "steps": 1, "restart": 2, "clip": {"restart": 1.0, "difference": 1.0, "local": 1.0},
         "routine": "bvr-l-sgd", "local_steps": 2, "local_batch": 20},
        accountant="rdp", model=partial(scalar_model, _FLIP_START), score=descent_score([-1.0]),
        noise_form="sigmas", trials=1000,
    ),
    # ---- white-box canaries of the minimax and DRO algorithms -------------------------------------------
    # On the mirrored records, full batches, scored by the released x-moves projected on e: the canary's whole
    # influence is in the x estimator; the other blocks (y, eta, lambda, s) are the same on both sides at the
    # start. A caller's noise is per stream of the run (DP-SGDA's x and y, PrivateDiff's checkpoint and y).
    CanaryGame(
        "dp-sgda", "DP-SGDA", "DP-SGDA, white-box gradient canary in x", DPSGDA, _MIRRORED,
        {**_MINIMAX, "steps": 2, "clip": {"x": 1.0, "y": 1.0}},
        loss=CanaryMinimax(), noise_form="sigmas",
    ),
    # Two checkpoint rounds (restart=1) of one y-ascent step and an x-step each.
    CanaryGame(
        "private-diff", "PrivateDiff", "PrivateDiff, white-box gradient canary in x (checkpoint rounds)",
        PrivateDiff, _MIRRORED,
        {**_MINIMAX, "steps": 2, "restart": 1, "y_steps": 1,
         "clip": {"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.0)}},
        loss=CanaryMinimax(), noise_form="sigmas",
    ),
    # Two refresh steps (restart=1). lam is large so the canary's dual weight exp((l - eta) / lam) stays near
    # 1 and its clipped x-gradient at the full radius as x moves.
    CanaryGame(
        "double-spider", "Double-SPIDER", "Double-SPIDER (KL-DRO), white-box gradient canary in x",
        DoubleSpider, _MIRRORED,
        {**_full_batches(_MIRRORED), **_DOUBLE_SPIDER, "lr": 1.0, "lam": 1e5, "restart": 1, "lr_eta": 1.0,
         "clip": {"eta-refresh": 1.0, "eta-difference": (1.0, 1.0), "x-refresh": 1.0,
                  "x-difference": (1.0, 1.0)}},
    ),
    # One refresh step (s from one sampled record: RDP). With lam = lam0 = 1 and the loss cap B = 1 the
    # canary's weight exp(-1) leaves its clipped x-gradient at the full radius; the x-step is lr (lam / s') v
    # with the released s, so the score divides it out.
    CanaryGame(
        "recursive-spider", "Recursive-SPIDER", "Recursive-SPIDER (KL-DRO), white-box gradient canary in x",
        RecursiveSpider, _MIRRORED,
        {**_full_batches(_MIRRORED), **_RECURSIVE_SPIDER, "lr": 1.0, "lam0": 1.0, "steps": 1, "restart": 1,
         "lr_lam": 1.0, "loss_bound": 1.0, "clip": _SPIDER_CLIP},
        accountant="rdp", score=descent_score([1.0], recursive_spider_step(1.0)),
        trials=1000,  # the sampled s-stream's RDP accounting, recorded every run, is the slow part
    ),
    # ---- difference steps and the DRO dual variables ----------------------------------------------------
    # Two steps, full batches: a refresh, then a difference step, on the difference canary unless said. The
    # score reads the audited streams' releases back from the run (gaussian_score, weighed by the canary's
    # sign). The claim is the whole run's epsilon, every stream together; the unaudited streams' noise takes a
    # FREE_SHARE of the budget each, so that the claim is nearly the audited streams' own.
    #
    # A checkpoint round and a difference round (restart=2, one y-step each), the canary in round 2's
    # x-difference; the y-gradients are public. The radius C2 ||x_2 - x_1|| is released in the step's info.
    CanaryGame(
        "private-diff-difference", "PrivateDiff (difference)",
        "PrivateDiff, difference canary in a difference round's x-release", PrivateDiff, _DRIVEN,
        {**_MINIMAX, "steps": 2, "restart": 2, "y_steps": 1,
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
    # The canary in the second step's x-difference. As in double-spider, lam is large (the canary's dual
    # weight stays near 1, and its loss moves the eta-difference by about 1% of that radius); the x-difference
    # radius is ||x_1 - x_0|| (clip (1e-3, 1): eta's move is negligible).
    CanaryGame(
        "double-spider-difference", "Double-SPIDER (x-difference)",
        "Double-SPIDER (KL-DRO), difference canary in the x-difference step", DoubleSpider, _DRIVEN,
        {**_full_batches(_DRIVEN), **_DOUBLE_SPIDER, "lr": 1.0, "lam": 1e5, "restart": 2, "lr_eta": 1.0,
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
        _LINEAR,
        {**_full_batches(_LINEAR), **_DOUBLE_SPIDER, "lr": 0.01, "lam": 1.0, "restart": 2, "lr_eta": 0.01,
         "clip": {"eta-refresh": 0.5, "eta-difference": (1.0, 100.0), "x-refresh": 1.0,
                  "x-difference": (1.0, 1.0)}},
        model=partial(scalar_model, -0.005),
        score=gaussian_score(double_spider_releases(0.0), {"eta-refresh": -1.0, "eta-difference": 1.0}),
        audited=("eta-refresh", "eta-difference"),
    ),
    # The canary in the second step's v-difference. With the loss cap B = 1 and |w_1| ~ 5e-4 the canary's
    # loss +-G |w_1| ~ +-0.5 stays below the cap on both sides, so its x-gradient exp((l - B) / lam) (+-G) is
    # clipped to +- the radius.
    CanaryGame(
        "recursive-spider-difference", "Recursive-SPIDER (v-difference)",
        "Recursive-SPIDER (KL-DRO), difference canary in the v-difference step", RecursiveSpider, _DRIVEN,
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
        _DRIVEN,
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
        "Recursive-SPIDER (KL-DRO), inner-value canary in the s (STORM) release", RecursiveSpider, _ALONE,
        {**_full_batches(_ALONE), **_RECURSIVE_SPIDER, "lr": 1.0, "lam0": 1.0, "steps": 1, "restart": 1,
         "lr_lam": 1.0, "loss_bound": 1.0, "clip": _SPIDER_CLIP},
        model=partial(scalar_model, 1.0), score=released_score("s"), audited=("s",),
    ),
)  # fmt: skip


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


TABLE: tuple[Target, ...] = (
    *(game.target for game in GAMES),
    Target("phased", "phased output perturbation (sc), logistic regression", phased, trials=2000),
)
TARGETS: dict[str, Target] = {target.name: target for target in TABLE}


def _builder(name: str) -> Callable[..., Game]:
    """``TARGETS[name].make`` as a function named after the game (as test ids and tracebacks show it)."""
    make = TARGETS[name].make

    @wraps(make)
    def builder(*args: Any, **kwargs: Any) -> Game:
        return make(*args, **kwargs)

    builder.__name__ = builder.__qualname__ = name.replace("-", "_")
    return builder


# Each game's builder by its Python name: ``make(epsilon, delta, algorithm, **noise)``.
dp_sgd = _builder("dp-sgd")
dp_gd = _builder("dp-gd")
dp_gd_input = _builder("dp-gd-input")
last_iterate = _builder("last-iterate")
diff2_gd = _builder("diff2-gd")
diff2_bvr = _builder("diff2-bvr-l-sgd")
dp_sgda = _builder("dp-sgda")
private_diff = _builder("private-diff")
double_spider = _builder("double-spider")
recursive_spider = _builder("recursive-spider")
private_diff_difference = _builder("private-diff-difference")
private_diff_y_output = _builder("private-diff-y-output")
double_spider_difference = _builder("double-spider-difference")
double_spider_eta = _builder("double-spider-eta")
recursive_spider_difference = _builder("recursive-spider-difference")
recursive_spider_u = _builder("recursive-spider-u")
recursive_spider_s = _builder("recursive-spider-s")
