"""DP-SGDA, noisy descent-ascent (the algorithm of :mod:`dpvr.algorithms.dp_sgda`), built on the minimax
machinery of :mod:`dpvr.algorithms.minimax`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ...optim.config import PrivacyConfig, RuntimeConfig, stream_clips
from ...optim.estimator import ClippedSum, DifferenceEstimator, Iterate, step_size
from ...optim.records import Records, as_records
from ...problems import MinimaxProblem
from ..minimax import MinimaxAlgorithm
from .plan import DPSGDAPlan


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
        plan :class:`dpvr.algorithms.DPSGDAPlan` (shared batch) describes, step by step, with the budget
        guard: a step that would exceed ``privacy.epsilon`` raises before anything is released. Assumptions:
        the batches are drawn as stated (the sampler is seeded from the operating system unless
        ``runtime.sampler_seed`` is given), ``y0`` does not depend on the private data.
    """

    name = "DP-SGDA"
    batch_stream = "x"  # x and y share its batch
    required_settings = ("lr_y", "steps", "batch_size", "clip")
    clip_streams = ("x", "y")

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
        clip = stream_clips(clip, self.clip_streams)
        units = {"y": clip["y"] / clip["x"]}  # shares="auto": y's noise is relative to C2, x's to C1
        records = as_records(inputs, targets)
        n = len(records)
        plan = DPSGDAPlan(n, n if sampling == "full" else batch_size, steps, sampling)
        super().__init__(
            model, problem, records, plan=plan, lr=lr, lr_y=lr_y, steps=steps, clip=clip, optimizer=optimizer,
            y0=y0, noise=noise, privacy=privacy, runtime=runtime, settings=settings, units=units,
        )  # fmt: skip
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
