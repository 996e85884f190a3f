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
- **difference canaries**: the ``|o|`` record (``t = (0, +-1)``) has gradient zero at ``w = 0`` and
  ``+-G e`` once ``w . e > 0``. Started at ``w = 0``, with public drivers that push ``w . e`` up, it adds
  nothing to a refresh and a same-sample difference of ``+-G e``, clipped to the whole difference radius,
  to the next difference step. The estimators of functions of the loss (the DRO dual variables) get the
  same from records whose loss values, ``+-G |w . e|`` or ``-+G w . e``, fall on either side of a clip
  radius or of the loss cap. The score reads each audited release back from the released values
  (:func:`gaussian_score`);
- **input-space canaries** (:func:`input_canary_records`): an ordinary record (an outlier input with a chosen
  label) in an ordinary model; the score is the released model's logit on it, a black-box end-to-end check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ..objectives import MinimaxProblem
from ..ops import NoiseGenerator
from ..problems.minimax import YSensitivity

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


StepSize = Callable[[Trace, Any, int], float]
Release = tuple[str, float, float]  # (stream, the release read back from the run, its clip radius)
_E = np.ones(1)  # the white-box games' one-parameter models: the canary direction e is +1


def released(trace: Trace, key: str, initial: float) -> np.ndarray:
    """A released scalar's trajectory: its public start ``initial``, then ``info[key]`` after each step."""
    return np.array([initial, *(info[key] for info in trace.infos)], dtype=np.float64)


def x_estimates(trace: Trace, algorithm: Any, e: np.ndarray, step_size: StepSize) -> np.ndarray:
    """Each step's released x-estimator projected on ``e``: ``(x_t - x_{t+1}) . e / step_t``, with
    ``step_size(trace, algorithm, t)`` the released step size of step ``t``."""
    moves = np.diff(np.stack(trace.params), axis=0) @ -e
    return np.array([m / step_size(trace, algorithm, t) for t, m in enumerate(moves)], dtype=np.float64)


def descent_score(
    direction: Sequence[float], step_size: StepSize | None = None
) -> Callable[[Trace, Any], float]:
    """``(x_0 - x_T) . e``: how far the run moved against ``e``, the canary's clipped gradient direction.

    With ``step_size`` (see :func:`x_estimates`) each step's move is divided by it first: the sum of the
    released estimators projected on ``e``."""
    e = np.asarray(direction, dtype=np.float64)
    e = e / np.linalg.norm(e)

    def score(trace: Trace, algorithm: Any) -> float:
        if step_size is None:
            return float((trace.params[0] - trace.params[-1]) @ e)
        return float(x_estimates(trace, algorithm, e, step_size).sum())

    return score


def released_score(key: str) -> Callable[[Trace, Any], float]:
    """The last step's ``info[key]``, for a value the algorithm releases with noise of its own stream."""
    return lambda trace, _: float(trace.infos[-1][key])


def gaussian_score(
    releases: Callable[[Trace, Any], Iterable[Release]], weights: Mapping[str, float]
) -> Callable[[Trace, Any], float]:
    """Likelihood-ratio score of the white-box Gaussian model of a run's audited releases.

    ``releases(trace, algorithm)`` reads every noisy release back from released values as ``(stream,
    value, radius)``: a refresh's estimate, or a difference step's increment of the estimator. In an
    audited stream (a key of ``weights``) the canary's clipped term is ``+-radius`` and its neighbour's the
    opposite, so ``value / radius`` is Gaussian with std ``z / b`` (``z`` the stream's noise multiplier,
    ``b`` its batch size) and a mean the canary shifts by ``2 / b``. The optimal linear test weights each by
    its shift over its variance: ``weights[stream]`` is the canary's sign over ``z^2`` (the audited streams
    of a game share ``b``), from the noise the game configured, never from the algorithm under audit; the
    other streams are left out.
    """

    def score(trace: Trace, algorithm: Any) -> float:
        return sum(
            weights[stream] * value / radius
            for stream, value, radius in releases(trace, algorithm)
            if stream in weights and radius > 0
        )

    return score


def _increments(values: np.ndarray, refresh: Sequence[bool]) -> list[float]:
    """What a recursive estimator's steps release: the estimate at a refresh, its change otherwise."""
    return [v if fresh else v - p for v, p, fresh in zip(values, [0.0, *values[:-1]], refresh)]


def round_releases(flag: str, streams: tuple[str, str]) -> Callable[[Trace, Any], list[Release]]:
    """DIFF2-GD's and PrivateDiff's x-releases: ``v_r = (x_r - x_{r+1}) / lr`` read from the iterates;
    ``info[flag]`` marks a refresh round (stream ``streams[0]``, else ``streams[1]``) and ``info["radius"]``
    is released."""

    def releases(trace: Trace, algorithm: Any) -> list[Release]:
        refresh = [bool(info[flag]) for info in trace.infos]
        v = x_estimates(trace, algorithm, _E, lambda _, alg, __: alg.lr)
        return [
            (streams[0] if fresh else streams[1], value, info["radius"])
            for fresh, value, info in zip(refresh, _increments(v, refresh), trace.infos)
        ]

    return releases


def _spider_releases(
    refresh: Sequence[bool], estimators: Sequence[tuple[str, np.ndarray, Sequence[float]]]
) -> list[Release]:
    """``(name-refresh | name-difference, value, radius)`` of every step, for each ``(name, estimates,
    radii)``."""
    return [
        (f"{name}-{'refresh' if fresh else 'difference'}", value, radius)
        for name, values, radii in estimators
        for fresh, value, radius in zip(refresh, _increments(values, refresh), radii)
    ]


def double_spider_releases(eta0: float) -> Callable[[Trace, Any], list[Release]]:
    """Double-SPIDER's releases read back from its iterates (``eta0`` is the public start of eta):
    ``g_t = (eta_t - eta_{t+1}) / lr_eta`` and ``v_t = (x_t - x_{t+1}) / beta_t`` with the released step
    ``beta_t = min(lr, max_move / ||v_t||)``; the difference radii are recomputed from the released eta
    iterates and moves, as the algorithm computes them."""

    def releases(trace: Trace, alg: Any) -> list[Release]:
        eta, infos = released(trace, "eta", eta0), trace.infos
        refresh = [bool(info["refresh"]) for info in infos]
        dx = [0.0, *(info["move"] for info in infos)]  # ||x_t - x_{t-1}|| at the start of step t
        g = (eta[:-1] - eta[1:]) / alg.lr_eta
        v = x_estimates(
            trace, alg, _E, lambda _, a, t: min(a.lr, a.max_move / infos[t]["v"]) if infos[t]["v"] else a.lr
        )
        # The algorithm's own public radius rules (capped), applied to the released iterates.
        eta_radii = [
            alg.eta_radius(fresh, abs(eta[t] - eta[t - 1]), dx[t]) for t, fresh in enumerate(refresh)
        ]
        x_radii = [alg.x_radius(fresh, abs(eta[t + 1] - eta[t]), dx[t]) for t, fresh in enumerate(refresh)]
        return _spider_releases(refresh, [("eta", g, eta_radii), ("x", v, x_radii)])

    return releases


def recursive_spider_step(lam_init: float) -> StepSize:
    """Recursive-SPIDER's released x-step ``lr lam_t / s'_t``, ``s'_t = max(s, s_floor)`` with the ``s`` that
    step ``t`` released (``lam_init`` is the public start of lambda)."""

    def step(trace: Trace, alg: Any, t: int) -> float:
        lam = lam_init if t == 0 else trace.infos[t - 1]["lam"]
        return alg.lr * lam / max(trace.infos[t]["s"], alg.s_floor)

    return step


def recursive_spider_releases(lam_init: float) -> Callable[[Trace, Any], list[Release]]:
    """Recursive-SPIDER's v- and u-releases read back from its iterates: ``v_t`` from the x-step
    (:func:`recursive_spider_step`) and, from the lambda-step (which must stay above ``lam0``: the
    projection would hide ``u``), ``u_t = ((lam_t - lam_{t+1}) / lr_lam - log s'_t - rho) s'_t / lam_t``;
    the difference radii are ``k2 d_t`` and ``k4 d_t`` (``clip["v-difference"]``, ``clip["u-difference"]``;
    capped)
    with ``d_t = ||(x_t, lam_t) - (x_{t-1}, lam_{t-1})||``, from released values."""

    def releases(trace: Trace, alg: Any) -> list[Release]:
        lam, infos = released(trace, "lam", lam_init), trace.infos
        s = np.maximum([info["s"] for info in infos], alg.s_floor)
        refresh = [bool(info["refresh"]) for info in infos]
        v = x_estimates(trace, alg, _E, recursive_spider_step(lam_init))
        u = ((lam[:-1] - lam[1:]) / alg.lr_lam - np.log(s) - alg.rho) * s / lam[:-1]
        d = [0.0, *(math.hypot(infos[t - 1]["move"], lam[t] - lam[t - 1]) for t in range(1, len(infos)))]
        v_radii = [alg.v_radius(fresh, d[t]) for t, fresh in enumerate(refresh)]
        u_radii = [alg.u_radius(fresh, d[t]) for t, fresh in enumerate(refresh)]
        return _spider_releases(refresh, [("v", v, v_radii), ("u", u, u_radii)])

    return releases


def white_box_records(
    n: int, *, canary: tuple[float, float], neighbour: tuple[float, float] | None, drivers: int = 0
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Two one-feature datasets for :func:`canary_loss`: record 0 is the canary (target ``canary``) or its
    neighbour (``neighbour``; ``None`` removes it), records ``2 .. drivers + 1`` are linear drivers with
    gradient ``-G e`` (they push ``w . e`` up, which is public and the same on both sides), the rest have
    zero gradient (input 0). Record 1 and the last record stay zero records: a canary's neighbours in any
    shifted pairing carry no gradient. ``n = 1`` is the canary alone."""
    if not 0 <= drivers <= max(n - 3, 0):
        raise ValueError(f"drivers: between 0 and n - 3 = {n - 3}, got {drivers}")
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


class CanaryOutputY(MinimaxProblem):
    """``f(x, y; z) = canary_loss(o, t[:2]) + t_y y - y^2 / 2`` on ``Y = [-1, 1]``, ``t_y = clamp(t[2], -1,
    1)``: a record's y-gradient ``t_y - y`` is its third target, so the inner maximiser is the clamped mean
    of the ``t_y`` and a canary ``t_y = +1`` against its neighbour ``-1`` moves it by exactly the stated
    stability ``2 / n`` (``gradient_range = 2``, ``mu = L = 1``). Records with zero inputs carry no
    x-gradient: the canary's whole influence is in the y output release."""

    y_dim, strong_concavity, diameter, y_lipschitz = 1, 1.0, 2.0, 2.0

    def loss(self, output: torch.Tensor, target: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return canary_loss(output, target[:2]) + target[2].clamp(-1.0, 1.0) * y[0] - 0.5 * (y**2).sum()

    def project(self, y: torch.Tensor) -> torch.Tensor:
        return y.clamp(-1.0, 1.0)

    def y_sensitivity(self) -> YSensitivity:
        return YSensitivity(gradient_range=2.0, strong_concavity=1.0, smoothness=1.0)

    def bounded_outputs(self, outputs: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(outputs, nan=0.0, posinf=0.0, neginf=0.0)  # o does not enter grad_y f


def output_y_records(n: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``n`` zero-input records for :class:`CanaryOutputY`: record 0 has ``t_y = +1`` (the canary) or
    ``-1`` (its neighbour), the others ``t_y = 0``."""
    inputs = torch.zeros(n, 1, dtype=torch.float64)
    sides = []
    for t_y in (1.0, -1.0):
        targets = torch.zeros(n, 3, dtype=torch.float64)
        targets[0, 2] = t_y
        sides.append((inputs.clone(), targets))
    return sides[0], sides[1]


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


def input_canary_records(
    n: int, dim: int, seed: int
) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The two sides of :func:`input_canary_data`'s game, its ``n`` records plus the canary input labelled 1
    (side 0) or 0 (side 1), and the canary input, which a score evaluates the released model on."""
    features, labels, canary = input_canary_data(n, dim, seed)
    inputs = torch.cat([features, canary])

    def side(label: float) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs, torch.cat([labels, torch.full((1, 1), label, dtype=labels.dtype)])

    return (side(1.0), side(0.0)), canary


def logistic_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(output, target, reduction="sum")


def logit_score(canary: torch.Tensor) -> Callable[[Trace, Any], float]:
    """The released model's logit on the canary input (black-box: only the final model is used)."""

    def score(_: Trace, algorithm: Any) -> float:
        with torch.no_grad():
            return float(algorithm.model(canary).reshape(-1)[0])

    return score
