"""What an audit game is made of: a row (:class:`CanaryGame`) per ``dpvr audit GAME``, and the canaries'
data the algorithms' games share.

Every game but one runs a :class:`~dpvr.optim.PrivateAlgorithm` on two neighbouring datasets and scores what
it released, so a game is data: a :class:`CanaryGame` row names the real algorithm class, the two sides' data
(model and loss), the constructor's settings and accountant, the form of its noise, the streams the canary is
scored in (``audited``), the score and the number of trials; :meth:`CanaryGame.make` is the one builder that
turns a row into a :class:`~dpvr.audit.games.AlgorithmGame`. A row's noise is given per stream or calibrated
once, by the real class, for the claimed epsilon; ``algorithm`` lets a caller (the tests) substitute a
subclass — e.g. a deliberately broken variant — into the same game. The configurations are small (tiny
models, one to a few steps) so that thousands of runs take seconds to minutes on two cores.

The rows live in each algorithm's home (``dpvr.algorithms.<name>.audit``, its ``GAMES``, built by
:func:`games`), named by its registry entry (``audit_games``); :func:`dpvr.registry.audit_targets` gathers
them. Phased output perturbation runs a whole solver on a problem, not steps on records, so its game is a
plain :class:`Target` around a builder of its own. Each builder keeps a Python name (:func:`builder`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any, Literal

import torch

from ..ops import NoiseGenerator
from ..optim import (
    PrivacyConfig,
    RuntimeConfig,
)
from ..privacy import PaperSigmas
from ..privacy.calibration import calibrate
from .games import (
    AlgorithmGame,
    Game,
    Trace,
    canary_loss,
    descent_score,
    input_canary_records,
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
MIRRORED = white_box_records(8, canary=(1.0, 0.0), neighbour=(-1.0, 0.0))
REMOVED = white_box_records(8, canary=(1.0, 0.0), neighbour=None)
# The difference canary (the |o| record at w = 0) and 190 drivers that move w to about +0.95 lr C in a
# refresh, far beyond its noise: it adds nothing to the refresh and a same-sample difference clipped to the
# whole radius to the next difference step.
DRIVEN = white_box_records(200, canary=(0.0, 1.0), neighbour=(0.0, -1.0), drivers=190)
# DIFF2's flip canary: the same records with w started at -a (a = 0.475), which the drivers move to about +a
# in the restart round, so the canary's gradient flips from -G e to +G e and its difference is 2 G e.
# DIFF2 takes a list of clients' shards: here one.
FLIP = tuple(([side],) for side in DRIVEN)
FLIP_START = -0.5 * 190 / 200
LINEAR = white_box_records(200, canary=(-1.0, 0.0), neighbour=(1.0, 0.0), drivers=190)
ALONE = white_box_records(1, canary=(0.0, 1.0), neighbour=(0.0, -1.0))
INPUT, INPUT_CANARY = input_canary_records(32, 4, seed=0)




def full_batches(data: Data) -> dict[str, Any]:
    """The SPIDERs' four estimators, each over every record."""
    return {"batch_sizes": (len(data[0][0]),) * 4}




MINIMAX = {"lr": 1.0, "lr_y": 1.0, "batch_size": None, "sampling": "full"}


def games(*rows: CanaryGame | Target) -> dict[str, Target]:
    """An algorithm's games by name (its home's ``GAMES``), from its rows; two rows of one name are
    refused."""
    table = {}
    for row in rows:
        target = row.target if isinstance(row, CanaryGame) else row
        if target.name in table:
            raise ValueError(f"two audit games are named {target.name!r}")
        table[target.name] = target
    return table


def builder(target: Target) -> Callable[..., Game]:
    """``target.make`` as a function named after the game (as test ids and tracebacks show it)."""
    make = target.make

    @wraps(make)
    def build(*args: Any, **kwargs: Any) -> Game:
        return make(*args, **kwargs)

    build.__name__ = build.__qualname__ = target.name.replace("-", "_")
    return build

