"""Last-iterate RDP of cyclically traversed, clipped DP-SGD with a proximal term (Kong & Ribero).

Algorithm 1 of the paper: batches ``B_t`` of ``b`` records in a fixed cyclic order over ``k`` records
(``ell = k/b`` steps per pass, ``b`` divides ``k``); ``X_t = prox_{lr h}(X_{t-1} - lr g_t + N_t)`` with
``g_t`` the mean of per-example gradients clipped at ``C`` and ``N_t ~ N(0, sigma^2 I)`` in parameter space;
only ``X_T`` is released. Losses are ``m``-weakly convex and ``M``-upper-smooth (assumption A2, also for the
neighbouring losses, A3); ``h`` is convex, proper and lower-semicontinuous (A1). The neighbouring relation is
replacement of one record.

Both bounds are linear in the RDP order, ``D_alpha(X_T || X'_T) <= rho * alpha``:

- Theorem 2.2 (``dom h`` of diameter ``d_h``, ``lr <= 1/(2(m+M))``):
  ``rho = (L d_h + 2 lr C / b)^2 / (2 sigma^2)``. The paper uses ``L = L_lambda``, which its Proposition
  2.1(c) justifies only without clipping; dpvr uses ``sqrt(2) L_lambda`` whenever clipping may be active
  (Proposition 2.1(b)).
- Theorem 2.3 (any ``h``): ``rho = 4 (lr C / (b sigma))^2 (1 + E theta_L(ell))`` with ``E = floor(T/ell)``
  and ``L = sqrt(2) L_lambda`` when clipping may be active (``lr <= 1/(2(m+M))``), ``L = L_lambda`` when no
  per-example gradient norm ever exceeds ``C`` (``lr <= 1/(m+M)``). The constant ``4`` is the theorem's;
  its proof supports ``2``, and dpvr keeps the safe one.

Here ``L_lambda = sqrt(1 + 2 lr m (1 + m / (2 (M + m))))`` and
``theta_L(s) = L^(2(s-1)) / sum_{j<s} L^(2j)``, computed as ``(1 - L^-2) / (1 - L^-2s)`` from ``log L^2`` so
that it stays finite and accurate for ``ell`` up to 10^6 and more.

A curve ``rho * alpha`` is dp_accounting's ``ZCDpEvent(rho)``: its RDP accountant adds ``rho * alpha`` at
every order, so the bound composes with any other event recorded in the same accountant (the PLD accountant
cannot take it). In dpvr's noise-multiplier convention ``sigma = lr z C / b``, and every bound is
``rho = unit / z^2``; :class:`CyclicDPSGDPlan` is the plan (mechanism factory) for ``account``/``calibrate``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from . import _checks
from .accountant import Accountant
from .backends import RDP
from .events import Plan
from .mechanism import Stream
from .relations import REPLACE_ONE, check_neighbouring

BOUNDS = ("best", "last-iterate", "composition")


def _log_l_lambda_sq(lr: float, weak_convexity: float, smoothness: float) -> float:
    """``log L_lambda^2`` via ``log1p`` (exact even when ``lr * m`` is tiny)."""
    m, big_m = weak_convexity, smoothness
    if m == 0:
        return 0.0
    return math.log1p(2 * lr * m * (1 + m / (2 * (big_m + m))))


def l_lambda(lr: float, weak_convexity: float, smoothness: float) -> float:
    """``L_lambda(m, M) = sqrt(1 + 2 lr m (1 + m / (2 (M + m))))`` (eq. 13; 1 when ``m = 0``)."""
    return math.exp(0.5 * _log_l_lambda_sq(lr, weak_convexity, smoothness))


def _theta_from_log(log_l_sq: float, s: int) -> float:
    if s <= 0:
        return 0.0
    if log_l_sq == 0:
        return 1.0 / s
    if log_l_sq > 0:
        return -math.expm1(-log_l_sq) / -math.expm1(-s * log_l_sq)
    # L < 1: theta = L^(2(s-1)) (1 - L^2) / (1 - L^(2s)).
    return math.exp((s - 1) * log_l_sq) * -math.expm1(log_l_sq) / -math.expm1(s * log_l_sq)


def theta(lipschitz: float, s: int) -> float:
    """``theta_L(s) = L^(2(s-1)) / sum_{j<s} L^(2j)`` (eq. 15), ``theta_L(0) = 0``; stable for large ``s``."""
    _checks.positive("lipschitz", lipschitz)
    return _theta_from_log(2 * math.log(lipschitz), _checks.count("s", s))


def _step_limit(weak_convexity: float, smoothness: float, clipping: bool) -> float:
    total = weak_convexity + smoothness
    if total == 0:
        return math.inf
    return 1 / (2 * total) if clipping else 1 / total


def _check_common(lr: float, clip: float, batch_size: int, weak_convexity: float, smoothness: float) -> None:
    _checks.positive("lr", lr)
    _checks.positive("clip", clip)
    _checks.count("batch_size", batch_size, minimum=1)
    _checks.non_negative("weak_convexity", weak_convexity)
    _checks.non_negative("smoothness", smoothness)


def _require_step(lr: float, limit: float, theorem: str) -> None:
    if lr > limit:
        raise ValueError(f"lr={lr} violates {theorem}'s step-size condition lr <= {limit:.6g}")


def theorem_2_2_rho(
    *,
    sigma: float,
    lr: float,
    clip: float,
    batch_size: int,
    domain_diameter: float,
    weak_convexity: float,
    smoothness: float,
    clipping: bool = True,
) -> float:
    """Theorem 2.2: ``rho`` with ``D_alpha(X_T || X'_T) <= rho * alpha`` for a domain of diameter ``d_h``."""
    _check_common(lr, clip, batch_size, weak_convexity, smoothness)
    _checks.positive("sigma", sigma)
    _checks.non_negative("domain_diameter", domain_diameter)
    _require_step(lr, _step_limit(weak_convexity, smoothness, clipping=True), "Theorem 2.2")
    lipschitz = l_lambda(lr, weak_convexity, smoothness) * (math.sqrt(2) if clipping else 1.0)
    return (lipschitz * domain_diameter + 2 * lr * clip / batch_size) ** 2 / (2 * sigma**2)


def theorem_2_3_rho(
    *,
    sigma: float,
    lr: float,
    clip: float,
    batch_size: int,
    dataset_size: int,
    steps: int,
    weak_convexity: float,
    smoothness: float,
    clipping: bool = True,
) -> float:
    """Theorem 2.3: ``rho`` with ``D_alpha(X_T || X'_T) <= rho * alpha``, clipped (17) or unclipped (19)."""
    _check_common(lr, clip, batch_size, weak_convexity, smoothness)
    _checks.positive("sigma", sigma)
    ell = _passes_length(dataset_size, batch_size)
    epochs = _checks.count("steps", steps, minimum=1) // ell
    _require_step(lr, _step_limit(weak_convexity, smoothness, clipping), "Theorem 2.3")
    log_l_sq = _log_l_lambda_sq(lr, weak_convexity, smoothness) + (math.log(2) if clipping else 0.0)
    return 4 * (lr * clip / (batch_size * sigma)) ** 2 * (1 + epochs * _theta_from_log(log_l_sq, ell))


def _passes_length(dataset_size: int, batch_size: int) -> int:
    dataset_size = _checks.count("dataset_size", dataset_size, minimum=1)
    batch_size = _checks.count("batch_size", batch_size, minimum=1)
    if dataset_size % batch_size:
        raise ValueError(
            f"batch_size ({batch_size}) must divide dataset_size ({dataset_size}) for cyclic batches"
        )
    return dataset_size // batch_size


@dataclass(frozen=True)
class CyclicDPSGDPlan(Plan):
    """Cyclic DP-SGD releasing only its last iterate; one stream ``"gradient"`` whose cost is an RDP curve.

    Noise multiplier ``z``: the noise std on the *sum* of the batch's clipped gradients over ``C``, i.e.
    ``sigma = lr z C / b`` in parameter space (:meth:`noise_multiplier`/:meth:`sigma` convert).
    ``clipping=False`` asserts that no per-example gradient norm exceeds ``C`` along either run (the known
    sensitivity case of Theorem 2.3, eq. 19). ``bound``:

    - ``"last-iterate"``: the smaller of Theorem 2.3 and (when ``domain_diameter`` is finite) Theorem 2.2;
      raises if the step-size condition fails;
    - ``"composition"``: plain composition of the ``ceil(T/ell)`` passes, each a Gaussian with
      replace-one sensitivity ``2C`` per record (``2 alpha / z^2`` per pass), valid for every iterate;
    - ``"best"`` (default): the smaller of both, composition alone if the step-size condition fails.
    """

    dataset_size: int
    batch_size: int
    steps: int
    lr: float
    clip: float
    weak_convexity: float = 0.0
    smoothness: float = 0.0
    domain_diameter: float = math.inf
    clipping: bool = True
    bound: str = "best"
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        _check_common(self.lr, self.clip, self.batch_size, self.weak_convexity, self.smoothness)
        _passes_length(self.dataset_size, self.batch_size)
        _checks.count("steps", self.steps, minimum=1)
        if not self.domain_diameter >= 0:
            raise ValueError(f"domain_diameter must be >= 0 (or inf), got {self.domain_diameter!r}")
        if self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {self.bound!r}")
        if check_neighbouring(self.neighbouring) != REPLACE_ONE:
            raise ValueError(
                "the last-iterate bounds are proved for replace-one neighbours; "
                "neighbouring must be 'replace-one'"
            )
        if self.bound == "last-iterate":
            _require_step(
                self.lr, _step_limit(self.weak_convexity, self.smoothness, self.clipping), "Theorem 2.3"
            )

    @property
    def steps_per_pass(self) -> int:
        """``ell = k / b``."""
        return _passes_length(self.dataset_size, self.batch_size)

    def cut(self, steps: int) -> dict[str, Plan]:
        """The run after ``steps`` steps under the last-iterate bound (where its step-size condition holds)
        and under composition of passes: the paper's Figure 1."""
        runs: dict[str, Plan] = {}
        for bound, label in (("last-iterate", "last iterate (Kong & Ribero)"),
                             ("composition", "composition of passes")):
            try:
                runs[label] = replace(self, steps=steps, bound=bound)
            except ValueError:  # the step-size condition of the last-iterate bound fails
                continue
        return runs

    @property
    def passes(self) -> int:
        """Passes started, ``ceil(T / ell)`` (each record is used once per pass)."""
        return -(-self.steps // self.steps_per_pass)

    def _unit(self, stream: str) -> float:
        # The paper's sigma is the parameter-space noise std: z = b sigma / (lr C).
        return self.batch_size / (self.lr * self.clip)

    @property
    def _last_iterate_ok(self) -> bool:
        return self.lr <= _step_limit(self.weak_convexity, self.smoothness, self.clipping)

    def units(self) -> dict[str, float]:
        """``rho * z^2`` of each applicable bound: ``"theorem 2.3"``, ``"theorem 2.2"``, ``"composition"``."""
        units = {"composition": 2.0 * self.passes}
        if self.bound == "composition" or not self._last_iterate_ok:
            return units
        sigma = 1.0 / self._unit("gradient")  # the parameter-space std at z = 1
        common = dict(
            sigma=sigma,
            lr=self.lr,
            clip=self.clip,
            batch_size=self.batch_size,
            weak_convexity=self.weak_convexity,
            smoothness=self.smoothness,
            clipping=self.clipping,
        )
        units["theorem 2.3"] = theorem_2_3_rho(dataset_size=self.dataset_size, steps=self.steps, **common)
        theorem_2_2_applies = self.lr <= _step_limit(self.weak_convexity, self.smoothness, clipping=True)
        if math.isfinite(self.domain_diameter) and theorem_2_2_applies:
            units["theorem 2.2"] = theorem_2_2_rho(domain_diameter=self.domain_diameter, **common)
        if self.bound == "last-iterate":
            del units["composition"]
        return units

    def active_bound(self) -> str:
        """The bound whose curve is used (the smallest applicable one)."""
        units = self.units()
        return min(units, key=units.get)

    def _streams(self, noise):
        z = noise.get("gradient", 1.0)
        if self.active_bound() == "composition":  # "best" included: the Gaussians themselves, as tight
            return [Stream("gradient", z, self.passes)]
        return [Stream("gradient", z, 1, zcdp_unit=self.units()[self.active_bound()])]

    def _assumptions(self):
        limit = _step_limit(self.weak_convexity, self.smoothness, self.clipping)
        notes = [
            f"cyclic batches of {self.batch_size} over {self.dataset_size} records "
            f"({self.steps_per_pass} steps per pass), {self.steps} steps; only the last iterate is released",
            f"bound used: {self.active_bound()}",
        ]
        if self.bound == "composition" or self.active_bound() == "composition":
            if not self._last_iterate_ok:
                notes.append(
                    f"lr={self.lr} exceeds the last-iterate step-size condition lr <= {limit:.6g}; "
                    "plain composition used"
                )
            return tuple(notes)
        notes += [
            f"losses are {self.weak_convexity:g}-weakly convex and {self.smoothness:g}-upper-smooth on "
            "dom h, for both neighbouring datasets (A2, A3); h convex, proper, lower-semicontinuous (A1)",
            f"step size lr={self.lr:g} <= {limit:.6g}",
            (
                "clipping may be active: Lipschitz constant sqrt(2) L_lambda"
                if self.clipping
                else f"no clipping: every per-example gradient norm along both runs is <= C={self.clip:g}"
            ),
            "Theorem 2.3 with its stated constant 4 alpha (its proof gives 2 alpha)",
        ]
        if "theorem 2.2" in self.units():
            notes.append(
                f"dom h has diameter {self.domain_diameter:g} (Theorem 2.2, with sqrt(2) L_lambda "
                "whenever clipping may be active)"
            )
        return tuple(notes)


def epsilon_by_epoch(
    plan: CyclicDPSGDPlan, noise_multiplier: float, delta: float, epochs: Sequence[int]
) -> dict[str, np.ndarray]:
    """epsilon at ``delta`` after each number of epochs: the last-iterate bound and plain composition.

    The curves of the paper's Figure 1, converted to ``(epsilon, delta)`` by dp_accounting's RDP accountant.
    """
    out = {"epochs": np.asarray(epochs, dtype=int), "last-iterate": [], "composition": []}
    for epoch in out["epochs"]:
        steps = _checks.count("epochs", int(epoch), minimum=1) * plan.steps_per_pass
        for bound in ("last-iterate", "composition"):
            run = replace(plan, steps=steps, bound=bound)
            acc = Accountant(RDP.name, REPLACE_ONE)  # the bounds are RDP curves
            acc.record_mechanism(run(noise_multiplier))
            out[bound].append(acc.epsilon(delta))
    return {k: np.asarray(v) for k, v in out.items()}


__all__ = [
    "BOUNDS",
    "CyclicDPSGDPlan",
    "epsilon_by_epoch",
    "l_lambda",
    "theorem_2_2_rho",
    "theorem_2_3_rho",
    "theta",
]
