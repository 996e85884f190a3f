"""DP-SGD and DP-GD: noisy clipped gradient steps on sampled batches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import ops
from ..privacy import events
from .base import LossFn, PrivateAlgorithm
from .gradients import ClippedGradients
from .sampling import BatchSampler


class DPSGD(PrivateAlgorithm):
    """DP-SGD (Abadi et al. 2016) on ``(inputs, targets)``.

    Each step draws a batch (``sampling``: ``"poisson"`` with rate ``batch_size / n``, ``"wor"`` fixed-size
    without replacement, ``"full"``), clips each per-sample gradient to ``clip``, adds
    ``N(0, (z * clip)^2 I)`` to the sum and steps ``x <- x - lr * noisy_sum / batch_size`` (the public,
    expected batch size).

    Privacy: the composition of ``steps`` sampled Gaussian mechanisms with noise multiplier ``z`` under the
    neighbouring relation (default: add/remove for Poisson, replace-one otherwise), recorded step by step
    in ``self.accountant``; a step that would exceed ``epsilon`` raises
    :class:`~dpvr.optim.base.BudgetExhaustedError` before anything is released. Give ``noise_multiplier``,
    or ``epsilon`` to calibrate it for the whole ``steps``.
    """

    name = "DP-SGD"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        lr: float,
        clip: float,
        steps: int,
        batch_size: int | None = None,
        sampling: str = "poisson",
        noise_multiplier: float | None = None,
        epsilon: float | None = None,
        delta: float = 1e-5,
        neighbouring: str | None = None,
        calibration: str = "tight",
        accountant: str = "rdp",
        generator: ops.NoiseGenerator | None = None,
        sampler_seed: int | None = None,
        chunk_size: int | None = None,
    ) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"targets: {len(targets)} rows for {len(inputs)} inputs")
        if not clip > 0:
            raise ValueError(f"clip: must be > 0, got {clip}")
        if sampling == "cyclic":
            raise ValueError("sampling='cyclic' is CyclicDPSGD (last-iterate accounting)")
        n = len(inputs)
        self.sampler = BatchSampler(sampling, n, batch_size, sampler_seed)
        relation = neighbouring or ("add-remove" if sampling == "poisson" else "replace-one")
        plan = events.DPSGD(
            steps=steps,
            sampling=sampling,
            batch_size=self.sampler.batch_size,
            dataset_size=n,
            neighbouring=relation,
        )
        super().__init__(
            model,
            loss_fn,
            plan=plan,
            delta=delta,
            epsilon=epsilon,
            noise=None if noise_multiplier is None else {"gradient": noise_multiplier},
            calibration=calibration,
            accountant=accountant,
            generator=generator,
        )
        self.inputs, self.targets = inputs, targets
        self.lr, self.clip, self.steps = float(lr), float(clip), int(steps)
        self.gradients = ClippedGradients(model, loss_fn, chunk_size=chunk_size)
        self._sum = [torch.zeros_like(f) for f in self.flat]
        self._v = [torch.zeros_like(f) for f in self.flat]

    @property
    def total_steps(self) -> int:
        return self.steps

    def step(self) -> dict[str, float]:
        admitted = self._admit("gradient")
        batch = torch.as_tensor(self.sampler.draw(), dtype=torch.long)
        for s in self._sum:
            s.zero_()
        dropped = self.gradients.sum(self.inputs[batch], self.targets[batch], self.clip, self._sum)
        b = self.sampler.batch_size
        move = ops.noisy_update(
            self._v,
            sum=self._sum,
            scale=1.0 / b,
            sigma=self.noise["gradient"] * self.clip / b,
            reset=True,
            generator=self.generator,
            stream="gradient",
            params=self.flat,
            lr=self.lr,
        )
        self._record(admitted)
        self.steps_done += 1
        return {"step": self.steps_done, "batch": len(batch), "nonfinite": dropped, "move": move}

    def _extra_state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


class DPGD(DPSGD):
    """DP-GD: :class:`DPSGD` on the full dataset every step (no sampling; replace-one by default)."""

    name = "DP-GD"

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: Any
    ) -> None:
        if kwargs.pop("sampling", "full") != "full" or kwargs.pop("batch_size", None) not in (
            None,
            len(inputs),
        ):
            raise ValueError("DPGD uses the full batch; use DPSGD for sampled batches")
        super().__init__(model, loss_fn, inputs, targets, sampling="full", **kwargs)
