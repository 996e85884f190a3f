"""Problems for the phased output-perturbation framework (:mod:`dpvr.algorithms.phased`), with their
constants.

Each implements :class:`~dpvr.problems.FiniteSumProblem`: per-sample operators ``(grad_x f, -grad_y f)``,
the operator of a public (data-independent) part ``P``, the domains, and the constants the privacy guarantee
rests on. The per-sample Lipschitz constant is *enforced* by clipping each record to a public norm bound when
the problem is built (a per-record map, so it needs no privacy budget).

- :class:`LogisticRegression`: L2-regularised logistic regression (DP-SCO); strongly convex with ``l2 > 0``.
- :class:`QuadraticSaddle`: an SC-SC quadratic saddle problem, data entering linearly; closed-form saddle
  point and duality gap.
- :class:`BilinearSaddle`: a convex-concave bilinear problem on balls; closed-form saddle point and gap.
- :class:`RobustRegression`: ``min_{||x|| <= D} max_{||y||_inf <= 1} y^T (A x - b)`` (least absolute
  deviations on the averaged system) with optional ridge terms; closed-form duality gap.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import expit

from ..problems import Ball, Box, Whole


class _LabelledData(Protocol):
    """What :meth:`LogisticRegression.from_dataset` reads of a :class:`dpvr.data.Dataset`, stated
    structurally because the data layer sits above the objectives and is not imported here."""

    @property
    def features(self) -> np.ndarray: ...

    @property
    def targets(self) -> np.ndarray: ...

    @property
    def task(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def num_classes(self) -> int | None: ...

    def __len__(self) -> int: ...


def _array(name: str, value: ArrayLike, ndim: int) -> np.ndarray:
    out = np.asarray(value, dtype=np.float64)
    if out.ndim != ndim or out.shape[0] == 0 or not np.all(np.isfinite(out)):
        raise ValueError(f"{name} must be a non-empty finite {ndim}-D array, got shape {out.shape}")
    return out


def _positive(name: str, value: float, *, zero: bool = False) -> float:
    value = float(value)
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise ValueError(f"{name} must be a finite number {'>=' if zero else '>'} 0, got {value!r}")
    return value


def clip_rows(a: np.ndarray, bound: float) -> np.ndarray:
    """Scale each record (leading axis) to L2/Frobenius norm at most ``bound``."""
    norms = np.linalg.norm(a.reshape(len(a), -1), axis=1)
    scale = np.minimum(1.0, bound / np.maximum(norms, np.finfo(np.float64).tiny))
    return a * scale.reshape(-1, *(1,) * (a.ndim - 1))


def _rows(n: int, rows: ArrayLike | None) -> np.ndarray:
    return np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64)


class LogisticRegression:
    """``min_x (1/n) sum_i log(1 + exp(-b_i a_i^T x)) + (l2/2) ||x||^2`` over ``R^d`` or a ball.

    Rows are clipped to norm ``clip_norm``, so each loss is ``clip_norm``-Lipschitz and
    ``clip_norm^2/4``-smooth; the ridge term is the public part (strong convexity ``l2``). Labels are
    ``+1``/``-1`` (``0``/``1`` is accepted and mapped).
    """

    dim_y = 0
    domain_y = Whole()

    def __init__(self, features: ArrayLike, labels: ArrayLike, *, l2: float = 0.0,
                 radius: float | None = None, clip_norm: float = 1.0) -> None:
        features = _array("features", features, 2)
        labels = np.asarray(labels, dtype=np.float64)
        if labels.shape != (len(features),):
            raise ValueError(f"labels must have shape ({len(features)},), got {labels.shape}")
        if np.all(np.isin(labels, (0.0, 1.0))):
            labels = 2 * labels - 1
        if not np.all(np.isin(labels, (-1.0, 1.0))):
            raise ValueError("labels must be +1/-1 (or 0/1)")
        self.clip_norm = _positive("clip_norm", clip_norm)
        self.l2 = _positive("l2", l2, zero=True)
        self.features = clip_rows(features, self.clip_norm)
        self.labels = labels
        self.n, self.dim_x = self.features.shape
        self.lipschitz = self.clip_norm
        self.smoothness = self.clip_norm**2 / 4
        self.public_smoothness = self.l2
        self.moduli = (self.l2, 0.0)
        self.domain_x = Whole() if radius is None else Ball(radius)

    @classmethod
    def from_dataset(cls, dataset: _LabelledData, *, l2: float = 0.0,
                     radius: float | None = None) -> LogisticRegression:
        """A binary :class:`~dpvr.data.Dataset`, with an intercept feature, each row scaled to unit norm.

        Standardise the features first with statistics that do not depend on the private records (e.g.
        :class:`~dpvr.data.PublicScaling` fitted on a public split); statistics fitted on the private data
        would void the per-record sensitivity argument.
        """
        if dataset.task != "classification" or dataset.num_classes != 2:
            raise ValueError(f"dataset must be a binary classification dataset, got {dataset.name!r} "
                             f"({dataset.task}, {dataset.num_classes} classes)")
        features = np.hstack([dataset.features.astype(np.float64), np.ones((len(dataset), 1))])
        features /= np.linalg.norm(features, axis=1, keepdims=True)
        return cls(features, dataset.targets, l2=l2, radius=radius)

    def sample_operator(self, z: np.ndarray, rows: np.ndarray) -> np.ndarray:
        a, b = self.features[rows], self.labels[rows]
        return (-b * expit(-b * (a @ z)))[:, None] * a

    def public_operator(self, z: np.ndarray) -> np.ndarray:
        return self.l2 * z

    def objective(self, x: np.ndarray) -> float:
        """The regularised empirical risk at ``x`` (all samples)."""
        margins = self.labels * (self.features @ x)
        return float(np.mean(np.logaddexp(0.0, -margins)) + self.l2 / 2 * x @ x)

    def solution(self, rows: ArrayLike | None = None, rho: tuple[float, float] = (0.0, 0.0),
                 centre: ArrayLike | None = None) -> np.ndarray:
        """The exact minimiser of the problem on ``rows`` plus ``(rho_x/2) ||x - centre||^2`` (damped Newton
        to machine precision; unconstrained problems with ``l2 + rho_x > 0`` only)."""
        if not isinstance(self.domain_x, Whole):
            raise ValueError("solution() needs an unconstrained problem (radius=None)")
        ridge = self.l2 + rho[0]
        if ridge <= 0:
            raise ValueError("solution() needs l2 + rho > 0 (a strongly convex problem)")
        rows = _rows(self.n, rows)
        a, b = self.features[rows], self.labels[rows]
        c = np.zeros(self.dim_x) if centre is None else np.asarray(centre, dtype=np.float64)[: self.dim_x]

        def value(x: np.ndarray) -> float:
            return float(np.mean(np.logaddexp(0.0, -b * (a @ x))) + self.l2 / 2 * x @ x
                         + rho[0] / 2 * (x - c) @ (x - c))

        x = c.copy()
        for _ in range(200):
            p = expit(-b * (a @ x))
            grad = a.T @ (-b * p) / len(rows) + self.l2 * x + rho[0] * (x - c)
            if np.linalg.norm(grad) <= 1e-15 * ridge:
                break
            hess = (a.T * (p * (1 - p))) @ a / len(rows) + ridge * np.eye(self.dim_x)
            step, t, f0 = np.linalg.solve(hess, grad), 1.0, value(x)
            while value(x - t * step) > f0 - 0.25 * t * grad @ step and t > 1e-10:
                t /= 2  # backtracking: a full Newton step can overshoot far from the optimum
            x_next = x - t * step
            if np.array_equal(x_next, x):
                break
            x = x_next
        return x


class _LinearData:
    """Saddle problems whose data enter linearly: ``f(x, y; xi_i) = u_i^T x - v_i^T y`` and
    ``P(x, y) = x^T Q x / 2 + x^T B y - y^T R y / 2``.

    Each record ``(u_i, v_i)`` is clipped to norm ``clip_norm``, which is then the (global) Lipschitz
    constant; the data operator ``(u_i, v_i)`` does not depend on the point (``smoothness = 0``).
    """

    def __init__(self, u: ArrayLike, v: ArrayLike, q: np.ndarray, b: np.ndarray, r: np.ndarray,
                 clip_norm: float) -> None:
        u, v = _array("u", u, 2), _array("v", v, 2)
        if len(u) != len(v):
            raise ValueError(f"u and v must have the same number of rows, got {len(u)} and {len(v)}")
        self.clip_norm = _positive("clip_norm", clip_norm)
        self.n, self.dim_x = u.shape
        self.dim_y = v.shape[1]
        if b.shape != (self.dim_x, self.dim_y):
            raise ValueError(f"B must have shape ({self.dim_x}, {self.dim_y}), got {b.shape}")
        self._data = clip_rows(np.hstack([u, v]), self.clip_norm)
        self.u, self.v = self._data[:, : self.dim_x], self._data[:, self.dim_x:]  # the clipped records
        self.q, self.b, self.r = q, b, r
        self.lipschitz = self.clip_norm
        self.smoothness = 0.0
        self._matrix = np.block([[q, b], [-b.T, r]])
        self.public_smoothness = float(np.linalg.norm(self._matrix, 2))

    def sample_operator(self, z: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return self._data[rows]

    def public_operator(self, z: np.ndarray) -> np.ndarray:
        return self._matrix @ z

    def means(self, rows: ArrayLike | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(u_bar, v_bar)`` over ``rows`` (all samples by default)."""
        mean = self._data[_rows(self.n, rows)].mean(axis=0)
        return mean[: self.dim_x], mean[self.dim_x:]

    def solution(self, rows: ArrayLike | None = None, rho: tuple[float, float] = (0.0, 0.0),
                 centre: ArrayLike | None = None) -> np.ndarray:
        """The exact saddle point on ``rows`` with ``+(rho_x/2)||x - c_x||^2 - (rho_y/2)||y - c_y||^2`` added:
        the root of the (linear) operator. Raises ``ValueError`` if it lies outside the domain."""
        c = np.zeros(self.dim_x + self.dim_y) if centre is None else np.asarray(centre, dtype=np.float64)
        shift = np.concatenate([np.full(self.dim_x, rho[0]), np.full(self.dim_y, rho[1])])
        mean = self._data[_rows(self.n, rows)].mean(axis=0)
        z = np.linalg.solve(self._matrix + np.diag(shift), shift * c - mean)
        for block, domain in ((z[: self.dim_x], self.domain_x), (z[self.dim_x:], self.domain_y)):
            if not np.array_equal(domain.project(block), block):
                raise ValueError("the unconstrained saddle point lies outside the domain; no closed form")
        return z


class QuadraticSaddle(_LinearData):
    """SC-SC: ``min_x max_y (1/n) sum_i (u_i^T x - v_i^T y) + x^T Q x/2 + x^T B y - y^T R y/2`` on
    ``R^dx x R^dy``, ``Q`` and ``R`` symmetric positive definite (the moduli are their smallest eigenvalues).
    """

    domain_x = Whole()
    domain_y = Whole()

    def __init__(self, u: ArrayLike, v: ArrayLike, *, Q: ArrayLike, B: ArrayLike, R: ArrayLike,
                 clip_norm: float = 1.0) -> None:
        q, r = np.asarray(Q, dtype=np.float64), np.asarray(R, dtype=np.float64)
        for name, m in (("Q", q), ("R", r)):
            if m.ndim != 2 or m.shape[0] != m.shape[1] or not np.allclose(m, m.T):
                raise ValueError(f"{name} must be a symmetric square matrix, got shape {m.shape}")
        super().__init__(u, v, q, np.asarray(B, dtype=np.float64), r, clip_norm)
        if q.shape[0] != self.dim_x or r.shape[0] != self.dim_y:
            raise ValueError(f"Q and R must be {self.dim_x}x{self.dim_x} and {self.dim_y}x{self.dim_y}")
        self.moduli = (float(np.linalg.eigvalsh(q)[0]), float(np.linalg.eigvalsh(r)[0]))
        if min(self.moduli) <= 0:
            raise ValueError(f"Q and R must be positive definite, smallest eigenvalues {self.moduli}")

    @classmethod
    def random(cls, n: int, dim_x: int, dim_y: int, *, mu_x: float = 0.5, mu_y: float = 0.5,
               coupling: float = 1.0, seed: int = 0) -> QuadraticSaddle:
        """A random instance: ``Q = mu_x I + G G^T/dx``, ``R`` likewise, ``B`` Gaussian of spectral scale
        ``coupling``, records ``(u_i, v_i)`` around a common mean (norms up to 1)."""
        rng = np.random.default_rng(seed)
        gq, gr = rng.normal(size=(dim_x, dim_x)), rng.normal(size=(dim_y, dim_y))
        q = mu_x * np.eye(dim_x) + gq @ gq.T / dim_x
        r = mu_y * np.eye(dim_y) + gr @ gr.T / dim_y
        b = coupling * rng.normal(size=(dim_x, dim_y)) / math.sqrt(max(dim_x, dim_y))
        d = dim_x + dim_y
        data = rng.normal(size=d) / math.sqrt(2 * d) + rng.normal(size=(n, d)) / math.sqrt(2 * d)
        return cls(data[:, :dim_x], data[:, dim_x:], Q=q, B=b, R=r)

    def duality_gap(self, x: np.ndarray, y: np.ndarray) -> float:
        """``max_y F(x, y) - min_x F(x, y)`` on all samples, in closed form."""
        u, v = self.means()
        r = self.b.T @ x - v
        s = self.b @ y + u
        primal = u @ x + x @ self.q @ x / 2 + r @ np.linalg.solve(self.r, r) / 2
        dual = -v @ y - y @ self.r @ y / 2 - s @ np.linalg.solve(self.q, s) / 2
        return float(primal - dual)


class BilinearSaddle(_LinearData):
    """C-C: ``min_{||x|| <= D_x} max_{||y|| <= D_y} (1/n) sum_i (u_i^T x - v_i^T y) + x^T B y``."""

    def __init__(self, u: ArrayLike, v: ArrayLike, *, B: ArrayLike, radius_x: float,
                 radius_y: float, clip_norm: float = 1.0) -> None:
        b = np.asarray(B, dtype=np.float64)
        if b.ndim != 2:
            raise ValueError(f"B must be a matrix, got shape {b.shape}")
        super().__init__(u, v, np.zeros((b.shape[0],) * 2), b, np.zeros((b.shape[1],) * 2), clip_norm)
        self.moduli = (0.0, 0.0)
        self.domain_x, self.domain_y = Ball(radius_x), Ball(radius_y)

    @classmethod
    def random(cls, n: int, dim: int, *, radius: float = 2.0, seed: int = 0) -> BilinearSaddle:
        """A random square instance whose saddle point is interior (``B`` well conditioned)."""
        rng = np.random.default_rng(seed)
        b = np.linalg.qr(rng.normal(size=(dim, dim)))[0] * 2.0
        data = (rng.normal(size=2 * dim) + rng.normal(size=(n, 2 * dim))) / math.sqrt(4 * dim)
        return cls(data[:, :dim], data[:, dim:], B=b, radius_x=radius, radius_y=radius)

    def duality_gap(self, x: np.ndarray, y: np.ndarray) -> float:
        """``max_{||y'|| <= D_y} F(x, y') - min_{||x'|| <= D_x} F(x', y)`` on all samples, in closed form."""
        u, v = self.means()
        return float(u @ x + v @ y + self.domain_y.radius * np.linalg.norm(self.b.T @ x - v)
                     + self.domain_x.radius * np.linalg.norm(self.b @ y + u))


class RobustRegression:
    """Robust regression as a saddle problem over ``||x|| <= D``, ``||y||_inf <= 1``:

    ``min_x max_y (1/n) sum_i y^T (A_i x - b_i) + (l2_x/2) ||x||^2 - (l2_y/2) ||y||^2``.

    Each record is a linear system ``(A_i, b_i)`` with ``A_i`` of shape ``(dim_y, dim_x)``; without ridge
    terms the primal is ``||A_bar x - b_bar||_1``, the nonsmooth problem the paper reformulates as a smooth
    convex-concave one. Records are clipped to ``||A_i||_F <= clip_a`` and ``||b_i|| <= clip_b``, so on the
    domain each loss is Lipschitz with ``L = sqrt(clip_a^2 dim_y + (clip_a D + clip_b)^2)`` and each operator
    ``clip_a``-Lipschitz. ``l2_x > 0`` and ``l2_y > 0`` make it SC-SC; ``l2_y > 0`` alone, C-SC.
    """

    def __init__(self, A: ArrayLike, b: ArrayLike, *, radius: float, l2_x: float = 0.0,
                 l2_y: float = 0.0, clip_a: float = 1.0, clip_b: float = 1.0) -> None:
        a, b = _array("A", A, 3), _array("b", b, 2)
        if b.shape != a.shape[:2]:
            raise ValueError(f"b must have shape {a.shape[:2]}, got {b.shape}")
        self.clip_a, self.clip_b = _positive("clip_a", clip_a), _positive("clip_b", clip_b)
        self.l2_x, self.l2_y = _positive("l2_x", l2_x, zero=True), _positive("l2_y", l2_y, zero=True)
        self.a, self.b = clip_rows(a, self.clip_a), clip_rows(b, self.clip_b)
        self.n, self.dim_y, self.dim_x = self.a.shape
        self.domain_x, self.domain_y = Ball(radius), Box(-1.0, 1.0)
        self.lipschitz = math.hypot(self.clip_a * math.sqrt(self.dim_y), self.clip_a * radius + self.clip_b)
        self.smoothness = self.clip_a
        self.public_smoothness = max(self.l2_x, self.l2_y)
        self.moduli = (self.l2_x, self.l2_y)
        self._a_bar, self._b_bar = self.a.mean(axis=0), self.b.mean(axis=0)

    @classmethod
    def synthetic(cls, n: int, dim_x: int, dim_y: int, *, radius: float = 1.0, outliers: float = 0.1,
                  l2_x: float = 0.0, l2_y: float = 0.0, seed: int = 0) -> RobustRegression:
        """Records ``A_i = A_0 + noise``, ``b_i = A_i x_true + noise``, with a fraction ``outliers`` of the
        records' right-hand sides grossly corrupted in a few shared coordinates (what L1 is robust to)."""
        rng = np.random.default_rng(seed)
        a0 = rng.normal(size=(dim_y, dim_x)) / math.sqrt(dim_x * dim_y)
        x_true = rng.normal(size=dim_x)
        x_true *= 0.5 * radius / np.linalg.norm(x_true)
        a = a0 + 0.3 * rng.normal(size=(n, dim_y, dim_x)) / math.sqrt(dim_x * dim_y)
        b = a @ x_true + 0.02 * rng.normal(size=(n, dim_y))
        bad = rng.random(n) < outliers
        coords = rng.choice(dim_y, size=max(1, dim_y // 5), replace=False)
        b[np.ix_(bad, coords)] += rng.choice([-1.0, 1.0], size=(int(bad.sum()), coords.size)) * 0.5
        return cls(a, b, radius=radius, l2_x=l2_x, l2_y=l2_y)

    def sample_operator(self, z: np.ndarray, rows: np.ndarray) -> np.ndarray:
        x, y = z[: self.dim_x], z[self.dim_x:]
        a = self.a[rows]
        return np.hstack([np.einsum("kij,i->kj", a, y), self.b[rows] - a @ x])

    def public_operator(self, z: np.ndarray) -> np.ndarray:
        return np.concatenate([self.l2_x * z[: self.dim_x], self.l2_y * z[self.dim_x:]])

    def primal(self, x: np.ndarray) -> float:
        """``max_{y in Y} F(x, y)`` on all samples (``||A_bar x - b_bar||_1`` without ridge terms)."""
        r = self._a_bar @ x - self._b_bar
        if self.l2_y > 0:
            y = np.clip(r / self.l2_y, -1.0, 1.0)
            inner = float(y @ r - self.l2_y / 2 * y @ y)
        else:
            inner = float(np.abs(r).sum())
        return inner + self.l2_x / 2 * float(x @ x)

    def dual(self, y: np.ndarray) -> float:
        """``min_{x in X} F(x, y)`` on all samples."""
        g = self._a_bar.T @ y
        if self.l2_x > 0:
            x = self.domain_x.project(-g / self.l2_x)
            inner = float(g @ x + self.l2_x / 2 * x @ x)
        else:
            inner = -self.domain_x.radius * float(np.linalg.norm(g))
        return inner - float(y @ self._b_bar) - self.l2_y / 2 * float(y @ y)

    def duality_gap(self, x: np.ndarray, y: np.ndarray) -> float:
        """``max_y F(x, y) - min_x F(x, y)`` over the domain, in closed form."""
        return self.primal(x) - self.dual(y)


__all__ = [
    "BilinearSaddle",
    "LogisticRegression",
    "QuadraticSaddle",
    "RobustRegression",
    "clip_rows",
]
