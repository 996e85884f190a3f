"""The PLD accountant's calibration hook: the common scale of an RDP design's noise at which the PLD spends
the target epsilon (:meth:`dpvr.privacy.pld.PldBackend.calibrate`; the design is
:mod:`dpvr.privacy.calibration`'s).

The RDP design at its best order fixes the ratios between streams and :func:`pld_scale` sets their common
scale: a secant search in log-epsilon against log-scale on a loss grid ten times coarser than the
accountant's, a Richardson extrapolation of the coarse epsilon to the accountant's grid, and a confirmation
there, where the run spends between ``(1 - 1e-3) epsilon`` and ``epsilon`` as the accountant composes it
(:func:`~dpvr.privacy.pld.composition.pld_epsilon`, the same multiset of releases, canonical order and grid
as a ledger's), so the budget guard and the report of the calibrated run read the cached result.
"""

from __future__ import annotations

import math
from typing import Any

from .._roots import secant_root
from .composition import pld_epsilon
from .subsampling import PLD_DISCRETIZATION

#: The PLD search runs on a loss grid ten times coarser than the accountant's, where an evaluation is several
#: times cheaper. A pessimistic connect-the-dots PLD (dp_accounting's, and dpvr's built from it) over-states
#: epsilon by about ``k h^2`` on a grid of width ``h`` (``k`` depends on the run): the epsilon on the
#: accountant's grid is predicted from the coarse one and one at half its width (Richardson extrapolation)
#: to within a few 1e-5 relative. dpvr's random-allocation PLD refines its own grids down to the loss grid, so
#: its coarse epsilon is cheaper and higher too. Where the accountant coarsens its grid (little noise), the
#: extrapolation is off and the search on the accountant's grid takes a few more steps.
_COARSE_INTERVAL = 10 * PLD_DISCRETIZATION
#: A PLD calibration spends between ``(1 - _PLD_RTOL) epsilon`` and ``epsilon`` on the accountant's grid; it
#: aims at ``(1 - _PLD_RTOL / 20) epsilon``, which the extrapolation usually hits at the first try.
_PLD_RTOL = 1e-3


def pld_scale(
    factory: Any, noise: dict[str, float], epsilon: float, delta: float
) -> dict[str, float]:
    """Scale the RDP solution by the common factor at which the PLD accountant spends ``epsilon``, to within
    a relative ``_PLD_RTOL`` below it.

    A secant search in log-epsilon against log-scale (nearly linear in each other) finds the factor on the
    coarse grid; the extrapolated epsilon on the accountant's grid and the search's last slope then give the
    first guess there, where the same search goes on until epsilon lies in ``[(1 - _PLD_RTOL) epsilon,
    epsilon]`` (usually at once). That last PLD is composed as :class:`~dpvr.privacy.Accountant` composes a
    run's ledger, so the calibrated run passes the budget guard release by release and reports at most
    ``epsilon`` (and finds its PLDs built). Guarantee: the returned noise spends at most ``epsilon`` at
    ``delta`` as the accountant prices it, or a ``RuntimeError`` is raised.
    """
    spent: dict[tuple[float, float], float] = {}  # epsilon by (log-scale, grid width)

    def log_epsilon(log_scale: float, interval: float) -> float:
        if (log_scale, interval) not in spent:
            scaled = factory({k: v * math.exp(log_scale) for k, v in noise.items()})
            spent[log_scale, interval] = pld_epsilon(scaled, delta, interval)
        return math.log(min(max(spent[log_scale, interval], 1e-300), 1e300))

    # Gaps are log-epsilon minus the aim's; the accepted band is narrowed by a hair at the top so that
    # round-off keeps an accepted point within epsilon.
    aim = math.log(epsilon) + math.log1p(-_PLD_RTOL / 20)
    band = (math.log1p(-_PLD_RTOL) - math.log1p(-_PLD_RTOL / 20), -math.log1p(-_PLD_RTOL / 20) - 1e-12)
    # A first slope of -2: epsilon falls faster than 1/scale where sampling amplifies (small rates), and a
    # shallower guess overshoots into large epsilons, whose PLDs are the widest and dearest to build.
    log_scale, slope = secant_root(
        lambda x: log_epsilon(x, _COARSE_INTERVAL) - aim, 0.0, slope=-2.0, band=(-_PLD_RTOL, _PLD_RTOL)
    )
    # Richardson: eps(h) = eps_0 + k h^2, from h and h/2, extrapolated to the accountant's grid.
    coarse, half = (math.exp(log_epsilon(log_scale, h)) for h in (_COARSE_INTERVAL, _COARSE_INTERVAL / 2))
    curvature = (coarse - half) / (0.75 * _COARSE_INTERVAL**2)
    predicted = coarse - curvature * (_COARSE_INTERVAL**2 - PLD_DISCRETIZATION**2)
    if predicted > 0:
        log_scale -= (math.log(predicted) - aim) / slope
    log_scale, _ = secant_root(
        lambda x: log_epsilon(x, PLD_DISCRETIZATION) - aim, log_scale, tol=0.0, slope=slope, band=band
    )
    final = spent[log_scale, PLD_DISCRETIZATION]
    if not final <= epsilon:  # the band ensures it; the guarantee, made explicit
        raise RuntimeError(f"PLD calibration overshot epsilon={epsilon}: {final}")
    return {k: v * math.exp(log_scale) for k, v in noise.items()}


__all__ = ["pld_scale"]
