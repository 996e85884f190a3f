"""Distinguishing games: an algorithm, two neighbouring datasets that differ in one canary, and a score.

A :class:`Game` runs the algorithm once on dataset 0 (the canary in) or dataset 1 (the neighbour: the canary
removed under add/remove, replaced by its mirror image under replace-one) and scores what the run released:
its iterates (and, for white-box games, the per-step information the algorithm returns). A higher score
should mean "canary in". The claimed epsilon comes from the algorithm's own accountant at the audited
configuration, never from a target copied over.

Canaries:

- **white-box gradient canaries**: a model and loss whose per-sample gradients are known vectors. With the
  loss ``t0 * o + t1 * |o|`` of the scalar output ``o = w . x`` (:func:`canary_loss`), a record
  ``x = G e`` with ``G`` far above every clip radius has gradient ``(t0 + t1 sign(w . e)) G e``, clipped to
  exactly the radius along ``e``: the canary spends the whole sensitivity in one known direction, and the
  score projects the released updates on it;
- **input-space canaries** (:func:`input_canary_game`): an ordinary record (an outlier input with a chosen
  label) in an ordinary model; the score is the released model's logit on it, a black-box end-to-end check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ..objectives import MinimaxProblem
from ..ops import NoiseGenerator

CANARY_SCALE = 1e3  # the canary's gradient norm, in clip radii: far outside every radius the games use


@dataclass
class Trace:
    """What one run released: the flattened parameters before and after each step, and each step's info."""

    params: list[np.ndarray] = field(default_factory=list)
    infos: list[dict[str, float]] = field(default_factory=list)


class Game(Protocol):
    """One audit configuration: ``play(side, generator, seed, account)`` runs once and returns the score
    and, when ``account`` is true, the claimed epsilon (at ``delta``) of that run (else ``None``: asking
    the accountant is the slow part of a run, and every run of a game releases the same)."""

    name: str
    delta: float

    def play(
        self, side: int, generator: NoiseGenerator, seed: int, account: bool
    ) -> tuple[float, float | None]: ...


def canary_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``t0 * o + t1 * |o|`` for target ``(t0, t1)``: linear records have a constant gradient, ``|o|``
    records a gradient whose sign follows the side of ``w . x`` (what makes a gradient *difference* large)."""
    return (target[..., 0] * output[..., 0] + target[..., 1] * output[..., 0].abs()).sum()


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy().copy()


@dataclass
class AlgorithmGame:
    """A game on a :class:`~dpvr.optim.PrivateAlgorithm`.

    ``make(side, generator, seed)`` builds the algorithm (with a fresh model) on dataset ``side``;
    ``score(trace, algorithm)`` scores the run. Every step's parameters and info are recorded.
    """

    name: str
    delta: float
    make: Callable[[int, NoiseGenerator, int], Any]
    score: Callable[[Trace, Any], float]

    def play(
        self, side: int, generator: NoiseGenerator, seed: int, account: bool
    ) -> tuple[float, float | None]:
        algorithm = self.make(side, generator, seed)
        trace = Trace([flat(algorithm.model)])
        for _ in range(algorithm.total_steps - algorithm.steps_done):
            trace.infos.append(algorithm.step())
            trace.params.append(flat(algorithm.model))
        claimed = float(algorithm.privacy_spent(self.delta).epsilon) if account else None
        return float(self.score(trace, algorithm)), claimed


def descent_score(
    direction: Sequence[float], step_size: Callable[[dict[str, float], Any], float] | None = None
) -> Callable[[Trace, Any], float]:
    """``(x_0 - x_T) . e``: how far the run moved against ``e``, the canary's clipped gradient direction.

    With ``step_size(info, algorithm)`` (the released step size of a step, from its information), each
    step's move is divided by it first: the sum of the released estimators projected on ``e``."""
    e = np.asarray(direction, dtype=np.float64)
    e = e / np.linalg.norm(e)

    def score(trace: Trace, algorithm: Any) -> float:
        if step_size is None:
            return float((trace.params[0] - trace.params[-1]) @ e)
        moves = np.diff(np.stack(trace.params), axis=0) @ -e
        return float(sum(m / step_size(info, algorithm) for m, info in zip(moves, trace.infos)))

    return score


def diff2_score(n: int) -> Callable[[Trace, Any], float]:
    """Likelihood-ratio score of DIFF2-GD on ``n`` records against the flip canary of
    :func:`dpvr.audit.targets.diff2_gd`.

    Round ``r``'s estimator increment is recovered from released iterates, ``v_r = (x_{r-1} - x_r) / lr``
    (restart rounds: ``v_r``; difference rounds: ``v_r - v_{r-1}``). Standardised by its noise std
    (``sigma * radius``) it is a unit Gaussian whose mean the canary shifts by ``-1 / (sigma n)`` in restart
    rounds (the canary's gradient at ``x_0`` points along ``-e``) and ``+1 / (sigma n)`` in difference rounds
    (the difference ``g(x_r) - g(x_{r-1}) = 2 G e``). Weighting each by its shift gives the optimal linear
    test of the white-box Gaussian model.
    """

    def score(trace: Trace, algorithm: Any) -> float:
        x = [p[0] for p in trace.params]
        v_prev, total = 0.0, 0.0
        for r, info in enumerate(trace.infos, 1):
            v = (x[r - 1] - x[r]) / algorithm.lr
            restart = bool(info["restart"])
            stream = "restart" if restart else "difference"
            std = algorithm.sigma[stream] * info["radius"]
            if std > 0:
                increment = v if restart else v - v_prev
                sign = -1.0 if restart else 1.0
                total += sign * increment / std / (algorithm.sigma[stream] * n)
            v_prev = v
        return total

    return score


def white_box_records(
    n: int, *, canary: tuple[float, float], neighbour: tuple[float, float] | None, drivers: int = 0
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Two one-feature datasets for :func:`canary_loss`: record 0 is the canary (target ``canary``) or its
    neighbour (``neighbour``; ``None`` removes it), records ``2 .. drivers + 1`` are linear drivers with
    gradient ``-G e`` (they push ``w . e`` up, which is public and the same on both sides), the rest have
    zero gradient (input 0). Record 1 and the last record stay zero records: a canary's neighbours in any
    shifted pairing carry no gradient."""
    if drivers > n - 3:
        raise ValueError(f"drivers: at most n - 3 = {n - 3}, got {drivers}")
    inputs = torch.zeros(n, 1, dtype=torch.float64)
    targets = torch.zeros(n, 2, dtype=torch.float64)
    inputs[0, 0] = CANARY_SCALE
    inputs[2 : 2 + drivers, 0] = CANARY_SCALE
    targets[2 : 2 + drivers, 0] = -1.0
    first, second = (inputs, targets.clone()), (inputs.clone(), targets.clone())
    first[1][0] = torch.tensor(canary, dtype=torch.float64)
    if neighbour is None:
        second = (second[0][1:], second[1][1:])
    else:
        second[1][0] = torch.tensor(neighbour, dtype=torch.float64)
    return first, second


class CanaryMinimax(MinimaxProblem):
    """``f(x, y; z) = canary_loss(o, t) - y^2 / 2`` on ``Y = [-1, 1]``: the records of
    :func:`white_box_records` carry their (known) gradients in ``x`` only; ``y``'s gradient is public."""

    y_dim, strong_concavity, diameter, y_lipschitz = 1, 1.0, 2.0, 1.0

    def loss(self, output: torch.Tensor, target: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return canary_loss(output, target) - 0.5 * (y**2).sum()

    def project(self, y: torch.Tensor) -> torch.Tensor:
        return y.clamp(-1.0, 1.0)


def scalar_model(weight: float = 0.0) -> nn.Module:
    model = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(weight)
    return model


def input_canary_data(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed logistic-regression dataset (features on the unit sphere, labels from a fixed direction) and
    an outlier canary input orthogonal to that direction, labelled 1."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, dim))
    features[:, -1] = 0.0  # the canary's direction carries no signal in the ordinary records
    features /= np.linalg.norm(features, axis=1, keepdims=True)
    labels = (features[:, 0] > 0).astype(np.float64)
    canary = np.zeros(dim)
    canary[-1] = 1.0
    return (
        torch.tensor(features),
        torch.tensor(labels).reshape(-1, 1),
        torch.tensor(canary).reshape(1, -1),
    )


def logistic_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(output, target, reduction="sum")


def logit_score(canary: torch.Tensor) -> Callable[[Trace, Any], float]:
    """The released model's logit on the canary input (black-box: only the final model is used)."""

    def score(_: Trace, algorithm: Any) -> float:
        with torch.no_grad():
            return float(algorithm.model(canary).reshape(-1)[0])

    return score
