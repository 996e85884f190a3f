"""The error proxy that ``shares="auto"`` minimises: what each stream's noise costs the final iterate.

Every variance-reduced algorithm's convergence bound has a noise term of one shape. DIFF2 (Murata &
Suzuki, proof of Proposition D.2): ``E||v_r - grad f(x_{r-1})||^2 = sigma_1^2 C_1^2 d + sigma_2^2 d
sum_{r'} C_{2,r'}^2``, the sum over the difference rounds since the last restart; PrivateDiff (Zhang et al.,
Lemma 15) adds the ascent's error ``l E||y_r - y*||^2`` to the same two terms; the SPIDER estimators of the
DRO paper have one such term per estimator. Averaged over the rounds (the next step of the same proof;
PrivateDiff's Lemma 16) it is, per unit clip radius,

    V(z) = sum_s  d_s * exposure_s * (z_s * scale_s)^2,

with, for stream ``s``:

- ``d_s``: the length of the released vector (the model's parameter count for x-streams, ``y``'s length
  for a minimax ``y``, 1 for a scalar dual);
- ``z_s * scale_s``: the noise std on the released vector per unit of its clip radius (``scale_s`` is
  ``1 / b_s`` for a mean over ``b_s`` records; :meth:`~dpvr.privacy.events.Plan.stream_scale`);
- ``exposure_s``: how many of the stream's noise draws the estimator carries, averaged over the steps.
  A reset release (a restart / checkpoint / refresh) is carried until the next reset: exposure 1. A
  difference release is added to the estimator and carried until the next reset: a period of ``L`` rounds
  carries ``0 + 1 + ... + (L - 1)`` of them, so the exposure is ``sum_periods L (L - 1) / 2`` over the
  number of rounds (the exact form of the papers' ``T sigma_2^2`` bound). A local step of DIFF2's
  BVR-L-SGD carries the local draws of its own round only: ``(K - 1) / 2``. PrivateDiff's ``T_2`` ascent
  releases per round enter through ``y``'s error after ``T_2`` steps of SGA, which Lemma 12 (Rakhlin et
  al., the paper's Eq. 48) bounds by the gradients' second moment over ``mu^2 T_2``: exposure
  ``1 / T_2`` (with ``l / mu^2`` taken as 1). One-step releases (DP-SGDA's x and y, the STORM value, an
  output perturbation) have exposure 1.

Only public quantities enter: the plan (counts, schedule, batch sizes), the dimensions and, optionally,
``units_s``: the public quantity each stream's noise multiplier is relative to (its clip radius, or an output
perturbation's sensitivity), relative to the others, which multiplies ``scale_s`` (default 1: equal radii).
PrivateDiff's ``y`` by output perturbation needs it: its noise is relative to a sensitivity ``Delta`` of
order ``1/n``, three orders of magnitude below the x-streams' clip radius. What the proxy leaves out,
knowingly: a difference radius ``C_2 ||x_r - x_{r-1}||`` (unknown before the run and usually smaller than
the reset radius, which would move budget away from difference streams; taken equal to it) and the
problem's constants (``l``, ``mu``, step sizes).

Minimising ``V`` under the budget. At the run's RDP order ``alpha``, a release spends ``R_s(z_s)`` of the RDP
budget ``E``. With ``R_s = k_s / z_s^2`` (an unsampled Gaussian exactly, a sampled one at small rates) and
``W_s = d_s exposure_s scale_s^2``, the Lagrangian of ``min sum_s W_s z_s^2`` subject to
``sum_s k_s / z_s^2 = E`` is stationary where ``W_s = lambda k_s / z_s^4``, i.e. ``z_s^2 = sqrt(k_s / (lambda
W_s))``: each stream's share of the budget, ``k_s / (z_s^2 E)``, is proportional to ``sqrt(k_s W_s)`` and
equals its share of the proxy, ``W_s z_s^2 / V`` (the objective is convex in the precisions ``1/z_s^2`` and
the constraint linear, so this is the minimum). For a general ``R_s`` with log-log slope ``-g_s`` the same
condition reads ``share_s ∝ W_s z_s^2 * 2 / g_s``; :func:`dpvr.privacy.calibrate` solves it by a fixed-point
iteration on the shares of its joint calibration (the order is optimal at the solution, so by the envelope
theorem its shift does not enter the stationarity condition).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol


class HasYDim(Protocol):
    """A minimax problem: ``y`` is a vector of ``y_dim`` coordinates."""

    y_dim: int


class ProxyPlan(Protocol):
    """What the error proxy reads from a plan; every :class:`~dpvr.privacy.events.Plan` has it, and each
    algorithm's plan states its own (:meth:`~dpvr.privacy.events.Plan.exposures`,
    :meth:`~dpvr.privacy.events.Plan.stream_vector`, :meth:`~dpvr.privacy.events.Plan.stream_scale`)."""

    @property
    def streams(self) -> tuple[str, ...]: ...

    def exposures(self) -> dict[str, float]: ...

    def stream_vector(self, stream: str) -> str: ...

    def stream_scale(self, stream: str) -> float: ...


def exposures(plan: ProxyPlan) -> dict[str, float]:
    """Per stream with releases: the noise draws the estimator carries per step (see the module docs), as
    the plan states them (:meth:`~dpvr.privacy.events.Plan.exposures`). A mechanism factory that is no
    plan, or a plan without an error proxy, is refused."""
    carried = getattr(plan, "exposures", None)
    if carried is None:
        raise ValueError(f"shares='auto' has no error proxy for {type(plan).__name__}")
    return carried()


def stream_dimensions(plan: ProxyPlan, parameters: int, problem: HasYDim | None = None) -> dict[str, int]:
    """The length of the vector each stream of ``plan`` releases, from the algorithm's public shapes.

    ``parameters``: the model's trainable parameter count (the x-streams); ``problem``: the minimax problem,
    whose ``y_dim`` is the length of ``y`` (left out when not given). DRO duals (Double-SPIDER's eta,
    Recursive-SPIDER's lambda-gradient ``u`` and STORM value ``s``) are scalars. The plan says which is which
    (:meth:`~dpvr.privacy.events.Plan.stream_vector`).
    """
    dimensions: dict[str, int] = {}
    for stream in plan.streams:
        vector = plan.stream_vector(stream)
        if vector == "y":
            if problem is not None:
                dimensions[stream] = int(problem.y_dim)
        elif vector == "scalar":
            dimensions[stream] = 1
        elif vector == "parameters":
            dimensions[stream] = int(parameters)
        else:
            raise ValueError(
                f"{type(plan).__name__}: stream {stream!r} releases a {vector!r}; the error proxy knows "
                "'parameters', 'y' and 'scalar'"
            )
    return dimensions


def proxy_weights(
    plan: ProxyPlan, dimensions: Mapping[str, int] | None, units: Mapping[str, float] | None = None
) -> dict[str, float]:
    """``W_s = d_s * exposure_s * (units_s * scale_s)^2``: the proxy is ``sum_s W_s z_s^2`` (see the module
    docs).

    ``dimensions`` must give every stream with releases a length >= 1 and name no other stream; ``units``
    (default 1 per stream) may name some of the streams, each with a finite unit > 0.
    """
    streams = tuple(plan.streams)
    given = dict(dimensions or {})
    unknown = sorted(set(given) - set(streams))
    missing = [s for s in streams if s not in given]
    if unknown or missing:
        raise ValueError(
            f"dimensions must give exactly the streams {streams}; missing {missing}, unknown {unknown}"
        )
    for stream, d in given.items():
        if isinstance(d, bool) or not float(d).is_integer() or d < 1:
            raise ValueError(f"dimension of stream {stream!r}: must be an integer >= 1, got {d!r}")
    unit = dict.fromkeys(streams, 1.0)
    for stream, value in (units or {}).items():
        if stream not in unit:
            raise ValueError(f"units: {stream!r} is not a stream of the plan {streams}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"unit of stream {stream!r}: must be finite and > 0, got {value!r}")
        unit[stream] = float(value)
    carried = exposures(plan)
    return {s: given[s] * carried[s] * (unit[s] * plan.stream_scale(s)) ** 2 for s in streams}


def proxy(
    plan: ProxyPlan,
    noise: Mapping[str, float],
    dimensions: Mapping[str, int],
    units: Mapping[str, float] | None = None,
) -> float:
    """The error proxy ``V`` of a run of ``plan`` with noise multipliers ``noise``."""
    weights = proxy_weights(plan, dimensions, units)
    return math.fsum(w * noise[s] ** 2 for s, w in weights.items())


__all__ = ["HasYDim", "ProxyPlan", "exposures", "proxy", "proxy_weights", "stream_dimensions"]
