"""What the DP minimax algorithms share (:class:`MinimaxAlgorithm`): DP-SGDA and PrivateDiff Minimax
(Zhang et al., nonconvex-strongly-concave).

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

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..optim.base import PrivateAlgorithm
from ..optim.config import PrivacyConfig, RuntimeConfig
from ..optim.estimator import ClippedSum, release
from ..optim.gradients import accumulators, check_loss
from ..optim.records import Batch, Records
from ..optim.sampling import BatchSampler
from ..privacy import events
from ..problems import MinimaxProblem


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
    """What DP-SGDA and PrivateDiff share: data, sampling, the x step's settings, ``y`` and its noisy clipped
    ascent step."""

    #: The stream whose batch size and scheme the one sampler draws with: every sampled stream of the plan
    #: draws at the same rate, each release its own batch.
    batch_stream: str

    def __init__(
        self,
        model: nn.Module,
        problem: MinimaxProblem,
        records: Records,
        *,
        plan: events.Plan,
        lr: float | None,
        lr_y: float | None,
        steps: int,
        clip: Mapping[str, Any],
        optimizer: torch.optim.Optimizer | None,
        y0: Tensor | None,
        noise: Mapping[str, float] | None,
        privacy: PrivacyConfig,
        runtime: RuntimeConfig,
        settings: Mapping[str, Any],
        units: Mapping[str, float],
    ) -> None:
        """``lr``: the x step size and ``clip`` the radii, both checked (``clip["y"]``: the ascent's, where it
        takes one); ``settings``: what the run's binding records (the subclass's arguments, as given);
        ``units``: for ``shares="auto"``, the public radius or sensitivity each stream's noise multiplier is
        relative to."""
        sampler = BatchSampler.for_stream(plan, self.batch_stream, len(records), runtime.sampler_seed)
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
        self.clip, self.lr, self.steps, self.optimizer = clip, lr, int(steps), optimizer
        self._units = dict(units)
        # None where the algorithm takes no noisy ascent step (PrivateDiff with y_release="output")
        self.lr_y = None if lr_y is None else float(lr_y)
        clip_y = clip.get("y")
        self.clip_y = None if clip_y is None else float(clip_y)
        dtype = self.params[0].dtype
        start = problem.initial_y(dtype) if y0 is None else torch.as_tensor(y0, dtype=dtype)
        if tuple(start.shape) != (d,):
            raise ValueError(f"y0: expected shape ({d},), got {tuple(start.shape)}")
        self.y = problem.project(start.detach().clone()).contiguous()
        self._with_y = _WithY(model, self.y)
        check_loss(self._with_y, x_loss, *records.probe(1))
        self.gradients = runtime.clipped_gradients(self._with_y, x_loss)
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
