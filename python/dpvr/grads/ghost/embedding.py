"""Ghost rules of lookup tables: ``nn.Embedding`` and ``nn.EmbeddingBag`` (``"sum"``/``"mean"`` over a
``(B, bag)`` index tensor). Sample i's gradient adds its output gradient rows to the rows it looked up
(:class:`~dpvr.grads.ghost.rules.Rows`); ``padding_idx`` rows get none. The clipper coalesces every sample's
rows per key before it measures them (:meth:`~dpvr.grads.ghost.rules.Rows.coalesced`), so repeated keys
and a difference's two points are written as the single rounded rows that the norm measured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .rules import GhostRule, LayerCall, Part, Rows, register_ghost_rule, same_tensor, scale_rows64, steps


def _difference(k: Tensor, g: Tensor, k_b: Tensor, g_b: Tensor, a: Tensor | None, b: Tensor | None,
                skip: int | None) -> Rows:
    """``a_i u_i - b_i u'_i``, :meth:`~Rows.coalesced`: the two points' rows (one piece when both looked up
    the same keys, the model input) are scaled and added in float64 and each sample's row of a key is
    rounded once, so the rows written are the rows measured (rows of the two points added into one float32
    row would cancel, and their rounding is not bounded by the small difference that the norm measures)."""
    wide, wide_b = scale_rows64(g, a), scale_rows64(g_b, b)
    pieces = [(k, wide - wide_b)] if same_tensor(k, k_b) else [(k, wide), (k_b, -wide_b)]
    return Rows(pieces, skip).coalesced(g.dtype)


@register_ghost_rule(nn.Embedding)
class EmbeddingRule(GhostRule):
    """``nn.Embedding`` without ``max_norm`` (which renormalises the table in the forward) or
    ``scale_grad_by_freq`` (which couples the samples of a batch)."""

    position_wise = True
    parameters = ("weight",)

    @classmethod
    def supports(cls, module):
        return module.max_norm is None and not module.scale_grad_by_freq

    @staticmethod
    def _pieces(calls: Sequence[LayerCall]) -> tuple[Tensor, Tensor]:
        keys = steps([c.input.reshape(c.input.shape[0], -1) for c in calls])
        grads = steps([c.grad.reshape(c.grad.shape[0], -1, c.grad.shape[-1]) for c in calls])
        return keys, grads

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        return {"weight": Rows([self._pieces(calls)], self.module.padding_idx)}

    def difference(self, calls, calls_b, a, b):
        return {"weight": _difference(*self._pieces(calls), *self._pieces(calls_b), a, b,
                                      self.module.padding_idx)}


@register_ghost_rule(nn.EmbeddingBag)
class EmbeddingBagRule(GhostRule):
    """``nn.EmbeddingBag`` in ``"sum"`` or ``"mean"`` mode, called on a ``(B, bag)`` index tensor (a bag
    per sample; optional ``per_sample_weights`` in ``"sum"`` mode). ``"max"`` mode falls back."""

    parameters = ("weight",)

    @classmethod
    def supports(cls, module):
        return module.mode in ("sum", "mean") and module.max_norm is None and not module.scale_grad_by_freq

    def _pieces(self, calls: Sequence[LayerCall]) -> tuple[Tensor, Tensor]:
        keys, grads = [], []
        for c in calls:
            k = c.input
            offsets = c.args[1] if len(c.args) > 1 else c.kwargs.get("offsets")
            if k.dim() != 2 or offsets is not None:
                raise ValueError("EmbeddingBag: ghost clipping needs a (B, bag) index tensor without "
                                 "offsets, so that each bag is one sample's")
            scale = c.args[2] if len(c.args) > 2 else c.kwargs.get("per_sample_weights")
            if self.module.mode == "mean":
                # The mean runs over the bag's non-padding entries (none: the output is zero).
                pad = self.module.padding_idx
                kept = k != pad if pad is not None else torch.ones_like(k, dtype=torch.bool)
                scale = kept.to(c.grad.dtype) / kept.sum(dim=1, keepdim=True).clamp(min=1)
            g = c.grad.unsqueeze(1).expand(-1, k.shape[1], -1)
            keys.append(k)
            grads.append(g if scale is None else g * scale.unsqueeze(-1))
        return steps(keys), steps(grads)

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        return {"weight": Rows([self._pieces(calls)], self.module.padding_idx)}

    def difference(self, calls, calls_b, a, b):
        return {"weight": _difference(*self._pieces(calls), *self._pieces(calls_b), a, b,
                                      self.module.padding_idx)}
