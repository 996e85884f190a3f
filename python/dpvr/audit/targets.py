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

from ..ops import NoiseGenerator
from ..optim import DIFF2, DPGD, DPSGD, PhasedOutputPerturbation
from .games import (
    AlgorithmGame,
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


def _calibrated(cls: type, build: Callable[..., Any], epsilon: float, delta: float) -> dict[str, float]:
    """The noise the real algorithm calibrates for ``epsilon`` at this configuration (calibrated once)."""
    algorithm = build(cls, NoiseGenerator(), 0, epsilon=epsilon)
    return dict(algorithm.noise if cls is not DIFF2 else algorithm.sigma)


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

    sigma = noise or _calibrated(DIFF2, build, epsilon, delta)
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
    )
}
