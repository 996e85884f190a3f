"""The ghost clipper: records each tracked layer's inputs and output gradients at a parameter point, asks the
layers' rules for the parts of the per-sample gradients (or differences), bounds the norms and forms the
clipped sums (see the package docstring)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ... import ops
from ..fields import Fields, as_inputs, cat, model_args
from ..fields import leaves as data_leaves
from ..layer_clip import LayerRadii
from ..materialized import Grads, LossFn, _check_point, clip_dtype, trainable_parameters
from . import cost
from . import norms as torch_norms
from .fallback import VjpRule
from .rules import Dense, GhostRule, LayerCall, Outer, Part, Rows, Tied, rule_for, shared

NormForm = Literal["auto", "gram", "direct"]
Backend = Literal["auto", "native", "torch"]
BACKENDS = ("auto", "native", "torch")
_HALF = (torch.float16, torch.bfloat16)
_TORCH_FORMS = ("chunked", "gram32")  # norm forms of the cost model computed in torch, not by the kernels


def _widened(v: Any, dtype: torch.dtype) -> Any:
    """``v`` in ``dtype`` when it is a half-precision tensor (an autocast activation or gradient)."""
    return v.to(dtype) if isinstance(v, Tensor) and v.dtype in _HALF else v


def _shared_call(args: tuple, kwargs: dict, output: Any, batch: int) -> bool:
    """Whether a layer was called once for the whole batch on inputs with a leading dimension of one (a
    position embedding of ``(1, T)`` position ids, broadcast over the batch by the model): its output
    gradient would then be the sum over records, so the call is recorded as ``batch`` identical calls,
    one per record, with its output expanded to match (broadcasting against it is unchanged)."""
    if batch == 1 or type(output) is not Tensor or output.dim() == 0 or output.shape[0] != 1:
        return False
    leaves = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, Tensor)]
    return bool(leaves) and all(v.dim() > 0 and v.shape[0] == 1 for v in leaves)


def _batched(v: Any, batch: int) -> bool:
    return isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == batch


class _LayoutUnknown(Exception):
    """Raised inside a recording that needs the layers' batch dimensions learned first."""


def _batch_first(v: Any, dim: int, batch: int) -> Any:
    """``v`` with its dimension ``dim`` (of size ``batch``) moved to the front, if it has one."""
    if isinstance(v, Tensor) and v.dim() > dim and v.shape[dim] == batch:
        return v.movedim(dim, 0)
    return v


def _per_record(v: Any, batch: int) -> Any:
    return v.expand(batch, *v.shape[1:]) if isinstance(v, Tensor) else v


def _zeros_like(t: Tensor) -> Callable[[], Tensor]:
    """Makes zeros shaped like ``t`` later, without holding ``t``."""
    shape, dtype, device = t.shape, t.dtype, t.device
    return lambda: torch.zeros(shape, dtype=dtype, device=device)


def _full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast switched off on ``device``, so that the rules and the clip arithmetic run in the
    parameters' dtype even inside a caller's ``torch.autocast`` region."""
    try:
        return torch.autocast(device.type, enabled=False)
    except RuntimeError:  # a device type without autocast
        return contextlib.nullcontext()


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


@dataclass(eq=False)  # hashed by identity: the key of a layer's calls
class _Layer:
    """A tracked module: ``params`` are (local name, index among the model's trainable parameters)."""

    name: str
    module: nn.Module
    params: list[tuple[str, int]]  # with its submodules' when ``subtree``
    rule: GhostRule
    subtree: bool

    @property
    def ghost(self) -> bool:
        return not isinstance(self.rule, VjpRule) or self.rule.recorded_as_ghost


@dataclass
class _Recording:
    """One forward and backward pass at one parameter point, and the per-layer parts of the gradient at that
    point once formed (``parts``: per layer, the parts and whether one was materialised), which a kept
    recording serves again to the next difference."""

    calls: dict[_Layer, list[LayerCall]]
    losses: Tensor
    parts: dict[_Layer, tuple[dict[str, Part], bool]] = field(default_factory=dict)
    held: float = 0.0  # bytes of the per-sample matrices materialised at this point, held until the sums


@dataclass
class _Kept:
    """A recording kept for reuse, with everything that must be unchanged for it to describe a later call:
    the same inputs and targets (the tensors themselves, at the versions recorded), bit-identical trainable
    parameter values (``point``: copies, which the recording's calls hold), the same buffers and frozen
    parameters (tensors and versions) and the same training flags of every module."""

    recording: _Recording
    data: list[tuple[Tensor, int]]
    point: list[Tensor]
    state: list[tuple[Tensor, int]]
    modes: tuple[bool, ...]


@dataclass
class _Pass:
    """What one recording pass gathers as the model runs: each layer's calls; ``pending``, ``(call, output
    leaf index or internal name, gradient edge, the output's zeros)`` for every output whose gradient the
    backward pass finds (the outputs are not held, so each is freed when the forward no longer needs it, as
    in an unrecorded pass); ``exposed``, the internals of the call now running; ``moved``, ``id(call)`` ->
    the batch dimension of its outputs, where not 0."""

    batch: int
    calls: dict[_Layer, list[LayerCall]]
    pending: list[tuple[LayerCall, int | str, Any, Callable[[], Tensor]]] = field(default_factory=list)
    exposed: dict[_Layer, dict[str, Tensor]] = field(default_factory=dict)
    moved: dict[int, int] = field(default_factory=dict)


def _recording_forward(layer: _Layer, original: Callable[..., Any],
                       exposed: dict[_Layer, dict[str, Tensor]]) -> Callable[..., Any]:
    """``layer``'s forward for a recording pass: its rule's own (:meth:`GhostRule.recording_forward`), which
    leaves the internals it exposes in ``exposed`` for the hook, or ``original`` where the rule declines."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        got = layer.rule.recording_forward(args, kwargs)
        if got is None:
            return original(*args, **kwargs)
        output, exposed[layer] = got
        return output
    return forward


# Clipped sums of at least this many bytes are written into kept buffers (_pooled). The C library maps a
# buffer of 32 MiB or more afresh at each allocation, and smaller ones fault as often when it trims its heap:
# GPT-2 small's 18 MiB float64 sums at B = 2 took 180 000 page faults a step (half its clipped sums' time)
# until they were pooled too.
POOLED_BYTES = 1 << 20
# ... and at most this many bytes of them are kept per clipper (the float64 sums of 6.7 * 10^7 parameters):
# what stays resident between steps, outside the step's peak.
POOL_BYTES = 512 << 20


def _storage_counter() -> Callable[[Tensor], int] | None:
    """How many references a tensor's memory has (tensors and views of it), where torch says: None if not."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return lambda t: count(t.untyped_storage()._cdata)


_storage_uses = _storage_counter()
# The count of a buffer that only the pool holds (the storage object made to ask adds one).
_FREE_USES = _storage_uses(torch.empty(1)) if _storage_uses is not None else 0

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32}


def _same_bits(kept: Sequence[Tensor], now: Sequence[Tensor]) -> bool:
    """Whether each tensor of ``now`` holds bit for bit the values of ``kept``'s (compared as integers: a
    point differing only in the sign of a zero is another point, and a NaN is the same NaN).

    On the host it stops at the first tensor that differs and allocates nothing: a difference round asks
    twice, once for the kept point (all of it equal) and once for the new one (differing at once), and
    a comparison by value that formed every tensor's mask cost a tenth of a ResNet's round. On a device,
    one synchronisation for all tensors, not one per tensor."""
    if len(kept) != len(now):
        return False
    pairs = [(k.view(_BITS[k.dtype]), v.view(_BITS[v.dtype])) for k, v in zip(kept, now)]
    if any(k.device.type != "cpu" for k, _ in pairs):
        return not bool(torch.stack([(k != v).any() for k, v in pairs]).any())
    return all(torch.equal(k, v) for k, v in pairs)


def _unchanged(pairs: list[tuple[Tensor, int]], now: Sequence[Tensor]) -> bool:
    """Whether ``now`` are the very tensors of ``pairs``, each still at its recorded version."""
    return len(pairs) == len(now) and all(t is u and t._version == v for (t, v), u in zip(pairs, now))


class GhostClipper:
    """Per-sample clipped gradient sums of ``model`` without per-sample gradients (see the package docstring).

    Args:
        model: the model; it is called functionally and never modified. Batch-norm layers are rejected;
            the trainable parameters must be float32 or float64 (one dtype).
        loss_fn: per-sample loss ``loss_fn(output, target) -> scalar``, as for ``per_sample_grads``.
        norm_form: how the norms of linear maps' weights are computed: ``"gram"`` or ``"direct"`` (see
            :func:`dpvr.ops.ghost_norms`), or ``"auto"``: on the host, each such part takes the form
            predicted fastest on this machine from its shapes, under a memory budget
            (:mod:`~dpvr.grads.ghost.cost`: the per-sample matrices materialised in one batched product,
            the native Gram or direct form, the direct form in float64 chunks of samples, or, for float32
            parameters, the Gram form from float32 blocks with its rounding priced; the choices
            are in :attr:`choices`); off the host, a layer
            applied at several steps whose per-sample matrix is no larger than its recorded inputs and
            output gradients has it materialised (:meth:`Outer.worth_materialising`), every other layer
            takes the cheaper of the two forms by operation count. The choice depends on shapes and the
            machine only, and every form bounds what it writes: it never changes the guarantee below.
        nonfinite: ``"zero"`` (default): a sample whose gradient, weight or scalar is not finite contributes
            nothing and its norm is NaN; ``"raise"``: ``FloatingPointError`` — the kernels' policies.
        backend: where norms and clip factors are computed: ``"native"`` (the host kernels; parameters on
            the host), ``"torch"`` (device operations, no host round trip: the path of CUDA parameters) or
            ``"auto"``, native on the host and torch elsewhere. Both give upper bounds on the norms; forcing
            ``"torch"`` on the host runs the device code path (tests do).
        reuse_recording: keep the recording of the latest call's point (of ``params``, or ``params_a`` of a
            difference) and use it again, instead of a forward and a backward pass, when a later call asks
            for the same inputs and targets (the same tensor objects, not modified in place since) at
            bit-identical parameter values, with the model's buffers, frozen parameters and training flags
            unchanged; anything else is recorded afresh. A full-batch DIFF2-GD round, whose previous point
            was recorded by the previous round on the same records, then costs one forward and one backward
            pass. Memory: one batch's recording and one copy of the trainable parameters. A reused recording
            is the one a recomputation would produce for a deterministic forward (with dropout active, it is
            the earlier draw of the masks).

    Attributes:
        supported_layers: names of the modules clipped from their activations and output gradients.
        fallback_layers: names of the modules whose own parameters' per-sample gradients are materialised.
        mode: ``"ghost"`` (no fallback layer), ``"mixed"`` or ``"materialised"`` (no ghost layer).
        backend: ``"native"`` or ``"torch"``.
        choices: ``"layer.parameter"`` -> :class:`~dpvr.grads.ghost.cost.Choice`, the form last chosen for
            each linear map's weight under ``norm_form="auto"`` on the host, with the predicted times;
            ``"layer.parameter (difference)"`` for the latest difference's own part of it, chosen for the
            difference's shapes (:meth:`_difference_forms`).

    Privacy-relevant guarantee: each sample's contribution to a returned sum, as written in the parameters'
    dtype (the sum of a batch of that sample alone), has norm at most ``clip`` — as the fused kernels'
    clipped vectors do after rounding. ``u_i`` is the exact per-sample gradient (or difference) of the
    recorded activations and output gradients, with a table's rows summed per key and rounded once and a
    materialised layer's per-sample matrix as computed: the very entries that the clipped sums write. The
    norms are upper bounds that include their rounding error; the rounding of a clipped sum that adds
    several terms per entry for one sample (a weight applied at several steps or by several calls, a
    difference's pieces, which may cancel) is bounded and added to the norm before the factor is formed;
    the factors follow the clip rule of the fused kernels, with their margin (see :meth:`_clip`). Adding
    different samples' terms into one entry rounds like any floating-point sum, as in the kernels.

    Mixed precision: inside a ``torch.autocast`` region the recorded forward and backward run in half
    precision; the recorded activations and output gradients are then widened to the parameters' dtype,
    and the rules, norms and clipped sums run with autocast off, so the guarantee above holds unchanged
    (for the per-sample gradients of the half-precision activations).

    Requirements: a trainable parameter is used only by the forwards of the modules that own it (several may,
    as a tied embedding and output head do; or of an ancestor whose rule owns its submodules, like
    ``MultiheadAttention``), and each such module runs in every forward pass; fallback modules take and
    return batch-first tensors; all parameters on one device.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, *, norm_form: NormForm = "auto",
                 nonfinite: str = "zero", backend: Backend = "auto", reuse_recording: bool = False) -> None:
        if norm_form not in ops.NORM_FORMS:
            raise ValueError(f"norm_form: must be one of {sorted(ops.NORM_FORMS)}, got {norm_form!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
        ops.check_nonfinite(nonfinite)
        self.model, self.loss_fn, self.norm_form, self.nonfinite = model, loss_fn, norm_form, nonfinite
        self._named = trainable_parameters(model)
        self._dtype = clip_dtype(self._named)
        devices = {p.device for _, p in self._named}
        if len(devices) > 1:
            raise ValueError(f"trainable parameters are on several devices {sorted(map(str, devices))}; "
                             "use one")
        self._device = devices.pop()
        on_host = self._device.type == "cpu"
        if backend == "native" and not on_host:
            raise ValueError(f"backend='native': the ghost-norm kernels run on the host, the parameters are "
                             f"on {self._device}; use backend='torch'")
        if backend == "auto":
            backend = "native" if on_host else "torch"
        self.backend = backend
        self._index_of = {id(p): k for k, (_, p) in enumerate(self._named)}
        self._dim = sum(p.numel() for _, p in self._named)
        self._layers = self._track(model)
        owners = [k for layer in self._layers for _, k in layer.params]
        self._shared = {k for k in owners if owners.count(k) > 1}
        self.reuse_recording = bool(reuse_recording)
        self._kept: _Kept | None = None
        self._batch_dims: dict[_Layer, int] | None = None  # learned at the first recording
        # "layer.parameter" -> the latest form chosen for its Outer part under norm_form="auto" on the host
        self.choices: dict[str, cost.Choice] = {}
        self._scratch_room = cost.GRAM32_SCRATCH  # bytes the float32 Gram form's blocks may use (_parts)
        self._pool: dict[int, list[Tensor]] = {}  # entries -> float64 buffers for large sums (_pooled)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the kept sum buffers behind (:meth:`_pooled`): they hold no state, only
        memory, and a copy sharing them could write into a sum the original still holds."""
        state = self.__dict__.copy()
        state["_pool"] = {}
        return state

    def _track(self, model: nn.Module) -> list[_Layer]:
        """The modules that own trainable parameters, each with its rule (the fallback when none applies)."""
        found: list[tuple[str, nn.Module, list[tuple[str, int]], type[GhostRule] | None, bool]] = []
        units: list[str] = []  # modules whose rule owns their submodules' parameters
        for name, module in model.named_modules():
            if any(unit == "" or name.startswith(unit + ".") for unit in units):
                continue
            rule = rule_for(module)
            subtree = rule is not None and rule.owns_submodules
            if subtree:
                units.append(name)
            params = [(attr, self._index_of[id(p)]) for attr, p in module.named_parameters(recurse=subtree)
                      if id(p) in self._index_of]
            if params:
                found.append((name, module, params, rule, subtree))
        layers = []
        for name, module, params, rule, subtree in found:
            attrs = {attr for attr, _ in params}
            if rule is None or not (rule.parameters is None or attrs <= set(rule.parameters)):
                rule = VjpRule
            trainable = [attr for attr, _ in params]
            layers.append(_Layer(name or "<model>", module, params, rule(module, trainable), subtree))
        for layer in layers:
            if not isinstance(layer.rule, VjpRule) or layer.subtree:
                continue
            # A fallback module is differentiated through its whole forward: a parameter that it and one of
            # its submodules both own would be counted twice.
            own = {k for _, k in layer.params}
            for child_name, child in layer.module.named_modules():
                if child_name and own & {self._index_of.get(id(p)) for p in child.parameters(recurse=False)}:
                    raise ValueError(f"layer {layer.name!r} and its submodule {child_name!r} both own a "
                                     "parameter; register it in one module only")
        return layers

    @property
    def supported_layers(self) -> list[str]:
        return [layer.name for layer in self._layers if layer.ghost]

    @property
    def fallback_layers(self) -> list[str]:
        return [layer.name for layer in self._layers if not layer.ghost]

    @property
    def mode(self) -> str:
        if not self.fallback_layers:
            return "ghost"
        return "materialised" if not self.supported_layers else "mixed"

    def clipped_sum(self, inputs: Tensor, targets: Tensor, clip: float | LayerRadii, *,
                    weights: Tensor | None = None, params: Sequence[Tensor] | None = None,
                    wide: bool = False) -> ClippedSum:
        """``sum_i c_i w_i g_i`` with ``g_i`` the gradient of sample i's loss at ``params`` (default: the
        model's own values) and ``c_i = min(1, C / ||w_i g_i||)`` by the rule of
        :func:`dpvr.ops.clip_accumulate`: each sample's contribution has norm at most ``clip``. ``clip``
        may be a :class:`~dpvr.grads.layer_clip.LayerRadii` (per-layer clipping): each group of parameters
        is then clipped to its own radius, and a sample's contribution has norm at most ``clip.total``.

        ``weights`` (``(B,)``, the parameters' dtype and device) scale samples before the norm (DRO
        re-weighting); the returned norms are ``||w_i g_i||``. The sums are accumulated over records in
        float64; ``wide=True`` returns them so (for a caller that keeps them in float64 until the noise is
        added), else rounded once to the parameters' dtype.
        """
        inputs, targets = as_inputs(inputs), as_inputs(targets)
        batch = self._check_batch(inputs, targets, clip)
        weights = self._check_scalars(weights, "weights", batch)
        rec = self._record(inputs, targets, params, "params", keep=True)
        with _full_precision(self._device):
            sums, norms = self._clip(self._parts(rec, None, None, None), clip, weights, batch, wide)
        return ClippedSum(sums, norms, rec.losses, None)

    def clipped_diff_sum(self, inputs: Tensor, targets: Tensor, params_a: Sequence[Tensor],
                         params_b: Sequence[Tensor], clip: float, *, a: Tensor | None = None,
                         b: Tensor | None = None, wide: bool = False) -> ClippedSum:
        """``sum_i c_i u_i`` with ``u_i = a_i g_i(params_a) - b_i g_i(params_b)``, gradients of the SAME
        sample at two points, and ``c_i = min(1, C / ||u_i||)`` by the rule of
        :func:`dpvr.ops.clip_accumulate_diff`: the difference is clipped per sample (never the difference of
        clipped terms), so each sample's contribution has norm at most ``clip``.

        ``a``, ``b``: optional ``(B,)`` per-sample scalars (default 1). ``losses`` and ``losses_b`` of the
        result are the per-sample losses at ``params_a`` and ``params_b``. ``wide``: as for
        :meth:`clipped_sum`.
        """
        inputs, targets = as_inputs(inputs), as_inputs(targets)
        batch = self._check_batch(inputs, targets, clip)
        a = self._check_scalars(a, "a", batch)
        b = self._check_scalars(b, "b", batch)
        # The second point first: it may be the recording kept from the previous call, which keeping the
        # first point's replaces.
        rec_b = self._record(inputs, targets, params_b, "params_b")
        with _full_precision(self._device):
            # Formed before the next pass: the layers whose parts stand alone let their recordings go first.
            self._form_parts(rec_b)
        rec_a = self._record(inputs, targets, params_a, "params_a", keep=True)
        with _full_precision(self._device):
            sums, norms = self._clip(self._parts(rec_a, rec_b, a, b), clip, None, batch, wide)
        return ClippedSum(sums, norms, rec_a.losses, rec_b.losses)

    # ---- checks ----

    @staticmethod
    def _check_batch(inputs: Tensor | Fields, targets: Tensor | Fields, clip: float) -> int:
        if isinstance(clip, LayerRadii):  # each radius checked when it was made
            pass
        elif not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
            raise ValueError(f"clip: must be a finite number > 0, got {clip!r}")
        if not isinstance(inputs, (Tensor, Fields)) or not isinstance(targets, (Tensor, Fields)):
            raise TypeError("inputs and targets must be tensors (or Fields: a dict or tuple of tensors)")
        if any(isinstance(t, Tensor) and t.dim() == 0 for t in (inputs, targets)):
            raise ValueError("inputs and targets need a leading batch dimension, got a 0-d tensor")
        if len(inputs) != len(targets):
            raise ValueError(f"inputs and targets need the same batch size, got {len(inputs)} and "
                             f"{len(targets)} records")
        if len(inputs) == 0:
            raise ValueError("empty batch: inputs and targets have no samples")
        return len(inputs)

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

    def _record(self, inputs: Tensor, targets: Tensor, point: Sequence[Tensor] | None, label: str, *,
                keep: bool = False) -> _Recording:
        """The recording at ``point``: the kept one when it describes this call, else one forward and one
        backward pass (kept for reuse when ``keep`` and ``reuse_recording``)."""
        values = [p for _, p in self._named] if point is None else _check_point(point, self._named, label)
        values = [v.detach() for v in values]
        if self._kept is not None and self._describes(self._kept, inputs, targets, values):
            return self._kept.recording
        if not (keep and self.reuse_recording):
            return self._run(inputs, targets, values)
        self._kept = None  # freed before the new recording is made
        # The recording's calls hold the parameter values: copies, which later steps cannot change.
        point_copy = [v.clone() for v in values]
        recording = self._run(inputs, targets, point_copy)
        self._kept = _Kept(recording, [(t, t._version) for t in data_leaves(inputs, targets)], point_copy,
                           self._state(), tuple(m.training for m in self.model.modules()))
        return recording

    def _state(self) -> list[tuple[Tensor, int]]:
        """The model's buffers and frozen parameters with their versions: what a recording depends on besides
        the trainable parameters and the data."""
        frozen = (p for p in self.model.parameters() if id(p) not in self._index_of)
        return [(t, t._version) for t in (*self.model.buffers(), *frozen)]

    def _describes(self, kept: _Kept, inputs: Tensor, targets: Tensor, values: list[Tensor]) -> bool:
        """Whether ``kept`` is the recording this call would make (see ``reuse_recording``)."""
        return (_unchanged(kept.data, data_leaves(inputs, targets))
                and _unchanged(kept.state, [t for t, _ in self._state()])
                and kept.modes == tuple(m.training for m in self.model.modules())
                and _same_bits(kept.point, values))

    def _batch_dim(self, layer: _Layer, output: Any, batch: int) -> int:
        """The dimension at which a call of ``layer`` carries the batch: 0, or what :meth:`_learn_layout`
        learned. Until it has run, a position-wise layer whose output does not show the batch at dimension 0
        alone (a sequence as long as the batch, or a sequence-first layout) stops the recording to learn
        it (:class:`_LayoutUnknown`)."""
        if self._batch_dims is not None:
            return self._batch_dims.get(layer, 0)
        # The last dimension of a position-wise layer's output is its features, never the batch.
        if (layer.rule.position_wise and type(output) is Tensor and output.dim() > 0
                and not (output.shape[0] == batch and batch not in output.shape[1:-1])):
            raise _LayoutUnknown
        return 0

    def _learn_layout(self, inputs: Tensor, values: list[Tensor]) -> dict[_Layer, int]:
        """Where each position-wise layer (``GhostRule.position_wise``: Linear, LayerNorm, embeddings) reads
        the batch: the one dimension of its outputs whose size follows the batch, found by running the model
        on the batch and on the batch with one more record (no gradients). Only a layer that reads it away
        from dimension 0 (a sequence-first layout, as in torch's transformer layers by default) is listed.
        A sequence as long as the batch cannot fool this, where a shape check at one batch size would read
        its positions as records. A layer whose outputs show no single such
        dimension keeps dimension 0 (and the rule's shape check). Run once, by the first recording that
        needs it (:meth:`_batch_dim`): a model whose layers all show the batch unambiguously never pays it."""
        shapes: list[dict[_Layer, list[list[int]]]] = []
        position_wise = [layer for layer in self._layers if layer.rule.position_wise]
        if not position_wise:
            return {}
        for rows in (inputs, cat([inputs, inputs[:1]])):
            seen: dict[_Layer, list[list[int]]] = {layer: [] for layer in position_wise}

            def hook_for(layer: _Layer, seen=seen):
                def hook(module: nn.Module, args: tuple, output: Any) -> None:
                    if type(output) is Tensor:
                        seen[layer].append(list(output.shape))
                return hook

            handles = [layer.module.register_forward_hook(hook_for(layer)) for layer in position_wise]
            try:
                with torch.no_grad():
                    leaves = {name: v.detach() for (name, _), v in zip(self._named, values)}
                    functional_call(self.model, leaves, *model_args(rows))
            finally:
                for h in handles:
                    h.remove()
            shapes.append(seen)
        dims: dict[_Layer, int] = {}
        for layer in position_wise:
            found = set()
            for a, b in zip(shapes[0][layer], shapes[1][layer]):
                differ = [d for d, (m, n) in enumerate(zip(a, b)) if m != n] if len(a) == len(b) else []
                found.add(differ[0] if len(differ) == 1 and b[differ[0]] == a[differ[0]] + 1 else None)
            if len(found) == 1 and (dim := found.pop()) not in (None, 0):
                dims[layer] = dim
        return dims

    def _run(self, inputs: Tensor, targets: Tensor, values: list[Tensor]) -> _Recording:
        """One forward and one backward pass at the parameter ``values``. The forward reads fresh leaves,
        never the model's own parameters: autocast caches its casts of those until its region ends, which
        would serve a later step stale weights."""
        batch = len(inputs)
        run = _Pass(batch, {layer: [] for layer in self._layers})
        try:
            with self._recording(run, values), torch.enable_grad():
                # Leaves that require gradients: every tracked output has a gradient edge.
                leaves = {name: v.detach().requires_grad_() for (name, _), v in zip(self._named, values)}
                output = functional_call(self.model, leaves, *model_args(inputs))
                # A structured output (a ModelOutput with a cache): the loss gets its per-record tensors only.
                output = tree_map(lambda t: t if _batched(t, batch) else None, output)
                losses = vmap(self.loss_fn)(output, targets)
                if tuple(losses.shape) != (batch,):
                    raise ValueError("loss_fn must return a scalar per sample; it returned shape "
                                     f"{tuple(losses.shape[1:])}")
                edges = [e for _, _, e, _ in run.pending]
                grads = (torch.autograd.grad(losses.sum(), edges, allow_unused=True)
                         if edges and losses.requires_grad else [None] * len(edges))
        except _LayoutUnknown:  # learned once, then recorded again
            relearn = True
        else:
            relearn = False
        if relearn:
            self._batch_dims = self._learn_layout(inputs, values)
            return self._run(inputs, targets, values)
        self._attach_gradients(run, grads)
        for layer, cs in run.calls.items():
            if not cs:
                raise ValueError(f"layer {layer.name!r} was not called in the forward pass, so its "
                                 "parameters get no per-sample gradient (if another module reads them, ghost "
                                 "clipping cannot see it); freeze parameters that are really unused with "
                                 "requires_grad_(False)")
            for c in cs:
                layer.rule.check(layer.name, c, batch)
        return _Recording(run.calls, _widened(losses.detach(), self._dtype))

    @contextlib.contextmanager
    def _recording(self, run: _Pass, values: list[Tensor]) -> Iterator[None]:
        """The tracked layers record their calls into ``run`` (:meth:`_recording_hook`) while the context is
        open; their hooks and replaced forwards are removed when it closes, however it closes."""
        handles = [layer.module.register_forward_hook(self._recording_hook(layer, values, run),
                                                      with_kwargs=True) for layer in run.calls]
        # Rules that record intermediate tensors run their own forward; an instance attribute shadows the
        # class's method for this pass only.
        replaced = [layer.module for layer in run.calls
                    if type(layer.rule).recording_forward is not GhostRule.recording_forward
                    and "forward" not in vars(layer.module)]
        for layer in run.calls:
            if layer.module in replaced:
                layer.module.forward = _recording_forward(layer, layer.module.forward, run.exposed)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for module in replaced:
                del module.forward

    def _recording_hook(self, layer: _Layer, values: list[Tensor], run: _Pass) -> Callable[..., Any]:
        """The forward hook that records each call of ``layer`` into ``run``: its inputs (batch-first, half
        precision widened), its parameters at ``values``, the internals its rule's forward exposed, and a
        gradient edge for each output that needs a gradient."""
        local = {attr: values[self._index_of[id(p)]] if id(p) in self._index_of else p.detach()
                 for attr, p in layer.module.named_parameters()}
        batch = run.batch

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            shared = _shared_call(args, kwargs, output, batch)
            if shared:  # one call serving every record (position ids): made a call per record
                args, kwargs = tree_map(lambda v: _per_record(v, batch), (args, kwargs))
                output = _per_record(output, batch)
            dim = self._batch_dim(layer, output, batch)
            if dim:  # a position-wise layer reading the batch at another dimension: recorded batch-first
                args, kwargs = tree_map(lambda v: _batch_first(v, dim, batch), (args, kwargs))
            if not kwargs and all(type(v) is Tensor for v in args):  # the common call, without pytrees
                flat = [v.detach() for v in args]
                recorded = (tuple(_widened(v, self._dtype) for v in flat), {})
            else:
                flat, spec = tree_flatten((args, kwargs))
                flat = [v.detach() if isinstance(v, Tensor) else v for v in flat]
                recorded = tree_unflatten([_widened(v, self._dtype) for v in flat], spec)
            outs = [output] if type(output) is Tensor else tree_flatten(output)[0]
            call = LayerCall(*recorded, [None] * len(outs), local, batch,
                             [(t, t._version) for t in flat if isinstance(t, Tensor)])
            if dim:
                run.moved[id(call)] = dim
            internals = run.exposed.pop(layer, {})
            call.internals = {name: _widened(t.detach(), self._dtype) for name, t in internals.items()
                              if name in layer.rule.internal_values}
            for k, o in [*enumerate(outs), *internals.items()]:
                if isinstance(o, Tensor) and o.requires_grad:
                    # The edge pins the gradient to this version of the output, even if a later operation
                    # modifies it in place (ReLU(inplace=True)).
                    run.pending.append((call, k, get_gradient_edge(o), _zeros_like(o)))
            run.calls[layer].append(call)
            return output if shared else None
        return hook

    def _attach_gradients(self, run: _Pass, grads: Sequence[Tensor | None]) -> None:
        """Each recorded output's (or internal's) gradient onto its call, widened from half precision and
        batch-first; zeros where the loss ignores the output."""
        for (call, k, _, zeros), g in zip(run.pending, grads):
            g = _widened(zeros() if g is None else g, self._dtype)  # None: the loss ignores it
            if id(call) in run.moved and isinstance(k, int):
                g = _batch_first(g, run.moved[id(call)], run.batch)
            if isinstance(k, str):
                call.internal_grads[k] = g
            else:
                call.grads[k] = g

    # ---- parts, factors, sums ----

    @staticmethod
    def _check_unmodified(rec: _Recording) -> None:
        for layer, cs in rec.calls.items():
            for c in cs:
                c.check_unmodified(layer.name)

    def _form_parts(self, rec: _Recording) -> None:
        """Every layer's parts at ``rec``'s point (:meth:`_gradient_parts`)."""
        self._check_unmodified(rec)
        with torch.no_grad():
            for layer in self._layers:
                self._gradient_parts(rec, layer)

    def _parts(self, rec: _Recording, rec_b: _Recording | None, a: Tensor | None,
               b: Tensor | None) -> list[tuple[int, Part]]:
        """``(parameter index, part)`` of every trainable parameter."""
        for r in (rec, rec_b) if rec_b is not None else (rec,):
            self._check_unmodified(r)
        parts: list[tuple[int, Part | Tied]] = []
        used: dict[int, list[Part]] = {}  # the parts of each shared parameter, one per module using it
        spent = 0.0  # bytes of the difference's own materialised parts
        # The second point's recording, when no later call can read it (not kept, not the first point's), may
        # have its materialised matrices overwritten by the difference: fresh ones would cost a page fault
        # per page at every round.
        disposable = rec_b is not None and rec_b is not rec and (self._kept is None
                                                                  or self._kept.recording is not rec_b)
        with torch.no_grad():
            for layer in self._layers:
                got, materialised = self._gradient_parts(rec, layer)
                if rec_b is not None:
                    if self._parts_only(layer, materialised):
                        # ``a u - b u'`` of the parts at both points (a kept recording's are formed already)
                        there = self._gradient_parts(rec_b, layer)[0]
                        got = {attr: got[attr].combine(there[attr], a, b, out=there[attr].u)
                               if disposable and isinstance(got[attr], Dense) else
                               got[attr].combine(there[attr], a, b) for attr, _ in layer.params}
                    else:  # the rule's own form, relative to the difference
                        got = self._checked(layer, layer.rule.difference(rec.calls[layer], rec_b.calls[layer],
                                                                          a, b))
                        room = cost.direct_budget_bytes() - rec.held - rec_b.held - spent
                        spent += self._difference_forms(layer, got, max(room, 0.0))
                for attr, k in layer.params:
                    part = got[attr]
                    if k in self._shared:
                        used.setdefault(k, []).append(part)
                    else:
                        parts.append((k, part))
            # A shared parameter's per-sample vector adds its modules' terms (ghost where they pair up).
            joined = [(k, shared(ps, self._named[k][1].shape)) for k, ps in used.items()]
            if rec_b is None:
                self._shared_sum_forms(joined)
            parts += joined
        # The float32 Gram form's blocks run while every part materialised at these points is held, and the
        # layers' choices each saw only the earlier layers' parts held: its scratch is capped by what the
        # memory budget leaves after all of them (read by _factors).
        held = rec.held + (rec_b.held if rec_b is not None else 0.0) + spent
        self._scratch_room = max(cost.direct_budget_bytes() - held, 0.0)
        return parts

    def _shared_sum_forms(self, joined: list[tuple[int, Part | Tied]]) -> None:
        """The clipped-sum form of each shared parameter's joined :class:`Outer` part (a Tied part's map
        too), at one point only, chosen from its shapes (:meth:`Outer.sum_choice`: all its modules' steps)
        under ``norm_form="auto"`` on the host, as a layer's own part is (:meth:`_gradient_parts`)."""
        if self.norm_form != "auto" or self.backend != "native":
            return
        for _, part in joined:
            outer = part.outer if isinstance(part, Tied) else part
            if isinstance(outer, Outer):
                outer.sum_form = outer.sum_choice()

    def _difference_forms(self, layer: _Layer, got: dict[str, Part], room: float) -> float:
        """The norm form of each :class:`Outer` part of ``layer``'s difference (its rule's own form: pieces of
        both points, twice a point's steps where the layer's input differs between them) chosen by
        :func:`cost.choose` for the difference's shapes, as a point's parts are chosen
        (:meth:`_gradient_parts`) under ``norm_form="auto"`` on the host, with ``room`` bytes of the memory
        budget left; a part chosen materialised is replaced by its per-sample matrices. Returns the bytes so
        materialised.

        Why: a Gram form's time grows with the square of the steps and the other forms' linearly, so the
        form fastest at one point may not be at the difference's doubled steps; left to ``"auto"`` here the
        kernels' memory rule would pick it, never the float32 forms. The choice reads shapes only (the
        steps as recorded, never the steps :func:`~dpvr.grads.ghost.linear.read_steps` keeps, which depend
        on the values), and every form bounds the norm of what its clipped sum writes, so it never changes
        the guarantee of :meth:`_clip`. The difference's sums stay float64 (``sum_form`` is not set here):
        see :meth:`Outer.combine`."""
        if self.norm_form != "auto" or self.backend != "native":
            return 0.0
        spent = 0.0
        for attr, _ in layer.params:
            part = got[attr]
            if not isinstance(part, Outer):
                continue
            if part.by_convolution:  # its steps are read from the recorded calls
                choice = part.choice(room - spent, difference=True)
            else:  # each piece spans a point's recorded steps
                steps, p, q = part.sizes()
                m = part.pieces[0][0]
                choice = cost.choose(m.shape[0], steps * len(part.pieces), p, q, m.element_size(),
                                     budget=room - spent, difference=True)
            self.choices[f"{layer.name}.{attr} (difference)"] = choice
            if choice.form != "materialise":
                part.norm_form = choice.form
                if choice.form == "gram32":
                    part.norm_scratch = cost.gram32_scratch(room - spent)
                continue
            matrices = part.per_sample()
            spent += matrices.numel() * matrices.element_size()
            got[attr] = Dense(matrices)
        return spent

    @staticmethod
    def _checked(layer: _Layer, got: dict[str, Part]) -> dict[str, Part]:
        for attr, _ in layer.params:
            part = got.get(attr)
            if not isinstance(part, (Outer, Rows, Dense)):
                raise TypeError(f"the ghost rule {type(layer.rule).__name__} of layer {layer.name!r} "
                                f"returned {type(part).__name__} for parameter {attr!r}, not a part")
        return got

    def _gradient_parts(self, rec: _Recording, layer: _Layer) -> tuple[dict[str, Part], bool]:
        """The parts of ``layer``'s per-sample gradient at ``rec``'s point (formed once per recording), with
        each ``Outer`` part worth materialising materialised under ``norm_form="auto"``, and whether one
        was. A layer whose parts are all that later steps read (materialised, or without a difference form
        of its own) drops its calls from the recording, so their tensors are freed."""
        if layer not in rec.parts:
            got = self._checked(layer, layer.rule.gradient(rec.calls[layer]))
            materialised = False
            for attr, _ in layer.params:
                part = got[attr]
                if self.norm_form != "auto" or not isinstance(part, Outer):
                    continue
                if self.backend == "native":
                    # By predicted time on this machine, from the shapes only, under what is left of the
                    # memory budget: materialised parts are all held until the clipped sums, so the budget
                    # bounds their total at this point (in the layers' fixed order).
                    choice = part.choice(max(cost.direct_budget_bytes() - rec.held, 0.0))
                    self.choices[f"{layer.name}.{attr}"] = choice
                    if choice.form != "materialise":
                        part.norm_form = choice.form
                        # a part at one point: its sum may form each record's float32 matrix (write_error
                        # prices it); a difference's parts never do (Outer.combine, _difference_forms)
                        part.sum_form = choice.sum_form
                        if choice.form == "gram32":  # its blocks' scratch within what is left of the budget
                            part.norm_scratch = cost.gram32_scratch(
                                max(cost.direct_budget_bytes() - rec.held, 0.0))
                        continue
                    batch, _, p, q = choice.shapes
                    rec.held += batch * p * q * choice.itemsize  # from the shapes: no unfolding
                elif not part.worth_materialising():  # off the host: the memory rule
                    continue
                got[attr], materialised = Dense(part.per_sample()), True
            rec.parts[layer] = got, materialised
            if self._parts_only(layer, materialised):
                rec.calls[layer] = []  # whatever follows reads the parts: the recorded tensors are let go
        return rec.parts[layer]

    @staticmethod
    def _parts_only(layer: _Layer, materialised: bool) -> bool:
        """Whether a difference of ``layer`` combines its parts at the two points (materialised, or a rule
        without a difference form of its own) rather than reading its recorded calls."""
        return materialised or type(layer.rule).difference is GhostRule.difference

    def _clip(self, parts: list[tuple[int, Part | Tied]], clip: float | LayerRadii, weights: Tensor | None,
              batch: int, wide: bool = False) -> tuple[Grads, Tensor]:
        """The clipped sums of ``parts`` and the norms of the samples' vectors (per group of parameters, each
        to its own radius, when ``clip`` is a :class:`~dpvr.grads.layer_clip.LayerRadii`:
        :meth:`_clip_layers`).

        The bound, in the parameters' dtype T (unit roundoff u): what is written for one sample alone (the
        sum of a batch of one) has norm at most ``clip``.

        1. Every :class:`Rows` part (a :class:`Tied` part's too) is coalesced first (:meth:`Rows.coalesced`:
           each sample's rows of one key summed into one row in T; a difference's in float64, rounded once),
           so its entries ``r`` are what will be written, and :class:`Dense` entries are written as they are.
           The norm bound ``n_i >= ||u_i||`` (native or torch ghost norms, which include their own float64
           rounding, plus a Tied part's cross term with its bound: :func:`~dpvr.grads.ghost.norms._cross`)
           is of exactly these entries, with the exact per-sample matrices of the :class:`Outer` parts'
           pieces.
        2. ``E_i`` (:func:`~dpvr.grads.ghost.norms.write_error`) bounds what an Outer part's matmul (a sum of
           ``K`` rounded terms per entry, which may cancel), a reduced-precision matmul and a Tied part's
           addition of its rows into its matmul add beyond one rounding per entry:
           ``||w_i - f_i u_i|| <= |f_i| (E_i + u ||u_i||)``, priced for the sums' float64 accumulation
           (below) and their rounding to T. The factor is formed from
           ``N_i >= n_i + E_i`` by the kernels' own rule and margin (``ops.clip_factors`` /
           ``norms.clip_factors``): ``f N_i <= C (1 - margin)`` in float64 with ``margin >= 2 u``, and the
           factor stored in T is ``f' <= f (1 + u)``.
        3. Each written entry of a Rows or Dense part is ``fl(f' r)``: ``|w_j - f' r_j| <= u f' |r_j|``
           (a Tied part's rounding is all in its ``E_i``, step 2). So
           ``||w_i|| <= f' (||u_i|| + u ||u_i|| + E_i) <= (1 + u) f' N_i <= (1 + u)^2 C (1 - 2u) < C``.

        The returned norms are the bounds ``n_i`` (times ``|w_i|``).

        Across records (the sums, :meth:`Outer.total` etc.): formed in float64 from the factors ``f'``
        widened exactly, so a record's term is ``f' u_i`` up to the float64 roundings of the matmul, and
        replacing one record moves the sum by at most ``2 clip`` plus float64 roundings of the partial sums
        (relative ``2^-53`` per addition), not float32 ones. An Outer part at one point whose sum form is
        ``"record32"`` (:mod:`~dpvr.grads.ghost.cost`) writes ``f' w_i`` with ``w_i`` record i's float32
        matrix, summed over records in float64 (:meth:`Outer._record32_total`); its ``E_i`` is priced in
        step 2 with the float32 unit (:func:`~dpvr.grads.ghost.norms.record32_error`), so each record's term
        still has norm below ``clip`` and the argument across records is the one above, unchanged: no
        accountant changes. The record32 sum and the materialised form (its per-sample matrices) form each
        record's float32 matrix by a matmul over that record's own read steps on the host
        (:meth:`Outer.per_sample`), so that it follows that record's inputs only, as the forward pass's
        per-record values are assumed to. ``wide``: return the sums in
        float64 (to be kept so until the noise is added); else they are rounded to T once.
        """
        if isinstance(clip, LayerRadii):
            return self._clip_layers(parts, clip, weights, batch, wide)
        parts, factors, norms, dirty = self._factors(parts, clip, weights, batch)
        if dirty:
            bad = torch.isnan(norms)  # factor 0, but 0 * NaN is NaN inside a matmul: clear their rows
            parts = [(k, p.drop(bad)) for k, p in parts]
        return self._sums(parts, factors.to(torch.float64), wide), norms

    def _factors(self, parts: list[tuple[int, Part | Tied]], clip: float, weights: Tensor | None,
                 batch: int) -> tuple[list[tuple[int, Part]], Tensor, Tensor, bool]:
        """Steps 1 and 2 of :meth:`_clip` for ``parts``: the coalesced parts, the factors (dtype T), the norm
        bounds ``n_i`` (NaN: a non-finite sample) and whether a sample may be non-finite."""
        dtype = self._dtype
        parts = [(k, p.coalesced() if isinstance(p, (Rows, Tied)) else p) for k, p in parts]
        if self.backend == "native":
            # The kernels measure a tied part's two parts apart; its cross term is added in torch.
            apart = [q for _, p in parts for q in ((p.rows, p.outer) if isinstance(p, Tied) else (p,))]
            outers = [p for p in apart if isinstance(p, Outer) and p.norm_form not in _TORCH_FORMS]
            chunked = [p for p in apart if isinstance(p, Outer) and p.norm_form == "chunked"]
            gram32 = [p for p in apart if isinstance(p, Outer) and p.norm_form == "gram32"]
            norms_sq = torch.empty(batch, dtype=torch.float64)
            # The same pass gives each Outer part's R_i, which write_error would otherwise measure again.
            bounds = torch.empty(len(outers), batch, dtype=torch.float64)
            ops.ghost_norms(norms_sq, outer=[p.pieces for p in outers], index=[],
                            dense=[p.u if isinstance(p, Dense) else p.flat() for p in apart
                                   if isinstance(p, (Dense, Rows))],
                            form=[p.norm_form or self.norm_form for p in outers],
                            outer_bounds=bounds if outers else None)
            known = {id(p): bounds[j] for j, p in enumerate(outers)}
            # The float32 Gram form's upper bounds (value + its priced rounding, norms.gram32_term), and R_i.
            terms32, magnitudes = torch_norms.gram32_terms(gram32, self._scratch_room)
            known.update({id(p): r for p, r in zip(gram32, magnitudes)})
            error = torch_norms.write_error(parts, batch, dtype, self._device, known=known,
                                            accumulate=torch.float64)
            norms_sq = torch_norms.with_terms(norms_sq, torch_norms.chunked_terms(chunked) + terms32)
            norms_sq = torch_norms.with_cross_terms(norms_sq, [p for _, p in parts])
            factors = torch.empty(batch, dtype=dtype)
            norms = torch.empty(batch, dtype=dtype)
            dirty = ops.clip_factors(torch_norms.with_write_error(norms_sq, error), clip, factors,
                                     columns=self._dim, weights=weights, norms=norms,
                                     nonfinite=self.nonfinite)
        else:
            error = torch_norms.write_error(parts, batch, dtype, self._device, accumulate=torch.float64)
            norms_sq = torch_norms.ghost_norms([p for _, p in parts], batch, self._device, self.norm_form)
            factors, norms = torch_norms.clip_factors(torch_norms.with_write_error(norms_sq, error), clip,
                                                      dtype, columns=self._dim, weights=weights,
                                                      nonfinite=self.nonfinite)
            dirty = True  # knowing would cost a synchronisation: clear the rows unconditionally
        if error is not None:  # report the bounds n_i of the norms, not N_i
            measured = norms_sq.sqrt()
            if weights is not None:
                measured = measured * weights.to(torch.float64).abs()
            norms = torch.where(torch.isnan(norms), norms, measured.to(dtype))
        return parts, factors, norms, dirty

    def _sums(self, parts: list[tuple[int, Part]], wide_factors: Tensor | list[Tensor], wide: bool) -> Grads:
        """Step 3 of :meth:`_clip`: every parameter's clipped sum (zeros for a parameter without a part).
        ``wide_factors``: the factors stored in T, widened to float64; per part (a list) under per-layer
        clipping."""
        dtype = self._dtype
        sums: list[Tensor | None] = [None] * len(self._named)
        # The sums over records in float64, from the factors stored in T (widened exactly): a float32 sum
        # rounds at the magnitude of its partial sums, so one record could move it by more than its clipped
        # norm (by roundings that grow with the batch); in float64 these stay below 2^-53 of the partial
        # sums. Rounded to T once, unless the caller keeps them in float64 (``wide``) until the noise.
        with torch.no_grad():
            for j, (k, p) in enumerate(parts):
                f = wide_factors[j] if isinstance(wide_factors, list) else wide_factors
                shape = self._named[k][1].shape
                pooled = type(p) in (Outer, Tied, Dense) and self.backend == "native"
                out = self._pooled(shape.numel()) if pooled else None
                total = p.total(f, shape) if out is None else p.total(f, shape, out=out)
                sums[k] = total if wide else total.to(dtype)
        zeros = torch.float64 if wide else dtype
        return [torch.zeros_like(p, dtype=zeros) if s is None else s for s, (_, p) in zip(sums, self._named)]

    def _pooled(self, numel: int) -> Tensor | None:
        """A float64 host buffer of ``numel`` entries for a part's clipped sum, or None (a fresh one).

        Why: the C library gives a large buffer new pages at most allocations (mapped afresh, or after
        trimming its heap), so every step's float64 sum of a large linear map was written to new pages, one
        page fault each: a quarter of the time of the wide MLP's 64 MiB float64 sum (47 of 178 ms), half of
        GPT-2 small's clipped sums (18 MiB each) at B = 2. A
        buffer is written again only when nothing outside the pool refers to its memory (the caller has
        dropped the previous sum and every view of it), so a sum still held is never overwritten; a model
        with several maps of one size (a transformer's blocks) keeps one buffer per map, and no more: a
        caller that still holds the previous sums gets fresh ones. Between steps the pool holds the float64
        sums of the large parameters (8 bytes per parameter, which every step needs at once anyway), up to
        :data:`POOL_BYTES`. (Per-sample matrices are not pooled: kept between the rounds of GPT-2 14M, they
        spared their own page faults at T = 128, a DIFF2 round 942 -> 902 ms, but the recording then took
        new pages instead, and at T = 512 the round went from 3.81 to 4.42 s.)"""
        if numel * 8 < POOLED_BYTES or _storage_uses is None:
            return None
        buffers = self._pool.setdefault(numel, [])
        for held in buffers:
            if _storage_uses(held) == _FREE_USES:
                return held
        if len(buffers) == sum(p.numel() == numel for _, p in self._named):
            return None  # every one is held (a caller keeping the previous sums): a fresh one
        if 8 * (numel + sum(b.numel() for held in self._pool.values() for b in held)) > POOL_BYTES:
            return None
        buffers.append(torch.empty(numel, dtype=torch.float64))
        return buffers[-1]

    def _clip_layers(self, parts: list[tuple[int, Part | Tied]], radii: LayerRadii, weights: Tensor | None,
                     batch: int, wide: bool) -> tuple[Grads, Tensor]:
        """Per-layer clipping: each group of ``radii`` clipped on its own to its radius, by
        :meth:`_factors` on the group's parts alone, so record i's terms in group l are its group vector
        times a factor ``f_il`` and have norm at most ``C_l`` (the bound of :meth:`_clip`, step 3, holds per
        group). A record that is not finite in one group contributes nothing to any group (the non-finite
        policy drops the record, not a part of it). The norms returned are ``sqrt(sum_l n_il^2)``, the
        whole per-record gradient's."""
        radii.check_covers(len(self._named))
        group_of = {k: g for g, ks in enumerate(radii.groups) for k in ks}
        by_group: list[list[tuple[int, Part | Tied]]] = [[] for _ in radii.groups]
        for k, p in parts:
            by_group[group_of[k]].append((k, p))
        formed, factors, norms_sq, dirty = [], [], None, False
        for group, radius in zip(by_group, radii.radii):
            if not group:
                continue
            got, f, n, d = self._factors(group, radius, weights, batch)
            formed.append(got)
            factors.append(f)
            dirty = dirty or d
            square = n.to(torch.float64) ** 2
            norms_sq = square if norms_sq is None else norms_sq + square
        assert norms_sq is not None  # every trainable parameter has a part
        norms = norms_sq.sqrt().to(self._dtype)  # NaN where any group was not finite
        flat: list[tuple[int, Part]] = []
        flat_factors: list[Tensor] = []
        bad = torch.isnan(norms) if dirty else None
        for got, f in zip(formed, factors):
            wide_f = f.to(torch.float64)
            if bad is not None:
                wide_f = torch.where(bad, torch.zeros_like(wide_f), wide_f)
                got = [(k, p.drop(bad)) for k, p in got]
            flat += got
            flat_factors += [wide_f] * len(got)
        return self._sums(flat, flat_factors, wide), norms
