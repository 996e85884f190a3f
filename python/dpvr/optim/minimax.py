"""DP minimax optimisation: DP-SGDA and PrivateDiff Minimax (Zhang et al., nonconvex-strongly-concave).

Both solve ``min_x max_{y in Y} (1/n) sum_i f(x, y; z_i)`` for a problem object with the interface of
:class:`dpvr.objectives.MinimaxProblem`: ``x`` is the model's trainable parameters, ``y`` a small tensor
the algorithm owns (:attr:`MinimaxAlgorithm.y`), kept in the public convex set ``Y`` by the problem's
projection. The two share the y-step: per-sample ``grad_y f`` (from the model's outputs, never through the
network), clipped per sample, averaged, noised, an ascent step and the projection.

The x-gradients treat ``y`` as a public constant. To evaluate a same-sample difference at two points that
differ in ``y`` as well as ``x`` (PrivateDiff), ``y`` is carried as an extra coordinate of the point: the
per-sample gradient code sees the model with a stop-gradient copy of ``y`` appended to its output, so that
coordinate's per-sample gradient is exactly zero and every clip norm is the norm of ``grad_x f`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import ops
from ..privacy import events
from ..problems import MinimaxProblem
from ..problems.minimax import YSensitivity
from .base import PrivateAlgorithm
from .config import PrivacyConfig, RuntimeConfig, stream_clips
from .estimator import ClippedSum, DifferenceEstimator, Iterate, Radius, release, step_size
from .gradients import ClippedGradients, accumulators, check_loss
from .records import Batch, Records, as_records
from .sampling import BatchSampler

Y_RELEASES = ("ascent", "output")  # how PrivateDiff makes y private
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


class _Point(nn.Module):
    """A constant vector broadcast over the batch; its value is a coordinate of the evaluation point."""

    def __init__(self, value: Tensor) -> None:
        super().__init__()
        self.value = nn.Parameter(value.detach().clone())

    def forward(self, inputs: Tensor) -> Tensor:
        return self.value.expand(inputs.shape[0], -1)


class _WithY(nn.Module):
    """``model`` whose output gets ``y`` appended: the module the x-gradients are computed on."""

    def __init__(self, model: nn.Module, y: Tensor) -> None:
        super().__init__()
        self.model = model
        self.y = _Point(y)

    def forward(self, inputs: Tensor) -> Tensor:
        return torch.cat([self.model(inputs), self.y(inputs)], dim=1)


class MinimaxAlgorithm(PrivateAlgorithm):
    """What DP-SGDA and PrivateDiff share: data, sampling, ``y`` and its noisy clipped ascent step."""

    def __init__(
        self,
        model: nn.Module,
        problem: MinimaxProblem,
        records: Records,
        *,
        plan: events.Plan,
        sampler: BatchSampler,
        lr_y: float | None,
        clip_y: float | None,
        y0: Tensor | None,
        noise: Mapping[str, float] | None,
        privacy: PrivacyConfig,
        runtime: RuntimeConfig,
        settings: Mapping[str, Any],
        units: Mapping[str, float],
    ) -> None:
        """``settings``: what the run's binding records (the subclass's arguments, as given); ``units``: for
        ``shares="auto"``, the public radius or sensitivity each stream's noise multiplier is relative to."""
        privacy.require_replace_one(self.name)
        if lr_y is not None and not lr_y > 0:
            raise ValueError(f"lr_y: must be > 0, got {lr_y}")
        d = problem.y_dim

        def x_loss(output: Tensor, target: Tensor) -> Tensor:
            # y enters the x-gradients as a constant: stop its gradient.
            return problem.loss(output[:-d], target, output[-d:].detach())

        super().__init__(
            model, x_loss, plan=plan, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
            data=records, units=units, problem=problem,  # y's (public) length enters shares="auto"
        )  # fmt: skip
        self.problem, self.records, self.sampler = problem, records, sampler
        self._units = dict(units)
        # None where the algorithm takes no noisy ascent step (PrivateDiff with y_release="output")
        self.lr_y = None if lr_y is None else float(lr_y)
        self.clip_y = None if clip_y is None else float(clip_y)
        dtype = self.params[0].dtype
        start = problem.initial_y(dtype) if y0 is None else torch.as_tensor(y0, dtype=dtype)
        if tuple(start.shape) != (d,):
            raise ValueError(f"y0: expected shape ({d},), got {tuple(start.shape)}")
        self.y = problem.project(start.detach().clone()).contiguous()
        self._with_y = _WithY(model, self.y)
        check_loss(self._with_y, x_loss, *records.probe(1))
        self.gradients = ClippedGradients(
            self._with_y,
            x_loss,
            mode=runtime.grad_mode,
            chunk_size=runtime.chunk_size,
            nonfinite=self.nonfinite,
        )
        # Sums over records stay in float64 until their release adds the noise (and rounds once).
        self._sum = accumulators(self.flat)
        (self._y_sum,) = accumulators([self.y])
        self._y_v, self._y_scratch = torch.zeros_like(self.y), torch.zeros_like(self.y)

    def _noise_units(self) -> dict[str, float]:
        """The ``units`` the noise was calibrated with (``shares="auto"``)."""
        return self._units

    # ---- x-gradients at (x, y) points -------------------------------------------------------------------
    def _point(self, x: Sequence[Tensor], y: Tensor) -> list[Tensor]:
        return [*x, y]

    def _x_sum(self, batch: Batch, clip: float) -> int:
        """``self._sum = sum_i clip_C(grad_x f(x, y; z_i))`` at the current ``(x, y)``."""
        for s in self._sum:
            s.zero_()
        inputs, targets = batch
        return self.gradients.sum(
            inputs,
            targets,
            clip,
            [*self._sum, self._y_scratch],
            point=self._point([p.detach() for p in self.params], self.y),
        )

    # ---- the y-step -------------------------------------------------------------------------------------
    def _y_gradient(self, batch: Batch) -> int:
        """``self._y_sum = sum_i clip_{C0}(grad_y f(x, y; z_i))`` at the current ``(x, y)``."""
        inputs, targets = batch
        with torch.no_grad():
            outputs = self.model(inputs)
        grads = self.problem.y_grads(outputs, targets, self.y)
        self._y_sum.zero_()
        # through the engine, like the x-sums: a data-parallel engine all-reduces it to the whole batch's
        return self.gradients.rows(grads, self.clip_y, [self._y_sum])

    def _y_step(self, stream: str, batch_size: int) -> None:
        """``y <- Proj_Y(y + lr_y (y_sum / b + N(0, (sigma_y C0)^2 I)))``: a noisy clipped ascent step."""
        release(
            [self._y_v], stream, ClippedSum([self._y_sum], self.clip_y, batch_size),
            noise_multiplier=self.noise[stream], reset=True, generator=self.generator, params=[self.y],
            lr=-self.lr_y,  # ascent
        )  # fmt: skip
        self.y.copy_(self.problem.project(self.y))

    def _draw(self) -> Batch:
        """The records of the sampler's next batch, ``(inputs, targets)``."""
        return self.records.draw(self.sampler)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, list[Tensor]]:
        return {"y": [self.y]}

    def _extra_state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


class DPSGDA(MinimaxAlgorithm):
    """DP-SGDA (Algorithm 1 of the PrivateDiff paper, after Yang et al. 2022): noisy descent-ascent.

    Each of ``steps`` steps draws one batch of ``batch_size`` records (``sampling="wor"``: without
    replacement, as in the paper; ``"full"``: every record) and, at the current ``(x_t, y_t)``:

    - ``x <- x - lr (mean_i clip_{C1}(grad_x f(x_t, y_t; z_i)) + N(0, (sigma_x C1)^2 I))``;
    - ``y <- Proj_Y(y + lr_y (mean_i clip_{C2}(grad_y f(x_t, y_t; z_i)) + N(0, (sigma_y C2)^2 I)))``.

    Output: the last iterate (the model's parameters and :attr:`y`).

    Args:
        model: the ``nn.Module`` whose trainable parameters are ``x``.
        problem: the :class:`~dpvr.problems.MinimaxProblem` (``f``, the domain ``Y`` and its projection).
        inputs: the private records' inputs, or :class:`~dpvr.optim.records.Records`.
        targets: the records' targets; omitted with ``Records``.
        lr: the x step size; required without ``optimizer``, not given with one.
        lr_y: the y ascent step size (> 0).
        steps: the number of steps.
        batch_size: the records ``b`` of each step's batch; unused with ``sampling="full"``.
        clip: ``{"x": C1, "y": C2}``, the per-sample clip radii of the x- and y-gradients (> 0).
        noise: ``{"x": z_x, "y": z_y}`` (noise multipliers) or ``PaperSigmas(x=sigma_x, y=sigma_y)`` (noise
            std over the clip radius on the batch mean, the paper's units); ``None``: calibrated from
            ``privacy.epsilon`` with the accountant.
        sampling: ``"wor"`` (default: without replacement, as in the paper) or ``"full"`` (every record).
        y0: the starting ``y`` (public, shape ``(problem.y_dim,)``); default the problem's initial ``y``.
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters that steps x on the released
            noisy gradient (post-processing) instead of the SGD step.
        privacy: the :class:`~dpvr.optim.PrivacyConfig`.
        runtime: the :class:`~dpvr.optim.RuntimeConfig`.

    Raises:
        ValueError: ``privacy.neighbouring="add-remove"`` (replace-one only: the sizes are the data's); a bad
            ``lr`` or ``lr_y`` (not > 0, or ``lr`` with an optimizer), ``clip`` without exactly
            ``"x"`` and ``"y"`` or a radius not > 0, a ``y0`` of the wrong shape, an invalid batch size or
            ``sampling``, noise neither given nor calibratable.
        TypeError: ``clip`` not a mapping, ``privacy``/``runtime``/``optimizer`` of the wrong type, or
            ``targets`` given with ``Records``.

    Guarantee:
        Replace-one neighbours: each block's clipped mean moves by at most ``2C/b`` when one record is
        replaced, so the step is a Gaussian release of the pair on one sampled batch; it is accounted as the
        plan :class:`dpvr.privacy.events.DPSGDAPlan` (shared batch) describes, step by step, with the budget
        guard: a step that would exceed ``privacy.epsilon`` raises before anything is released. Assumptions:
        the batches are drawn as stated (the sampler is seeded from the operating system unless
        ``runtime.sampler_seed`` is given), ``y0`` does not depend on the private data.
    """

    name = "DP-SGDA"

    def __init__(
        self,
        model: nn.Module,
        problem: MinimaxProblem,
        inputs: Tensor | Records,
        targets: Tensor | None = None,
        *,
        lr: float | None = None,
        lr_y: float,
        steps: int,
        batch_size: int | None,
        clip: Mapping[str, float],
        noise: Mapping[str, float] | None = None,
        sampling: str = "wor",
        y0: Tensor | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        privacy: PrivacyConfig = PrivacyConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        settings = dict(
            lr=lr, lr_y=lr_y, steps=steps, batch_size=batch_size, clip=clip, noise=noise, sampling=sampling,
            y0=y0, optimizer=optimizer, privacy=privacy, runtime=runtime,
        )  # fmt: skip
        lr = step_size(lr, optimizer)
        clip = stream_clips(clip, ("x", "y"))
        units = {"y": clip["y"] / clip["x"]}  # shares="auto": y's noise is relative to C2, x's to C1
        records = as_records(inputs, targets)
        n = len(records)
        plan = events.DPSGDAPlan(n, n if sampling == "full" else batch_size, steps, sampling)
        sampler = BatchSampler.for_stream(plan, "x", n, runtime.sampler_seed)  # x and y share its batch
        super().__init__(
            model, problem, records, plan=plan, sampler=sampler, lr_y=lr_y, clip_y=clip["y"], y0=y0,
            noise=noise, privacy=privacy, runtime=runtime, settings=settings, units=units,
        )
        self.clip, self.lr, self.steps, self.optimizer = clip, lr, int(steps), optimizer
        self.x = Iterate(self.params, optimizer, keep_previous=False)
        self.v = DifferenceEstimator(self.flat)  # reset at every step: a plain noisy gradient

    def _step(self) -> dict[str, float]:
        with self.releasing("x"):  # x and y on one shared batch: one release of the group
            batch = self._draw()
            b = self.sampler.batch_size
            dropped = self._x_sum(batch, self.clip["x"]) + self._y_gradient(batch)  # both at (x_t, y_t)
            self.v.release(
                "x", ClippedSum(self._sum, self.clip["x"], b), noise_multiplier=self.noise["x"], reset=True,
                generator=self.generator, iterate=self.x, lr=self.lr,
            )
            self._y_step("y", b)
        return {"move": self.x.move, "y": float(self.y.norm()), "nonfinite": dropped}


class PrivateDiff(MinimaxAlgorithm):
    """PrivateDiff Minimax (Algorithm 3 of Zhang et al., with Algorithm 4 as the y-solver), made private as
    dpvr's design requires.

    Round ``r`` (1-based; the paper's ``r - 1``), at ``x_r`` with the public ``y_r``:

    1. ``y_{r+1}``, private before anything reads it, made one of two ways (``y_release``, below);
    2. one batch of ``m`` records; a checkpoint round (``(r - 1) % restart == 0``) resets the estimator to
       ``mean_i clip_{C1}(grad_x f(x_r, y_{r+1}; z_i)) + N(0, (sigma_x1 C1)^2 I)``; a difference round adds
       ``mean_i clip_{C_r}(grad_x f(x_r, y_{r+1}; z_i) - grad_x f(x_{r-1}, y_r; z_i))
       + N(0, (sigma_x2 C_r)^2 I)`` with ``C_r = C2 ||x_r - x_{r-1}|| + C3`` (the same sample at both points);
    3. ``x_{r+1} = x_r - lr v``.

    **Why y is private.** In the paper ``y_{r+1}`` is the output of noiseless clipped SGA, perturbed only
    after the x-gradient has used it, with a sensitivity bound (uniform stability) that holds in expectation,
    not for every neighbouring pair. dpvr releases ``y_{r+1}`` before any x-gradient reads it, either way:

    - ``y_release="ascent"`` (default): ``y_steps = T2`` noisy clipped ascent steps from ``y_r`` with ``x_r``
      fixed, each on its own batch of ``m`` records: ``y <- Proj_Y(y + lr_y (mean_i clip_{C0}(grad_y f(x_r,
      y; z_i)) + N(0, (sigma_y C0)^2 I)))``. The clipped mean moves by at most ``2 C0 / m`` when one record
      is replaced, so each step is a sampled Gaussian release (``steps * y_steps`` releases of stream
      ``"y"``), and ``y_{r+1}`` is private by post-processing. Needs no property of the problem.
    - ``y_release="output"``: solve the inner problem ``max_{y in Y} F(y) = (1/n) sum_i f(x_r, y; z_i)``
      over *all* ``n`` training records to a certified accuracy ``tau`` (``y_tolerance``) and release
      ``y_{r+1} = Proj_Y(y_hat + N(0, (sigma_y Delta)^2 I))``, ``Delta = gradient_range / (n mu) + 2 tau``
      from the problem's public constants (:meth:`~dpvr.problems.MinimaxProblem.y_sensitivity`; a problem
      that has none is refused). One unsampled Gaussian release of stream ``"y"`` per round, its noise
      multiplier relative to ``Delta``.

    **Proof of the output release's sensitivity** (replace-one, ``n`` public). ``x_r`` is a released
    iterate, and record ``i``'s model output at ``x_r`` depends on record ``i`` alone, so replacing it
    changes one term of ``F``. The exact maximisers then satisfy ``||y*(D) - y*(D')|| <= gradient_range / (n
    mu)`` (:class:`~dpvr.problems.minimax.YSensitivity`). The solver returns a ``y_hat`` with ``||y_hat -
    y*|| <= tau`` on each dataset (its certificate, rounding included, below), so ``||y_hat(D) -
    y_hat(D')|| <= Delta``, and the release is the Gaussian mechanism with that sensitivity; the projection
    is post-processing. Every model output is read through the problem's
    :meth:`~dpvr.problems.MinimaxProblem.bounded_outputs`, which maps a non-finite output to a public
    admissible value, so a record with a non-finite score is still an admissible record and the bound holds
    on every pair (``nonfinite="raise"`` raises instead). No clipping is used, so ``F`` keeps the problem's
    strong concavity.

    **The certificate.** Projected gradient ascent in float64 from the public ``y_r`` with step ``lr_y``
    (default ``1/L``, the problem's smoothness), for at most ``y_steps`` iterations. In exact arithmetic,
    after the step ``y+ = Proj_Y(y + lr_y g)`` along any direction ``g``, with ``G = (y+ - y) / lr_y``: the
    projection's optimality gives ``<g - G, v - y+> <= 0`` for all ``v`` in ``Y``, and strong concavity with
    ``y*``'s optimality gives ``mu ||y+ - y*||^2 <= <grad F(y+), y* - y+>``; together ``||y+ - y*|| <= (||G||
    + ||grad F(y+) - g||) / mu`` for any step size and any ``g``.

    **Rounding.** In floating point ``g`` and ``g+`` are the computed gradients at ``y`` and ``y+``, and
    ``y+`` is the projection (assumed exact, as a clamp to a box is) of the rounded ``w = fl(y + lr_y g)``,
    so it is the exact step along ``g' = (w - y) / lr_y``; the bound above with ``g'`` for ``g`` gives
    ``||y+ - y*|| <= (||G|| + ||g+ - g|| + ||g+ - grad F(y+)|| + ||g' - g||) / mu``. The last two terms are
    bounded by the public allowance ``A`` of :class:`YRounding` (``y_rounding``): each record's gradient is
    within ``32 u L_y`` (``u`` float64's unit roundoff, ``L_y`` the problem's ``y_lipschitz``; assumed of
    the problem's ``y_grads``, and a computed gradient longer than ``L_y`` raises), the ``n`` records are
    summed by a balanced tree (error ``~ log2(n) u L_y``), and ``w``'s two roundings cost ``u (||y|| / lr_y
    + 2 ||g||)``. ``A`` depends on ``n`` only through ``log2 n``. The solver stops at the first ``y+`` with
    ``s ((||G|| + ||g+ - g||) / mu + ||y_hat - y+||) + A <= tau``, ``y_hat`` being ``y+`` in ``y``'s dtype
    and ``s = 1 + 2 (y_dim + 8) u`` covering the rounding of those measured norms: then ``||y_hat - y*|| <=
    tau``, which is all that the sensitivity proof above uses, so the rounding enters the proof only through
    the certificate, never through ``Delta``'s form.

    **The tolerance.** ``tau`` is public: by default ``max(1% of gradient_range / (n mu), 4 A + r)``, ``r``
    a public bound on rounding ``y`` to its dtype (0 in float64; ``~1e-7 ||y||`` in float32), so the
    allowance is below ``tau`` by construction at every ``n``. For AUC-M in float64 the 1% rule holds to
    about ``1e11`` records; a float32 ``y`` reaches its floor (``~1e-7``) from a few hundred thousand
    records (a float64 model avoids that). A ``y_tolerance`` below ``4 A + r`` is refused at construction,
    naming ``y_tolerance`` with the numbers: more iterations cannot certify it. Otherwise the solver raises
    ``RuntimeError`` naming ``y_steps`` if none of its iterations certifies (the round's y-release is then
    charged all the same, and the failure itself depends on the data: choose ``y_steps`` with a margin; a
    quadratic ``F`` such as AUC-M's is certified at the second iteration with the default step). The
    certificate's value is not released.

    The paper's ``C0, C1, C2, C3`` are ``clip["y"]`` (ascent only), ``clip["checkpoint"]`` and
    ``clip["difference"] = (C2, C3)``; the difference round is
    :class:`~dpvr.optim.estimator.DifferenceEstimator`'s, its radius capped at ``max_radius`` (default
    ``2 C1``; not in the paper: it keeps noise from feeding on itself).

    Output: the last iterate (the model's parameters and :attr:`y`).

    Args:
        model: the ``nn.Module`` whose trainable parameters are ``x``.
        problem: the :class:`~dpvr.problems.MinimaxProblem` (``f``, ``Y``; with ``y_release="output"`` also
            its public constants, :meth:`~dpvr.problems.MinimaxProblem.y_sensitivity`).
        inputs: the private records' inputs, or :class:`~dpvr.optim.records.Records`.
        targets: the records' targets; omitted with ``Records``.
        lr: the x step size of ``x_{r+1} = x_r - lr v``; required without ``optimizer``, not given with one.
        lr_y: the y step size: of the noisy ascent (required with ``"ascent"``), or of the output solver
            (default ``1/L``, the problem's smoothness).
        steps: the number of rounds.
        restart: the checkpoint period: round ``r`` resets the estimator when ``(r - 1) % restart == 0``.
        y_steps: ``T2``, the noisy ascent steps per round (``"ascent"``), or the solver's iteration limit
            (``"output"``).
        batch_size: the records ``m`` of each batch; unused with ``sampling="full"``.
        clip: ``{"checkpoint": C1, "difference": (C2, C3)[, "y": C0]}`` (``"y"`` exactly with ``"ascent"``);
            ``C_r = C2 ||x_r - x_{r-1}|| + C3``.
        noise: ``{"checkpoint": z1, "difference": z2, "y": z_y}`` (noise multipliers), or
            ``PaperSigmas(checkpoint=sigma_x1, difference=sigma_x2, y=sigma_y)`` (noise std over the clip
            radius on the batch mean; output y: over ``Delta``); ``None``: calibrated jointly from
            ``privacy.epsilon`` (``calibration="tight"``; with ``y_release="output"`` also Remark 5.1's
            ``calibration="paper"``).
        sampling: ``"wor"`` (default: without replacement) or ``"full"``.
        y_release: ``"ascent"`` (default) or ``"output"`` (see above).
        y_tolerance: ``tau``, the output solver's certified accuracy (``"output"`` only); default the rule
            under **The tolerance**.
        y0: the starting ``y`` (public, shape ``(problem.y_dim,)``); default the problem's initial ``y``.
        max_radius: the cap on the difference radius ``C_r``; default ``2 C1``.
        optimizer: a ``torch.optim.Optimizer`` that steps x on the released estimate (post-processing)
            instead of the SGD step.
        privacy: the :class:`~dpvr.optim.PrivacyConfig`.
        runtime: the :class:`~dpvr.optim.RuntimeConfig`.

    Raises:
        ValueError: ``privacy.neighbouring="add-remove"`` (replace-one only: the sizes are the data's); an
            unknown ``y_release``; ``clip`` without exactly the streams above or with a bad
            radius; ``y_tolerance`` with ``"ascent"``, or not finite and > 0, or below ``4 A + r`` (naming
            the numbers); ``"ascent"`` without ``lr_y``; a bad ``lr``/``lr_y``; a problem without public
            constants under ``"output"``; a ``y0`` of the wrong shape; an invalid batch size or
            ``sampling``; noise neither given nor calibratable.
        TypeError: ``clip`` not a mapping, ``privacy``/``runtime``/``optimizer`` of the wrong type, or
            ``targets`` given with ``Records``.
        RuntimeError: (at a round, ``"output"``) none of the solver's ``y_steps`` iterations certifies
            ``tau``.

    Guarantee:
        ``y`` is released as above. ``C_r`` depends on released iterates only and the noise std scales with
        it, so each x-round is a sampled Gaussian release of fixed noise multiplier (Lemma 8: sensitivity
        ``2C/m``). All three streams are recorded in one accountant as they happen, behind the budget guard
        (the plan :class:`dpvr.privacy.events.PrivateDiffPlan` with the same ``y_release``). Assumptions:
        batches drawn as stated (seeded from the operating system unless ``runtime.sampler_seed`` is given);
        ``y0`` does not depend on the private data; with ``y_release="output"``, replace-one neighbours (the
        plan's relation).
    """

    name = "PrivateDiff"

    def __init__(
        self,
        model: nn.Module,
        problem: MinimaxProblem,
        inputs: Tensor | Records,
        targets: Tensor | None = None,
        *,
        lr: float | None = None,
        lr_y: float | None = None,
        steps: int,
        restart: int,
        y_steps: int,
        batch_size: int | None,
        clip: Mapping[str, float | tuple[float, float]],
        noise: Mapping[str, float] | None = None,
        sampling: str = "wor",
        y_release: str = "ascent",
        y_tolerance: float | None = None,
        y0: Tensor | None = None,
        max_radius: float | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        privacy: PrivacyConfig = PrivacyConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        settings = dict(
            lr=lr, lr_y=lr_y, steps=steps, restart=restart, y_steps=y_steps, batch_size=batch_size, clip=clip,
            noise=noise, sampling=sampling, y_release=y_release, y_tolerance=y_tolerance, y0=y0,
            max_radius=max_radius, optimizer=optimizer, privacy=privacy, runtime=runtime,
        )  # fmt: skip
        lr = step_size(lr, optimizer)
        if y_release not in Y_RELEASES:
            raise ValueError(f"y_release: must be one of {Y_RELEASES}, got {y_release!r}")
        output = y_release == "output"
        clip = stream_clips(
            clip, ("checkpoint", "difference") if output else ("checkpoint", "difference", "y"),
            pairs=("difference",),
        )  # fmt: skip
        records = as_records(inputs, targets)
        n = len(records)
        if output:
            self.y_constants = problem.y_sensitivity()  # refuses a problem without public constants
            stability = self.y_constants.stability(n)
            lr_y = 1.0 / self.y_constants.smoothness if lr_y is None else lr_y
            # y is kept in the dtype of the model's (first trainable) parameters
            dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float64)
            self.y_rounding = YRounding.of(problem, self.y_constants, n, lr_y, dtype)
            if y_tolerance is None:  # allowance < tolerance by construction, at any n
                tolerance = self.y_rounding.default_tolerance(stability)
            else:
                tolerance = float(y_tolerance)
                if not (tolerance > 0 and math.isfinite(tolerance)):
                    raise ValueError(f"y_tolerance: must be finite and > 0, got {y_tolerance}")
                if tolerance < self.y_rounding.minimum_tolerance:  # public: refused before any data is read
                    raise ValueError(self.y_rounding.refusal(tolerance))
            self.y_tolerance = tolerance
            self.y_sensitivity = stability + 2 * tolerance  # Delta: the release's replace-one sensitivity
        else:
            self.y_constants = self.y_tolerance = self.y_sensitivity = self.y_rounding = None
            if y_tolerance is not None:
                raise ValueError("y_tolerance: only y_release='output' solves the inner problem")
            if lr_y is None:
                raise ValueError("lr_y: the ascent step size is required with y_release='ascent'")
        # shares="auto": the y noise is relative to Delta (output) or C0 (ascent), the x noise to C1
        units = {"y": (self.y_sensitivity if output else clip["y"]) / clip["checkpoint"]}
        plan = events.PrivateDiffPlan(
            n, n if sampling == "full" else batch_size, steps, restart, y_steps, sampling, y_release=y_release
        )
        # One sampler for the sampled streams: they draw at the same rate, each release its own batch.
        sampler = BatchSampler.for_stream(plan, "checkpoint", n, runtime.sampler_seed)
        super().__init__(
            model, problem, records, plan=plan, sampler=sampler, lr_y=lr_y,
            clip_y=None if output else clip["y"], y0=y0, noise=noise, privacy=privacy, runtime=runtime,
            settings=settings, units=units,
        )  # fmt: skip
        self.clip, self.y_release = clip, y_release
        self.lr, self.steps, self.restart, self.y_steps = lr, int(steps), int(restart), int(y_steps)
        self.optimizer = optimizer
        per_move, offset = clip["difference"]
        cap = 2 * clip["checkpoint"] if max_radius is None else float(max_radius)
        self.radius = Radius(clip["checkpoint"], per_move=(per_move,), offset=offset, cap=cap)
        self.x = Iterate(self.params, optimizer)  # x_r, and x_{r-1} before round r
        self.v = DifferenceEstimator(self.flat)
        self._y_prev = self.y.clone()  # y_r: the y that x_{r-1}'s gradient was taken at

    @property
    def estimate(self) -> list[Tensor]:
        """The noisy estimator ``v`` of ``grad_x L(x_r, y_{r+1})`` used by the last step (flat tensors)."""
        return self.v.value

    def _step(self) -> dict[str, float]:
        r = self.steps_done + 1
        m = self.sampler.batch_size
        checkpoint = (r - 1) % self.restart == 0
        stream = "checkpoint" if checkpoint else "difference"
        radius = self.radius(checkpoint, self.x.move)
        y_releases = 1 if self.y_release == "output" else self.y_steps
        self._admit_round({"y": y_releases, stream: 1})  # the whole round fits, or none of it happens
        # 1. y_{r+1} at x_r, released before anything reads it
        self._y_prev.copy_(self.y)
        if self.y_release == "output":
            with self.releasing("y"):
                dropped = self._y_output()
        else:
            dropped = 0
            for _ in range(self.y_steps):
                with self.releasing("y"):
                    dropped += self._y_gradient(self._draw())
                    self._y_step("y", m)
        # 2-3. the estimator of grad_x L(x_r, y_{r+1}), reset or difference, and x_{r+1} = x_r - lr v
        with self.releasing(stream):
            batch = self._draw()
            for s in self._sum:
                s.zero_()
            if checkpoint:
                dropped += self._x_sum(batch, radius)
            elif radius > 0:  # a zero radius (x did not move, no offset) clips every difference to 0
                inputs, targets = batch
                dropped += self.gradients.diff_sum(
                    inputs,
                    targets,
                    self._point(self.x.point(), self.y),
                    self._point(self.x.previous, self._y_prev),
                    radius,
                    [*self._sum, self._y_scratch],
                )
            self.v.release(
                stream, ClippedSum(self._sum, radius, m), noise_multiplier=self.noise[stream],
                reset=checkpoint, generator=self.generator, iterate=self.x, lr=self.lr,
            )
        return {
            "checkpoint": float(checkpoint),
            "radius": radius,
            "move": self.x.move,
            "y": float(self.y.norm()),
            "nonfinite": dropped,
        }

    # ---- y by output perturbation ---------------------------------------------------------------------
    def _y_output(self) -> int:
        """``y <- Proj_Y(y_hat + N(0, (sigma_y Delta)^2 I))``; returns the records with non-finite outputs."""
        y_hat, dropped = self._solve_y()
        self._y_sum.copy_(y_hat)
        release(
            [self._y_v], "y", ClippedSum.replace_one([self._y_sum], self.y_sensitivity),
            noise_multiplier=self.noise["y"], reset=True, generator=self.generator,
        )  # fmt: skip
        self.y.copy_(self.problem.project(self._y_v))
        return dropped

    def _outputs(self) -> tuple[Tensor, Tensor, int]:
        """Every training record's model output at the current ``x`` (float64, through the problem's
        ``bounded_outputs``), every record's target, and how many records had a non-finite output."""
        outputs, targets = [], []
        with torch.no_grad():
            for inputs, chunk_targets in self.records.chunks(_OUTPUT_CHUNK):
                outputs.append(self.model(inputs))
                targets.append(chunk_targets)
        output = torch.cat(outputs).double()
        dropped = int((~torch.isfinite(output.reshape(len(output), -1))).any(dim=1).sum())
        if dropped and self.nonfinite == "raise":
            raise ops.NonFiniteError(f"{self.name}: {dropped} records have non-finite model outputs")
        target = targets[0] if len(targets) == 1 else torch.cat(targets)
        return self.problem.bounded_outputs(output), target, dropped

    def _mean_y_grad(self, outputs: Tensor, targets: Tensor, y: Tensor) -> Tensor:
        """``grad F(y)`` over every record, summed by :func:`_pairwise_sum` (within
        :attr:`YRounding.gradient_error` of the exact value when the problem's constants hold)."""
        grads = self.problem.y_grads(outputs, targets, y)
        if not bool(torch.isfinite(grads).all()):
            raise RuntimeError(
                f"{type(self.problem).__name__}.bounded_outputs leaves non-finite y-gradients: its "
                "y_sensitivity constants cannot hold"
            )
        if float(grads.norm(dim=1).max()) > self.y_rounding.record_bound:  # a diagnostic, not a release
            raise RuntimeError(
                f"{type(self.problem).__name__}.y_grads gives a record a y-gradient longer than its "
                f"y_lipschitz={self.y_rounding.y_lipschitz:g}: the constants that bound the inner solve's "
                "rounding do not hold"
            )
        return _pairwise_sum(grads) / len(grads)

    def _solve_y(self) -> tuple[Tensor, int]:
        """``y_hat`` within ``y_tolerance`` of ``argmax_Y F`` at the current ``x``, certified (see the class
        documentation), in ``y``'s dtype; and the number of records with non-finite outputs. Unnoised: a
        value of the private data, never to be released as it is."""
        outputs, targets, dropped = self._outputs()
        rounding = self.y_rounding  # public: depends on n, the problem's constants, lr_y and y's dtype
        mu, step = self.y_constants.strong_concavity, self.lr_y
        y = self.y.double()  # the warm start y_r is public
        g = self._mean_y_grad(outputs, targets, y)
        for _ in range(self.y_steps):
            y_next = self.problem.project(y + step * g)
            g_next = self._mean_y_grad(outputs, targets, y_next)
            y_hat = y_next.to(self.y.dtype)
            measured = (float((y_next - y).norm()) / step + float((g_next - g).norm())) / mu + float(
                (y_hat.double() - y_next).norm()
            )
            if rounding.slack * measured + rounding.allowance <= self.y_tolerance:
                return y_hat, dropped
            y, g = y_next, g_next
        raise RuntimeError(
            f"{self.name}: the inner problem was not solved to y_tolerance={self.y_tolerance:g} in "
            f"y_steps={self.y_steps} iterations of lr_y={step:g}: raise y_steps (the solve's rounding "
            f"allowance over n={rounding.records} records, {rounding.allowance:.3g}, is at most "
            f"1/{_FLOOR} of y_tolerance, which leaves the iterations room to certify)"
        )

    def _buffers(self) -> dict[str, list[Tensor]]:
        return {**super()._buffers(), "v": self.v.value, "prev": self.x.previous, "y_prev": [self._y_prev]}

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), "move": self.x.move}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        super()._load_extra_state(state)
        self.x.move = float(state["move"])
