"""``nn.MultiheadAttention``: its forward reads ``out_proj``'s parameters directly (``out_proj`` is never
called), so the module is one unit that owns them, with materialised per-sample gradients.

In the common configuration (packed input projection, no ``bias_k``/``bias_v``, no zero attention, no
active dropout, no ``is_causal``; a ``key_padding_mask``, a 2-D ``attn_mask`` and attention weights read by
the loss are fine) the recorded forward runs the module as its parts (:meth:`recording_forward`): the
projected queries, keys and values and the attended values receive their gradients in the recorded backward
pass, and each projection's per-sample gradient is the batched product of those gradients and its inputs —
no part of the attention is computed twice. Any other call runs the module's own forward and takes the
per-sample vector-Jacobian product of the module.

Batch-first or sequence-first: ``query``, ``key`` and ``value`` are split at their batch dimension;
``key_padding_mask`` (``(B, S)``) by sample; a 2-D ``attn_mask`` is shared. A 3-D ``attn_mask``
(``(B * num_heads, L, S)``) cannot be split by sample: pass the per-sample part as ``key_padding_mask``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .fallback import VjpRule
from .rules import Dense, LayerCall, Part, register_ghost_rule, summed

_SEQUENCES = {0: "query", 1: "key", 2: "value"}
_DECOMPOSABLE_KWARGS = {"key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal"}


def _additive(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """A boolean mask (True: excluded) as the additive float mask that the module applies."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))


def _steps_outer(g: Tensor, x: Tensor) -> Tensor:
    """``(B, q, p)`` per-sample ``sum_t g[i, t] x[i, t]^T`` of ``(B, T, q)`` and ``(B, T, p)``."""
    return g.transpose(1, 2) @ x


@register_ghost_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(VjpRule):
    owns_submodules = True
    internal_values = frozenset({"attended"})  # the output projection's input

    def _batch_dim(self) -> int:
        return 0 if self.module.batch_first else 1

    def in_dim(self, position, leaf, batch):
        if not isinstance(leaf, Tensor):
            return None
        if position in _SEQUENCES or position in _SEQUENCES.values():
            return self._batch_dim() if leaf.dim() == 3 else None
        if position in (5, "attn_mask") and leaf.dim() == 3:
            raise ValueError("MultiheadAttention: a 3-D attn_mask mixes samples and heads; ghost clipping "
                             "needs the per-sample part as key_padding_mask")
        return super().in_dim(position, leaf, batch)

    def out_dims(self, call: LayerCall) -> list[int | None]:
        # (attn_output, attn_weights): the weights are (B, L, S) or (B, heads, L, S) in either layout.
        return [self._batch_dim()] + [0] * (len(call.grads) - 1)

    def check(self, name, call, batch):
        if call.input.dim() != 3:
            raise ValueError(f"layer {name!r}: unbatched MultiheadAttention input; pass (batch, ...) inputs")
        super().check(name, call, batch)

    def _decomposable(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call is in the configuration that :meth:`recording_forward` computes."""
        m = self.module
        return (len(args) == 3 and set(kwargs) <= _DECOMPOSABLE_KWARGS and m._qkv_same_embed_dim
                and m.bias_k is None and not m.add_zero_attn and not (m.training and m.dropout > 0)
                and not kwargs.get("is_causal", False) and all(isinstance(t, Tensor) and t.dim() == 3
                                                               for t in args)
                and (kwargs.get("attn_mask") is None or kwargs["attn_mask"].dim() == 2))

    def recording_forward(self, args, kwargs):
        """The module's forward as its parts: the input projections (one packed projection when query, key
        and value are one tensor), the attention and the output projection, exposing the projected queries,
        keys and values and the attended values, so that the recorded backward pass hands over their
        gradients and no part is computed twice."""
        if not self._decomposable(args, kwargs):
            return None
        m = self.module
        inputs = [t if m.batch_first else t.transpose(0, 1) for t in args]  # all (B, L or S, E)
        batch, length, width = inputs[0].shape
        heads, head = m.num_heads, width // m.num_heads
        if args[0] is args[1] and args[0] is args[2]:  # one tensor (not merely its memory), as torch asks
            # Self-attention: one packed projection, whose gradient arrives as one (B, L, 3E) tensor.
            packed = F.linear(inputs[0], m.in_proj_weight, m.in_proj_bias)
            qkv, exposed = packed.chunk(3, dim=-1), {"qkv": packed}
        else:
            biases = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None,) * 3
            qkv = [F.linear(x, w, b) for x, w, b in zip(inputs, m.in_proj_weight.chunk(3), biases)]
            exposed = dict(zip(("q", "k", "v"), qkv))
        q, k, v = (t.reshape(batch, t.shape[1], heads, head).transpose(1, 2) for t in qkv)
        mask = _additive(kwargs.get("attn_mask"), q)  # (L, S)
        padding = _additive(kwargs.get("key_padding_mask"), q)  # (B, S)
        if padding is not None:
            padding = padding.view(batch, 1, 1, -1)
            mask = padding if mask is None else mask + padding
        weights = None
        if kwargs.get("need_weights", True):
            scores = (q / math.sqrt(head)) @ k.transpose(-2, -1)  # (B, H, L, S)
            probabilities = (scores if mask is None else scores + mask).softmax(dim=-1)
            attended = probabilities @ v
            weights = probabilities.mean(dim=1) if kwargs.get("average_attn_weights", True) else probabilities
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attended = attended.transpose(1, 2).reshape(batch, length, width)
        output = F.linear(attended, m.out_proj.weight, m.out_proj.bias)
        output = output if m.batch_first else output.transpose(0, 1)
        return (output, weights), {**exposed, "attended": attended}

    def _recorded(self, call: LayerCall) -> dict[str, Tensor]:
        """Per-sample gradients of all four parameters from the tensors the recording exposed."""
        inputs = [t if self.module.batch_first else t.transpose(0, 1) for t in (*call.args, call.grad)]
        g_out = inputs.pop()  # all (B, L or S, E)
        if "qkv" in call.internal_grads:  # the packed projection of self-attention
            g_qkv = call.internal_grads["qkv"]
            in_proj, in_bias = _steps_outer(g_qkv, inputs[0]), g_qkv.sum(dim=1)
        else:
            g_each = [call.internal_grads[name] for name in "qkv"]
            in_proj = torch.cat([_steps_outer(g, x) for g, x in zip(g_each, inputs)], dim=1)
            in_bias = torch.cat([g.sum(dim=1) for g in g_each], dim=1)
        return {
            "in_proj_weight": in_proj,
            "in_proj_bias": in_bias,
            "out_proj.weight": _steps_outer(g_out, call.internals["attended"]),
            "out_proj.bias": g_out.sum(dim=1),
        }

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        if not all(c.internal_grads for c in calls):
            return super().gradient(calls)
        found = [self._recorded(c) for c in calls]
        return {name: Dense(summed([f[name] for f in found])) for name in self.trainable}
