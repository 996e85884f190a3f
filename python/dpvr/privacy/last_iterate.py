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

from . import _checks

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


def step_limit(weak_convexity: float, smoothness: float, clipping: bool) -> float:
    total = weak_convexity + smoothness
    if total == 0:
        return math.inf
    return 1 / (2 * total) if clipping else 1 / total


def check_settings(lr: float, clip: float, batch_size: int, weak_convexity: float, smoothness: float) -> None:
    _checks.positive("lr", lr)
    _checks.positive("clip", clip)
    _checks.count("batch_size", batch_size, minimum=1)
    _checks.non_negative("weak_convexity", weak_convexity)
    _checks.non_negative("smoothness", smoothness)


def require_step(lr: float, limit: float, theorem: str) -> None:
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
    check_settings(lr, clip, batch_size, weak_convexity, smoothness)
    _checks.positive("sigma", sigma)
    _checks.non_negative("domain_diameter", domain_diameter)
    require_step(lr, step_limit(weak_convexity, smoothness, clipping=True), "Theorem 2.2")
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
    check_settings(lr, clip, batch_size, weak_convexity, smoothness)
    _checks.positive("sigma", sigma)
    ell = passes_length(dataset_size, batch_size)
    epochs = _checks.count("steps", steps, minimum=1) // ell
    require_step(lr, step_limit(weak_convexity, smoothness, clipping), "Theorem 2.3")
    log_l_sq = _log_l_lambda_sq(lr, weak_convexity, smoothness) + (math.log(2) if clipping else 0.0)
    return 4 * (lr * clip / (batch_size * sigma)) ** 2 * (1 + epochs * _theta_from_log(log_l_sq, ell))


def passes_length(dataset_size: int, batch_size: int) -> int:
    dataset_size = _checks.count("dataset_size", dataset_size, minimum=1)
    batch_size = _checks.count("batch_size", batch_size, minimum=1)
    if dataset_size % batch_size:
        raise ValueError(
            f"batch_size ({batch_size}) must divide dataset_size ({dataset_size}) for cyclic batches"
        )
    return dataset_size // batch_size






__all__ = [
    "BOUNDS",
    "check_settings",
    "l_lambda",
    "passes_length",
    "require_step",
    "step_limit",
    "theorem_2_2_rho",
    "theorem_2_3_rho",
    "theta",
]
