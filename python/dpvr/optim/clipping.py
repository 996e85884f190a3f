"""DP-SGD's clipping policies beside flat clipping: per-layer radii and private adaptive clipping.

**Per-layer** (``clipping="per_layer"``): each record's gradient on parameter group ``l`` is clipped to
``C_l`` on its own (:class:`dpvr.grads.layer_clip.LayerRadii`, honoured by the ghost and the materialised
paths), so one record's whole clipped gradient has norm at most ``sqrt(sum_l C_l^2)``: the radius the release
is priced at (its add/remove sensitivity; replace-one twice it).

**Adaptive** (``clipping="adaptive"``, Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially private
learning with adaptive clipping"): the radius ``C_t`` follows a target quantile ``gamma`` of the per-record
gradient norms. Each step releases, on the step's batch,

- the clipped gradient sum at ``C_t`` plus ``N(0, (z_g C_t)^2 I)``, and
- the shifted count ``b = sum_i (1[||g_i|| <= C_t] - 1/2) + N(0, sigma_b^2)``,

then sets ``C_{t+1} = C_t exp(-eta_C (b_frac - gamma))`` with ``b_frac = (b + B/2) / B`` for the public
(expected) batch size ``B``. Subtracting ``1/2`` per record makes the count move by at most ``1/2`` when a
record is added or removed (and by 1 when one is replaced), half a clipped gradient's move under either
relation; for a fixed-size batch the shift is undone exactly by ``+ B/2``, for a Poisson batch it adds the
public-rate estimate's error ``(B - |batch|) / 2``, a function of the batch size only.

Pricing (dpvr's convention: a noise multiplier is the std over the add/remove bound, which the replace-one
accountant doubles for both parts alike): the pair is one Gaussian mechanism on the concatenated vector
``(gradient sum, count)`` whose parts move by ``C_t`` and ``1/2`` (units) with stds ``z_g C_t`` and
``sigma_b``, so its noise multiplier ``z`` satisfies ``1/z^2 = 1/z_g^2 + 1/(2 sigma_b)^2``. Given the user's
``z`` (or the one calibrated to the budget), :func:`split_noise` raises the gradient's to
``z_g = (z^-2 - (2 sigma_b)^-2)^-1/2`` so the pair costs what one release at ``z`` would; that needs
``sigma_b > z / 2``. This is Andrew et al.'s relation under add/remove, and, because the shift halves the
count's unit, the same relation holds under replace-one (an unshifted count, moving by 1 under add/remove,
would need ``1/z_g^2 = 1/z^2 - 1/sigma_b^2``). The accountant records exactly that group per step
(:class:`dpvr.algorithms.dp_sgd.plan.AdaptiveClipDPSGDPlan`).

Post-processing: ``C_t`` is a function of the initial radius (public), ``gamma``, ``eta_C``, ``B`` and the
counts released before step ``t`` only; the radius in force at a step therefore reads no private data beyond
earlier releases, and each step's pair is a Gaussian mechanism at multiplier ``z`` whatever ``C_t`` is
(adaptive composition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: the values DPSGD's ``clipping`` takes (``True`` is ``"flat"``)
POLICIES = (True, False, "flat", "per_layer", "adaptive")


def check_policy(clipping: object) -> str:
    """The policy's name (``"flat"``, ``"none"``, ``"per_layer"``, ``"adaptive"``), or ``ValueError``."""
    if clipping is True or clipping == "flat":
        return "flat"
    if clipping is False:
        return "none"
    if isinstance(clipping, str) and clipping in ("per_layer", "adaptive"):
        return clipping
    raise ValueError(
        f"clipping: True or 'flat' (each record's whole gradient clipped to clip), 'per_layer' (each "
        f"parameter group to its own radius), 'adaptive' (a private quantile of the norms, Andrew et al.) or "
        f"False (sampling='cyclic' only); got {clipping!r}"
    )


def split_noise(z: float, count_noise: float) -> tuple[float, float]:
    """``(z_g, z_b)``: the gradient's noise multiplier and the count's (``2 sigma_b``) such that the pair
    costs no more than one Gaussian release at ``z`` (``1/z_g^2 + 1/z_b^2 <= 1/z^2`` as the accountant sums
    them: ``z_g`` is nudged up past any rounding).

    Raises:
        ValueError: ``count_noise <= z / 2`` (the count alone would cost as much as the whole budget of a
            step, leaving no room for the gradient).
    """
    z_b = 2.0 * count_noise
    if not z_b > z:
        raise ValueError(
            f"count_noise: the count's noise std sigma_b = {count_noise:g} is too small for the noise "
            f"multiplier z = {z:g}: the pair of releases costs one at z only if sigma_b > z/2 = {z / 2:g} "
            "(the gradient's multiplier is (z^-2 - (2 sigma_b)^-2)^-1/2); Andrew et al. use sigma_b = "
            "batch_size / 20"
        )
    z_g = (z**-2 - z_b**-2) ** -0.5
    while math.fsum((z_g**-2, z_b**-2)) ** -0.5 < z:  # the accountant's group multiplier, never below z
        z_g = math.nextafter(z_g, math.inf)
    return z_g, z_b


@dataclass
class AdaptiveRadius:
    """The radius of private adaptive clipping (see the module documentation): ``radius`` in force, updated
    from each released count by :meth:`update`.

    Raises (at construction) ``ValueError`` for ``quantile`` outside (0, 1), ``lr <= 0``, ``count_noise <= 0``
    or a radius that is not a finite number > 0."""

    radius: float
    quantile: float
    lr: float
    count_noise: float

    def __post_init__(self) -> None:
        if not (isinstance(self.quantile, (int, float)) and 0 < self.quantile < 1):
            raise ValueError(f"target_quantile: the fraction of records left unclipped, in (0, 1); got "
                             f"{self.quantile!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"clip_lr: the geometric step of the radius must be > 0, got {self.lr!r}")
        if not (isinstance(self.count_noise, (int, float)) and math.isfinite(self.count_noise)
                and self.count_noise > 0):
            raise ValueError(f"count_noise: the count's noise std must be > 0, got {self.count_noise!r}")
        if not (math.isfinite(self.radius) and self.radius > 0):
            raise ValueError(f"clip: the initial radius must be a finite number > 0, got {self.radius!r}")
        self.radius, self.quantile = float(self.radius), float(self.quantile)
        self.lr, self.count_noise = float(self.lr), float(self.count_noise)

    def update(self, released: float, batch_size: float) -> float:
        """``C <- C exp(-lr (b_frac - quantile))`` with ``b_frac = (released + B/2) / B`` from the released
        shifted count (post-processing); returns the new radius. A radius that over- or underflows the
        floats raises ``RuntimeError`` (the run stops; nothing is released at it)."""
        fraction = (released + batch_size / 2.0) / batch_size
        exponent = -self.lr * (fraction - self.quantile)
        radius = self.radius * math.exp(exponent) if abs(exponent) < 700 else math.inf
        if not (math.isfinite(radius) and radius > 0):
            raise RuntimeError(f"adaptive clipping: the radius left the floating-point range ({radius!r}); "
                               "lower clip_lr")
        self.radius = radius
        return radius
