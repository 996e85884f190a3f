"""The rounding allowance of :class:`~dpvr.algorithms.PrivateDiffOutputY`'s float64 inner solve
(PrivateDiff with ``y_release="output"``): public quantities that let the solver certify its accuracy, and
the balanced summation whose error they bound."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...problems import MinimaxProblem
from ...problems.minimax import YSensitivity

_OUTPUT_CHUNK = 4096  # records per forward pass when the inner problem reads every record's output
_UNIT = torch.finfo(torch.float64).eps / 2  # u: float64's unit roundoff
_RECORD_ROUNDING = 32  # assumed: one record's float64 y-gradient is within this many u * y_lipschitz
_FLOOR = 4  # the default y_tolerance is at least this many rounding allowances (and y's own rounding)


def _pairwise_sum(rows: Tensor) -> Tensor:
    """The sum of the rows of ``rows`` (``(n, d)``) by a balanced tree of elementwise additions, each row
    passing through at most ``ceil(log2 n)`` of them: the float error is at most ``gamma_ceil(log2 n) sum_i
    ||row_i||`` (``gamma_k = k u / (1 - k u)``), whatever order a library reduction would have used."""
    while len(rows) > 1:
        half = len(rows) // 2
        head = rows[:half] + rows[half : 2 * half]
        rows = torch.cat([head, rows[2 * half :]]) if len(rows) % 2 else head
    return rows[0]


@dataclass(frozen=True)
class YRounding:
    """The rounding allowance of PrivateDiff's float64 inner solve (``y_release="output"``), from public
    quantities only: the number of records ``n``, the problem's ``mu`` (``strong_concavity``),
    ``y_lipschitz`` (``L_y``, a bound on every record's ``||grad_y f||`` on ``Y``) and ``y_dim``, the
    solver's step, a bound ``radius`` on ``||y||`` over ``Y`` (``||initial_y|| + diameter``) and ``y``'s
    dtype.

    - :attr:`gradient_error` ``E``: the computed ``grad F(y)`` at any float64 ``y`` in ``Y`` is within
      ``E`` of the exact one. Each record's gradient is within ``32 u L_y`` (the assumption on the problem's
      ``y_grads``: a few float64 operations on terms bounded by ``L_y``, as for every problem in dpvr that
      states ``y_sensitivity``), the rows are summed by :func:`_pairwise_sum` (error ``gamma_h sum_i
      ||g_i||``, ``h = ceil(log2 n)``) and divided by ``n`` (``u`` relative): ``E = 32 u L_y + (gamma_h +
      u (1 + gamma_h)) L_y (1 + 32 u)``. It grows as ``log2 n``, not ``n``.
    - :attr:`step_error`: ``||fl(y + step fl(g)) - (y + step g)|| / step <= u (radius / step + (2 + u)
      (L_y + E))``.
    - :attr:`allowance` ``A = (E + step_error) / mu`` (a hair more, for its own float evaluation): what the
      certificate adds to its measured terms.
    - :attr:`dtype_rounding`: a bound on ``||y_hat - y+||`` when ``y+`` is rounded to ``y``'s dtype (0 in
      float64).
    - :attr:`minimum_tolerance` ``4 A + dtype_rounding``: the smallest ``y_tolerance`` accepted; it leaves
      the measured terms, which float64 gradients cannot drive below about ``2 E / mu``, room to certify.
    """

    records: int
    strong_concavity: float
    y_lipschitz: float
    y_dim: int
    step: float
    radius: float
    dtype: torch.dtype

    @classmethod
    def of(
        cls, problem: MinimaxProblem, constants: YSensitivity, records: int, step: float, dtype: torch.dtype
    ) -> YRounding:
        """The allowance of ``problem``'s inner solve (its sensitivity ``constants``) over ``records``
        records with step ``step``, ``y`` in ``dtype``."""
        if not (step > 0 and math.isfinite(step)):
            raise ValueError(f"lr_y: must be finite and > 0, got {step}")
        lipschitz = float(getattr(problem, "y_lipschitz", math.nan))
        if not (lipschitz > 0 and math.isfinite(lipschitz)):
            raise ValueError(
                f"{type(problem).__name__}.y_lipschitz: must be finite and > 0 (it bounds the rounding of "
                f"the inner solve), got {lipschitz}"
            )
        radius = float(problem.initial_y(torch.float64).norm()) + float(problem.diameter)
        if not math.isfinite(radius):
            raise ValueError(f"{type(problem).__name__}.diameter: must be finite, got {problem.diameter}")
        mu = float(constants.strong_concavity)
        return cls(int(records), mu, lipschitz, int(problem.y_dim), float(step), radius, dtype)

    @property
    def depth(self) -> int:
        """``ceil(log2 n)``: the additions any one record's gradient passes through in the sum."""
        return (self.records - 1).bit_length()

    @property
    def record_bound(self) -> float:
        """A bound on a computed record gradient's computed norm when the problem's ``L_y`` holds."""
        return self.y_lipschitz * (1 + _RECORD_ROUNDING * _UNIT) * (1 + 2 * (self.y_dim + 2) * _UNIT)

    @property
    def gradient_error(self) -> float:
        u, h = _UNIT, self.depth
        gamma = h * u / (1 - h * u)
        per_record = _RECORD_ROUNDING * u
        return self.y_lipschitz * (per_record + (gamma + u * (1 + gamma)) * (1 + per_record))

    @property
    def step_error(self) -> float:
        u = _UNIT
        return u * (self.radius / self.step + (2 + u) * (self.y_lipschitz + self.gradient_error))

    @property
    def allowance(self) -> float:
        return (self.gradient_error + self.step_error) / self.strong_concavity * (1 + 64 * _UNIT)

    @property
    def dtype_rounding(self) -> float:
        if self.dtype == torch.float64:
            return 0.0
        info = torch.finfo(self.dtype)  # round to nearest: u_dtype relative, half a subnormal step absolute
        return (info.eps / 2 * self.radius + math.sqrt(self.y_dim) * info.tiny * info.eps) * (1 + 8 * _UNIT)

    @property
    def minimum_tolerance(self) -> float:
        return _FLOOR * self.allowance + self.dtype_rounding

    def default_tolerance(self, stability: float) -> float:
        """``max(stability / 100, minimum_tolerance)``: 1% of the exact maximiser's sensitivity while the
        rounding allows it (to about ``1e11`` records for AUC-M in float64), the floor beyond."""
        return max(0.01 * stability, self.minimum_tolerance)

    def refusal(self, tolerance: float) -> str:
        """Why ``tolerance`` cannot be certified, naming the knob that fixes it and the numbers."""
        cast = ""
        if self.dtype_rounding:
            dtype = str(self.dtype).removeprefix("torch.")
            cast = f", and rounding y to {dtype} may move it by {self.dtype_rounding:.3g} (a float64 model "
            cast += "avoids that)"
        return (
            f"y_tolerance={tolerance:g} is below {self.minimum_tolerance:.3g}, the smallest tolerance the "
            f"inner solve can certify over n={self.records} records: its float64 rounding allowance is "
            f"{self.allowance:.3g} (it grows as log2(n), y_lipschitz/strong_concavity={self.y_lipschitz:g}/"
            f"{self.strong_concavity:g} and 1/lr_y; y_tolerance must be at least {_FLOOR} times it)"
            f"{cast}. "
            f"Raise y_tolerance to at least {self.minimum_tolerance:.3g}, or leave it None for the default "
            "(1% of gradient_range / (n mu), or that minimum where it is larger); more y_steps cannot help"
        )

    @property
    def slack(self) -> float:
        """The factor on the measured terms for the rounding of their own differences, norms and sums."""
        return 1 + 2 * (self.y_dim + 8) * _UNIT
