"""What the DP SPIDER algorithms share (:class:`SpiderAlgorithm`): DP Double-SPIDER (psi-divergence DRO,
dual form) and DP Recursive-SPIDER (KL-DRO, compositional form).

Both are SPIDER estimators refreshed every ``q`` steps: at a refresh step an estimator is reset to a noisy
mean of per-sample clipped gradients; at the other steps it adds a noisy mean of per-sample clipped
same-sample differences between the current and the previous point, clipped at a radius proportional to
how far the (released) iterates moved, with noise std proportional to that radius. Each noisy mean is a
release of one stream of the plans :class:`dpvr.algorithms.DoubleSpiderPlan` / ``RecursiveSpider``, which
the algorithm admits (budget guard), performs and records in one accountant, as it happens.

Noise multipliers are dpvr's (``dpvr account double-spider --noise-multipliers ...``): the noise std on a
stream's batch *mean* is ``z * C / b`` with ``C`` its clip radius and ``b`` its batch size (``n`` for a full
batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ..optim.base import PrivateAlgorithm
from ..optim.config import PrivacyConfig, RuntimeConfig, stream_clips
from ..optim.estimator import ClippedSum, DifferenceEstimator, Iterate, Radius
from ..optim.gradients import accumulators, check_loss
from ..optim.records import Batch, Records, as_records
from ..optim.sampling import BatchSampler
from ..problems import LossFn
from .spider_plan import SpiderPlan


class SpiderAlgorithm(PrivateAlgorithm):
    """What both algorithms share: data, the plan of their streams, one sampler per stream, the clip radii,
    per-sample losses and clipped sums at iterates, the noisy estimator update of one stream, and the
    previous iterate ``x_{t-1}``."""

    #: The plan of the algorithm's streams, built from the run's size, length, period, batch sizes and scheme.
    plan_type: type[SpiderPlan]

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor | Records,
        targets: Tensor | None,
        *,
        steps: int,
        restart: int,
        batch_sizes: Mapping[str, int] | Sequence[int],
        sampling: str,
        clip: Mapping[str, float | tuple[float, float]],
        noise: Mapping[str, float] | None,
        privacy: PrivacyConfig,
        runtime: RuntimeConfig,
        settings: Mapping[str, Any],
    ) -> None:
        """``settings``: what the run's binding records (the subclass's arguments, as given)."""
        clip = self._checked_clip(clip)
        records = as_records(inputs, targets)
        plan = self.plan_type(len(records), steps, restart, as_batch_sizes(batch_sizes), sampling)
        privacy.require_replace_one(self.name)
        check_loss(model, loss_fn, *records.probe(1))
        super().__init__(
            model, loss_fn, plan=plan, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
            data=records,
        )  # fmt: skip
        self.records, self.restart, self.clip = records, int(restart), clip
        n = len(records)
        # One sampler per stream, keyed by name and sized by the plan's own per-stream batch size: what a
        # stream draws is what its releases are charged for.
        self.samplers = {
            stream: BatchSampler.for_stream(plan, stream, n, runtime.sampler_seed_for(k))
            for k, (stream, _) in enumerate(plan.batch_sizes)
        }
        self.gradients = runtime.clipped_gradients(model, loss_fn)
        # Sums over records stay in float64 until their release adds the noise (and rounds once).
        self._sum = accumulators(self.flat)
        self.x = Iterate(self.params)  # x_t and x_{t-1}

    def _checked_clip(self, clip: Mapping[str, float | tuple[float, float]]) -> dict[str, Any]:
        """``clip`` checked against :attr:`clip_streams` (those in ``clip_pairs`` a pair of constants)."""
        return stream_clips(clip, self.clip_streams, pairs=self.clip_pairs)

    def _difference_radius(self, refresh: str, difference: str) -> Radius:
        """The radius of a difference stream: ``clip[refresh]`` at a refresh, then ``clip[difference]`` per
        unit of each moving point's move, capped at twice the refresh radius (not in the paper: noise cannot
        feed on itself)."""
        per_move = self.clip[difference]
        per_move = per_move if isinstance(per_move, tuple) else (per_move,)
        return Radius(self.clip[refresh], per_move=per_move, cap=2 * self.clip[refresh])

    def _draw(self, stream: str) -> Batch:
        """The records of ``stream``'s next batch, ``(inputs, targets)``."""
        return self.records.draw(self.samplers[stream])

    def _losses(self, point: Sequence[Tensor], batch: Batch) -> Tensor:
        """Per-sample losses at the parameter values ``point`` (no gradient)."""
        inputs, targets = batch
        with torch.no_grad():
            outputs = functional_call(self.model, dict(zip(self.param_names, point)), (inputs,))
            return vmap(self.loss_fn)(outputs, targets)

    def _vector_sum(
        self,
        batch: Batch,
        radius: float,
        weights: Tensor,
        previous: Sequence[Tensor] | None = None,
        previous_weights: Tensor | None = None,
    ) -> int:
        """``self._sum = sum_i clip(w_i grad l(x_t; z_i))`` or, with ``previous``, the clipped same-sample
        difference ``w_i grad l(x_t; z_i) - w'_i grad l(x_{t-1}; z_i)``; radius 0 means both points and
        weights coincide, so the sum is exactly zero."""
        for s in self._sum:
            s.zero_()
        if radius == 0:
            return 0
        dtype = self.params[0].dtype
        (inputs, t), x, w = batch, self.x.point(), weights.to(dtype)
        if previous is None:
            return self.gradients.sum(inputs, t, radius, self._sum, point=x, weights=w)
        return self.gradients.diff_sum(
            inputs, t, x, previous, radius, self._sum, a=w, b=previous_weights.to(dtype)
        )

    def _scalar_sum(self, values: Tensor, radius: float, out: Tensor) -> int:
        """``out = sum_i clip_radius(values_i)`` for per-sample scalars (or same-sample differences of them),
        through the engine like every other sum of a release (so a data-parallel engine all-reduces it)."""
        out.zero_()
        if radius == 0:
            return 0
        # The per-record values in the parameters' dtype (clipped so), their sum into float64 ``out``.
        return self.gradients.rows(values.reshape(-1, 1).to(self.params[0].dtype), radius, [out])

    def _clipped(self, stream: str, total: Sequence[Tensor], radius: float) -> ClippedSum:
        """``total``, a sum over ``stream``'s batch of terms clipped into a ball of ``radius``."""
        return ClippedSum(total, radius, self.samplers[stream].batch_size)

    def _clipped_range(self, stream: str, total: Sequence[Tensor], low: float, high: float) -> ClippedSum:
        """``total``, a sum over ``stream``'s batch of scalar terms confined to ``[low, high]``: a replace-one
        range, less than a ball's ``2 high`` when the terms are one-sided."""
        return ClippedSum.replace_one(total, high - low, self.samplers[stream].batch_size)

    def _release(self, stream: str, estimator: DifferenceEstimator, clipped: ClippedSum, reset: bool) -> None:
        """``v <- (0 if reset else v) + clipped / b + noise`` at the stream's noise multiplier."""
        estimator.release(
            stream, clipped, noise_multiplier=self.noise[stream], reset=reset, generator=self.generator
        )

    def _buffers(self) -> dict[str, list[Tensor]]:
        return {"prev": self.x.previous}

    def _extra_state(self) -> dict[str, Any]:
        return {"dx": self.x.move, "samplers": {k: s.state_dict() for k, s in self.samplers.items()}}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.x.move = float(state["dx"])
        for k, s in self.samplers.items():
            s.load_state_dict(state["samplers"][k])


def require_positive(**values: float) -> None:
    """Refuses a step size or constant that must be > 0, naming it."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")


def as_batch_sizes(given: Mapping[str, int] | Sequence[int]) -> Mapping[str, int] | tuple[int, ...]:
    """Per-stream batch sizes as the plan takes them: keyed by stream name, or in the paper's order."""
    return dict(given) if isinstance(given, Mapping) else tuple(given)
