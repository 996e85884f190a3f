"""Record independence, checked before a private run starts.

Per-sample clipping bounds one record's influence on a release by ``C`` only if (1) the forward pass treats
records independently, in the mode the model trains in, (2) it writes nothing derived from the records into
the model outside the parameters the noise covers, and (3) the per-sample gradients dpvr forms are the
records' gradients: every use of every trainable parameter counted, the batch dimension read correctly in
every layer. :func:`check_model` refuses a model that breaks one of them, naming the module and the fix:

1. modules refused whatever the data (:func:`dpvr.trainer.validation.validate`), all listed at once;
2. buffer or parameter writes in the forward pass, in training and in evaluation mode, seen on a copy of
   the model, so the user's model is never touched;
3. independence in both modes, on the probe and on synthetic records (random, of the probe's shape, dtype
   and range, from a public seed): in evaluation mode, each record's output in a batch must equal its output
   alone; in training mode, each record's output must not change when *other* records of the batch are
   replaced by synthetic ones (several swaps, one of them a wholly synthetic batch), with the random number
   generators reset between the two passes so that dropout draws the same masks (the same shapes draw the
   same numbers);
4. the gradient oracle, on a copy in evaluation mode at two batch sizes: the per-sample gradient norms and
   sums of the gradient engine the run will use must match ordinary autograd on one record at a time. This
   catches what a ghost rule misses (a parameter used outside its module, as in a tied output head, whose
   gradient term a hook-based rule never sees) and a sequence-first layer read as batch-first (a batch size
   equal to the sequence length passes the engine's shape check, so two batch sizes are probed). Where the
   ghost path fails it and materialised per-sample gradients (which differentiate each record alone, so
   any parameter use and any layout) pass, ``grad_mode="auto"`` falls back to them with a warning.

Every pass runs in exact float32: autocast off and no TF32 in matrix products or convolutions, whatever the
caller has enabled. The checks test structure (which records an output reads), and at reduced precision a
record's output in a batch and alone already differ by rounding (cuDNN picks its algorithm by batch size:
TF32 convolutions of a GroupNorm ResNet-18 differed by more than the checks' tolerance on a GPU), which
would refuse an independent model. The training steps keep the caller's precision.

Like every construction-time check these read a few private records (the probe); their errors are
diagnostics for the data holder, not releases.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from ..grads import Fields, as_inputs, trainable_parameters
from ..grads.fields import call, cat
from ..optim.gradients import ClippedGradients
from .validation import refuse_invalid

PROBE = 16  # records read by the checks
_SEED = 20261126  # the generators' state for the paired training-mode passes (any fixed value)
_UNCLIPPED = 1e30  # a clip radius no gradient of the probe reaches


def check_model(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor | None = None,
    loss: Callable[[Tensor, Tensor], Tensor] | None = None,
    *,
    grad_mode: str = "auto",
) -> str:
    """Runs the checks of the module documentation on the probe records ``inputs`` (and ``targets``);
    returns the gradient mode the run may use (``grad_mode``, or ``"materialised"`` where ``"auto"`` had to
    fall back). Without ``loss`` the gradient oracle is skipped (the minimax problems form their own
    per-sample losses). ``inputs`` may be :class:`~dpvr.grads.Fields` (a dict or tuple of tensors per
    record): each field is the record's own, replaced field by field in the synthetic records."""
    inputs = as_inputs(inputs)
    refuse_invalid(model)
    probe = copy.deepcopy(model)
    with exact_float32():
        for training in (True, False):
            probe.train(training)
            _check_no_writes(probe, inputs[:8], training)
        _check_independent(probe, inputs)
        if loss is None or targets is None:
            return grad_mode
        probe.eval()
        return _check_gradients(probe, loss, inputs, targets, grad_mode)


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Autocast off on every device, float32 matrix products at full precision (no TF32 or bfloat16 passes)
    and no TF32 in cuDNN convolutions; the caller's settings restored on exit, exactly (the checks'
    precision: see the module documentation). Set through torch's legacy settings, or through its
    per-backend ones (``torch.backends.*.fp32_precision``, torch 2.9 on) where the caller uses those (torch
    then refuses the legacy getters)."""
    cudnn = torch.backends.cudnn
    try:
        saved: str | list[str] = torch.get_float32_matmul_precision()
        settings: list = []
    except RuntimeError:
        backends = torch.backends
        settings = [backends.cuda.matmul, backends.cudnn.conv, backends.mkldnn.matmul, backends.mkldnn.conv]
        saved = [b.fp32_precision for b in settings]
    try:
        if settings:
            for b in settings:
                b.fp32_precision = "ieee"
            legacy_conv = contextlib.nullcontext()
        else:
            torch.set_float32_matmul_precision("highest")
            legacy_conv = cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                                      deterministic=cudnn.deterministic, allow_tf32=False)
        with legacy_conv, torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            yield
    finally:
        if settings:
            for b, value in zip(settings, saved):
                b.fp32_precision = value
        else:
            torch.set_float32_matmul_precision(saved)


# ---- 2. writes --------------------------------------------------------------------------------------------


def _check_no_writes(model: nn.Module, x: Tensor | Fields, training: bool) -> None:
    def state() -> dict[str, tuple[int, int]]:
        tensors = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        return {k: (id(t), t._version) for k, t in tensors.items() if t is not None}

    before = state()
    with torch.no_grad():
        call(model, x)
    after = state()
    written = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if written:
        shown = ", ".join(f"{k} ({_owner(model, k)})" for k in written)
        raise ValueError(
            f"module: its forward pass in {'training' if training else 'evaluation'} mode writes {shown}: "
            "what it writes is computed from private records and would be released with the model without "
            "noise; compute such state from public data, or stop the module from updating it "
            "(e.g. track_running_stats=False)"
        )


def _owner(model: nn.Module, name: str) -> str:
    path = name.rpartition(".")[0]
    return f"in {type(model.get_submodule(path)).__name__} {path!r}" if path else "of the model"


# ---- 3. independence --------------------------------------------------------------------------------------


def _check_independent(model: nn.Module, inputs: Tensor | Fields) -> None:
    if len(inputs) < 2:
        return
    x = inputs[:8]
    synthetic = [_synthetic(model, x, k) for k in range(3)]  # public records: the probe's shape and range
    model.eval()
    for batch in (x, synthetic[0]):
        with torch.no_grad():
            batched = _leaves(call(model, batch), len(batch))
            alone = [_leaves(call(model, batch[i : i + 1]), 1) for i in range(len(batch))]
        for k, leaf in enumerate(batched):
            joined = torch.cat([a[k] for a in alone]) if all(len(a) > k for a in alone) else None
            if joined is not None and joined.shape == leaf.shape and not _close(leaf, joined):
                raise ValueError(_MIXES.format(
                    mode="evaluation",
                    how="its output in a batch differs from its output alone (batch statistics, e.g. "
                    "x - x.mean(0)?)",
                ))
    # Training mode: the first half of a batch keeps its records while the second half is replaced, with the
    # generators in the same state (dropout draws the same masks). The replacements are synthetic, never
    # other private records: identical or degenerate private records (all-zero features, a constant
    # column) would leave batch statistics unchanged and let a mixing module pass. Several swaps: private
    # records kept with their own others replaced, private records kept between two synthetic halves, and a
    # wholly synthetic batch, so the check does not rest on any property of the private data.
    half = max(1, len(x) // 2)
    swaps = [
        (x[:half], x[half:], synthetic[1][half:]),
        (x[:half], synthetic[1][half:], synthetic[2][half:]),
        (synthetic[0][:half], synthetic[1][half:], synthetic[2][half:]),
    ]
    model.train()
    for kept, before, after in swaps:
        with torch.no_grad():
            first = _leaves(_seeded(model, cat([kept, before])), len(x))
            second = _leaves(_seeded(model, cat([kept, after])), len(x))
        for a, b in zip(first, second):
            if a.shape == b.shape and not _close(a[:half], b[:half]):
                raise ValueError(_MIXES.format(
                    mode="training",
                    how="its output changes when other records of its batch are replaced (batch statistics?)",
                ))


def _synthetic(model: nn.Module, like: Tensor | Fields, k: int) -> Tensor | Fields:
    """``len(like)`` random records of ``like``'s shape, dtype and device from a fixed public seed (the
    ``k``-th set): floating values uniform over the probe's range (widened to ``[lo - 1, hi + 1]`` where the
    probe is constant, so that they always differ from it), integers (tokens) uniform over the probe's range
    up to the smallest vocabulary of the model's embeddings, booleans fair coins. Structured records
    (:class:`~dpvr.grads.Fields`: ``input_ids``, ``attention_mask``, ...): every field so, each from its own
    seed and over its own range, except that an integer field whose probe is all 0 and 1 (an attention mask,
    token types) is drawn as fair 0/1 coins rather than widened to the vocabulary, which it does not index."""
    if isinstance(like, Fields):
        return Fields._unchecked(like.names, [
            _coins(t, k + 7919 * (j + 1)) if _binary(t) else _synthetic(model, t, k + 7919 * (j + 1))
            for j, t in enumerate(like.tensors)])
    g = torch.Generator().manual_seed(_SEED + 1 + k)
    if like.dtype == torch.bool:
        return (torch.rand(like.shape, generator=g) < 0.5).to(like.device)
    if like.is_floating_point():
        finite = like[torch.isfinite(like)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (-1.0, 1.0)
        if hi - lo <= 1e-6 * (1 + abs(lo) + abs(hi)):
            lo, hi = lo - 1.0, hi + 1.0
        values = lo + (hi - lo) * torch.rand(like.shape, generator=g, dtype=torch.float64)
        return values.to(dtype=like.dtype, device=like.device)
    if like.is_complex():
        return torch.randn(like.shape, generator=g, dtype=like.dtype).to(like.device)
    lo, hi = int(like.min()), int(like.max())
    tables = (nn.Embedding, nn.EmbeddingBag)
    vocabularies = [m.num_embeddings for m in model.modules() if isinstance(m, tables)]
    top = min(vocabularies) - 1 if vocabularies else None
    if top is not None:
        hi = max(hi, top)
    if hi <= lo:  # a constant probe: widen by one token where the vocabulary allows, else below
        lo, hi = (lo - 1, lo) if top is not None and lo >= top and lo > 0 else (lo, lo + 1)
    values = torch.randint(lo, hi + 1, like.shape, generator=g, dtype=torch.int64)
    return values.to(dtype=like.dtype, device=like.device)


def _binary(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool) and t.numel() > 0 and bool(
        ((t == 0) | (t == 1)).all())


def _coins(like: Tensor, k: int) -> Tensor:
    g = torch.Generator().manual_seed(_SEED + 1 + k)
    return (torch.rand(like.shape, generator=g) < 0.5).to(dtype=like.dtype, device=like.device)


_MIXES = (
    "module: in {mode} mode, a record's output depends on the other records of its batch ({how}), so one "
    "record moves the others' gradients and clipping bounds nothing; compute such statistics per record or "
    "from public data (dpvr.validate(model) lists the usual suspects)"
)


def _seeded(model: nn.Module, x: Tensor | Fields) -> object:
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_SEED)
        return call(model, x)


def _leaves(output: object, batch: int) -> list[Tensor]:
    """The output's tensors with a leading batch dimension (structured outputs: every such leaf)."""
    return [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.dim() > 0 and len(t) == batch
            and t.is_floating_point()]


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal up to a tolerance relative to ``b``'s largest finite value; non-finite values must agree."""
    if not a.numel():
        return True
    finite = b[torch.isfinite(b)]
    scale = 1e-4 * (1 + float(finite.abs().max())) if finite.numel() else 0.0
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return bool((same | ((a - b).abs() <= scale)).all())


# ---- 4. the gradient oracle -------------------------------------------------------------------------------


def _check_gradients(model: nn.Module, loss: Callable, inputs: Tensor, targets: Tensor, mode: str) -> str:
    sizes = [k for k in (5, 3) if k <= len(inputs)] or [len(inputs)]
    truth = _alone(model, loss, inputs[: sizes[0]], targets[: sizes[0]])
    failure = _compare(model, loss, inputs, targets, sizes, truth, mode)
    if failure is None:
        return mode
    if mode == "auto" and _compare(model, loss, inputs, targets, sizes, truth, "materialised") is None:
        warnings.warn(
            f"make_private: ghost clipping does not reproduce this model's per-sample gradients ({failure}); "
            "this run uses materialised per-sample gradients instead, which are exact and slower",
            stacklevel=3,
        )
        return "materialised"
    raise ValueError(
        f"module: the per-sample gradients dpvr would clip are not the records' gradients ({failure}), so "
        "the clipping bound would not hold; "
        + ("use grad_mode='materialised' (RuntimeConfig)" if mode == "ghost" else
           "report the model: no gradient path of dpvr handles it")
    )


def _alone(model: nn.Module, loss: Callable, x: Tensor, y: Tensor) -> list[list[Tensor]]:
    """Each record's gradient, by ordinary autograd on a batch of one."""
    _, params = zip(*trainable_parameters(model))
    grads = []
    for i in range(len(x)):
        output = tree_map(lambda t: t[0] if isinstance(t, Tensor) else t, call(model, x[i : i + 1]))
        value = loss(output, y[i])
        grads.append([g if g is not None else torch.zeros_like(p) for g, p in
                      zip(torch.autograd.grad(value, params, allow_unused=True), params)])
    return grads


def _compare(model: nn.Module, loss: Callable, inputs: Tensor, targets: Tensor, sizes: list[int],
             truth: list[list[Tensor]], mode: str) -> str | None:
    """What differs between the engine's per-sample gradients and ``truth`` (None: nothing)."""
    names = [name for name, _ in trainable_parameters(model)]
    engine = ClippedGradients(model, loss, mode=mode)
    for size in sizes:
        x, y = inputs[:size], targets[:size]
        params = [p for _, p in trainable_parameters(model)]
        sums = [torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params]
        norms = torch.zeros(size, dtype=sums[0].dtype, device=sums[0].device)
        try:
            engine.sum(x, y, _UNCLIPPED, sums, norms=norms)
        except ValueError as err:  # a layer the engine cannot read per sample (e.g. sequence-first)
            return str(err)
        expected = [math.sqrt(sum(float(g.double().square().sum()) for g in one)) for one in truth[:size]]
        scale = 1e-3 * max(expected) + 1e-6
        for k, name in enumerate(names):
            want = sum(record[k].double() for record in truth[:size]).reshape(-1)
            if float((sums[k].double() - want).abs().max()) > scale:
                return (f"the summed gradient of {name!r} differs from autograd's: it is used outside the "
                        "module that owns it (a tied weight?), where no rule sees it")
        for i, (got, want) in enumerate(zip(norms.tolist(), expected)):
            if abs(got - want) > scale:
                return (f"at batch size {size}, record {i}'s gradient norm is {got:.6g}, alone it is "
                        f"{want:.6g}: a layer reads the batch dimension wrongly")
    return None
