"""The settings ``make_private`` derives from the papers' theorems when they are not given.

Each default is the parameter choice of the theorem that proves the algorithm's utility, evaluated on public
quantities only: the dataset size ``n`` (per client), the number of clients ``P``, the model's trainable
dimension ``d``, the run's ``epsilon`` and ``delta``, its length ``R`` (steps), and the clip radii the user
gave. The theorems' constants are ``Theta(.)``; they are taken as 1. Their unknown problem constants are
replaced by the radii that the analyses require to bound them: the Lipschitz constant ``G`` by the gradient
radius (``C1 >= G``), the smoothness ``L`` by the difference radius (``C2 >= L``), and the initial
suboptimality by 1 (the papers' ``O(1)`` assumption).

The clip radii and step sizes themselves stay the user's: they *are* the estimates of ``G``, ``L`` and
``1/L`` that the theorems assume, and no public quantity estimates a model's smoothness. What was derived,
and from which theorem, is returned with each value, and ``make_private`` reports it on the trainer.

Privacy: a derived setting is a function of public quantities only (sizes, the budget and the user's
settings), so it is chosen before, and independently of, the private data, like any setting the user gives;
the run's accountant prices the run with it as with any other value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
    steps: int


def derivable(algorithm: str) -> tuple[str, ...]:
    """The settings of ``algorithm`` that :func:`derive` can fill in."""
    return tuple(_RULES.get(algorithm, {}))


def derive(algorithm: str, settings: Mapping[str, Any], public: Public) -> dict[str, Derived]:
    """The defaults of ``algorithm``'s derivable settings absent from ``settings``.

    Raises:
        ValueError: a setting is absent and its theorem needs a radius that ``clip`` does not give (every
            such setting named at once).
    """
    derived, problems = {}, []
    for name, rule in _RULES.get(algorithm, {}).items():
        if settings.get(name) is not None:
            continue
        try:
            derived[name] = rule({**settings, **{k: d.value for k, d in derived.items()}}, public)
        except _Missing as missing:
            problems.append(f"{name}: not given, and its default ({missing})")
    if problems:
        raise ValueError(f"make_private({algorithm!r}): " + "; ".join(problems))
    return derived


class _Missing(Exception):
    """A theorem's default needs a setting that is not there."""


def _radius(settings: Mapping[str, Any], stream: str, needed_for: str) -> float:
    """The clip radius of ``stream`` (the first number where a stream takes a pair)."""
    clip = settings.get("clip")
    value = clip.get(stream) if isinstance(clip, Mapping) else None
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if not isinstance(value, (int, float)) or not value > 0:
        raise _Missing(f"{needed_for}) needs clip[{stream!r}] > 0")
    return float(value)


def _period(tau: float, steps: int) -> int:
    """``T = max(1, tau R)``, a whole number of steps in ``[1, R]``."""
    return int(min(steps, max(1, round(tau * steps))))


def _diff2_restart(settings: Mapping[str, Any], p: Public) -> Derived:
    """DIFF2-GD, Theorem 4.3: ``T = max(1, tau R)``, ``tau = (G^2 sqrt(d) / (L n P epsilon))^(2/3)``."""
    theorem = "DIFF2 Theorem 4.3, T = max(1, tau R), tau = (C1^2 sqrt(d) / (C2 n P epsilon))^(2/3)"
    c1, c2 = _radius(settings, "restart", theorem), _radius(settings, "difference", theorem)
    tau = (c1**2 * math.sqrt(p.dimension) / (c2 * p.n * p.clients * p.epsilon)) ** (2 / 3)
    value = _period(tau, p.steps)
    return Derived(value, f"{theorem}: C1={c1:g}, C2={c2:g}, d={p.dimension}, n={p.n}, P={p.clients}, "
                          f"epsilon={p.epsilon:g}, R={p.steps}: tau={tau:.3g}, T={value}")


def _private_diff_restart(settings: Mapping[str, Any], p: Public) -> Derived:
    """PrivateDiff, Theorem 6 (its proof): ``T = max(1, (G^2 sqrt(d) / (l n epsilon))^(2/3) R)``."""
    theorem = "PrivateDiff Theorem 6, T = max(1, tau R), tau = (C1^2 sqrt(d) / (C2 n epsilon))^(2/3)"
    c1, c2 = _radius(settings, "checkpoint", theorem), _radius(settings, "difference", theorem)
    tau = (c1**2 * math.sqrt(p.dimension) / (c2 * p.n * p.epsilon)) ** (2 / 3)
    value = _period(tau, p.steps)
    return Derived(value, f"{theorem}: C1={c1:g}, C2={c2:g}, d={p.dimension}, n={p.n}, "
                          f"epsilon={p.epsilon:g}, R={p.steps}: tau={tau:.3g}, T={value}")


def _private_diff_y_steps(settings: Mapping[str, Any], p: Public) -> Derived:
    """PrivateDiff's ``T2``. With ``y_release="output"``, Theorem 6's iteration count of the inner solve,
    ``T2 = max((n epsilon)^(4/3) / d^(2/3), T R d^(1/3) / (n epsilon)^(2/3))`` (a cap: the solve stops once
    it certifies). With ``"ascent"`` every ascent step is a release of its own, which the theorem does not
    cover; one step per round, as DP-SGDA takes."""
    if settings.get("y_release", "ascent") != "output":
        return Derived(1, "y_release='ascent': one noisy ascent step per round (as DP-SGDA); Theorem 6's "
                          "T2 counts the iterations of the inner solve of y_release='output'")
    ne, d = p.n * p.epsilon, p.dimension
    restart = settings["restart"]
    value = math.ceil(max(ne ** (4 / 3) / d ** (2 / 3), restart * p.steps * d ** (1 / 3) / ne ** (2 / 3)))
    return Derived(value, f"PrivateDiff Theorem 6, T2 = max((n eps)^(4/3) / d^(2/3), T R d^(1/3) / "
                          f"(n eps)^(2/3)): n={p.n}, epsilon={p.epsilon:g}, d={d}, T={restart}, "
                          f"R={p.steps}: T2={value}")


def _spider_restart(settings: Mapping[str, Any], p: Public) -> Derived:
    """DP-DRO, Theorem 7 (its proof): ``q = (n epsilon / sqrt(d log(1/delta)))^(2/3)``."""
    q = (p.n * p.epsilon / math.sqrt(p.dimension * math.log(1 / p.delta))) ** (2 / 3)
    value = int(min(p.steps, max(1, round(q))))
    return Derived(value, f"DP-DRO Theorem 7, q = (n epsilon / sqrt(d log(1/delta)))^(2/3): n={p.n}, "
                          f"epsilon={p.epsilon:g}, d={p.dimension}, delta={p.delta:g}: q={value}")


def _spider_batch_sizes(streams: tuple[str, str, str, str], refresh: tuple[str, ...]):
    """DP-DRO, Theorem 8: a full batch on the refresh streams (``b1 = n``) and on the difference streams
    ``b2 = max((G n eps / sqrt(Psi0 L d log(1/delta)))^(2/3), (G n d log(1/delta))^(1/3) /
    ((L Psi0)^(1/6) eps^(2/3)))``, capped at ``n``, with ``G``, ``L`` the refresh and difference radii."""

    def rule(settings: Mapping[str, Any], p: Public) -> Derived:
        theorem = "DP-DRO Theorem 8, b1 = n, b2 = max((G n eps / sqrt(L d log(1/delta)))^(2/3), " \
                  "(G n d log(1/delta))^(1/3) / (L^(1/6) eps^(2/3)))"
        sizes = {}
        for stream in streams:
            if stream in refresh:
                sizes[stream] = p.n
                continue
            g = _radius(settings, refresh[streams.index(stream) // 2], theorem)
            lip = _radius(settings, stream, theorem)
            log_d = math.log(1 / p.delta)
            b2 = max((g * p.n * p.epsilon / math.sqrt(lip * p.dimension * log_d)) ** (2 / 3),
                     (g * p.n * p.dimension * log_d) ** (1 / 3) / (lip ** (1 / 6) * p.epsilon ** (2 / 3)))
            sizes[stream] = int(min(p.n, max(1, math.ceil(b2))))
        why = f"{theorem} (Psi0 = 1): n={p.n}, epsilon={p.epsilon:g}, d={p.dimension}: {sizes}"
        return Derived(sizes, why)

    return rule


_RULES: dict[str, dict[str, Any]] = {
    "diff2": {"restart": _diff2_restart},
    "private-diff": {"restart": _private_diff_restart, "y_steps": _private_diff_y_steps},
    "double-spider": {
        "restart": _spider_restart,
        "batch_sizes": _spider_batch_sizes(("eta-refresh", "eta-difference", "x-refresh", "x-difference"),
                                           ("eta-refresh", "x-refresh")),
    },
    "recursive-spider": {
        "restart": _spider_restart,
        "batch_sizes": _spider_batch_sizes(("v-refresh", "v-difference", "u-refresh", "u-difference"),
                                           ("v-refresh", "u-refresh")),
    },
}
