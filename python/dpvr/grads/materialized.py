"""Materialised per-sample gradients with ``torch.func`` (``functional_call`` + ``vmap`` + ``grad``).

The loss contract: ``loss_fn(output, target) -> scalar`` for ONE sample. Under ``vmap`` the model is called
on a batch of one (``x_i.unsqueeze(0)``, so layers that expect a batch dimension work), and ``loss_fn``
receives that output with the batch dimension removed together with ``y_i`` (also without one). For
example ``lambda out, y: F.cross_entropy(out, y)`` with ``out`` of shape ``(C,)`` and ``y`` a 0-d class
index, or ``lambda out, y: 0.5 * (out - y).pow(2).sum()``. It must not reduce over other samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map

from ..problems import LossFn
from .fields import as_inputs, model_args

Grads = list[Tensor]
"""One ``B × (parameter shape)`` tensor per trainable parameter, in ``model.parameters()`` order."""


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for each parameter with ``requires_grad``, in ``model.parameters()`` order.

    Raises ``ValueError`` when the model has none, or contains a batch-norm layer: in training mode it
    mixes the samples of a batch (so no per-sample gradient exists), and in evaluation mode its running
    statistics were computed from unclipped private data.
    """
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            raise ValueError(f"layer {name or '<model>'!r} ({type(module).__name__}) normalises with batch "
                             "statistics, which mix samples (in eval mode, running statistics of unclipped "
                             "data); use GroupNorm or LayerNorm instead")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (none requires grad)")
    return named


CLIP_DTYPES = (torch.float32, torch.float64)
"""The parameter dtypes that clipping accepts: its norms and sums must hold their bound after rounding."""


def clip_dtype(named: list[tuple[str, nn.Parameter]]) -> torch.dtype:
    """The one dtype of the trainable parameters ``named``, which must be float32 or float64.

    Per-sample clipping bounds each sample's contribution to a sum, rounding included, and the sum then
    carries the noise: in half precision the rounding of the norms and sums would be of the order of the
    clip bound itself. Half-precision *activations* are supported: keep the parameters in float32 and run
    the forward under ``torch.autocast``; the norms and sums stay in the parameters' dtype.
    """
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) > 1:
        raise ValueError(f"model: trainable parameters have several dtypes {sorted(map(str, dtypes))}; "
                         "use one")
    dtype, device = dtypes.pop(), named[0][1].device.type
    if dtype not in CLIP_DTYPES:
        raise ValueError(
            f"model: trainable parameters are {dtype}; per-sample clipping needs float32 or float64 "
            "parameters, so that norms and clipped sums hold their bound after rounding. Keep the parameters "
            "in float32 (model.float()) and run the forward in half precision with torch.autocast, e.g. "
            f"`with torch.autocast({device!r}, dtype={dtype}): algorithm.step()`"
        )
    return dtype


def _check_point(values: Sequence[Tensor], named: list[tuple[str, nn.Parameter]], label: str) -> list[Tensor]:
    if len(values) != len(named):
        raise ValueError(f"{label} has {len(values)} tensors, the model has {len(named)} trainable "
                         "parameters")
    for i, (value, (name, p)) in enumerate(zip(values, named)):
        if not isinstance(value, Tensor):
            raise ValueError(f"{label}[{i}] ({name}) is a {type(value).__name__}, not a tensor")
        for what, got, expected in (("shape", tuple(value.shape), tuple(p.shape)),
                                    ("dtype", value.dtype, p.dtype), ("device", value.device, p.device)):
            if got != expected:
                raise ValueError(f"{label}[{i}] ({name}) has {what} {got}, expected {expected}")
    return list(values)


def _chunk_size(batch: int, per_sample_bytes: int, chunk_size: int | None,
                max_memory_bytes: int | None) -> int:
    """Samples per vmap call: the smaller of ``chunk_size`` and what fits in ``max_memory_bytes``."""
    size = batch
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        size = min(size, chunk_size)
    if max_memory_bytes is not None:
        if max_memory_bytes < 1:
            raise ValueError(f"max_memory_bytes must be >= 1, got {max_memory_bytes}")
        size = min(size, max(1, max_memory_bytes // per_sample_bytes))
    return size


def _compute(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor,
             points: dict[str, Sequence[Tensor] | None], chunk_size: int | None,
             max_memory_bytes: int | None) -> list[tuple[Grads, Tensor]]:
    """Per-sample gradients and losses at each parameter point, keyed by the argument name that supplied it
    (``None``: the model's own values)."""
    named = trainable_parameters(model)
    inputs, targets = as_inputs(inputs), as_inputs(targets)
    if any(isinstance(t, Tensor) and t.dim() == 0 for t in (inputs, targets)):
        raise ValueError("inputs and targets need a leading batch dimension, got a 0-d tensor")
    if len(inputs) != len(targets):
        raise ValueError(f"inputs and targets need the same batch size, got {len(inputs)} and "
                         f"{len(targets)} records")
    batch = len(inputs)
    if batch == 0:
        raise ValueError("empty batch: inputs and targets have no samples")
    values = [[p for _, p in named] if point is None else _check_point(point, named, label)
              for label, point in points.items()]
    names = [name for name, _ in named]

    def sample_loss(point: list[Tensor], x: Any, y: Any) -> tuple[Tensor, Tensor]:
        # A batch of one record (every field of structured inputs), given to the model unpacked.
        args, kwargs = model_args(tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, x))
        output = functional_call(model, dict(zip(names, point)), args, kwargs)
        loss = loss_fn(tree_map(lambda t: t.squeeze(0) if isinstance(t, Tensor) else t, output), y)
        return loss, loss

    # Each record draws its own dropout masks, as in a batched forward pass.
    vmapped = vmap(grad(sample_loss, has_aux=True), in_dims=(None, 0, 0), randomness="different")
    one = grad(sample_loss, has_aux=True)

    def looped(point: list[Tensor], x: Any, y: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        """The records one at a time: for a forward with control flow on the values of its inputs (Hugging
        Face models inspect an attention mask to choose an attention kernel), which ``vmap`` cannot map."""
        each = [one(point, tree_map(lambda t, i=i: t[i], x), tree_map(lambda t, i=i: t[i], y))
                for i in range(len(x))]
        return tuple(torch.stack(g) for g in zip(*(e[0] for e in each))), torch.stack([e[1] for e in each])

    def grads_and_loss(point: list[Tensor], x: Any, y: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        try:
            return vmapped(point, x, y)
        except RuntimeError as err:
            if not str(err).startswith("vmap:"):
                raise
        return looped(point, x, y)
    per_sample_bytes = len(points) * sum(p.numel() * p.element_size() for _, p in named)
    size = _chunk_size(batch, per_sample_bytes, chunk_size, max_memory_bytes)
    # Outside no_grad, parameters that require grad would make the results part of an outer autograd
    # graph; torch.func.grad differentiates regardless of the ambient grad mode.
    with torch.no_grad():
        if size == batch:
            whole = [grads_and_loss(point, inputs, targets) for point in values]
            return [(list(grads), loss) for grads, loss in whole]
        results: list[tuple[Grads, Tensor]] = []
        for start in range(0, batch, size):
            stop = min(start + size, batch)
            for k, point in enumerate(values):
                grads, loss = grads_and_loss(point, inputs[start:stop], targets[start:stop])
                if start == 0:  # allocate the full outputs once, with the dtypes the first chunk produced
                    results.append(([g.new_empty((batch, *g.shape[1:])) for g in grads],
                                    loss.new_empty((batch,))))
                for out, g in zip(results[k][0], grads):
                    out[start:stop].copy_(g)
                results[k][1][start:stop].copy_(loss)
        return results


@overload
def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                     params: Sequence[Tensor] | None = ..., chunk_size: int | None = ...,
                     max_memory_bytes: int | None = ..., return_loss: Literal[False] = ...) -> Grads: ...
@overload
def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                     params: Sequence[Tensor] | None = ..., chunk_size: int | None = ...,
                     max_memory_bytes: int | None = ...,
                     return_loss: Literal[True]) -> tuple[Grads, Tensor]: ...


def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                     params: Sequence[Tensor] | None = None, chunk_size: int | None = None,
                     max_memory_bytes: int | None = None,
                     return_loss: bool = False) -> Grads | tuple[Grads, Tensor]:
    """Gradient of ``loss_fn(model(x_i), y_i)`` for each sample i, w.r.t. each trainable parameter.

    Args:
        model: any module without batch-norm layers; it is called functionally and not modified. Random
            layers (dropout) must be in eval mode: vmap rejects random operations.
        loss_fn: per-sample loss, see the module docstring for the contract.
        inputs: ``(B, ...)`` tensor, or :class:`~dpvr.grads.Fields` (a dict or tuple of such tensors: the
            model is called with them unpacked); targets: ``(B, ...)`` tensor (or fields, given to
            ``loss_fn`` as they are).
        params: values for the trainable parameters (same order, shapes, dtypes and devices) to evaluate
            at another point; default the model's own.
        chunk_size: at most this many samples per vmap call.
        max_memory_bytes: budget for one chunk's per-sample gradients, estimated as chunk × trainable
            parameter count × element size (activations are not counted; the B × d outputs are the result
            and not counted either). With both limits the smaller chunk wins.
        return_loss: also return the ``(B,)`` per-sample losses (e.g. for DRO re-weighting).

    Returns:
        ``B × (parameter shape)`` tensors in the order of ``[p for p in model.parameters() if
        p.requires_grad]``, not attached to any autograd graph; with ``return_loss``, ``(grads, losses)``.
        Chunked results are written into outputs allocated once.

    Raises:
        ValueError: a batch-norm layer, no trainable parameters, batch sizes of inputs and targets differ,
            an empty batch, a wrong ``params`` entry (the message names its index), or a bad chunk limit.
    """
    ((grads, losses),) = _compute(model, loss_fn, inputs, targets, {"params": params}, chunk_size,
                                 max_memory_bytes)
    return (grads, losses) if return_loss else grads


@overload
def per_sample_grads_at_two_points(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, params_a: Sequence[Tensor],
    params_b: Sequence[Tensor], *, chunk_size: int | None = ..., max_memory_bytes: int | None = ...,
    return_loss: Literal[False] = ...) -> tuple[Grads, Grads]: ...
@overload
def per_sample_grads_at_two_points(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, params_a: Sequence[Tensor],
    params_b: Sequence[Tensor], *, chunk_size: int | None = ..., max_memory_bytes: int | None = ...,
    return_loss: Literal[True]) -> tuple[Grads, Grads, Tensor, Tensor]: ...


def per_sample_grads_at_two_points(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, params_a: Sequence[Tensor],
    params_b: Sequence[Tensor], *, chunk_size: int | None = None, max_memory_bytes: int | None = None,
    return_loss: bool = False,
) -> tuple[Grads, Grads] | tuple[Grads, Grads, Tensor, Tensor]:
    """Per-sample gradients of the same samples at two parameter points, for gradient differences.

    Arguments as for :func:`per_sample_grads`; ``params_a`` and ``params_b`` are both required, and the
    memory estimate counts both points. Returns ``(grads_a, grads_b)``, or with ``return_loss``
    ``(grads_a, grads_b, losses_a, losses_b)``.
    """
    (grads_a, losses_a), (grads_b, losses_b) = _compute(
        model, loss_fn, inputs, targets, {"params_a": params_a, "params_b": params_b}, chunk_size,
        max_memory_bytes)
    return (grads_a, grads_b, losses_a, losses_b) if return_loss else (grads_a, grads_b)
