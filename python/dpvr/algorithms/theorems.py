"""The papers' theorems read as defaults: the formulas that the algorithms' rules evaluate.

Each algorithm binds its rules in its own module of :mod:`dpvr.algorithms`; :mod:`dpvr.trainer.defaults`
applies them.

Each default is the parameter choice of the theorem that proves the algorithm's utility, evaluated on public
quantities only: the dataset size ``n`` (per client), the number of clients ``P``, the model's trainable
dimension ``d``, the run's ``epsilon`` and ``delta``, its length ``R`` (steps), and the clip radii the user
gave. Their unknown problem constants are replaced by the radii that the analyses require to bound them: the
Lipschitz constant ``G`` by the gradient radius (``C1 >= G``), the smoothness ``L`` by the difference radius
(``C2 >= L``), and the initial suboptimality ``f(x0) - f*`` by 1 (the papers' ``O(1)`` assumption).

DIFF2-GD (Theorem 4.3) is derived from its proof rather than its printed statement: the printed ``tau`` drops
the log factors of Proposition 4.1's noise, and on real data that period is several times too short (the
difference noise then accumulates over too few restarts). In their place stands the accountant's own noise
constant ``c(epsilon, delta)``: ``R`` full-batch Gaussian releases at noise multiplier ``z`` spend exactly
``(epsilon, delta)`` when ``z^2 = c R`` (:func:`noise_constant`; ``c = 71.4`` at ``epsilon = 1`` and ``5.70``
at ``4``, ``delta = 1e-6``, PLD). With the budget split equally between the restart and difference streams
(the calibration's default), the ``R/T`` restart releases get ``z1^2 = 2 c R/T`` and the others ``z2^2 =
2 c (R - R/T)``, and the proof's descent-lemma bound, with every ``O(.)`` constant taken as 1,

    E||grad f||^2 <= 2 (f(x0) - f*) / (eta R) + d (z1 G / N)^2,  eta = 1 / (L max(1, sqrt(T d) z2 / N)),

``N = n P``, is least at ``T = tau R`` with ``tau = (sqrt(2 c) G^2 sqrt(d) / ((f(x0) - f*) L N))^(2/3)``
(:func:`diff2_protocol`, which also gives the rounds ``R`` the theorem needs and the bound it predicts;
:func:`dpgd_protocol` is DP-GD's counterpart, the baseline's optimal ``R``).

PrivateDiff (Theorem 6 of Zhang et al., NC-SC minimax) is derived the same way from its proof (Lemmas 14-16
with every ``O(.)`` constant 1). Its three streams (checkpoint, difference, y) share the budget equally, so
``z1^2 = 3 c ceil(R/T)``, ``z2^2 = 3 c (R - ceil(R/T))`` and the y stream ``3 c`` per round and release
(:func:`private_diff_noise`); the step is the proof's ``eta = 1 / (2 L max(1, sqrt(2 T d) z2 / N))`` with
``L = l + kappa l`` (``Phi``'s smoothness, the difference radius), the bound

    E||grad Phi||^2 <= 2 gap / (eta R) + 2 d (z1 G / N)^2 + 2 l^2 d_y (z_y Delta / 2)^2,

and its least ``tau = (sqrt(3c/2) G^2 sqrt(d) / (gap L N))^(2/3)``, ``R = max(1/tau, N / sqrt(6 c d tau))``
(:func:`private_diff_protocol`). The last term is dpvr's, not the paper's: dpvr releases ``y_{r+1}`` (noise
std ``z_y Delta / 2``, ``Delta = gradient_range / (N mu)`` its sensitivity) before the x-gradient reads it,
and that noise reaches the x-gradient through ``grad_xy f`` (``||.|| <= l``). It grows with ``R``, so when the
problem's ``l``, ``mu`` and ``gradient_range`` are known the rounds are ``min(R, R_y)``, ``R_y`` the least of
``4 gap L / R + 6 c l^2 d_y (Delta / 2)^2 R``: past ``R_y`` the y-noise is a DP-GD-like floor of order
``sqrt(c d_y) / N`` (:func:`private_diff_protocol` documents it). DP-SGDA's counterpart is Theorem 2's bound
(41) with ``log(1/delta) / eps^2`` read as ``2c`` (two equal streams): :func:`dpsgda_protocol`.

The SPIDERs (DP-DRO Theorems 7 and 8) read ``log(1/delta) / epsilon^2`` as ``k c``, ``k`` the algorithm's
number of streams sharing the budget equally (4 for Double-SPIDER, 5 for Recursive-SPIDER; the theorems
calibrate every stream to the whole budget, which composes to ``k`` times it): Theorem 7's period ``q =
(N / sqrt(k c d))^(2/3)``; Theorem 8's rounds ``T = max(((Psi0 L)^(1/4) N / sqrt(G d k c))^(4/3), N /
sqrt(k c d))``, its period ``q = floor(N^2 / (L^2 T d k c))`` and its difference batch ``b2 = max((G N /
sqrt(Psi0 L d k c))^(2/3), (G N d k c)^(1/3) / (L Psi0)^(1/6))`` (:func:`spider_protocol`); ``G`` and ``L``
are the refresh and difference radii of the x-streams, ``Psi0 = 1``.

The clip radii stay the user's: they *are* the estimates of ``G`` and ``L`` that the theorems assume, and no
public quantity estimates a model's smoothness. What was derived, and from which theorem, is returned with
each value, and ``make_private`` reports it on the trainer.

Privacy: a derived setting is a function of public quantities only (sizes, the budget and the user's
settings), so it is chosen before, and independently of, the private data, like any setting the user gives;
the run's accountant prices the run with it as with any other value.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..privacy.calibration import calibrate
from .dp_sgd.plan import DPSGDPlan


@dataclass(frozen=True)


class Derived:
    """A setting derived from a theorem: its ``value`` and ``why`` (the theorem and the numbers used)."""

    value: Any
    why: str


@dataclass(frozen=True)


class Public:
    """The public quantities a derivation may read."""

    n: int
    clients: int
    dimension: int
    epsilon: float
    delta: float
    steps: int | None  # None only while the run's length itself is derived (:func:`derive_steps`)


class Missing(Exception):
    """A theorem's default needs a setting that is not there."""


def radius(settings: Mapping[str, Any], stream: str, needed_for: str) -> float:
    """The clip radius of ``stream`` (the first number where a stream takes a pair)."""
    clip = settings.get("clip")
    value = clip.get(stream) if isinstance(clip, Mapping) else None
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if not isinstance(value, (int, float)) or not value > 0:
        raise Missing(f"{needed_for}) needs clip[{stream!r}] > 0")
    return float(value)


def restart_period(tau: float, steps: int) -> int:
    """The restart period ``T = max(1, tau R)`` of a theorem's ``tau``: whole steps in ``[1, R]``."""
    return int(min(steps, max(1, round(tau * steps))))


@functools.lru_cache(maxsize=256)


def noise_constant(epsilon: float, delta: float, accountant: str = "pld") -> float:
    """``c(epsilon, delta)``: ``R`` unsampled Gaussian releases of noise multiplier ``z`` (dpvr's convention:
    noise std over a record's L2 bound, replace-one) spend exactly ``(epsilon, delta)`` when ``z^2 = c R``.

    The composition of ``R`` Gaussians of multiplier ``z`` is one Gaussian of multiplier ``z / sqrt(R)``, so
    ``c`` is the squared multiplier of a single release calibrated by ``accountant`` (PLD by default, the one
    a full-batch run records with): ``c = 71.4`` at ``(1, 1e-6)``, ``5.70`` at ``(4, 1e-6)``. It stands in for
    the log factors the theorems drop (``Theta(log(1/delta) / epsilon^2)``)."""
    plan = DPSGDPlan(steps=1, sampling="full", dataset_size=1)
    z = calibrate(plan, epsilon, delta, accountant=accountant)["gradient"]
    return float(z * z)


@dataclass(frozen=True)


class Protocol:
    """A theorem's schedule at public quantities: ``rounds`` (R), ``restart`` (T; 1 for DP-GD), ``lr`` (eta),
    ``tau`` (T/R before rounding; 0 for DP-GD), ``bound`` (the predicted ``E||grad f||^2`` with every
    ``O(.)`` constant 1) and the accountant's ``noise_constant`` ``c`` it was derived with."""

    rounds: int
    restart: int
    lr: float
    tau: float
    bound: float
    noise_constant: float
    lr_y: float | None = None  # DP-SGDA's ascent step (Theorem 2's 1 / l); None elsewhere


def diff2_tau(n_total: int, dimension: int, c: float, lipschitz: float, smoothness: float,
              gap: float = 1.0) -> float:
    """Theorem 4.3's proof with the accountant's constant: ``tau = (sqrt(2c) G^2 sqrt(d) / (gap L N))^(2/3)``
    (module documentation), ``N = n P`` records in all and ``gap = f(x0) - f*``."""
    return (math.sqrt(2 * c) * lipschitz**2 * math.sqrt(dimension) / (gap * smoothness * n_total)) ** (2 / 3)


def diff2_noise(rounds: int, restart: int, c: float) -> tuple[float, float]:
    """The noise multipliers ``(z1, z2)`` of the restart and difference streams when the budget is split
    equally between them (the calibration's default): ``z1^2 = 2 c ceil(R/T)``,
    ``z2^2 = 2 c (R - ceil(R/T))``; ``T = 1`` has no difference stream, and its restarts take the whole
    budget (``z1^2 = c R``)."""
    restarts = -(-rounds // restart)
    if restarts == rounds:
        return math.sqrt(c * rounds), 0.0
    return math.sqrt(2 * c * restarts), math.sqrt(2 * c * (rounds - restarts))


def diff2_lr(n_total: int, dimension: int, restart: int, z_difference: float, smoothness: float) -> float:
    """Theorem 4.3's step ``eta = 1 / (L max(1, sqrt(T d) sigma2))`` with the paper's ``sigma2 = z2 / N``
    (the difference noise on the averaged mean, per unit of radius)."""
    return 1.0 / (smoothness * max(1.0, math.sqrt(restart * dimension) * z_difference / n_total))


def diff2_protocol(n: int, clients: int, dimension: int, epsilon: float, delta: float, lipschitz: float,
                   smoothness: float, gap: float = 1.0, rounds: int | None = None,
                   accountant: str = "pld") -> Protocol:
    """DIFF2-GD's schedule: the proof of Theorem 4.3 with the accountant's constant (module documentation).

    ``rounds`` ``None``: the theorem's ``R = max(1/tau, N / sqrt(2 c d tau))``, the fewest rounds at which the
    optimisation term ``2 gap L / R`` is no larger than the difference noise's ``2 gap L sqrt(2 c d tau) / N``
    (past it the bound no longer falls with R). Then ``T = max(1, round(tau R))`` (at most ``R``) and ``eta``
    by :func:`diff2_lr` with the calibrated ``z2`` (:func:`diff2_noise`)."""
    c, total = noise_constant(epsilon, delta, accountant), n * clients
    tau = diff2_tau(total, dimension, c, lipschitz, smoothness, gap)
    if rounds is None:
        t = min(tau, 1.0)
        rounds = math.ceil(max(1.0 / t, total / math.sqrt(2 * c * dimension * t)))
    restart = restart_period(tau, rounds)
    z1, z2 = diff2_noise(rounds, restart, c)
    lr = diff2_lr(total, dimension, restart, z2, smoothness)
    bound = 2 * gap / (lr * rounds) + dimension * (z1 * lipschitz / total) ** 2
    return Protocol(rounds, restart, lr, tau, bound, c)


def dpgd_protocol(n: int, clients: int, dimension: int, epsilon: float, delta: float, lipschitz: float,
                  smoothness: float, gap: float = 1.0, accountant: str = "pld") -> Protocol:
    """DP-GD's schedule from its standard analysis (the descent lemma with ``eta = 1/L``):
    ``E||grad f||^2 <= 2 gap L / R + c R d (G / N)^2``, least at ``R = N sqrt(2 gap L / (c d)) / G``, where
    it is ``2 G sqrt(2 gap L c d) / N``: the ``sqrt(d) / (N epsilon)`` rate against DIFF2's
    ``(sqrt(d) / (N epsilon))^(4/3)``."""
    c, total = noise_constant(epsilon, delta, accountant), n * clients
    rounds = max(1, math.ceil(total * math.sqrt(2 * gap * smoothness / (c * dimension)) / lipschitz))
    bound = 2 * gap * smoothness / rounds + c * rounds * dimension * (lipschitz / total) ** 2
    return Protocol(rounds, 1, 1.0 / smoothness, 0.0, bound, c)


def private_diff_tau(n_total: int, dimension: int, c: float, lipschitz: float, smoothness: float,
                     gap: float = 1.0) -> float:
    """Theorem 6's proof with the accountant's constant: ``tau = (sqrt(3c/2) G^2 sqrt(d) / (gap L N))^(2/3)``,
    the least of ``4 gap L sqrt(6 c d tau) / N + 6 c d G^2 / (tau N^2)`` (difference noise against checkpoint
    noise, module documentation); ``L = l + kappa l`` is ``Phi``'s smoothness."""
    ratio = math.sqrt(1.5 * c) * lipschitz**2 * math.sqrt(dimension) / (gap * smoothness * n_total)
    return ratio ** (2 / 3)


def private_diff_noise(rounds: int, restart: int, c: float) -> tuple[float, float, float]:
    """PrivateDiff's multipliers ``(z1, z2, z_y)`` under the calibration's equal shares of its three streams
    with one y-release a round (``y_release="output"``): ``z1^2 = 3c ceil(R/T)``, ``z2^2 = 3c (R -
    ceil(R/T))``, ``z_y^2 = 3c R``; ``T = 1`` leaves the difference stream idle and the other two share the
    budget (``2c``)."""
    restarts = -(-rounds // restart)
    if restarts == rounds:
        return math.sqrt(2 * c * rounds), 0.0, math.sqrt(2 * c * rounds)
    return math.sqrt(3 * c * restarts), math.sqrt(3 * c * (rounds - restarts)), math.sqrt(3 * c * rounds)


def private_diff_lr(n_total: int, dimension: int, restart: int, z_difference: float,
                    smoothness: float) -> float:
    """Theorem 6's step (its proof): ``eta = min(1 / (2 L), 1 / (2 sqrt(2 T sigma2^2 C2^2 d)))`` with
    ``sigma2 = z2 / N`` and ``C2 = L``: ``1 / (2 L max(1, sqrt(2 T d) z2 / N))``."""
    return 1.0 / (2 * smoothness * max(1.0, math.sqrt(2 * restart * dimension) * z_difference / n_total))


def private_diff_protocol(n: int, dimension: int, epsilon: float, delta: float, lipschitz: float,
                          smoothness: float, gap: float = 1.0, *, cross: float | None = None,
                          strong_concavity: float | None = None, y_range: float | None = None,
                          y_dim: int = 1, rounds: int | None = None, accountant: str = "pld") -> Protocol:
    """PrivateDiff's schedule (full batch, ``y_release="output"``): Theorem 6's proof with the accountant's
    constant (module documentation). ``lipschitz`` ``G`` bounds ``||grad_x f||`` (the checkpoint radius),
    ``smoothness`` is ``L = l + kappa l`` (the difference radius' per-move coefficient), ``gap = Phi(x0) -
    min Phi``.

    ``rounds`` ``None``: the theorem's ``R = max(1/tau, N / sqrt(6 c d tau))``; with the problem's ``cross``
    (``l``, a bound on ``||grad_xy f||``), ``strong_concavity`` (``mu``) and ``y_range`` (the
    ``gradient_range`` of :class:`~dpvr.problems.minimax.YSensitivity`) also the y-release's
    ``R_y = sqrt(2 gap L / (3 c d_y)) / (l s)``, ``s = y_range / (2 N mu)`` (half the release's replace-one
    sensitivity: the unit dpvr's multiplier is relative to), and ``R = min(R, R_y)``: the y-noise dpvr adds
    before the x-gradient reads ``y`` costs ``2 l^2 d_y (z_y s)^2`` with ``z_y^2 = 3 c R``, which the
    paper's proof does not have (its x-gradient reads the noiseless ``y``). ``bound`` includes that term
    when the constants are given."""
    c, total = noise_constant(epsilon, delta, accountant), n
    tau = private_diff_tau(total, dimension, c, lipschitz, smoothness, gap)
    with_y = None not in (cross, strong_concavity, y_range)
    spread = y_range / (2 * total * strong_concavity) if with_y else 0.0
    if rounds is None:
        t = min(tau, 1.0)
        rounds = math.ceil(max(1.0 / t, total / math.sqrt(6 * c * dimension * t)))
        if with_y:
            r_y = math.sqrt(2 * gap * smoothness / (3 * c * y_dim)) / (cross * spread)
            rounds = max(1, min(rounds, math.ceil(r_y)))
    restart = restart_period(tau, rounds)
    z1, z2, zy = private_diff_noise(rounds, restart, c)
    lr = private_diff_lr(total, dimension, restart, z2, smoothness)
    bound = 2 * gap / (lr * rounds) + 2 * dimension * (z1 * lipschitz / total) ** 2
    if with_y:
        bound += 2 * cross**2 * y_dim * (zy * spread) ** 2
    return Protocol(rounds, restart, lr, tau, bound, c)


def sgda_kappa_factor(kappa: float) -> float:
    """Bound (41)'s noise coefficient ``2 max(9 kappa + 1/(8 kappa), 1/(4 kappa))``."""
    return 2 * max(9 * kappa + 1 / (8 * kappa), 1 / (4 * kappa))


def dpsgda_protocol(n: int, dimension: int, epsilon: float, delta: float, lipschitz: float, cross: float,
                    strong_concavity: float, gap: float = 1.0, diameter: float = 1.0,
                    accountant: str = "pld") -> Protocol:
    """DP-SGDA's schedule (full batch): Theorem 2 of the PrivateDiff paper, its bound (41) with
    ``log(1/delta) / eps^2`` read as ``2c`` (x and y streams, equal shares: ``z_x^2 = z_y^2 = 2 c T``):

        E||grad Phi||^2 <= A / T + K 2c d G^2 T / N^2,  A = 3 gap / eta_x + 6 kappa l^2 Lambda^2,

    ``K`` = :func:`sgda_kappa_factor`, ``eta_x = 1 / (16 (kappa + 1)^2 l)``, ``eta_y = 1 / l``, ``kappa = l /
    mu``; least at ``T = N sqrt(A / (2 K c d G^2))``, where it is ``2 sqrt(2 A K c d) G / N``.
    ``lipschitz`` ``G`` bounds both blocks' per-sample gradients (the larger clip radius), ``cross`` is
    ``l``, ``diameter`` ``Lambda`` that of ``Y``. ``restart`` is 1 and ``tau`` 0; the y-step is
    :attr:`Protocol.lr_y`."""
    c, total = noise_constant(epsilon, delta, accountant), n
    kappa = cross / strong_concavity
    lr = 1.0 / (16 * (kappa + 1) ** 2 * cross)
    big_k = sgda_kappa_factor(kappa)
    a = 3 * gap / lr + 6 * kappa * cross**2 * diameter**2
    rounds = max(1, math.ceil(total * math.sqrt(a / (2 * big_k * c * dimension * lipschitz**2))))
    bound = a / rounds + big_k * 2 * c * dimension * lipschitz**2 * rounds / total**2
    return Protocol(rounds, 1, lr, 0.0, bound, c, lr_y=1.0 / cross)


def spider_period_theorem7(n: int, dimension: int, c: float, streams: int = 4) -> int:
    """DP-DRO Theorem 7's ``q = (N / sqrt(k c d))^(2/3)`` (``log(1/delta) / eps^2`` read as ``k c``), at least
    1."""
    return max(1, round((n / math.sqrt(streams * c * dimension)) ** (2 / 3)))


@dataclass(frozen=True)


class SpiderProtocol:
    """DP-DRO Theorem 8 at public quantities: ``rounds`` ``T``, ``restart`` ``q``, difference batch ``b2``
    (the refresh batch is ``n``), the x step ``lr = 1 / (2 L)`` and the accountant's ``noise_constant``."""

    rounds: int
    restart: int
    batch: int
    lr: float
    noise_constant: float


def spider_protocol(n: int, dimension: int, epsilon: float, delta: float, lipschitz: float, smoothness: float,
                    psi0: float = 1.0, streams: int = 5, rounds: int | None = None,
                    accountant: str = "pld") -> SpiderProtocol:
    """DP-DRO Theorem 8 (Recursive-SPIDER) with ``log(1/delta) / eps^2`` read as ``k c`` (``k = streams``):
    ``T = max(((Psi0 L)^(1/4) N / sqrt(G d k c))^(4/3), N / sqrt(d k c))`` (unless ``rounds`` is given),
    ``q = max(1, floor(N^2 / (L^2 T d k c)))`` (at most ``T``), ``b2 = max((G N / sqrt(Psi0 L d k c))^(2/3),
    (G N d k c)^(1/3) / (L Psi0)^(1/6))`` capped at ``N``, ``eta = 1 / (2 L)`` (the theorem's ``min(1/(2L),
    .)``; its second term is garbled in the paper)."""
    c = noise_constant(epsilon, delta, accountant)
    kc = streams * c
    if rounds is None:
        rounds = math.ceil(max(((psi0 * smoothness) ** 0.25 * n / math.sqrt(lipschitz * dimension * kc))
                               ** (4 / 3), n / math.sqrt(dimension * kc)))
    restart = int(min(rounds, max(1, math.floor(n**2 / (smoothness**2 * rounds * dimension * kc)))))
    batch = spider_protocol_batch(n, dimension, kc, lipschitz, smoothness, psi0)
    return SpiderProtocol(rounds, restart, batch, 1.0 / (2 * smoothness), c)


def difference_multiplier(settings: Mapping[str, Any], p: Public, restart: int, shares, rule: str
                           ) -> tuple[float, str]:
    """The difference stream's noise multiplier a step-size rule reads, and where it came from: the run's
    own (``settings["noise"]``: one number for every stream, or ``{stream: z}``), else the calibration's
    equal share ``shares(R, T, c)[1]`` (``rule`` names it)."""
    noise = settings.get("noise")
    if isinstance(noise, Mapping):
        noise = noise.get("difference")
    if noise is not None:
        return float(noise), "given"
    c = noise_constant(p.epsilon, p.delta)
    return shares(p.steps, restart, c)[1], f"{rule}, c={c:.4g}"


def spider_batch_sizes(k: int, streams: tuple[str, ...], refresh: tuple[str, ...]):
    """DP-DRO, Theorem 8: a full batch on the refresh streams (``b1 = n``) and on the difference streams
    ``b2 = max((G n / sqrt(Psi0 L d k c))^(2/3), (G n d k c)^(1/3) / (L Psi0)^(1/6))`` (``log(1/delta) /
    eps^2`` read as ``k c``, ``k`` the algorithm's streams sharing the budget equally), capped at ``n``,
    with ``G``, ``L`` the refresh and difference radii."""

    def rule(settings: Mapping[str, Any], p: Public) -> Derived:
        theorem = ("DP-DRO Theorem 8, b1 = n, b2 = max((G n / sqrt(L d k c))^(2/3), "
                   "(G n d k c)^(1/3) / L^(1/6))")
        c = noise_constant(p.epsilon, p.delta)
        sizes = {}
        for stream in streams:
            if stream in refresh:
                sizes[stream] = p.n
                continue
            g = radius(settings, refresh[streams.index(stream) // 2], theorem)
            lip = radius(settings, stream, theorem)
            sizes[stream] = spider_protocol_batch(p.n, p.dimension, c * k, g, lip)
        why = f"{theorem} (Psi0 = 1), log(1/delta)/eps^2 read as k c: n={p.n}, d={p.dimension}, k={k}, " \
              f"c={c:.4g}: {sizes}"
        return Derived(sizes, why)

    return rule


def spider_protocol_batch(n: int, dimension: int, kc: float, lipschitz: float, smoothness: float,
                          psi0: float = 1.0) -> int:
    """Theorem 8's ``b2`` with ``log(1/delta) / eps^2`` read as ``kc``, capped at ``n``."""
    b2 = max((lipschitz * n / math.sqrt(psi0 * smoothness * dimension * kc)) ** (2 / 3),
             (lipschitz * n * dimension * kc) ** (1 / 3) / (smoothness * psi0) ** (1 / 6))
    return int(min(n, max(1, math.ceil(b2))))
