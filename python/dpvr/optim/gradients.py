"""Clipped sums of per-sample gradients and of same-sample gradient differences, for the algorithms.

The algorithms ask for "the clipped sum over these samples at this point" and never see per-sample
gradients; this module decides how to compute it: ghost clipping (:class:`dpvr.grads.GhostClipper`, no
per-sample gradient tensor; unsupported layers fall back to materialised gradients in the same step) where
the model allows, materialised per-sample gradients and the fused kernels otherwise.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .. import ops
from ..grads import (
    GhostClipper,
    as_inputs,
    clip_dtype,
    per_sample_grads,
    per_sample_grads_at_two_points,
    trainable_parameters,
)
from ..grads.fields import call
from ..grads.layer_clip import LayerRadii
from ..problems import LossFn

MODES = ("auto", "ghost", "materialised")


def accumulators(like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zeroed float64 buffers shaped like ``like`` (flat parameters), for a clipped sum over records that is
    kept in float64 until the noise is added (:func:`dpvr.ops.noisy_update` takes a float64 sum beside
    float32 values).

    Why: a sum of ``B`` clipped terms rounded to float32 is off by up to half a unit in the last place of
    its entries, which are up to ``B C``; replacing one record then moves the rounded sum by ``2C`` plus
    those units (about ``2C + 2^-24 B C``: 2.0078C at ``B = 10^5``), more than the accountant prices. In
    float64 the sum's roundings stay below ``2^-53`` of its partial sums, and the release rounds to float32
    only after the noise is added (post-processing)."""
    return [torch.zeros_like(t, dtype=torch.float64) for t in like]


def _wide(out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Float64 accumulators for a sum into ``out``: ``out``'s own tensors where they are float64, else fresh
    zeros, added to ``out`` once by :func:`_flush`."""
    return [o if o.dtype == torch.float64 else torch.zeros_like(o, dtype=torch.float64) for o in out]


def _flush(wide: Sequence[torch.Tensor], out: Sequence[torch.Tensor], replace: bool = False) -> None:
    for o, w in zip(out, wide):
        if w is o:
            continue
        if replace:
            o.copy_(w)  # one rounding to out's dtype
        else:
            o.add_(w)


def finite_records(values: torch.Tensor, policy: str, what: str) -> tuple[torch.Tensor, int]:
    """``values`` (one row per record) with every row holding a non-finite entry zeroed, and their count.

    The policy of the clip kernels, for released values computed outside them (Recursive-SPIDER's ``s``,
    the phased solvers' per-sample operators):
    under ``"zero"`` such a record contributes nothing, so it cannot move a release by more than the
    sensitivity; under ``"raise"`` it raises :class:`dpvr.ops.NonFiniteError` naming ``what``.
    """
    rows = values.reshape(len(values), -1)
    bad = ~torch.isfinite(rows).all(dim=1)
    count = int(bad.sum())
    if count and policy == "raise":
        raise ops.NonFiniteError(f"{what}: {count} record(s) have non-finite values")
    if count:
        values = torch.where(bad.view(-1, *([1] * (values.dim() - 1))), torch.zeros_like(values), values)
    return values, count


_LOSS_CONTRACT = (
    "loss_fn gets one sample without its batch dimension and must return its loss as a 0-d tensor: reduce "
    "an unreduced loss (e.g. .sum() of reduction='none'), and for a batched criterion use dpvr.make_private "
    "or wrap it: lambda o, t: criterion(o[None], t[None])"
)


def check_loss(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """Raises ``ValueError`` naming ``loss_fn`` unless it returns a scalar for one sample.

    The algorithms evaluate ``loss_fn(output, target)`` per sample (vmapped): a loss that keeps a dimension
    (a criterion with ``reduction="none"``, an output and a target of different shapes that broadcast)
    would otherwise fail deep inside a step, in ``vmap`` or ``torch.func.grad``, with a message that names
    neither. Checked once, on the first record at the model's current parameters, without gradients; the
    model's output for it is taken without its batch dimension, as the algorithms do. The error reads a
    private record: it is a diagnostic for the data holder, not a release.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (output, target) -> loss, got "
                        f"{type(loss_fn).__name__}")
    inputs, targets = as_inputs(inputs), as_inputs(targets)
    if len(inputs) == 0 or len(targets) == 0:
        raise ValueError("inputs, targets: no record to check loss_fn on")
    clip_dtype(trainable_parameters(model))  # a half-precision model is refused with its fix, not run here
    with torch.no_grad():
        output = tree_map(lambda t: t[0] if isinstance(t, torch.Tensor) else t, call(model, inputs[:1]))
        target = targets[0]
        shapes = tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else t, (output, target))
        seen = f"output shape {shapes[0]}, target shape {shapes[1]}"
        try:
            loss = loss_fn(output, target)
        except Exception as err:  # the user's function: say which call failed and what it was given
            raise ValueError(f"loss_fn: raised {type(err).__name__} on one sample ({seen}): {err}. "
                             f"{_LOSS_CONTRACT}") from err
    if not isinstance(loss, torch.Tensor):
        got = type(loss).__name__
    elif loss.dim() != 0 or not loss.is_floating_point():
        got = f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
    else:
        return
    raise ValueError(f"loss_fn: expected a 0-d floating-point tensor (shape ()) for one sample ({seen}), "
                     f"got {got}. {_LOSS_CONTRACT}")


class ClippedGradients:
    """Per-sample clipping for one model and per-sample loss (``loss_fn(output, target)`` on one sample).

    Every sum adds, for each sample, a vector of L2 norm at most ``clip`` (both paths use the native clip
    rule, which holds after rounding). Sums over records (and over micro-batches) are accumulated in
    float64 on every path and added to ``out`` once; give float64 ``out`` buffers (:func:`accumulators`)
    to keep them so until the noise is added, which a float32 model's release needs for its sensitivity
    to hold (see :func:`accumulators`). A sample whose gradient or weight is not finite follows ``nonfinite``:
    ``"zero"`` (it contributes nothing, which keeps the sensitivity bound) or ``"raise"``
    (:class:`dpvr.ops.NonFiniteError` before anything is written; the error itself reveals that such a
    record exists, so it is for debugging, not for private runs). When every sample of one sum is dropped,
    a ``RuntimeWarning`` says so, once per instance (the algorithm's): that release is noise alone, which
    usually means NaN or infinite data or a loss that overflows. Like the ``nonfinite`` counts the
    algorithms report, it is a diagnostic for the data holder, computed without noise. On a CUDA device the
    ghost path's count is a 0-d int64 device tensor, read only when the caller reads it (no host
    synchronisation per step); the warning then comes from a copy to pinned host memory checked, without
    waiting, at later sums (a step or a few after the one that dropped its batch). ``mode`` says which
    path is used: ``"ghost"``, ``"mixed"`` (ghost with fallback layers) or ``"materialised"``.

    Precision: the trainable parameters must be float32 or float64 (half-precision parameters are refused
    here, with the fix). Half-precision activations are supported through ``torch.autocast``: called inside
    an autocast region (``with torch.autocast("cuda", dtype=torch.bfloat16): algorithm.step()``), the
    model's forward and backward run in half precision while per-sample gradients, their norms and the
    clipped sums are formed in the parameters' dtype, so ``out`` accumulates in float32 and the clip bound
    holds as in full precision.

    ``chunk_size``: records per micro-batch (the physical batch) in every mode; the clipped sums of the
    micro-batches add up to the batch's. Under ``nonfinite="raise"`` the error then stops the sum at the
    first micro-batch with such a record, after the earlier ones were added to ``out`` (the algorithms
    release nothing from a sum that raised).

    ``reuse_recording`` (ghost and mixed modes): keep the latest point's recording and use it again when a
    later sum asks for the same records at the same point (see :class:`dpvr.grads.GhostClipper`), as a
    full-batch difference round does for the previous iterate.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        mode: str = "auto",
        chunk_size: int | None = None,
        nonfinite: str = "zero",
        reuse_recording: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"grad_mode: must be one of {MODES}, got {mode!r}")
        clip_dtype(trainable_parameters(model))  # half-precision parameters: refused here, with the fix
        self.model, self.loss_fn, self.chunk_size = model, loss_fn, chunk_size
        self.nonfinite = ops.check_nonfinite(nonfinite)
        self._warned = False
        # Device counts on their way to the host for the all-dropped warning: (pinned copy, event, batch).
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event, int]] = []
        # Ghost clipping runs where the parameters are: native kernels on the host, torch on CUDA.
        self._ghost = (GhostClipper(model, loss_fn, nonfinite=nonfinite, reuse_recording=reuse_recording)
                       if mode != "materialised" else None)
        self.mode = self._ghost.mode if self._ghost is not None else "materialised"

    def sum(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        clip: float | LayerRadii,
        out: Sequence[torch.Tensor],
        point: Sequence[torch.Tensor] | None = None,
        norms: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        losses: torch.Tensor | None = None,
        *,
        replace: bool = False,
    ) -> int | torch.Tensor:
        """``out += sum_i clip_C(w_i grad l(point; z_i))`` (``weights`` ``w`` scale before the norm; default
        1), or ``out = ...`` with ``replace`` (which spares the caller a pass zeroing ``out``); returns the
        number of non-finite samples. ``norms`` and ``losses``, when given, receive each
        sample's gradient norm and loss (from the pass that formed the sum: no extra work). ``clip`` may be a
        :class:`~dpvr.grads.layer_clip.LayerRadii` (per-layer clipping, on both paths: each group of
        parameters clipped to its own radius, a sample's whole term then of norm at most ``clip.total``;
        ``norms`` are the whole per-sample gradients'). On a CUDA device
        the count of the ghost path is a 0-d device tensor (see the class)."""
        inputs, targets = as_inputs(inputs), as_inputs(targets)
        if len(inputs) == 0:
            for o in out if replace else ():
                o.zero_()
            return 0
        acc = _wide(out)
        if self._ghost is not None:
            dropped = 0
            parts = self._micro_batches(inputs, targets, weights, norms, losses)
            for k, (x, t, w, n, loss) in enumerate(parts):
                result = self._ghost.clipped_sum(x, t, clip, weights=w, params=point, wide=True)
                dropped += self._add(result.sums, result.norms, acc, n, replace=replace and k == 0)
                if loss is not None:
                    loss.copy_(result.losses)
            _flush(acc, out, replace)
            return self._dropped(dropped, len(inputs))
        grads, each = per_sample_grads(
            self.model, self.loss_fn, inputs, targets, params=point, chunk_size=self.chunk_size,
            return_loss=True,
        )
        if losses is not None:
            losses.copy_(each)
        for a, o in zip(acc, out) if replace else ():
            if a is o:  # the kernels accumulate
                a.zero_()
        if isinstance(clip, LayerRadii):
            count = self._clip_layers(grads, clip, acc, weights, norms)
        else:
            count = ops.clip_accumulate(grads, clip, acc, weights=weights, norms=norms,
                                        nonfinite=self.nonfinite)
        _flush(acc, out, replace)
        return self._dropped(int(count), len(inputs))

    def _clip_layers(self, grads: Sequence[torch.Tensor], radii: LayerRadii, acc: Sequence[torch.Tensor],
                     weights: torch.Tensor | None, norms: torch.Tensor | None) -> int:
        """Per-layer clipping of materialised per-sample gradients: each group of ``radii`` clipped on its
        own by the fused kernel (so record i's terms in group l have norm at most ``C_l`` after rounding),
        after every record that is not finite in some group has been dropped from all of them (the policy
        drops the record, not a part of it). ``norms`` receives ``sqrt(sum_l ||w_i g_il||^2)``."""
        radii.check_covers(len(grads))
        batch = len(grads[0])
        bad = torch.zeros(batch, dtype=torch.bool, device=grads[0].device)
        for g in grads:
            bad |= ~torch.isfinite(g.reshape(batch, -1)).all(dim=1)
        if weights is not None:
            bad |= ~torch.isfinite(weights)
        count = int(bad.sum())
        if count and self.nonfinite == "raise":
            raise ops.NonFiniteError(f"per-layer clipping: {count} sample(s) have non-finite gradients")
        if count:  # dropped from every group; their norms are reported as NaN
            grads = [torch.where(bad.view(-1, *([1] * (g.dim() - 1))), torch.zeros_like(g), g) for g in grads]
            if weights is not None:
                weights = torch.where(bad, torch.zeros_like(weights), weights)
        squares = torch.zeros(batch, dtype=torch.float64, device=grads[0].device)
        for group, radius in zip(radii.groups, radii.radii):
            part = torch.empty(batch, dtype=grads[0].dtype, device=grads[0].device)
            ops.clip_accumulate([grads[k] for k in group], radius, [acc[k] for k in group], weights=weights,
                                norms=part, nonfinite=self.nonfinite)
            squares += part.to(torch.float64) ** 2
        if norms is not None:
            whole = squares.sqrt()
            norms.copy_(torch.where(bad, torch.full_like(whole, math.nan), whole))
        return count

    def diff_sum(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        point: Sequence[torch.Tensor],
        previous: Sequence[torch.Tensor],
        clip: float,
        out: Sequence[torch.Tensor],
        a: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
    ) -> int | torch.Tensor:
        """``out += sum_i clip_C(a_i grad l(point; z_i) - b_i grad l(previous; z_i))``, the same sample at
        both points (per-sample scalars ``a``, ``b`` default to 1)."""
        inputs, targets = as_inputs(inputs), as_inputs(targets)
        if len(inputs) == 0:
            return 0
        acc = _wide(out)
        if self._ghost is not None:
            dropped = 0
            for x, t, a_rows, b_rows in self._micro_batches(inputs, targets, a, b):
                result = self._ghost.clipped_diff_sum(x, t, list(point), list(previous), clip, a=a_rows,
                                                      b=b_rows, wide=True)
                dropped += self._add(result.sums, result.norms, acc, None)
            _flush(acc, out)
            return self._dropped(dropped, len(inputs))
        now, before = per_sample_grads_at_two_points(
            self.model, self.loss_fn, inputs, targets, list(point), list(previous), chunk_size=self.chunk_size
        )
        count = ops.clip_accumulate_diff(now, before, clip, acc, a=a, b=b, nonfinite=self.nonfinite)
        _flush(acc, out)
        return self._dropped(int(count), len(inputs))

    def batch_mean(self, losses: torch.Tensor | None, count: int) -> tuple[int, torch.Tensor | None]:
        """The batch's size and mean per-record loss (a 0-d tensor; None without losses or records), from
        the records this engine saw: a diagnostic of the data holder, never released."""
        if losses is None or count == 0:
            return count, None
        return count, losses.detach().mean()

    def rows(self, values: torch.Tensor, clip: float, out: Sequence[torch.Tensor]) -> int:
        """``out += sum_i clip_C(values_i)`` for per-record vectors computed outside the model's gradients (a
        minimax problem's y-gradients, the SPIDERs' per-record scalars and same-record scalar differences:
        one row per record), under the same ``nonfinite`` policy; returns the number of non-finite rows. A
        sum over the batch like the others, so an engine that all-reduces its sums across processes makes
        it the whole batch's."""
        if len(values) == 0:
            return 0
        acc = _wide(out)
        count = int(ops.clip_accumulate([values], clip, acc, nonfinite=self.nonfinite))
        _flush(acc, out)
        return count

    def clamped_diff_sum(self, now: torch.Tensor, before: torch.Tensor, low: float, high: float,
                         out: Sequence[torch.Tensor], weight: float = 1.0) -> int:
        """``out[0] += sum_i clamp(now_i) - weight clamp(before_i)``, each per-record scalar clamped into
        ``[low, high]`` (Recursive-SPIDER's STORM term: one record's inner value at two points), so each
        record's term lies in ``[low - weight high, high - weight low]``. A record with a non-finite value at
        either point follows the ``nonfinite`` policy (under ``"zero"`` it contributes nothing); returns
        their number. A sum over the records given, so an engine that all-reduces it makes it the whole
        batch's: a process holding none of them adds exactly zero."""
        if len(now) == 0:
            return 0
        pair, count = finite_records(torch.stack([now, before], dim=1), self.nonfinite,
                                     "a clamped difference of per-record values")
        clamped_now, clamped_before = pair.clamp(low, high).to(torch.float64).unbind(1)
        out[0].add_((clamped_now - weight * clamped_before).sum())  # summed over records in float64
        return count

    def _micro_batches(self, *rows: torch.Tensor | None) -> Iterator[tuple[torch.Tensor | None, ...]]:
        """``rows`` (per-record tensors, or None) a micro-batch at a time: ``chunk_size`` records, so that the
        recorded activations and output gradients (the step's peak memory) are a micro-batch's. Each
        record's term is clipped on its own, so the sum over micro-batches is the batch's clipped sum (up to
        the order of float additions). A single micro-batch is the tensors themselves, not views of them: a
        recording kept for reuse is recognised by its tensors."""
        batch = len(rows[0])
        size = self.chunk_size or batch
        if size >= batch:
            yield rows
            return
        for start in range(0, batch, size):
            yield tuple(None if r is None else r[start : start + size] for r in rows)

    def _dropped(self, count: int | torch.Tensor, batch: int) -> int | torch.Tensor:
        """``count``, after warning (once) when it is the whole batch. A host count is checked at once and
        returned as an int. A device count (a 0-d tensor) is returned as it is, and reading it is the
        caller's choice: the check reads a non-blocking copy in pinned host memory once its event has
        completed, at this or a later call, so that no step waits for the device."""
        if isinstance(count, torch.Tensor) and count.device.type == "cuda":
            self._check_pending()
            if not self._warned:
                host = torch.empty((), dtype=count.dtype, pin_memory=True)
                host.copy_(count, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending.append((host, event, batch))
            return count
        count = int(count)
        self._warn_if_all(count, batch)
        return count

    def _check_pending(self) -> None:
        """Reads the device counts whose copies have arrived (never waits for one that has not)."""
        while self._pending and self._pending[0][1].query():
            host, _, batch = self._pending.pop(0)
            self._warn_if_all(int(host), batch)
        if self._warned:
            self._pending.clear()

    def _warn_if_all(self, count: int, batch: int) -> None:
        if count == batch and not self._warned:
            self._warned = True
            warnings.warn(
                f"all {batch} samples of a clipped sum had non-finite gradients and were dropped "
                f"(nonfinite={self.nonfinite!r}: such a sample contributes zero), so this release is noise "
                "alone; check the data and the loss for NaN or infinite values (nonfinite='raise' stops at "
                "the first such sample while debugging). Shown once per algorithm.",
                RuntimeWarning,
                stacklevel=4,
            )

    @staticmethod
    def _add(sums, sample_norms, out, norms, *, replace: bool = False) -> int | torch.Tensor:
        """Adds a micro-batch's sums to ``out`` (writes them there, with ``replace``); its non-finite count
        (NaN norms): an int on the host, a 0-d device tensor on a device (reading it would wait for it)."""
        for o, s in zip(out, sums):
            if replace:
                o.copy_(s.reshape(-1))
            else:
                o.add_(s.reshape(-1))
        if norms is not None:
            norms.copy_(sample_norms)
        count = torch.isnan(sample_norms).sum()
        return count if count.device.type == "cuda" else int(count)
