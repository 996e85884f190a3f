"""The per-sample loss dpvr needs, derived from an ordinary batched criterion.

dpvr clips each record's gradient, so it evaluates the loss one record at a time (``vmap``-ed over the batch).
A batched criterion such as ``nn.CrossEntropyLoss()`` gives that loss on a batch of one record: with one
record the mean, the sum and the unreduced loss agree. A class-weighted mean is rewritten with a public
normaliser; what cannot be recovered is a criterion that couples records (batch statistics, a pairwise
loss): such a criterion is refused after a check on a small batch.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

Criterion = Callable[[Tensor, Tensor], Tensor]


def per_sample(criterion: Criterion) -> Criterion:
    """``loss(output, target)`` of one record (no batch dimension), from a batched ``criterion``.

    A class-weighted mean (``CrossEntropyLoss``/``NLLLoss`` with ``weight`` and the default mean reduction)
    divides by the batch's total weight, which depends on every record's label: it is not a mean of
    per-record losses, and on one record its weight cancels. Such a criterion is rewritten with a public
    normaliser: each record's loss is its weighted loss (``reduction="sum"`` on one record), and the batch's
    is their mean over the batch size (a warning says so)."""
    if not callable(criterion):
        raise TypeError(f"criterion: expected a loss callable (output, target) -> loss, got {criterion!r}")
    criterion = _public_normaliser(criterion)

    def loss(output: Any, target: Tensor) -> Tensor:
        batched = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, output)
        return criterion(_logits(criterion, batched), target.unsqueeze(0)).reshape(())

    return loss


def _logits(criterion: Criterion, output: Any) -> Any:
    """A torch loss module given a structured output with ``logits`` (a Hugging Face ``ModelOutput``) gets
    the logits; any other criterion gets the output as the model returned it."""
    if isinstance(criterion, nn.modules.loss._Loss) and isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    return output


def _public_normaliser(criterion: Criterion, *, warn: bool = True) -> Criterion:
    if not (isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) and criterion.weight is not None
            and criterion.reduction == "mean"):
        return criterion
    if warn:
        warnings.warn(
            f"make_private: {type(criterion).__name__}(weight=...) with reduction='mean' divides by the "
            "batch's total class weight, which depends on the records' labels; dpvr uses each record's "
            "weighted loss averaged over the batch size instead (on each batch, the same gradient direction)",
            stacklevel=3,
        )
    rewritten = copy.copy(criterion)
    rewritten.reduction = "sum"
    return rewritten


def check_separable(criterion: Criterion, model: nn.Module, inputs: Tensor, targets: Tensor) -> None:
    """Refuses a criterion that is not a mean or sum of per-record losses, or whose value is not a scalar.

    Checked on the first (up to) 8 records at the model's initial parameters: the batched value must equal
    the mean or the sum of the one-record values (to float rounding). Like every construction-time check,
    it reads private records and its error is a diagnostic for the data holder, not a release."""
    criterion = _public_normaliser(criterion, warn=False)
    loss = per_sample(criterion)
    x, y = inputs[:8], targets[:8]
    with torch.no_grad():
        output = model(x)
        try:
            batched = criterion(_logits(criterion, output), y)
        except Exception as err:  # the user's criterion: name it in the message
            raise ValueError(f"criterion: fails on the model's output for a batch ({err})") from err
        if batched.numel() != 1:
            raise ValueError(
                "criterion: must return a scalar for a batch (mean or sum reduction), got shape "
                f"{tuple(batched.shape)}"
            )
        each = torch.stack([loss(tree_map(lambda t, i=i: t[i] if isinstance(t, Tensor) else t, output), y[i])
                            for i in range(len(y))])
    tolerance = 1e-4 * (1 + float(each.abs().sum()))
    value = float(batched)
    if abs(value - float(each.mean())) > tolerance and abs(value - float(each.sum())) > tolerance:
        raise ValueError(
            "criterion: its value on a batch is neither the mean nor the sum of its values on single "
            "records, so it couples records (batch statistics?) and no per-record gradient bound holds for it"
        )
