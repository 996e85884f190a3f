"""Clipped sums of per-sample gradients and of same-sample gradient differences, for the algorithms.

The algorithms ask for "the clipped sum over these samples at this point" and never see per-sample
gradients; this module decides how to compute it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import ops
from ..grads import per_sample_grads, per_sample_grads_at_two_points


class ClippedGradients:
    """Per-sample clipping for one model and per-sample loss (``loss_fn(output, target)`` on one sample).

    Every sum adds, for each sample, a vector of L2 norm at most ``clip`` (the native kernels guarantee it
    after rounding); non-finite samples contribute nothing. ``mode`` names how gradients are obtained.
    """

    mode = "materialised"

    def __init__(self, model: nn.Module, loss_fn, *, chunk_size: int | None = None) -> None:
        self.model, self.loss_fn, self.chunk_size = model, loss_fn, chunk_size

    def sum(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        clip: float,
        out: Sequence[torch.Tensor],
        point: Sequence[torch.Tensor] | None = None,
        norms: torch.Tensor | None = None,
    ) -> int:
        """``out += sum_i clip_C(grad l(point; z_i))``; returns the number of non-finite samples."""
        if len(inputs) == 0:
            return 0
        grads = per_sample_grads(
            self.model, self.loss_fn, inputs, targets, params=point, chunk_size=self.chunk_size
        )
        return int(ops.clip_accumulate(grads, clip, list(out), norms=norms))

    def diff_sum(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        point: Sequence[torch.Tensor],
        previous: Sequence[torch.Tensor],
        clip: float,
        out: Sequence[torch.Tensor],
    ) -> int:
        """``out += sum_i clip_C(grad l(point; z_i) - grad l(previous; z_i))``, the same sample at both."""
        if len(inputs) == 0:
            return 0
        now, before = per_sample_grads_at_two_points(
            self.model, self.loss_fn, inputs, targets, list(point), list(previous), chunk_size=self.chunk_size
        )
        return int(ops.clip_accumulate_diff(now, before, clip, list(out)))
