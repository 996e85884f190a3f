"""The per-sample loss dpvr needs, derived from an ordinary batched criterion.

dpvr clips each record's gradient, so it evaluates the loss one record at a time (``vmap``-ed over the batch).
A batched criterion such as ``nn.CrossEntropyLoss()`` gives that loss on a batch of one record: with one
record the mean, the sum and the unreduced loss agree. A class-weighted mean is rewritten with a public
normaliser; what cannot be recovered is a criterion that couples records (batch statistics, a pairwise
loss): such a criterion is refused after a check on a small batch.

**What the criterion receives.** The model's output as the model returns it, so any callable on it works.
Two conveniences for Hugging Face models, whose output is a ``ModelOutput``: a torch loss (an ``nn`` loss
module such as ``nn.CrossEntropyLoss()``, or a function of ``torch.nn.functional`` such as
``F.cross_entropy``) is given the output's ``logits``; and, a ``ModelOutput``'s logits being class-last, a
cross-entropy or NLL loss on token logits ``(B, T, V)`` with labels ``(B, T)`` is given them flattened
(``(B T, V)`` and ``(B T,)``), so that ``nn.CrossEntropyLoss()`` trains a token classifier or a language
model as it is. Any other callable gets the ``ModelOutput`` itself and reads ``output.logits``. The labels are
the target and never go to the model, so its own ``.loss`` is never computed or used (it is a mean over the
batch's tokens, which couples records).

**Token losses: how a record's tokens are weighed.** DP clips one loss per record, so a loss over a
sequence's tokens must say how each record's token losses make its loss. A plain criterion with the mean
reduction gives each record the mean over *its own* counted tokens (labels equal to ``ignore_index``, -100
by default, e.g. padding, are not counted): every record weighs the same, and a token of a short record
weighs more than one of a long record. On a batch, such a criterion is a mean over the batch's tokens
instead (records weighted by their token counts), so dpvr trains something else than the batched criterion
computes; :func:`check_separable` notices (on perturbed outputs, not only at the initial parameters, where
every token's loss is about the same) and warns. :class:`TokenLoss` makes the choice explicit:
``weighting="record"`` (the per-record mean above) or ``weighting="token"``: each record's loss is
``token_weight`` times the sum of its counted tokens' losses, so that every token weighs the same, with
``token_weight`` a public constant (e.g. one over the padded length) rather than the batch's token count,
which depends on the records.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ..grads.fields import call

Criterion = Callable[[Any, Any], Tensor]
IGNORE_INDEX = -100  # torch's and Hugging Face's label for a token that does not count
_PERTURB_SEED = 20260419  # the public seed of the perturbed outputs of check_separable


class TokenLoss:
    """Cross-entropy over each record's tokens, with the per-record weighting explicit (module
    documentation).

    Args:
        weighting: ``"record"`` (default): a record's loss is the mean of its counted tokens' losses
            (records weigh the same; a record with no counted token has loss 0). ``"token"``: a record's loss
            is ``token_weight`` times the sum of its counted tokens' losses (tokens weigh the same).
        token_weight: the public weight of each token under ``"token"`` (required there, and a constant: not
            computed from the records), e.g. ``1 / T`` for sequences padded to length ``T``, so that a full
            record's loss is its token mean.
        ignore_index: labels with this value are not counted (padding); default -100, Hugging Face's.
        shift: for a causal language model whose labels are its input ids (Hugging Face's convention for
            GPT-2 and its kin): the logits at position ``t`` are scored against the label at ``t + 1``.
        label_smoothing: as for ``nn.CrossEntropyLoss``.

    Called as a batched criterion ``loss(output, labels)``: ``output`` is the logits ``(B, T, V)`` or a
    ``ModelOutput`` holding them, ``labels`` is ``(B, T)``; it returns the mean over the records of their
    losses (so a record's loss is this on a batch of one, which is what dpvr clips).
    :meth:`per_record` returns the ``(B,)`` losses.

    Guarantee: none of its own; the loss shapes what is clipped, never what is released beyond the clip bound.
    Under ``"token"`` a record's loss grows with its number of tokens; clipping bounds its gradient all the
    same.
    """

    def __init__(self, weighting: str = "record", *, token_weight: float | None = None,
                 ignore_index: int = IGNORE_INDEX, shift: bool = False, label_smoothing: float = 0.0) -> None:
        if weighting not in ("record", "token"):
            raise ValueError(f"weighting: must be 'record' or 'token', got {weighting!r}")
        if weighting == "token":
            if token_weight is None:
                raise ValueError(
                    "token_weight: required with weighting='token' (a public constant such as 1 / the padded "
                    "length; the batch's token count depends on the records, so it cannot normalise)"
                )
            if not (isinstance(token_weight, (int, float)) and math.isfinite(token_weight)
                    and token_weight > 0):
                raise ValueError(f"token_weight: must be a finite number > 0, got {token_weight!r}")
        elif token_weight is not None:
            raise ValueError("token_weight: only with weighting='token' (under 'record' each record's loss "
                             "is the mean over its own tokens)")
        self.weighting, self.token_weight = weighting, token_weight
        self.ignore_index, self.shift, self.label_smoothing = int(ignore_index), bool(shift), label_smoothing

    def per_record(self, output: Any, labels: Tensor) -> Tensor:
        """The ``(B,)`` per-record losses."""
        logits = output["logits"] if isinstance(output, Mapping) else output
        if not isinstance(logits, Tensor) or not isinstance(labels, Tensor):
            raise TypeError("TokenLoss: expected logits (B, T, V) (or a ModelOutput with logits) and labels "
                            f"(B, T), got {type(logits).__name__} and {type(labels).__name__}")
        if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
            raise ValueError(f"TokenLoss: expected logits (B, T, V) and labels (B, T), got shapes "
                             f"{tuple(logits.shape)} and {tuple(labels.shape)}")
        if self.shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        each = nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=self.ignore_index, reduction="none",
            label_smoothing=self.label_smoothing,
        )  # (B, T): 0 where ignored
        total = each.sum(dim=1)
        if self.weighting == "token":
            return total * self.token_weight
        counted = (labels != self.ignore_index).sum(dim=1)
        return total / counted.clamp(min=1).to(total.dtype)

    def __call__(self, output: Any, labels: Tensor) -> Tensor:
        return self.per_record(output, labels).mean()

    def __repr__(self) -> str:
        weight = f", token_weight={self.token_weight}" if self.weighting == "token" else ""
        return (f"TokenLoss({self.weighting!r}{weight}, ignore_index={self.ignore_index}, "
                f"shift={self.shift})")


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

    def loss(output: Any, target: Any) -> Tensor:
        if type(output) is Tensor and type(target) is Tensor:
            # The common case, run once per step under vmap: the very call of the general path below (a
            # plain tensor goes to the criterion as it is, and its errors carry no hint), without the tree
            # traversals and the checks that only structured outputs need.
            return criterion(output.unsqueeze(0), target.unsqueeze(0)).reshape(())
        batched, target = (tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, v)
                           for v in (output, target))
        try:
            value = _apply(criterion, batched, target)
        except Exception as err:
            hint = _hint(criterion, output)
            if not hint:
                raise
            raise ValueError(f"criterion: fails on one record's output ({type(err).__name__}: {err}){hint}"
                             ) from err
        return value.reshape(())

    return loss


def _torch_loss(criterion: Criterion) -> bool:
    """An ``nn`` loss module or a loss function of ``torch.nn.functional``."""
    return isinstance(criterion, nn.modules.loss._Loss) or (
        getattr(criterion, "__module__", None) == "torch.nn.functional")


def _classes(criterion: Criterion) -> bool:
    return isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) or criterion in (
        nn.functional.cross_entropy, nn.functional.nll_loss)


def _apply(criterion: Criterion, output: Any, target: Any) -> Tensor:
    """``criterion`` on a batch's output and targets (module documentation: a torch loss given a
    ``ModelOutput`` gets its logits, flattened over tokens for a class loss on token logits)."""
    if _torch_loss(criterion) and isinstance(output, Mapping) and "logits" in output:
        output = output["logits"]
        if (_classes(criterion) and isinstance(output, Tensor) and isinstance(target, Tensor)
                and output.dim() >= 3 and tuple(output.shape[:-1]) == tuple(target.shape)):
            # class-last token logits (Hugging Face's layout): one class vector per token
            output, target = output.flatten(0, -2), target.flatten()
    return criterion(output, target)


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


def check_separable(criterion: Criterion, model: nn.Module, inputs: Any, targets: Any) -> None:
    """Refuses a criterion that is not a mean or sum of per-record losses, or whose value is not a scalar;
    warns when it is a mean over tokens (module documentation), which dpvr trains as a mean of the records'
    own token means unless :class:`TokenLoss` says otherwise.

    Checked on the first (up to) 8 records at the model's initial parameters, and again on the same outputs
    perturbed by public noise (at initialisation every token's loss is about the same, so a mean over
    tokens and a mean of per-record means agree there): the batched value must equal the mean or the sum of
    the one-record values (to float rounding). Like every construction-time check, it reads private records
    and its errors and warnings are diagnostics for the data holder, not releases."""
    criterion = _public_normaliser(criterion, warn=False)
    x, y = inputs[:8], targets[:8]
    with torch.no_grad():
        output = call(model, x)
        try:
            batched = _apply(criterion, output, y)
        except Exception as err:  # the user's criterion: name it in the message
            raise ValueError(f"criterion: fails on the model's output for a batch ({err})"
                             f"{_hint(criterion, output)}") from err
        if not isinstance(batched, Tensor) or batched.numel() != 1:
            got = tuple(batched.shape) if isinstance(batched, Tensor) else type(batched).__name__
            raise ValueError(f"criterion: must return a scalar for a batch (mean or sum reduction), "
                             f"got {got}")
        _compare(criterion, output, y, batched, strict=True)
        perturbed = _perturbed(output, len(y))
        if perturbed is not None:
            try:
                again = _apply(criterion, perturbed, y)
            except Exception:  # e.g. a loss on probabilities, which noise takes out of [0, 1]: not checked
                return
            if isinstance(again, Tensor) and again.numel() == 1 and bool(torch.isfinite(again).all()):
                _compare(criterion, perturbed, y, again, strict=False)


def _hint(criterion: Criterion, output: Any) -> str:
    if isinstance(output, Mapping) and not _torch_loss(criterion) and not isinstance(criterion, TokenLoss):
        return (f"; the criterion receives the model's output as returned (a {type(output).__name__}): read "
                "its logits as output.logits (the model's own .loss is not used: the labels are the target, "
                "never given to the model)")
    return ""


def _perturbed(output: Any, batch: int) -> Any:
    """``output`` with public Gaussian noise (of scale 1 plus the output's spread) added to its floating
    per-record tensors, or None when it has none."""
    g = torch.Generator().manual_seed(_PERTURB_SEED)
    found = False

    def noisy(t: Any) -> Any:
        nonlocal found
        if not (isinstance(t, Tensor) and t.is_floating_point() and t.dim() > 0 and len(t) == batch):
            return t
        found = True
        scale = 1.0 + float(t.double().std()) if t.numel() > 1 else 1.0
        noise = torch.randn(t.shape, generator=g, dtype=torch.float64) * scale
        return t + noise.to(dtype=t.dtype, device=t.device)

    out = tree_map(noisy, output)
    return out if found else None


def _compare(criterion: Criterion, output: Any, y: Any, batched: Tensor, *, strict: bool) -> None:
    loss = per_sample(criterion)
    each = torch.stack([loss(tree_map(lambda t, i=i: t[i] if isinstance(t, Tensor) else t, output), y[i])
                        for i in range(len(y))]).double()
    tolerance = 1e-4 * (1 + float(each.abs().sum()))
    value = float(batched)
    if abs(value - float(each.mean())) <= tolerance or abs(value - float(each.sum())) <= tolerance:
        return
    if not bool(torch.isfinite(each).all()):
        if strict:
            raise ValueError("criterion: not finite on single records of the model's initial output")
        return
    counts = _token_counts(criterion, y)
    if counts is not None and counts.sum() > 0:
        token_mean = float((each * counts).sum() / counts.sum())
        if abs(value - token_mean) <= tolerance:
            warnings.warn(
                f"make_private: the criterion ({_name(criterion)}) is a mean over the batch's tokens, but DP "
                "clips one loss per record: dpvr trains each record's loss as the mean over its own counted "
                "tokens (records weigh the same, so a token of a short record weighs more). To say so and "
                "silence this, use dpvr.TokenLoss('record'); to weigh every token the same, "
                "dpvr.TokenLoss('token', token_weight=1 / T) with a public T such as the padded length",
                stacklevel=5  # the caller of make_private,
            )
            return
    raise ValueError(
        "criterion: its value on a batch is neither the mean nor the sum of its values on single "
        "records, so it couples records (batch statistics?) and no per-record gradient bound holds for it"
    )


def _token_counts(criterion: Criterion, targets: Any) -> Tensor | None:
    """Each record's number of counted labels (those not equal to the criterion's ``ignore_index``, -100 by
    default), for labels with a token dimension; None otherwise."""
    if not isinstance(targets, Tensor) or targets.dim() < 2 or targets.is_floating_point():
        return None
    ignore = getattr(criterion, "ignore_index", IGNORE_INDEX)
    return (targets != ignore).reshape(len(targets), -1).sum(dim=1).double()


def _name(criterion: Criterion) -> str:
    return getattr(criterion, "__name__", type(criterion).__name__)
