"""Ghost clipping: clipped sums of per-sample gradients, and of same-sample gradient differences, formed from
each layer's activations and output gradients without per-sample gradients.

Loss contract: as :func:`dpvr.grads.per_sample_grads`, ``loss_fn(output, target) -> scalar`` for ONE sample
(``output`` without its batch dimension). Here the model runs once on the whole batch and ``loss_fn`` is
vmapped over it; the backward pass is of the *sum* of the per-sample losses, so row i of the gradient that a
layer's output receives is sample i's own. Every layer must keep the batch dimension first and must not mix
samples (batch norm is rejected).

At each parameter point, one forward pass (``torch.func.functional_call``) records the inputs of every tracked
layer and one backward pass asks autograd for the gradients of the layer outputs only (no parameter gradient
is formed). Then:

- ``Linear`` (any leading dimensions: sequences), ``Conv2d`` (``groups=1``, any padding), ``Embedding`` (no
  ``max_norm``, no ``scale_grad_by_freq``) and ``LayerNorm`` are *ghost* layers: their per-sample norms come
  from :func:`dpvr.ops.ghost_norms` (for Linear and Conv2d the Gram or the direct form, the cheaper one per
  layer) and their clipped sums are matmuls of the recorded tensors (a Linear weight's is ``G^T diag(c) A``);
- every other module with trainable parameters of its own is a *fallback* layer: the per-sample gradients of
  its own parameters are materialised from its recorded inputs and output gradients (``torch.func.vjp`` of
  that module alone, under ``vmap``; no second pass through the model). Modules that share a parameter are
  fallback layers too.

The difference ``a_i g_i(x) - b_i g_i(x')`` of a Linear or Conv2d weight gradient goes to the native core as
the pieces ``(A, a G - b G')`` and ``(A - A', b G')``: its norm is accurate relative to the difference, zero
at identical points, and a layer whose input is the same at both points (the first layer) has one piece.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import ops
from .materialized import Grads, LossFn, _check_point, trainable_parameters

NormForm = Literal["auto", "gram", "direct"]


class ClippedSum(NamedTuple):
    """What :meth:`GhostClipper.clipped_sum` and :meth:`GhostClipper.clipped_diff_sum` return.

    ``sums``: ``sum_i c_i u_i`` per trainable parameter (parameter-shaped, ``model.parameters()`` order),
    where every sample's ``c_i u_i`` has norm at most ``clip``. ``norms``: ``(B,)`` norms of the ``u_i``
    (NaN: a non-finite sample, which contributed nothing). ``losses``: ``(B,)`` per-sample losses at the
    (first) point; ``losses_b``: at the second point of a difference, else ``None``.
    """

    sums: Grads
    norms: Tensor
    losses: Tensor
    losses_b: Tensor | None


@dataclass
class _Call:
    """One call of a tracked module in a recorded forward pass: its inputs (detached) and, per leaf of its
    output, the gradient of the summed loss (None for a leaf that carries none, e.g. an integer tensor)."""

    args: tuple
    kwargs: dict
    grads: list[Tensor | None]
    versions: list[tuple[Tensor, int]] = field(default_factory=list)

    @property
    def input(self) -> Tensor:
        return self.args[0] if self.args else self.kwargs["input"]

    def check_unmodified(self, layer: str) -> None:
        if any(t._version != v for t, v in self.versions):
            raise ValueError(f"an input of layer {layer!r} was modified in place after the layer used it")


@dataclass
class _Recording:
    """One forward and backward pass at one parameter point."""

    calls: dict[_Layer, list[_Call]]
    losses: Tensor
    values: list[Tensor]  # the trainable parameters' values at the point


def _rows(t: Tensor, s: Tensor | None) -> Tensor:
    """``t`` with row i scaled by ``s[i]`` (``t`` itself when ``s`` is None)."""
    return t if s is None else t * s.view(-1, *([1] * (t.dim() - 1)))


def _difference(u: Tensor, u_b: Tensor, a: Tensor | None, b: Tensor | None) -> Tensor:
    return _rows(u, a) - _rows(u_b, b)


def _zero_rows(t: Tensor, bad: Tensor) -> Tensor:
    return t.masked_fill(bad.view(-1, *([1] * (t.dim() - 1))), 0)


def _steps(ts: list[Tensor]) -> Tensor:
    """Several calls of one layer are more steps of one sequence: their gradients add."""
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=1)


def _same(x: Tensor, y: Tensor) -> bool:
    """Whether two recorded tensors hold the same values (cheap when they are the same memory)."""
    if x.shape != y.shape:
        return False
    return (x.data_ptr() == y.data_ptr() and x.stride() == y.stride()) or bool(torch.equal(x, y))


# ---- the parts of the per-sample vector: each gives its norm term and forms its clipped sum ----

@dataclass
class _Outer:
    """A weight whose per-sample gradient is ``sum_j N_j^T M_j`` (pieces ``(M_j, N_j)``, ``(B, T, p|q)``)."""

    index: int
    shape: torch.Size
    pieces: list[tuple[Tensor, Tensor]]

    def total(self, f: Tensor) -> Tensor:
        out = None
        for m, n in self.pieces:
            # Scale the narrower side by the factors; one matmul contracts samples and steps together.
            m, n = (m, _rows(n, f)) if n.shape[-1] <= m.shape[-1] else (_rows(m, f), n)
            term = n.reshape(-1, n.shape[-1]).t() @ m.reshape(-1, m.shape[-1])
            out = term if out is None else out.add_(term)
        return out.reshape(self.shape)

    def drop(self, bad: Tensor) -> None:
        self.pieces = [(_zero_rows(m, bad), _zero_rows(n, bad)) for m, n in self.pieces]


@dataclass
class _Index:
    """An embedding table whose per-sample gradient adds ``N_j[i, t]`` to row ``K_j[i, t]``."""

    index: int
    shape: torch.Size
    pieces: list[tuple[Tensor, Tensor]]  # (indices (B, T), grads (B, T, q))
    skip: int | None

    def total(self, f: Tensor) -> Tensor:
        n0 = self.pieces[0][1]
        out = torch.zeros(self.shape, dtype=n0.dtype, device=n0.device)
        for k, n in self.pieces:
            out.index_add_(0, k.reshape(-1), _rows(n, f).reshape(-1, n.shape[-1]))
        if self.skip is not None:
            out[self.skip] = 0  # the padding row gets no gradient
        return out

    def drop(self, bad: Tensor) -> None:
        self.pieces = [(k, _zero_rows(n, bad)) for k, n in self.pieces]


@dataclass
class _Dense:
    """A parameter whose per-sample gradients ``u`` (``(B, ...)``) are materialised."""

    index: int
    shape: torch.Size
    u: Tensor

    def total(self, f: Tensor) -> Tensor:
        return (f @ self.u.reshape(self.u.shape[0], -1)).reshape(self.shape)

    def drop(self, bad: Tensor) -> None:
        self.u = _zero_rows(self.u, bad)


_Part = Union[_Outer, _Index, _Dense]


# ---- layers ----

class _Layer:
    """A module whose own trainable parameters get per-sample terms. ``params``: (attribute, index among the
    model's trainable parameters) of each of them. Used as is for fallback layers."""

    def __init__(self, name: str, module: nn.Module, params: list[tuple[str, int]]) -> None:
        self.name = name or "<model>"
        self.module = module
        self.params = params

    def index(self, attr: str) -> int | None:
        return next((k for a, k in self.params if a == attr), None)

    def parts(self, calls: list[_Call], calls_b: list[_Call] | None, a: Tensor | None,
              b: Tensor | None) -> list[_Part]:
        """The parts of this layer's per-sample gradient (``calls_b`` None) or gradient difference."""
        raise NotImplementedError


class _LinearMap(_Layer):
    """Linear and Conv2d: per-sample weight gradient ``G^T A`` over the steps, bias gradient ``sum_t G_t``."""

    def activations(self, x: Tensor) -> Tensor:
        """``(B, ...)`` input -> ``(B, T, p)``."""
        raise NotImplementedError

    def output_grads(self, g: Tensor) -> Tensor:
        """``(B, ...)`` output gradient -> ``(B, T, q)``."""
        raise NotImplementedError

    def parts(self, calls, calls_b, a, b):
        acts = _steps([self.activations(c.input) for c in calls])
        grads = _steps([self.output_grads(c.grads[0]) for c in calls])
        if calls_b is None:
            pieces, bias = [(acts, grads)], grads
        else:
            grads_b = _rows(_steps([self.output_grads(c.grads[0]) for c in calls_b]), b)
            bias = _rows(grads, a) - grads_b
            pieces = [(acts, bias)]
            inputs = [(c.input, c_b.input) for c, c_b in zip(calls, calls_b)]
            if not all(_same(x, x_b) for x, x_b in inputs):
                # The activation map is linear: the difference of activations is that of the inputs.
                pieces.append((_steps([self.activations(x - x_b) for x, x_b in inputs]), grads_b))
        out: list[_Part] = []
        if (k := self.index("weight")) is not None:
            out.append(_Outer(k, self.module.weight.shape, pieces))
        if (k := self.index("bias")) is not None:
            out.append(_Dense(k, self.module.bias.shape, bias.sum(dim=1)))
        return out


class _Linear(_LinearMap):
    def activations(self, x):
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def output_grads(self, g):
        return g.reshape(g.shape[0], -1, g.shape[-1])


class _Conv2d(_LinearMap):
    def activations(self, x):
        m = self.module
        if m.padding_mode == "zeros" and not isinstance(m.padding, str):
            cols = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)
        else:  # the padding the module applies ('same' may be asymmetric), then none
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
            cols = F.unfold(x, m.kernel_size, m.dilation, 0, m.stride)
        return cols.transpose(1, 2)  # (B, positions, C_in * kh * kw): the layout of weight.view(C_out, -1)

    def output_grads(self, g):
        return g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2)


class _Embedding(_Layer):
    def parts(self, calls, calls_b, a, b):
        def keys(cs: list[_Call]) -> Tensor:
            return _steps([c.input.reshape(c.input.shape[0], -1) for c in cs])

        def grads(cs: list[_Call]) -> Tensor:
            return _steps([c.grads[0].reshape(c.grads[0].shape[0], -1, c.grads[0].shape[-1]) for c in cs])

        if calls_b is None:
            pieces = [(keys(calls), grads(calls))]
        else:
            k, k_b = keys(calls), keys(calls_b)
            g, g_b = _rows(grads(calls), a), _rows(grads(calls_b), b)
            pieces = [(k, g - g_b)] if _same(k, k_b) else [(k, g), (k_b, -g_b)]
        return [_Index(self.params[0][1], self.module.weight.shape, pieces, self.module.padding_idx)]


class _LayerNorm(_Layer):
    def _grads(self, calls: list[_Call]) -> tuple[Tensor, Tensor]:
        """Per-sample gradients of weight (``sum_t x_hat_t * g_t``) and bias (``sum_t g_t``), ``(B, k)``."""
        m = self.module
        size = math.prod(m.normalized_shape)
        weight = bias = None
        for c in calls:
            g = c.grads[0]
            x_hat = F.layer_norm(c.input, m.normalized_shape, None, None, m.eps)
            w = (x_hat * g).reshape(g.shape[0], -1, size).sum(dim=1)
            s = g.reshape(g.shape[0], -1, size).sum(dim=1)
            weight, bias = (w, s) if weight is None else (weight + w, bias + s)
        return weight, bias

    def parts(self, calls, calls_b, a, b):
        us = self._grads(calls)
        if calls_b is not None:
            us = tuple(_difference(u, u_b, a, b) for u, u_b in zip(us, self._grads(calls_b)))
        return [_Dense(k, getattr(self.module, attr).shape, u)
                for attr, u in zip(("weight", "bias"), us) if (k := self.index(attr)) is not None]


def _ghost_type(module: nn.Module, attrs: set[str]) -> type[_Layer] | None:
    """The ghost handler of a module whose own trainable parameters are ``attrs``; None: a fallback layer."""
    kind = type(module)  # exact types: a subclass may change forward
    if kind is nn.Linear and attrs <= {"weight", "bias"}:
        return _Linear
    if kind is nn.Conv2d and module.groups == 1 and attrs <= {"weight", "bias"}:
        return _Conv2d
    if (kind is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq
            and attrs == {"weight"}):
        return _Embedding
    if kind is nn.LayerNorm and attrs <= {"weight", "bias"}:
        return _LayerNorm
    return None


def _vjp_per_sample(module: nn.Module, values: dict[str, Tensor], wrt: dict[str, Tensor], call: _Call,
                    batch: int) -> dict[str, Tensor]:
    """Per-sample gradients of ``module``'s parameters ``wrt`` from one recorded call: the vector-Jacobian
    product of the module alone with sample i's inputs and output gradient, under vmap. Tensors in the call's
    arguments with the batch first are split by sample; the rest are shared."""
    flat, spec = tree_flatten((call.args, call.kwargs))
    batched = [isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == batch for v in flat]
    used = [k for k, g in enumerate(call.grads) if g is not None]

    def one(w: dict[str, Tensor], xs: list[Tensor], cotangents: list[Tensor]) -> dict[str, Tensor]:
        it = iter(xs)
        sample = [next(it).unsqueeze(0) if bt else v for v, bt in zip(flat, batched)]
        args, kwargs = tree_unflatten(sample, spec)

        def outputs(w: dict[str, Tensor]) -> list[Tensor]:
            leaves = tree_flatten(functional_call(module, {**values, **w}, args, kwargs))[0]
            return [leaves[k] for k in used]

        _, pullback = vjp(outputs, w)
        return pullback([c.unsqueeze(0) for c in cotangents])[0]

    xs = [v for v, bt in zip(flat, batched) if bt]
    return vmap(one, in_dims=(None, 0, 0))(wrt, xs, [call.grads[k] for k in used])


class GhostClipper:
    """Per-sample clipped gradient sums of ``model`` without per-sample gradients (see the module docstring).

    Args:
        model: the model; it is called functionally and never modified. Batch-norm layers are rejected.
        loss_fn: per-sample loss ``loss_fn(output, target) -> scalar``, as for ``per_sample_grads``.
        norm_form: how Linear/Conv2d norms are computed: ``"auto"`` (the cheaper form per layer), ``"gram"``
            or ``"direct"`` (see :func:`dpvr.ops.ghost_norms`).
        nonfinite: ``"zero"`` (default): a sample whose gradient, weight or scalar is not finite contributes
            nothing and its norm is NaN; ``"raise"``: ``FloatingPointError`` — the kernels' policies.

    Attributes:
        supported_layers: names of the modules clipped from their activations and output gradients.
        fallback_layers: names of the modules whose own parameters' per-sample gradients are materialised.
        mode: ``"ghost"`` (no fallback layer), ``"mixed"`` or ``"materialised"`` (no ghost layer).

    Privacy-relevant guarantee: each sample's contribution ``c_i u_i`` to a returned sum has norm at most
    ``clip``, where ``u_i`` is the exact per-sample gradient (or difference) of the recorded activations and
    output gradients: the norms are upper bounds that include their rounding error
    (:func:`dpvr.ops.ghost_norms`) and the factors come from :func:`dpvr.ops.clip_factors`, the clip rule of
    the fused kernels. The matmuls that add the clipped terms round like any floating-point sum.

    Requirements: a trainable parameter is used only by the forward of the module that owns it, and each such
    module runs in every forward pass (a parameter read by another module, like ``MultiheadAttention``'s
    ``out_proj``, is reported as not called); fallback modules take and return batch-first tensors; parameters
    are on the host (the ghost-norm kernel has no CUDA backend yet).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, *, norm_form: NormForm = "auto",
                 nonfinite: str = "zero") -> None:
        if norm_form not in ops.NORM_FORMS:
            raise ValueError(f"norm_form: must be one of {sorted(ops.NORM_FORMS)}, got {norm_form!r}")
        ops.check_nonfinite(nonfinite)
        self.model, self.loss_fn, self.norm_form, self.nonfinite = model, loss_fn, norm_form, nonfinite
        self._named = trainable_parameters(model)
        dtypes = {p.dtype for _, p in self._named}
        if len(dtypes) > 1:
            raise ValueError(f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; use one")
        devices = {p.device.type for _, p in self._named}
        if devices != {"cpu"}:
            raise ValueError(f"parameters on {sorted(devices)}: the ghost-norm kernel runs on the host only; "
                             "use per_sample_grads with the CUDA kernels")
        self._index_of = {id(p): k for k, (_, p) in enumerate(self._named)}
        self._dim = sum(p.numel() for _, p in self._named)

        owned = []
        for name, module in model.named_modules():
            params = [(attr, self._index_of[id(p)]) for attr, p in module.named_parameters(recurse=False)
                      if p.requires_grad]
            if params:
                owned.append((name, module, params))
        owners = [k for _, _, params in owned for _, k in params]
        self._ghost: list[_Layer] = []
        self._fallback: list[_Layer] = []
        for name, module, params in owned:
            shared = any(owners.count(k) > 1 for _, k in params)
            kind = None if shared else _ghost_type(module, {attr for attr, _ in params})
            (self._ghost if kind else self._fallback).append((kind or _Layer)(name, module, params))
        for layer in self._fallback:
            # A fallback module is differentiated through its whole forward: a parameter that it and one of
            # its submodules both own would be counted twice.
            own = {k for _, k in layer.params}
            for child_name, child in layer.module.named_modules():
                if child_name and own & {self._index_of.get(id(p)) for p in child.parameters(recurse=False)}:
                    raise ValueError(f"layer {layer.name!r} and its submodule {child_name!r} both own a "
                                     "parameter; register it in one module only")

    @property
    def supported_layers(self) -> list[str]:
        return [layer.name for layer in self._ghost]

    @property
    def fallback_layers(self) -> list[str]:
        return [layer.name for layer in self._fallback]

    @property
    def mode(self) -> str:
        if not self._fallback:
            return "ghost"
        return "materialised" if not self._ghost else "mixed"

    def clipped_sum(self, inputs: Tensor, targets: Tensor, clip: float, *, weights: Tensor | None = None,
                    params: Sequence[Tensor] | None = None) -> ClippedSum:
        """``sum_i c_i w_i g_i`` with ``g_i`` the gradient of sample i's loss at ``params`` (default: the
        model's own values) and ``c_i = min(1, C / ||w_i g_i||)`` by the rule of
        :func:`dpvr.ops.clip_accumulate`: each sample's contribution has norm at most ``clip``.

        ``weights`` (``(B,)``, the parameters' dtype and device) scale samples before the norm (DRO
        re-weighting); the returned norms are ``||w_i g_i||``.
        """
        batch = self._check_batch(inputs, targets, clip)
        weights = self._check_scalars(weights, "weights", batch)
        rec = self._record(inputs, targets, params, "params")
        sums, norms = self._clip(self._parts(rec, None, None, None, batch), clip, weights, batch)
        return ClippedSum(sums, norms, rec.losses, None)

    def clipped_diff_sum(self, inputs: Tensor, targets: Tensor, params_a: Sequence[Tensor],
                         params_b: Sequence[Tensor], clip: float, *, a: Tensor | None = None,
                         b: Tensor | None = None) -> ClippedSum:
        """``sum_i c_i u_i`` with ``u_i = a_i g_i(params_a) - b_i g_i(params_b)``, gradients of the SAME
        sample at two points, and ``c_i = min(1, C / ||u_i||)`` by the rule of
        :func:`dpvr.ops.clip_accumulate_diff`: the difference is clipped per sample (never the difference of
        clipped terms), so each sample's contribution has norm at most ``clip``.

        ``a``, ``b``: optional ``(B,)`` per-sample scalars (default 1). ``losses`` and ``losses_b`` of the
        result are the per-sample losses at ``params_a`` and ``params_b``.
        """
        batch = self._check_batch(inputs, targets, clip)
        a = self._check_scalars(a, "a", batch)
        b = self._check_scalars(b, "b", batch)
        rec_a = self._record(inputs, targets, params_a, "params_a")
        rec_b = self._record(inputs, targets, params_b, "params_b")
        sums, norms = self._clip(self._parts(rec_a, rec_b, a, b, batch), clip, None, batch)
        return ClippedSum(sums, norms, rec_a.losses, rec_b.losses)

    # ---- checks ----

    @staticmethod
    def _check_batch(inputs: Tensor, targets: Tensor, clip: float) -> int:
        if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
            raise ValueError(f"clip: must be a finite number > 0, got {clip!r}")
        if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor):
            raise TypeError("inputs and targets must be tensors")
        if inputs.dim() == 0 or targets.dim() == 0:
            raise ValueError("inputs and targets need a leading batch dimension, got a 0-d tensor")
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"inputs and targets need the same batch size, got shapes {tuple(inputs.shape)} "
                             f"and {tuple(targets.shape)}")
        if inputs.shape[0] == 0:
            raise ValueError("empty batch: inputs and targets have no samples")
        return inputs.shape[0]

    def _check_scalars(self, s: Tensor | None, name: str, batch: int) -> Tensor | None:
        if s is None:
            return None
        p = self._named[0][1]
        if not isinstance(s, Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(s).__name__}")
        if tuple(s.shape) != (batch,):
            raise ValueError(f"{name}: expected shape ({batch},), got {tuple(s.shape)}")
        if s.dtype != p.dtype or s.device != p.device:
            raise ValueError(f"{name}: expected dtype {p.dtype} on {p.device}, got {s.dtype} on {s.device}")
        return s.detach()

    # ---- recording ----

    def _record(self, inputs: Tensor, targets: Tensor, point: Sequence[Tensor] | None,
                label: str) -> _Recording:
        """One forward and one backward pass at ``point``."""
        values = [p for _, p in self._named] if point is None else _check_point(point, self._named, label)
        values = [v.detach() for v in values]
        leaves = [v.detach().requires_grad_() for v in values]  # so every tracked output has a gradient edge
        calls: dict[_Layer, list[_Call]] = {layer: [] for layer in (*self._ghost, *self._fallback)}
        pending: list[tuple[_Call, int, Any, Tensor]] = []  # (call, output leaf, gradient edge, the output)

        def hook_for(layer: _Layer):
            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                flat, spec = tree_flatten((args, kwargs))
                flat = [v.detach() if isinstance(v, Tensor) else v for v in flat]
                outs = tree_flatten(output)[0]
                call = _Call(*tree_unflatten(flat, spec), [None] * len(outs),
                             [(t, t._version) for t in flat if isinstance(t, Tensor)])
                for k, o in enumerate(outs):
                    if isinstance(o, Tensor) and o.requires_grad:
                        # The edge pins the gradient to this version of the output, even if a later operation
                        # modifies it in place (ReLU(inplace=True)).
                        pending.append((call, k, get_gradient_edge(o), o.detach()))
                calls[layer].append(call)
            return hook

        handles = [layer.module.register_forward_hook(hook_for(layer), with_kwargs=True) for layer in calls]
        try:
            with torch.enable_grad():
                point_values = {name: v for (name, _), v in zip(self._named, leaves)}
                output = functional_call(self.model, point_values, (inputs,))
                losses = vmap(self.loss_fn)(output, targets)
                if tuple(losses.shape) != (inputs.shape[0],):
                    raise ValueError("loss_fn must return a scalar per sample; it returned shape "
                                     f"{tuple(losses.shape[1:])}")
                grads = (torch.autograd.grad(losses.sum(), [e for _, _, e, _ in pending], allow_unused=True)
                         if pending and losses.requires_grad else [None] * len(pending))
        finally:
            for h in handles:
                h.remove()
        for (call, k, _, out), g in zip(pending, grads):
            call.grads[k] = torch.zeros_like(out) if g is None else g  # None: the loss does not use it
        batch = inputs.shape[0]
        for layer, cs in calls.items():
            if not cs:
                raise ValueError(f"layer {layer.name!r} was not called in the forward pass, so its "
                                 "parameters get no per-sample gradient (if another module reads them, ghost "
                                 "clipping cannot see it); freeze parameters that are really unused with "
                                 "requires_grad_(False)")
            for g in (g for c in cs for g in c.grads if g is not None):
                if g.dim() == 0 or g.shape[0] != batch:
                    raise ValueError(f"layer {layer.name!r} returned shape {tuple(g.shape)}, not batch-first "
                                     f"(batch {batch}): its per-sample gradients cannot be recovered")
        return _Recording(calls, losses.detach(), values)

    # ---- parts, factors, sums ----

    def _parts(self, rec: _Recording, rec_b: _Recording | None, a: Tensor | None, b: Tensor | None,
               batch: int) -> list[_Part]:
        for r in (rec, rec_b) if rec_b is not None else (rec,):
            for layer, cs in r.calls.items():
                for c in cs:
                    c.check_unmodified(layer.name)
        parts: list[_Part] = []
        for layer in self._ghost:
            parts += layer.parts(rec.calls[layer], None if rec_b is None else rec_b.calls[layer], a, b)
        # Fallback layers: materialised per-sample gradients, summed over the modules that share a parameter.
        dense: dict[int, Tensor] = {}
        for layer in self._fallback:
            own = self._materialise(layer, rec, batch)
            if rec_b is not None:
                own_b = self._materialise(layer, rec_b, batch)
                own = {k: _difference(u, own_b[k], a, b) for k, u in own.items()}
            for k, u in own.items():
                dense[k] = dense[k] + u if k in dense else u
        return parts + [_Dense(k, self._named[k][1].shape, u) for k, u in dense.items()]

    def _materialise(self, layer: _Layer, rec: _Recording, batch: int) -> dict[int, Tensor]:
        """Per-sample gradients of a fallback layer's own parameters at ``rec``'s point."""
        module = layer.module
        values = {local: rec.values[self._index_of[id(p)]] for local, p in module.named_parameters()
                  if p.requires_grad}
        wrt = {attr: values.pop(attr) for attr, _ in layer.params}
        out: dict[int, Tensor] = {}
        with torch.no_grad():
            for call in rec.calls[layer]:
                grads = _vjp_per_sample(module, values, wrt, call, batch)
                for attr, k in layer.params:
                    out[k] = out[k] + grads[attr] if k in out else grads[attr]
        return out

    def _clip(self, parts: list[_Part], clip: float, weights: Tensor | None,
              batch: int) -> tuple[Grads, Tensor]:
        dtype = self._named[0][1].dtype
        norms_sq = torch.empty(batch, dtype=torch.float64)
        ops.ghost_norms(norms_sq, outer=[p.pieces for p in parts if isinstance(p, _Outer)],
                        index=[ops.IndexTerm(p.pieces, p.skip) for p in parts if isinstance(p, _Index)],
                        dense=[p.u for p in parts if isinstance(p, _Dense)], form=self.norm_form)
        factors = torch.empty(batch, dtype=dtype)
        norms = torch.empty(batch, dtype=dtype)
        if ops.clip_factors(norms_sq, clip, factors, columns=self._dim, weights=weights, norms=norms,
                            nonfinite=self.nonfinite):
            bad = torch.isnan(norms)  # factor 0, but 0 * NaN is NaN inside a matmul: clear their rows
            for p in parts:
                p.drop(bad)
        sums: list[Tensor | None] = [None] * len(self._named)
        with torch.no_grad():
            for p in parts:
                sums[p.index] = p.total(factors)
        return [torch.zeros_like(p) if s is None else s for s, (_, p) in zip(sums, self._named)], norms
