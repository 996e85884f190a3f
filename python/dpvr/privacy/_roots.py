"""A root finder for the calibrations: the RDP design's (:mod:`dpvr.privacy.calibration`) and the PLD's
(:mod:`dpvr.privacy.pld.calibration`)."""

from __future__ import annotations

from collections.abc import Callable


def secant_root(
    gap: Callable[[float], float],
    x: float,
    tol: float = 1e-11,
    *,
    slope: float = -2.0,
    band: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, float]:
    """Root of a decreasing ``gap`` near ``x``: secant steps, bisection once bracketed and a step leaves it.

    Every gap here is a log-RDP (or log-epsilon) against a log noise scale, close to a line of slope ``-2``
    (RDP) or about ``-1`` (epsilon), the first step's ``slope``. Stops at a point whose gap lies in
    ``band = (low, high)``, or after a step of at most ``tol`` (relative); returns that point and the last
    secant slope, which starts a search of a nearby gap.
    """
    g = gap(x)
    above = below = None  # the nearest points with gap > 0 (smaller x) and gap < 0 (larger x)
    for _ in range(200):
        if band[0] <= g <= band[1]:
            return x, slope
        if g > 0:
            above = x if above is None else max(above, x)
        else:
            below = x if below is None else min(below, x)
        x_new = x + min(5.0, max(-5.0, -g / slope))
        if above is not None and below is not None and not above < x_new < below:
            x_new = 0.5 * (above + below)
        g_new = gap(x_new)
        if x_new != x and (g_new - g) / (x_new - x) < 0:
            slope = (g_new - g) / (x_new - x)
        if abs(x_new - x) <= tol * max(1.0, abs(x_new)):
            return x_new, slope
        x, g = x_new, g_new
    raise RuntimeError("noise calibration did not converge")


__all__ = ["secant_root"]
