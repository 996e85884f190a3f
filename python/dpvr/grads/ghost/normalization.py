"""Ghost rules of per-sample normalisation layers: ``nn.LayerNorm``, ``nn.GroupNorm`` and ``nn.RMSNorm``
(torch >= 2.4).

Each normalises every sample with its own statistics, then applies an elementwise affine map, so a
sample's gradient is ``sum_positions x_hat * g`` for the weight and ``sum_positions g`` for the bias, with
``x_hat`` the normalised input recomputed from the recorded one. These gradients are small (one entry per
channel) and are materialised (:class:`~dpvr.grads.ghost.rules.Dense`). Batch normalisation mixes samples
and is rejected by the clipper (use GroupNorm or LayerNorm).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from .rules import Dense, GhostRule, LayerCall, Part, register_ghost_rule, summed


class AffineNormRule(GhostRule):
    """A normalisation followed by ``x_hat * weight + bias``; subclasses give ``x_hat`` and how its entries
    map to the parameter: :meth:`per_channel` sums an elementwise product over the positions that share one
    parameter entry, giving ``(B, *parameter shape)``."""

    def normalised(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def per_channel(self, t: Tensor) -> Tensor:
        raise NotImplementedError

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        weight = summed([self.per_channel(self.normalised(c.input) * c.grad) for c in calls])
        bias = summed([self.per_channel(c.grad) for c in calls])
        return {"weight": Dense(weight), "bias": Dense(bias)}


class _TrailingShape(AffineNormRule):
    """Parameters of ``normalized_shape``, over the trailing dimensions of the input."""

    def per_channel(self, t):
        shape = tuple(self.module.normalized_shape)
        return t.reshape(t.shape[0], -1, *shape).sum(dim=1)


@register_ghost_rule(nn.LayerNorm)
class LayerNormRule(_TrailingShape):
    position_wise = True

    def normalised(self, x):
        return F.layer_norm(x, self.module.normalized_shape, None, None, self.module.eps)


if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    @register_ghost_rule(nn.RMSNorm)
    class RMSNormRule(_TrailingShape):
        parameters = ("weight",)

        def normalised(self, x):
            return F.rms_norm(x, self.module.normalized_shape, None, self.module.eps)

        def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
            weight = summed([self.per_channel(self.normalised(c.input) * c.grad) for c in calls])
            return {"weight": Dense(weight)}


@register_ghost_rule(nn.GroupNorm)
class GroupNormRule(AffineNormRule):
    """``(B, C, *)`` inputs; one parameter entry per channel."""

    def normalised(self, x):
        return F.group_norm(x, self.module.num_groups, None, None, self.module.eps)

    def per_channel(self, t):
        return t.reshape(t.shape[0], t.shape[1], -1).sum(dim=2)
