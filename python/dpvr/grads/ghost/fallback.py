"""The fallback for modules without a ghost rule: per-sample gradients of the module's own parameters,
materialised from its recorded inputs and output gradients (``torch.func.vjp`` of that module alone, under
``vmap`` or sample by sample; no second pass through the model).

:class:`VjpRule` assumes batch-first tensors: an input leaf whose first dimension is the batch size is split
by sample, any other is shared; every output is batch-first. Subclasses for modules with another layout
(recurrent layers' ``(layers, B, H)`` states, sequence-first attention) say where the batch dimension of
each input and output is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .rules import Dense, GhostRule, LayerCall, Part


def per_sample_vjp(module: nn.Module, call: LayerCall, wrt: Sequence[str], in_dims: list[int | None],
                   out_dims: list[int | None], *, loop: bool = False) -> dict[str, Tensor]:
    """``(B, *shape)`` per-sample gradients of ``module``'s parameters ``wrt`` from one recorded call: the
    vector-Jacobian product of the module alone with sample i's inputs and output gradients.

    ``in_dims``: the batch dimension of each leaf of ``(call.args, call.kwargs)`` (``tree_flatten`` order;
    None: shared by all samples); ``out_dims``: that of each output leaf. Each sample runs as a batch of one.
    ``loop``: one vjp per sample instead of ``vmap``, for modules that have no batching rule.
    """
    values = dict(call.params)
    weights = {name: values.pop(name) for name in wrt}
    flat, spec = tree_flatten((call.args, call.kwargs))
    used = [k for k, g in enumerate(call.grads) if g is not None]
    xs = [v for v, d in zip(flat, in_dims) if d is not None]
    x_dims = [d for d in in_dims if d is not None]
    cotangents = [call.grads[k] for k in used]
    c_dims = [out_dims[k] for k in used]

    def one(w: dict[str, Tensor], sample_xs: list[Tensor], sample_cots: list[Tensor]) -> dict[str, Tensor]:
        """Gradients for one sample, whose tensors keep a batch dimension of size one."""
        it = iter(sample_xs)
        args, kwargs = tree_unflatten([next(it) if d is not None else v for v, d in zip(flat, in_dims)], spec)

        def outputs(w: dict[str, Tensor]) -> list[Tensor]:
            leaves = tree_flatten(functional_call(module, {**values, **w}, args, kwargs))[0]
            return [leaves[k] for k in used]

        _, pullback = vjp(outputs, w)
        return pullback(sample_cots)[0]

    if loop:
        per = [one(weights, [x.narrow(d, i, 1) for x, d in zip(xs, x_dims)],
                   [c.narrow(d, i, 1) for c, d in zip(cotangents, c_dims)]) for i in range(call.batch)]
        return {name: torch.stack([p[name] for p in per]) for name in wrt}

    def unsqueezed(w: dict[str, Tensor], sample_xs: list[Tensor], sample_cots: list[Tensor]):
        return one(w, [x.unsqueeze(d) for x, d in zip(sample_xs, x_dims)],
                   [c.unsqueeze(d) for c, d in zip(sample_cots, c_dims)])

    return vmap(unsqueezed, in_dims=(None, x_dims, c_dims))(weights, xs, cotangents)


class VjpRule(GhostRule):
    """Materialised per-sample gradients of the module's parameters (:func:`per_sample_vjp`): the rule of
    every module without a registered one (a parameter it shares with another module gets the sum of both
    modules' terms, materialised). Subclasses override :meth:`in_dim` and :meth:`out_dims` for modules that
    are not batch-first, and set ``loop`` for modules that ``vmap`` cannot batch."""

    parameters = None
    loop: ClassVar[bool] = False
    # Whether the rule's recording forms ghost parts (``Outer``) in the module's usual configuration, so that
    # the layer counts as a ghost layer (its per-sample gradients materialised only in the fallback).
    recorded_as_ghost: ClassVar[bool] = False

    def in_dim(self, position: int | str, leaf: object, batch: int) -> int | None:
        """The batch dimension of a tensor ``leaf`` of the argument at ``position`` (index or keyword)."""
        return 0 if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch else None

    def out_dims(self, call: LayerCall) -> list[int | None]:
        """The batch dimension of each output leaf."""
        return [0] * len(call.grads)

    def check(self, name: str, call: LayerCall, batch: int) -> None:
        for g, d in zip(call.grads, self.out_dims(call)):
            if g is not None and (d is None or g.dim() <= d or g.shape[d] != batch):
                where = "not batch-first" if d == 0 else f"batch not at dimension {d}"
                raise ValueError(f"layer {name!r} returned shape {tuple(g.shape)}, {where} (batch {batch}): "
                                 "its per-sample gradients cannot be recovered")

    def _in_dims(self, call: LayerCall) -> list[int | None]:
        def dims(position: int | str, value: object) -> object:
            return tree_map(lambda leaf: self.in_dim(position, leaf, call.batch), value)

        args = tuple(dims(k, v) for k, v in enumerate(call.args))
        return tree_flatten((args, {k: dims(k, v) for k, v in call.kwargs.items()}))[0]

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        total: dict[str, Tensor] = {}
        for call in calls:
            grads = per_sample_vjp(self.module, call, self.trainable, self._in_dims(call),
                                   self.out_dims(call), loop=self.loop)
            for name, g in grads.items():
                total[name] = total[name] + g if name in total else g
        return {name: Dense(u) for name, u in total.items()}
