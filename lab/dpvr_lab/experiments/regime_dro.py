"""Where Recursive-SPIDER wins: DP Recursive-SPIDER against DP-SGD on the dual, on a KL-penalised DRO problem
whose constants are known.

The problem. The planted atoms of :mod:`dpvr_lab.experiments.regime` (unit ``a_j``, ``b_j = a_j^T x*``) with
the bounded nonconvex loss ``l_j(x) = phi(a_j^T x - b_j)``, ``phi(t) = t^2 / (1 + t^2)`` in ``[0, 1)``, and
the KL-penalised DRO objective with penalty ``LAM = 1``::

    F(x) = LAM log((1/m) sum_j exp(l_j(x) / LAM)),  grad F(x) = sum_j q_j phi'(r_j) a_j,  q = softmax(l/LAM)

``F >= mean l >= 0`` and ``F(x*) = 0``, so ``min F = 0`` and ``F(x0) - min F = F(0)`` exactly (``x0 = 0``).
As in the other regime experiments the ``n`` records are ``m`` atoms repeated ``n / m`` times: one
objective at every ``n``, a full-batch round costs ``O(m d)``. The metric is ``||grad F(x_T)||`` at the last
iterate, for both methods (the x-block of both formulations below at ``LAM``). ``phi`` is flat far from
``x*``: a run thrown out there has a small gradient at an objective above its start's, ``F(x_T) > F(0)``.
Such a run counts as no progress: its norm is taken as ``||grad F(x0)||`` (and ``escaped`` is set in its
record), so neither the tables nor the tuning reward it.

The two formulations the paper compares, each minimising ``F``:

- **DP Recursive-SPIDER** (:class:`dpvr.algorithms.RecursiveSpider`) on the compositional form ``Psi(x, lam) =
  lam log mean_j exp(l_j / lam) + lam rho`` over ``lam >= lam0 = LAM``, ``rho = RHO = 2``. For losses in
  ``[0, 1)``, ``d Psi / d lam = rho - KL(q || uniform)`` and ``KL(q || uniform) <= (max l - min l) / lam <
  1 / lam0``, so with ``rho = 2 / lam0`` the minimum over ``lam`` is at ``lam0`` for every ``x``:
  ``min_lam Psi(x, lam) = F(x) + LAM rho``, ``min Psi = LAM rho`` at ``(x*, LAM)``, and ``Psi0 = Psi(x0,
  lam_init = LAM) - min Psi = F(0)``. The inner function is dpvr's shifted ``g(w; z_j) = exp((l_j - B) /
  lam)`` with the public loss bound ``B = 1`` (``l < 1``, so the shift changes nothing), ``g`` in
  ``[exp(-1 / lam0), 1]``: its public floor ``s_floor = exp(-1 / lam0)`` is the least value ``g`` takes.
  Per-sample constants, over all residuals ``t`` and ``lam >= lam0`` (suprema on a grid,
  :func:`spider_constants`, checked against random points and finite differences in the tests):
  ``C1 = sup ||grad_x g|| = sup (g / lam) |phi'|``; ``k2`` (the Lipschitz constant of ``grad_x g`` in ``w =
  (x, lam)``) ``= sup sqrt(A^2 + b^2)``, the Jacobian of ``(g / lam) phi'(t) a`` being the rank-one ``a [A
  a^T, b]`` with ``A = (g / lam)(phi'' + phi'^2 / lam)``, ``b = phi' (g / lam^2)((1 - phi) / lam - 1)``;
  ``C3 = sup dg/dlam = sup g (1 - phi) / lam^2``; ``k4 = sup ||grad_w (dg/dlam)||``; ``C5 = 1``. Theorem 8's
  ``G`` and ``L`` are ``C1`` and ``k2`` (what :func:`dpvr.trainer.defaults.spider_protocol` reads).
- **DP-SGD on the dual** (the paper's DP-ERM baseline, eq. (3), run as :mod:`dpvr_lab.experiments.dro`
  runs it: :class:`dpvr.algorithms.DPSGD` on ``(x, eta)``, here full batch, i.e.
  :class:`dpvr.algorithms.DPGD`): the per-sample dual loss ``LAM (exp((l_j - eta) / LAM) - 1) + eta``, whose
  minimum over ``eta`` is ``F(x)``; ``eta0 = 0``, gap ``mean_j LAM (exp(l_j(0) / LAM) - 1)`` exactly (the
  dual's minimum is 0, at ``(x*, 0)``). On the region ``eta in [0, 1]`` (``eta*(x) = F(x)`` lies in ``[0,
  1)``; ``eta0 = 0``), with ``E = exp((l - eta) / LAM)``: ``G = sup sqrt(E^2 phi'^2 + (1 - E)^2)`` and ``L``
  the largest spectral norm of the per-sample Hessian ``E [[phi'' + phi'^2 / LAM, -phi' / LAM], [-phi' / LAM,
  1 / LAM]]`` (in the plane of ``a_j`` and ``eta``) (:func:`dual_constants`). The clip radius is ``G``, so the
  iterates leaving the region costs no privacy, only bias.

Protocols, five paired seeds (a seed draws the atoms, ``x*`` and the noise):

- ``Recursive-SPIDER (theorem)``: ``T``, ``q``, ``b2`` (both difference streams), ``eta = 1 / (2 L)`` from
  :func:`~dpvr.trainer.defaults.spider_protocol` (DP-DRO Theorem 8 with ``log(1/delta) / eps^2`` read as
  ``5 c``) at ``G = C1``, ``L = k2``, ``Psi0 = F(0)``, dimension ``d``; ``b1 = b3 = n``; the ``lam`` step
  equal to ``eta`` (the theorem's one step on ``w``). The STORM weight: dpvr's defaults derive none (Lemma
  9's ``beta = c eta^2`` leaves ``c`` open). With dpvr's sensitivity for the one-record ``s`` stream the
  stationary variance of ``s``'s accumulated noise is ``z_s^2 (2 - beta) / (4 beta)``, least at ``beta =
  1``, which is used (``s`` is then one record's noisy inner value each step);
- ``DP-SGD-dual (theorem)``: :func:`~dpvr.trainer.defaults.dpgd_protocol` at the dual's ``G``, ``L``, gap,
  dimension ``d + 1``;
- ``... (tuned)``: the step multiplied by ``k`` in a public grid (default 1, 4, 16) with ``T / k`` rounds
  (``q`` re-derived), the ``k`` with the lowest median on two held-out instances kept (never the
  evaluation seeds; a public grid, not a private selection).

Noise multipliers come from dpvr's calibration of each run's plan (``RecursiveSpiderPlan`` with batches
``(n, b2, n, b2)`` sampled without replacement and the one-record ``s`` stream; ``DPSGDPlan`` full batch;
PLD, replace-one) and the spent epsilon is what the accountant reports for it. The updates are replicas of
the library's classes on these closed-form gradients (checked equal to 1e-9 without noise in the tests),
vectorised over seeds; a batch of ``b2`` records drawn without replacement from ``n / m`` copies of ``m``
atoms is a multivariate hypergeometric draw of per-atom counts, which is how the replica draws it.

Output as the other regime experiments: medians, exponents in ``n`` (theory ``-2/3`` for Recursive-SPIDER,
``-1/2`` for DP-SGD), the crossover in ``n eps / sqrt(d)`` with its interval, a PNG.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from typing import Any

import numpy as np

from dpvr.algorithms import DPSGDPlan, RecursiveSpiderPlan
from dpvr.privacy.accountant import account
from dpvr.privacy.calibration import calibrate
from dpvr.results import Record, document
from dpvr.trainer.defaults import Protocol, dpgd_protocol, spider_protocol

from . import regime
from .common import derive_seed, progress, save
from .regime import Problem, d2phi, dphi, phi

NAME = "regime-spider"
DELTA = regime.DELTA
LAM = 1.0  # the KL penalty; Recursive-SPIDER's lam0 and lam_init
RHO = 2.0 / LAM  # > 1 / lam0: the optimal lam is lam0 for every x
BOUND = 1.0  # public loss bound B (phi < 1)
S_FLOOR = math.exp(-BOUND / LAM)  # the least value of the shifted inner function
BETA = 1.0  # STORM weight (module docstring)
METHODS = ("Recursive-SPIDER", "DP-SGD-dual")
SIZES = regime.SIZES
QUICK_SIZES = (2_000, 8_000, 32_000)
GRID = (1.0, 4.0, 16.0)


def _grid(lams: int = 400, points: int = 20001) -> tuple[np.ndarray, np.ndarray]:
    """Residuals ``t`` in ``[0, 30]`` (the constants are even in ``t``) by ``lam`` from ``lam0`` to ``200
    lam0`` (log-spaced; every term decays at least as ``1 / lam`` beyond)."""
    t = np.linspace(0.0, 30.0, points)[:, None]
    lam = LAM * np.geomspace(1.0, 200.0, lams)[None, :]
    return t, lam


def inner_terms(t: np.ndarray, lam: np.ndarray) -> dict[str, np.ndarray]:
    """Per-sample quantities of ``g = exp((phi(t) - B) / lam)`` at residual ``t``: ``gx`` (``grad_x g`` =
    ``gx a``), ``A``, ``b`` (its Jacobian in ``(x, lam)``: ``a [A a^T, b]``), ``u`` (``dg/dlam``), ``u_t``,
    ``u_lam`` (its partials)."""
    p, dp, ddp = phi(t), dphi(t), d2phi(t)
    g = np.exp((p - BOUND) / lam)
    gx = g / lam * dp
    a = g / lam * (ddp + dp * dp / lam)
    b = dp * g / lam**2 * ((BOUND - p) / lam - 1)
    u = g * (BOUND - p) / lam**2
    u_t = g * dp / lam**2 * ((BOUND - p) / lam - 1)
    u_lam = g * (BOUND - p) ** 2 / lam**4 - 2 * g * (BOUND - p) / lam**3
    return {"g": g, "gx": gx, "A": a, "b": b, "u": u, "u_t": u_t, "u_lam": u_lam}


def _supremum(value, t: np.ndarray, lam: np.ndarray) -> float:
    """The largest ``value(t, lam)`` on the grid, refined by a local search from the grid's best point
    (``lam >= lam0`` kept by searching over ``log(lam / lam0)``)."""
    from scipy.optimize import minimize

    grid = value(t, lam)
    i, k = np.unravel_index(np.argmax(grid), grid.shape)
    start = np.array([float(t[i, 0]), math.log(float(lam[0, k]) / LAM)])

    def negative(p: np.ndarray) -> float:
        at = np.array([[p[0]]]), np.array([[LAM * math.exp(max(p[1], 0.0))]])
        return -float(value(*at)[0, 0])

    found = minimize(negative, start, method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-14})
    return max(float(grid.max()), -float(found.fun))


@functools.lru_cache(maxsize=1)
def spider_constants() -> dict[str, float]:
    """``C1``, ``k2``, ``C3``, ``k4`` (module docstring): suprema of the per-sample terms over residuals and
    ``lam >= lam0`` (:func:`_grid`, refined locally), and ``C5 = 1``."""
    t, lam = _grid(200, 4001)
    terms = {
        "v-refresh": lambda a, b: np.abs(inner_terms(a, b)["gx"]),
        "v-difference": lambda a, b: np.hypot(inner_terms(a, b)["A"], inner_terms(a, b)["b"]),
        "u-refresh": lambda a, b: inner_terms(a, b)["u"],
        "u-difference": lambda a, b: np.hypot(inner_terms(a, b)["u_t"], inner_terms(a, b)["u_lam"]),
    }
    return {**{k: _supremum(f, t, lam) for k, f in terms.items()}, "s": 1.0}


def dual_terms(t: np.ndarray, eta: np.ndarray) -> dict[str, np.ndarray]:
    """Per-sample dual quantities at residual ``t`` and ``eta``: ``E``, the gradient's norm, the Hessian's
    spectral norm (module docstring)."""
    p, dp, ddp = phi(t), dphi(t), d2phi(t)
    e = np.exp((p - eta) / LAM)
    h11, h12, h22 = e * (ddp + dp * dp / LAM), -e * dp / LAM, e / LAM + 0 * t
    mid, rad = (h11 + h22) / 2, np.hypot((h11 - h22) / 2, h12)
    return {"E": e, "grad": np.hypot(e * dp, 1 - e), "hess": np.maximum(abs(mid + rad), abs(mid - rad))}


@functools.lru_cache(maxsize=1)
def dual_constants() -> tuple[float, float]:
    """The dual's ``(G, L)`` on ``eta in [0, 1]``: suprema on a grid of residuals and ``eta``."""
    t = np.linspace(0.0, 30.0, 20001)[:, None]
    eta = np.linspace(0.0, 1.0, 201)[None, :]
    q = dual_terms(t, eta)
    return float(q["grad"].max()), float(q["hess"].max())


def objective(problem: Problem, x: np.ndarray) -> np.ndarray:
    """``F(x) = LAM log mean exp(l / LAM)`` per instance."""
    z = phi(problem.residuals(x)) / LAM
    top = z.max(axis=1, keepdims=True)
    return LAM * (top[:, 0] + np.log(np.exp(z - top).mean(axis=1)))


def gradient(problem: Problem, x: np.ndarray) -> np.ndarray:
    """``grad F(x) = sum_j softmax_j(l / LAM) phi'(r_j) a_j`` per instance."""
    r = problem.residuals(x)
    z = phi(r) / LAM
    w = np.exp(z - z.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return problem.mean(w * dphi(r)) * problem.atoms.shape[1]


def dual_gap(problem: Problem) -> np.ndarray:
    """The dual's ``L(x0, eta0) - min L = mean LAM (exp(l(0) / LAM) - 1)`` per instance."""
    return (LAM * np.expm1(phi(problem.residuals(np.zeros_like(problem.solution))) / LAM)).mean(axis=1)


def run_dual(problem: Problem, n: int, rounds: int, lr: float, noise: float, clip: float,
             rng: np.random.Generator) -> np.ndarray:
    """DP-SGD on the dual, full batch (the replica of :class:`dpvr.algorithms.DPGD` on ``(x, eta)``): the mean
    of per-sample gradients ``(E phi' a, 1 - E)`` clipped at ``clip`` plus ``N(0, (z clip / n)^2)`` in all
    ``d + 1`` coordinates, then ``(x, eta) <- (x, eta) - lr v``. Returns ``x_R``."""
    s, d = problem.solution.shape
    x, eta = np.zeros((s, d)), np.zeros(s)
    for _ in range(rounds):
        r = problem.residuals(x)
        e = np.exp((phi(r) - eta[:, None]) / LAM)
        gx, ge = e * dphi(r), 1 - e
        scale = np.minimum(1.0, clip / np.maximum(np.hypot(gx, ge), 1e-300))
        vx = problem.mean(gx * scale) + rng.standard_normal((s, d)) * (noise * clip / n)
        ve = (ge * scale).mean(axis=1) + rng.standard_normal(s) * (noise * clip / n)
        x, eta = x - lr * vx, eta - lr * ve
    return x


def _inner(r: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample ``g``, ``(g / lam) phi'`` (``grad_x g = (g / lam) phi' a``) and ``dg/dlam = g (B - phi) /
    lam^2`` at residuals ``r`` ``(S, m)`` and ``lam`` ``(S,)``."""
    lam_ = lam[:, None]
    t2 = r * r
    p = t2 / (1 + t2)
    g = np.exp((p - BOUND) / lam_)
    return g, g / lam_ * (2 * r / (1 + t2) ** 2), g * (BOUND - p) / (lam_ * lam_)


def sample_counts(rng: np.random.Generator, n: int, atoms: int, batch: int,
                  shape: tuple[int, ...]) -> np.ndarray:
    """Per-atom counts ``(*shape, atoms)`` of independent batches of ``batch`` records drawn without
    replacement from the ``n`` records, record ``i`` being atom ``i mod atoms``.

    ``batch`` indices are drawn uniformly and any repeated ones redrawn until all are distinct: the procedure
    commutes with every permutation of the records, so the set it returns is a uniform ``batch``-subset, what
    fixed-size sampling without replacement draws."""
    idx = rng.integers(0, n, (*shape, batch))
    while True:
        idx.sort(axis=-1)
        repeated = idx[..., 1:] == idx[..., :-1]
        if not repeated.any():
            break
        idx[..., 1:][repeated] = rng.integers(0, n, int(repeated.sum()))
    cells = int(np.prod(shape))
    flat = (idx.reshape(cells, batch) % atoms + np.arange(cells)[:, None] * atoms).ravel()
    return np.bincount(flat, minlength=cells * atoms).reshape(*shape, atoms)


class _Batches:
    """A stream's batches, drawn ``chunk`` steps at a time (one vectorised draw instead of one per step)."""

    def __init__(self, rng: np.random.Generator, n: int, atoms: int, batch: int, instances: int,
                 chunk: int = 256) -> None:
        self.rng, self.n, self.atoms, self.batch = rng, n, atoms, batch
        self.instances, self.chunk = instances, chunk
        self.buffer, self.next = np.zeros((0, instances, atoms), dtype=np.int64), 0

    def __call__(self) -> np.ndarray:
        if self.next == len(self.buffer):
            shape = (self.chunk, self.instances)
            self.buffer = sample_counts(self.rng, self.n, self.atoms, self.batch, shape)
            self.next = 0
        self.next += 1
        return self.buffer[self.next - 1]


def run_spider(problem: Problem, n: int, rounds: int, restart: int, batch: int, lr: float, lr_lam: float,
               noise: dict[str, float], clip: dict[str, float], rng: np.random.Generator,
               draws=None) -> tuple[np.ndarray, np.ndarray]:
    """DP Recursive-SPIDER (the replica of :class:`dpvr.algorithms.RecursiveSpider`, ``b1 = b3 = n``, ``b2 =
    b4 = batch``, ``beta = BETA``, ``lam0 = lam_init = LAM``, ``s0 = 1``); returns ``(x_T, lam_T)``.

    Step ``t`` (a refresh when ``t % q == 0``), ``dw = ||(x_t, lam_t) - (x_{t-1}, lam_{t-1})||``: ``v`` is
    reset to the mean of ``(g / lam) phi' a`` clipped at ``C1`` plus ``N(0, (z C1 / n)^2)``, or adds the
    mean over a batch of ``b2`` of same-record differences clipped at ``min(k2 dw, 2 C1)`` plus noise of std
    ``z`` times that radius over ``b2``; ``u`` the same for ``dg/dlam`` (a refresh term lies in ``[0, C3]``:
    noise std ``z C3 / (2 n)``); ``s <- (1 - beta) s + clip(g(w_t; z)) - (1 - beta) clip(g(w_{t-1}; z)) +
    N(0, (z_s (2 - beta) C5 / 2)^2)`` on one record; with ``s' = max(s, s_floor)``: ``x <- x - lr (lam / s')
    v``, ``lam <- max(lam0, lam - lr_lam ((lam / s') u + log s' + rho))``.

    ``draws(stream, t)`` (tests only) returns the per-atom counts ``(S, m)`` of a difference batch or the atom
    of the ``s`` record ``(S,)``; by default they are drawn from ``rng`` (:func:`sample_counts`; the ``s``
    record uniform over the atoms)."""
    s_, d = problem.solution.shape
    m = problem.atoms.shape[1]
    x = np.zeros((s_, d))
    lam, lam_prev = np.full(s_, LAM), np.full(s_, LAM)
    v, u, s = np.zeros((s_, d)), np.zeros(s_), np.ones(s_)
    move = np.zeros(s_)
    c1, k2, c3, k4, c5 = (clip[k] for k in ("v-refresh", "v-difference", "u-refresh", "u-difference", "s"))
    rows = np.arange(s_)
    # w_{-1} = w_0: the previous point's per-sample terms start as the first point's
    g_prev, xw_prev, lg_prev = _inner(problem.residuals(x), lam)

    batches = {k: _Batches(rng, n, m, batch, s_) for k in ("v-difference", "u-difference")}

    def draw(stream: str, t: int) -> np.ndarray:
        if draws is not None:
            return draws(stream, t)
        if stream == "s":
            return rng.integers(0, m, s_)
        return batches[stream]()

    for t in range(rounds):
        g, xw, lg = _inner(problem.residuals(x), lam)
        dw = np.hypot(move, lam - lam_prev)
        if t % restart == 0:
            v = problem.mean(np.clip(xw, -c1, c1)) + rng.standard_normal((s_, d)) * (
                noise["v-refresh"] * c1 / n)
            u = np.clip(lg, -c3, c3).mean(axis=1) + rng.standard_normal(s_) * (
                noise["u-refresh"] * c3 / (2 * n))
        else:
            radius = np.minimum(k2 * dw, 2 * c1)[:, None]
            counts = draw("v-difference", t)
            delta = np.clip(xw - xw_prev, -radius, radius)
            v = v + problem.mean(counts * delta) * (m / batch) + rng.standard_normal((s_, d)) * (
                noise["v-difference"] * radius / batch)
            radius = np.minimum(k4 * dw, 2 * c3)
            counts = draw("u-difference", t)
            delta = np.clip(lg - lg_prev, -radius[:, None], radius[:, None])
            u = u + (counts * delta).sum(axis=1) / batch + rng.standard_normal(s_) * (
                noise["u-difference"] * radius / batch)
        j = draw("s", t)
        now, before = np.minimum(g[rows, j], c5), np.minimum(g_prev[rows, j], c5)
        s = (1 - BETA) * s + (now - (1 - BETA) * before) + rng.standard_normal(s_) * (
            noise["s"] * (2 - BETA) * c5 / 2)
        floor = np.maximum(s, S_FLOOR)
        scale = lam / floor
        step = (lr * scale)[:, None] * v
        x = x - step
        move = np.linalg.norm(step, axis=1)
        lam_prev, lam = lam, np.maximum(LAM, lam - lr_lam * (scale * u + np.log(floor) + RHO))
        g_prev, xw_prev, lg_prev = g, xw, lg
    return x, lam


def schedule(method: str, n: int, dimension: int, epsilon: float, gap: float,
             multiplier: float = 1.0) -> Protocol:
    """The theorem's protocol of ``method`` at this problem's constants, its step multiplied by
    ``multiplier`` with ``T / multiplier`` rounds (``q`` re-derived). For Recursive-SPIDER, ``Protocol.tau``
    carries ``b2`` and ``lr_y`` the ``lam`` step."""
    if method == "DP-SGD-dual":
        g, lip = dual_constants()
        base = dpgd_protocol(n, 1, dimension + 1, epsilon, DELTA, g, lip, gap)
        rounds = max(1, math.ceil(base.rounds / multiplier))
        return Protocol(rounds, 1, base.lr * multiplier, 0.0, base.bound, base.noise_constant)
    c = spider_constants()
    g, lip = c["v-refresh"], c["v-difference"]
    base = spider_protocol(n, dimension, epsilon, DELTA, g, lip, psi0=gap)
    if multiplier != 1.0:
        base = spider_protocol(n, dimension, epsilon, DELTA, g, lip, psi0=gap,
                               rounds=max(1, math.ceil(base.rounds / multiplier)))
    lr = base.lr * multiplier
    return Protocol(base.rounds, base.restart, lr, float(base.batch), math.nan, base.noise_constant, lr)


def spider_plan(n: int, protocol: Protocol) -> RecursiveSpiderPlan:
    batch = int(protocol.tau)
    return RecursiveSpiderPlan(n, protocol.rounds, protocol.restart,
                               {"v-refresh": n, "v-difference": batch, "u-refresh": n, "u-difference": batch})


def evaluate(method: str, problem: Problem, n: int, protocol: Protocol, epsilon: float,
             seed: int) -> dict[str, Any]:
    """Runs ``method`` at ``protocol`` on every instance: ``||grad F(x_T)||``, the noise multipliers and the
    epsilon the accountant (PLD) reports for the releases made."""
    rng = np.random.default_rng(derive_seed(seed, n, int(epsilon * 1000), 20 + METHODS.index(method)))
    if method == "DP-SGD-dual":
        plan = DPSGDPlan(steps=protocol.rounds, sampling="full", dataset_size=n)
        z = calibrate(plan, epsilon, DELTA, accountant="pld")["gradient"]
        x = run_dual(problem, n, protocol.rounds, protocol.lr, z, dual_constants()[0], rng)
        noise, spent = {"gradient": z}, account(plan({"gradient": z}), DELTA, "pld").epsilon
        lam = np.full(len(x), LAM)
    else:
        plan = spider_plan(n, protocol)
        noise = dict(calibrate(plan, epsilon, DELTA, accountant="pld"))
        spent = account(plan(noise), DELTA, "pld").epsilon
        noise.setdefault("v-difference", 0.0)
        noise.setdefault("u-difference", 0.0)
        x, lam = run_spider(problem, n, protocol.rounds, protocol.restart, int(protocol.tau), protocol.lr,
                            protocol.lr_y, noise, spider_constants(), rng)
    value = objective(problem, x)
    norms, escaped = regime.scored(x, functools.partial(objective, problem),
                                   functools.partial(gradient, problem))
    return {"norms": norms, "lam": lam, "noise": noise, "spent": float(spent), "objective": value,
            "escaped": escaped, "capped": np.zeros(len(x), dtype=np.int64)}


def theory_crossover(dimension: int, epsilon: float, gap: float) -> float:
    """Where the two theorems' rates meet, every ``O(.)`` constant 1: Theorem 8's ``(sqrt(Psi0 L G) sqrt(d
    5 c) / N)^(2/3)`` (its bound on ``E||grad Psi||``) against DP-GD's ``sqrt`` of its protocol's bound on
    ``E||grad f||^2``, as ``n eps / sqrt(d)``; ``nan`` when they do not meet in ``[10, 1e12]``."""
    c = spider_constants()

    def below(n: int) -> bool:
        p = spider_protocol(n, dimension, epsilon, DELTA, c["v-refresh"], c["v-difference"], psi0=gap)
        spider = (math.sqrt(gap * c["v-difference"] * c["v-refresh"] * dimension * 5 * p.noise_constant)
                  / n) ** (2 / 3)
        g, lip = dual_constants()
        dual = math.sqrt(dpgd_protocol(int(n), 1, dimension + 1, epsilon, DELTA, g, lip, gap).bound)
        return spider < dual

    return regime.crossing(below, dimension, epsilon)


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)
    sizes = list(args.n or (QUICK_SIZES if quick else SIZES))
    epsilons = list(args.epsilon or ((0.5, 1.0) if quick else regime.EPSILONS))
    seeds = list(range(args.seeds or (3 if quick else 5)))
    grid = list((1.0, 4.0) if quick and args.grid is None else GRID if args.grid is None else args.grid)
    d, m = args.dimension, args.atoms
    tuning = [1000 + s for s in range(args.tuning_seeds)] if len(grid) > 1 else []
    problem = Problem.planted(seeds, d, m)
    tuner = Problem.planted(tuning, d, m) if tuning else None
    gaps = {"Recursive-SPIDER": objective(problem, np.zeros_like(problem.solution)),
            "DP-SGD-dual": dual_gap(problem)}
    gap = {k: float(v.max()) for k, v in gaps.items()}  # one public constant per run: the largest
    protocols = ("theorem", "tuned") if tuning else ("theorem",)
    records: list[Record] = []
    norms: dict[tuple[str, str, float], list[np.ndarray]] = {}
    with progress(len(sizes) * len(epsilons) * len(METHODS) * len(protocols), f"{NAME}: d={d}") as bar:
        for epsilon in epsilons:
            for n in sizes:
                for method in METHODS:
                    for protocol_name in protocols:
                        multiplier, scores = 1.0, {}
                        if protocol_name == "tuned":
                            multiplier, scores = regime.tune_multiplier(
                                evaluate, schedule, method, tuner, n, d, epsilon, gap[method], grid)
                        plan = schedule(method, n, d, epsilon, gap[method], multiplier)
                        result = evaluate(method, problem, n, plan, epsilon, 0)
                        label = f"{method} ({protocol_name})"
                        norms.setdefault((label, "", epsilon), []).append(result["norms"])
                        for i, seed in enumerate(seeds):
                            metrics = {
                                "grad_norm": float(result["norms"][i]), "n": n, "dimension": d,
                                "coordinate": n * epsilon / math.sqrt(d), "rounds": plan.rounds,
                                "restart": plan.restart, "lr": plan.lr, "multiplier": multiplier,
                                "batch": int(plan.tau) if method == "Recursive-SPIDER" else n,
                                "lam": float(result["lam"][i]), "noise": result["noise"],
                                "objective": float(result["objective"][i]),
                                "escaped": bool(result["escaped"][i]),
                                "gap": float(gaps[method][i]),
                                "tuning_scores": {str(k): v for k, v in scores.items()},
                            }
                            records.append(Record(label, f"kl-dro-planted-d{d}", epsilon, DELTA, seed,
                                                  result["spent"], metrics))
                        bar.update(1)
    summary = regime.summarise(norms, sizes, epsilons, d, gap["Recursive-SPIDER"], protocols, methods=METHODS,
                               theory=lambda e: theory_crossover(d, e, gap["Recursive-SPIDER"]))
    config = {"quick": quick, "sizes": sizes, "epsilons": epsilons, "seeds": seeds, "dimension": d,
              "atoms": m, "grid": grid, "tuning_seeds": tuning, "delta": DELTA, "gap": gap, "lam": LAM,
              "rho": RHO, "loss_bound": BOUND, "s_floor": S_FLOOR, "beta": BETA,
              "spider_constants": spider_constants(), "dual_constants": list(dual_constants()),
              "summary": summary}
    doc = document(NAME, config, records)
    os.makedirs(args.out, exist_ok=True)
    paths = save(doc, records, args.out)
    regime.print_tables(summary, norms, sizes, epsilons, d)
    paths.append(regime.plot(os.path.join(args.out, f"{NAME}-d{d}.png"), norms, sizes, epsilons, d, summary,
                             methods=METHODS, measure="||grad F(x_T)||"))
    print("wrote " + ", ".join(paths))
    return doc
