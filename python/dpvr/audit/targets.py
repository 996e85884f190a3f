"""The audit registry: one entry per ``dpvr audit ALGORITHM``.

Each entry builds a :class:`~dpvr.audit.games.Game` at a small configuration (tiny models, one to a few
steps) so that thousands of runs take seconds to minutes on two cores. ``algorithm`` lets a caller (the
tests) substitute a subclass — e.g. a deliberately broken variant — into the same game. Adding an algorithm
is one :data:`TARGETS` entry.
"""

from __future__ import annotations

from collections.abc import Callable
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
    PrivateDiff,
    RecursiveSpider,
)
from .games import (
    AlgorithmGame,
    CanaryMinimax,
    Game,
    canary_loss,
    descent_score,
    diff2_score,
    input_canary_data,
    logistic_loss,
    logit_score,
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


def _calibrated(
    cls: type, build: Callable[..., Any], epsilon: float, delta: float, attribute: str = "noise"
) -> dict[str, float]:
    """The noise the real algorithm calibrates for ``epsilon`` at this configuration (calibrated once), per
    stream: its noise multipliers (``attribute="noise"``) or the paper's sigmas (``"sigma"``)."""
    algorithm = build(cls, NoiseGenerator(), 0, epsilon=epsilon)
    return dict(getattr(algorithm, attribute))


def dp_gd(epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPGD, **noise: float) -> Game:
    """DP-GD, replace-one: the canary (gradient ``+C e``) vs its mirror (``-C e``), 8 records, 2 steps."""
    data = white_box_records(8, canary=(1.0, 0.0), neighbour=(-1.0, 0.0))

    def build(cls, generator, seed, side=0, **options):
        x, y = data[side]
        return cls(
            scalar_model(),
            canary_loss,
            x,
            y,
            lr=1.0,
            clip=1.0,
            steps=2,
            delta=delta,
            accountant="pld",
            generator=generator,
            sampler_seed=seed,
            **options,
        )

    z = noise.get("noise_multiplier") or _calibrated(DPGD, build, epsilon, delta)["gradient"]
    return AlgorithmGame(
        "DP-GD",
        delta,
        lambda side, gen, seed: build(algorithm, gen, seed, side, noise_multiplier=z),
        descent_score([1.0]),
    )


def dp_sgd(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPSGD, **noise: float
) -> Game:
    """DP-SGD, Poisson sampling (rate 1/2), add/remove: the canary in or removed, 8 records, 2 steps."""
    data = white_box_records(8, canary=(1.0, 0.0), neighbour=None)

    def build(cls, generator, seed, side=0, **options):
        x, y = data[side]
        return cls(
            scalar_model(),
            canary_loss,
            x,
            y,
            lr=1.0,
            clip=1.0,
            steps=2,
            batch_size=len(x) // 2,
            sampling="poisson",
            delta=delta,
            accountant="rdp",
            generator=generator,
            sampler_seed=seed,
            **options,
        )

    z = noise.get("noise_multiplier") or _calibrated(DPSGD, build, epsilon, delta)["gradient"]
    return AlgorithmGame(
        "DP-SGD",
        delta,
        lambda side, gen, seed: build(algorithm, gen, seed, side, noise_multiplier=z),
        descent_score([1.0]),
    )


def _diff2(routine: str, epsilon: float, delta: float, algorithm: type, noise: dict[str, float]) -> Game:
    # The flip canary: w starts at -a; 190 drivers move it to about +a in the restart round (far more than
    # the noise), so the canary's |o| gradient flips from -G e to +G e and its same-sample difference in the
    # next round is 2 G e, clipped to the whole difference radius.
    n, drivers, lr = 200, 190, 1.0
    start = -0.5 * lr * drivers / n
    data = white_box_records(n, canary=(0.0, 1.0), neighbour=(0.0, -1.0), drivers=drivers)
    local = {"local_steps": 2, "local_batch": 20, "clip3": 1.0} if routine == "bvr-l-sgd" else {}
    rounds = 2 if routine == "gd" else 1
    accountant = "pld" if routine == "gd" else "rdp"  # PLD has no sampling-without-replacement event

    def build(cls, generator, seed, side=0, **options):
        return cls(
            scalar_model(start),
            canary_loss,
            [data[side]],
            lr=lr,
            rounds=rounds,
            restart=2,
            clip1=1.0,
            clip2=1.0,
            routine=routine,
            delta=delta,
            accountant=accountant,
            generator=generator,
            sampler_seed=seed,
            **local,
            **options,
        )

    sigma = noise or _calibrated(DIFF2, build, epsilon, delta, "sigma")
    options = {
        f"sigma{i}": sigma[s] for i, s in ((1, "restart"), (2, "difference"), (3, "local")) if s in sigma
    }
    # GD: the white-box likelihood-ratio score over both rounds. BVR-L-SGD: one round (restart, then a local
    # difference step); the restart pushes the canary's side up along e, so the final iterate is the score.
    score = (
        diff2_score(n)
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

    def build(cls, generator, seed, side=0, **options):
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
            delta=delta,
            accountant="pld",
            generator=generator,
            sampler_seed=seed,
            **options,
        )

    z = noise.get("noise_multiplier") or _calibrated(DPGD, build, epsilon, delta)["gradient"]
    return AlgorithmGame(
        "DP-GD (input canary)",
        delta,
        lambda side, gen, seed: build(algorithm, gen, seed, side, noise_multiplier=z),
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
) -> Game:
    """A game on ``build(cls, generator, seed, side, **options)``: the noise is ``noise`` (per stream) or
    what ``real`` calibrates for ``epsilon``; ``keywords`` turns it into the constructor's options."""
    options = keywords(noise or _calibrated(real, build, epsilon, delta, attribute))
    return AlgorithmGame(
        name, delta, lambda side, gen, seed: build(algorithm, gen, seed, side, **options), score
    )


def _minimax(cls: type, delta: float, **config: Any) -> Callable[..., Any]:
    def build(algorithm, generator, seed, side=0, **options):
        x, y = _RECORDS[side]
        return algorithm(
            scalar_model(),
            CanaryMinimax(),
            x,
            y,
            lr=1.0,
            lr_y=1.0,
            batch_size=None,
            sampling="full",
            delta=delta,
            accountant="pld",
            generator=generator,
            sampler_seed=seed,
            **config,
            **options,
        )

    return build


def dp_sgda(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DPSGDA, **noise: float
) -> Game:
    """DP-SGDA, full batch, 2 steps; the canary's gradient is in x (noise per stream: ``x``, ``y``)."""
    build = _minimax(DPSGDA, delta, steps=2, clip_x=1.0, clip_y=1.0)
    names = {"x": "sigma_x", "y": "sigma_y"}
    keywords = lambda sigma: {names[s]: v for s, v in sigma.items()}  # noqa: E731
    return _white_box_game(
        "DP-SGDA", delta, DPSGDA, algorithm, build, epsilon, noise, keywords, descent_score([1.0]), "sigma"
    )


def private_diff(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = PrivateDiff, **noise: float
) -> Game:
    """PrivateDiff, full batch, 2 checkpoint rounds (``restart=1``) of one y-ascent step and an x-step
    each (noise per stream: ``checkpoint``, ``y``). Its difference rounds are not audited here."""
    build = _minimax(
        PrivateDiff, delta, rounds=2, restart=1, y_steps=1, clip0=1.0, clip1=1.0, clip2=1.0, clip3=0.0
    )
    names = {"checkpoint": "sigma_x1", "difference": "sigma_x2", "y": "sigma_y"}
    keywords = lambda sigma: {names[s]: v for s, v in sigma.items()}  # noqa: E731
    return _white_box_game(
        "PrivateDiff",
        delta,
        PrivateDiff,
        algorithm,
        build,
        epsilon,
        noise,
        keywords,
        descent_score([1.0]),
        "sigma",
    )


def _spider(cls: type, delta: float, accountant: str, **config: Any) -> Callable[..., Any]:
    def build(algorithm, generator, seed, side=0, **options):
        x, y = _RECORDS[side]
        return algorithm(
            scalar_model(),
            canary_loss,
            x,
            y,
            batch_sizes=(len(x),) * 4,
            lr=1.0,
            delta=delta,
            accountant=accountant,
            generator=generator,
            sampler_seed=seed,
            **config,
            **options,
        )

    return build


def double_spider(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = DoubleSpider, **noise: float
) -> Game:
    """Double-SPIDER (KL), full batches, 2 refresh steps (``epoch_size=1``). ``lam`` is large so the
    canary's dual weight ``exp((l - eta) / lam)`` stays near 1 and its clipped x-gradient at the full radius
    as x moves; ``max_move`` is out of reach, so the step is ``lr v`` (noise per stream: ``eta-refresh``,
    ``x-refresh``). Its difference steps are not audited here."""
    build = _spider(
        DoubleSpider,
        delta,
        "pld",
        divergence=KL(),
        lam=1e5,
        steps=2,
        epoch_size=1,
        lr_eta=1.0,
        max_move=1e9,
        clip1=1.0,
        clip2=(1.0, 1.0),
        clip3=1.0,
        clip4=(1.0, 1.0),
    )
    return _white_box_game(
        "Double-SPIDER",
        delta,
        DoubleSpider,
        algorithm,
        build,
        epsilon,
        noise,
        lambda z: {"noise": z},
        descent_score([1.0]),
    )


def recursive_spider(
    epsilon: float = 2.0, delta: float = DEFAULT_DELTA, algorithm: type = RecursiveSpider, **noise: float
) -> Game:
    """Recursive-SPIDER, one refresh step (full batches; ``s`` from one sampled record, RDP accounting).
    With ``lam = lam0 = 1`` and the loss cap ``B = 1`` the canary's weight ``exp(-1)`` leaves its clipped
    x-gradient at the full radius; the x-step is ``lr (lam / s') v`` with the released ``s``, so the score
    divides it out (noise per stream: ``v-refresh``, ``u-refresh``, ``s``). Difference steps not audited."""
    build = _spider(
        RecursiveSpider,
        delta,
        "rdp",
        rho=0.1,
        lam0=1.0,
        lam_init=1.0,
        steps=1,
        epoch_size=1,
        lr_lam=1.0,
        beta=1.0,
        loss_bound=1.0,
        clip1=1.0,
        clip2=1.0,
        clip3=1.0,
        clip4=1.0,
    )
    step = lambda info, alg: alg.lr * alg.lam0 / max(info["s"], alg.s_floor)  # noqa: E731
    return _white_box_game(
        "Recursive-SPIDER",
        delta,
        RecursiveSpider,
        algorithm,
        build,
        epsilon,
        noise,
        lambda z: {"noise": z},
        descent_score([1.0], step),
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
        run = self.algorithm("sc", epsilon=self.epsilon, delta=self.delta, generator=generator, seed=seed)
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
    )
}
