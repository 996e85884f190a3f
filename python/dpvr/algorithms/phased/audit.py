"""Phased output perturbation's audit games (``phased``): each a canary on two neighbouring
datasets, scored from what the run released (:mod:`dpvr.audit.targets` builds them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...audit.games import (
    Game,
)
from ...audit.targets import (
    DEFAULT_DELTA,
    Target,
    games,
)
from ...objectives.phased_problems import LogisticRegression
from ...ops import NoiseGenerator
from ...optim import PrivacyConfig, RuntimeConfig
from .algorithm import PhasedOutputPerturbation


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


GAMES = games(
    Target("phased", "phased output perturbation (sc), logistic regression", phased, trials=2000),
)
