"""Ghost rules for Hugging Face ``transformers`` layers, registered when a model holding one is first seen
(importing ``transformers`` is never forced by dpvr).

``transformers.pytorch_utils.Conv1D`` (GPT-2's projections) is a linear map with its weight stored
transposed, ``y = x W + b`` with ``W`` of shape ``(p, q)``: the Linear rule's parts with their two sides
swapped, so that the per-sample matrix ``A^T G`` comes out in the parameter's own layout.
"""

from __future__ import annotations

from transformers.pytorch_utils import Conv1D

from .linear import LinearRule, Pieces
from .rules import Outer, register_ghost_rule


@register_ghost_rule(Conv1D)
class Conv1DRule(LinearRule):
    def weight(self, pieces: Pieces) -> Outer:
        weight = super().weight(pieces)
        return Outer([(n, m) for m, n in weight.pieces], weight.recorded_steps)
