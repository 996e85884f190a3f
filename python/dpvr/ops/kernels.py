"""Typed wrappers over the native kernels (``dpvr._C``).

Every function takes lists of arrays (one per parameter tensor; torch, numpy or cupy, CPU or CUDA), checks
them, and runs one fused kernel on the arrays' memory. On CUDA the work is queued on the caller's current
stream and nothing waits for it: values the kernels produce for the host (non-finite counts, step norms) are
returned as one-element device arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from blake3 import blake3

from .. import _C
from .arrays import CPU, ArrayView, as_matrix, cuda_stream, view
from .noise import NoiseGenerator

Array = Any  # torch.Tensor | numpy.ndarray | cupy.ndarray
NONFINITE_POLICIES = {"zero": 0, "raise": 1}


def check_nonfinite(policy: str) -> str:
    """``policy`` if it names a non-finite policy (``"zero"`` or ``"raise"``), else ``ValueError``."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite: must be one of {sorted(NONFINITE_POLICIES)}, got {policy!r}")
    return policy


def _as_list(arrays: Array | Sequence[Array], name: str) -> list[Array]:
    if isinstance(arrays, (list, tuple)):
        if not arrays:
            raise ValueError(f"{name}: at least one tensor is required")
        return list(arrays)
    return [arrays]


class _Call:
    """Collects the arrays of one kernel call and checks that they agree on dtype and device."""

    def __init__(self) -> None:
        self.dtype: str | None = None
        self.device: int | None = None
        self.framework = "numpy"
        self.wide_dtype: str | None = None  # the dtype of the sums over records (``wide`` arrays)
        self.keep: list[ArrayView] = []

    def add(self, a: Array, name: str, *, writable: bool = False, wide: bool = False) -> ArrayView:
        """``wide``: a sum over records, which may be float64 beside float32 arrays (see
        :func:`clip_accumulate`); its dtype is then recorded in :attr:`wide_dtype`."""
        v = view(a, name)
        if v.dtype not in ("float32", "float64"):
            raise TypeError(f"{name}: dtype must be float32 or float64, got {v.dtype}")
        if self.dtype is None:
            self.dtype, self.device, self.framework = v.dtype, v.device, v.framework
        elif v.dtype != self.dtype and not (wide and v.dtype == "float64"):
            what = " (a sum may be float64 or the data's dtype)" if wide else ""
            raise TypeError(f"{name}: dtype {v.dtype} differs from the other arrays' {self.dtype}{what}")
        if v.device != self.device:
            raise ValueError(
                f"{name}: on {_device_name(v.device)}, the other arrays are on {_device_name(self.device)}"
            )
        if wide:
            if self.wide_dtype not in (None, v.dtype):
                raise TypeError(f"{name}: dtype {v.dtype} differs from the other sums' {self.wide_dtype}")
            self.wide_dtype = v.dtype
        if writable and not v.writable:
            raise ValueError(f"{name}: array is read-only")
        self.keep.append(v)
        return v

    def matrix(self, a: Array, name: str) -> tuple[int, int, int, int, int]:
        v, desc = as_matrix(self.add(a, name))
        self.keep.append(v)
        return desc

    def vector(
        self, a: Array, name: str, size: int | None = None, *, writable: bool = False, wide: bool = False
    ) -> tuple[int, int]:
        v = self.add(a, name, writable=writable, wide=wide)
        if v.framework == "torch":  # torch's own answers, without a Python loop over the layout
            contiguous, count = a.is_contiguous(), a.numel()
        else:
            contiguous, count = v.is_contiguous(), v.size
        if not contiguous:
            raise ValueError(f"{name}: must be contiguous")
        if size is not None and count != size:
            raise ValueError(f"{name}: expected {size} elements, got {count} (shape {v.shape})")
        return v.address, count

    def per_sample(self, a: Array | None, name: str, batch: int, *, writable: bool = False) -> int:
        if a is None:
            return 0
        v = self.add(a, name, writable=writable)
        if len(v.shape) != 1 or v.shape[0] != batch:
            raise ValueError(f"{name}: expected shape ({batch},), got {v.shape}")
        if v.strides[0] != 1 and batch > 1:
            raise ValueError(f"{name}: must be contiguous")
        return v.address

    @property
    def stream(self) -> int:
        return cuda_stream(self.device, self.framework)

    def scalar_buffer(self, dtype: str) -> tuple[Any, int]:
        """A one-element array on the call's device for a value the kernel writes (no host sync)."""
        if self.device == CPU:
            buf = np.zeros(1, dtype=dtype)
            return buf, buf.ctypes.data
        if self.framework == "cupy":
            import cupy  # optional: only cupy arrays reach here

            buf = cupy.zeros(1, dtype=dtype)
            return buf, buf.data.ptr
        import torch  # lazily: dpvr.ops serves numpy and cupy arrays without torch

        buf = torch.zeros(1, dtype=getattr(torch, dtype), device=f"cuda:{self.device}")
        return buf, buf.data_ptr()


def _device_name(device: int | None) -> str:
    return "the host" if device == CPU else f"cuda:{device}"


def _batch_of(grads: list[Array], name: str) -> int:
    shape = view(grads[0], f"{name}[0]").shape
    if len(shape) == 0:
        raise ValueError(f"{name}[0]: per-sample arrays need a leading batch dimension")
    batch = int(shape[0])
    if batch == 0:
        raise ValueError(f"{name}: the batch is empty")
    return batch


def _clip(
    grads: Array | Sequence[Array],
    grads_prev: Array | Sequence[Array] | None,
    clip: float,
    out: Array | Sequence[Array] | None,
    first: Array | None,
    second: Array | None,
    norms: Array | None,
    nonfinite: str,
    names: tuple[str, str],
) -> Any:
    check_nonfinite(nonfinite)
    call = _Call()
    g = _as_list(grads, "grads")
    batch = _batch_of(g, "grads")
    g_desc = [call.matrix(a, f"grads[{k}]") for k, a in enumerate(g)]
    h_desc = []
    if grads_prev is not None:
        h = _as_list(grads_prev, "grads_prev")
        if len(h) != len(g):
            raise ValueError(f"grads_prev: expected {len(g)} tensors, got {len(h)}")
        h_desc = [call.matrix(a, f"grads_prev[{k}]") for k, a in enumerate(h)]
    o_desc = []
    if out is not None:
        o = _as_list(out, "out")
        if len(o) != len(g):
            raise ValueError(f"out: expected {len(g)} tensors, got {len(o)}")
        o_desc = [
            call.vector(a, f"out[{k}]", gd[2], writable=True, wide=True)
            for k, (a, gd) in enumerate(zip(o, g_desc))
        ]
    w = call.per_sample(first, names[0], batch)
    b = call.per_sample(second, names[1], batch)
    n = call.per_sample(norms, "norms", batch, writable=True)
    count, count_address = (None, 0) if call.device == CPU else call.scalar_buffer("int64")
    result = _C.clip_accumulate(
        call.device,
        0 if call.dtype == "float32" else 1,
        batch,
        g_desc,
        h_desc,
        o_desc,
        w,
        b,
        n,
        float(clip),
        NONFINITE_POLICIES[nonfinite],
        call.stream,
        count_address,
        1 if call.wide_dtype == "float64" else 0 if call.wide_dtype == "float32" else -1,
    )
    return result if count is None else count


def clip_accumulate(
    grads: Array | Sequence[Array],
    clip: float,
    out: Array | Sequence[Array],
    *,
    weights: Array | None = None,
    norms: Array | None = None,
    nonfinite: str = "zero",
) -> Any:
    """``out[k] += sum_i c_i * w_i * grads[k][i]`` with ``c_i = min(1, C / ||w_i g_i||)``.

    The norm of sample i runs over all K tensors (the global per-sample gradient norm), so each sample's total
    contribution has L2 norm at most ``clip`` — also after rounding to the output dtype.

    Accumulation: the sum over samples is formed in float64 and added to ``out`` once, on every backend.
    ``out`` may be float64 beside float32 ``grads``: that is how a float32 model keeps its clipped sum in
    float64 until :func:`noisy_update` adds the noise. A float32 ``out`` rounds the sum once per call, at
    its own magnitude: replacing one record then moves ``out`` by up to ``2 clip`` plus one unit in the
    last place of the sum's entries, which for sums over many records exceeds what the accountant prices.

    Args:
        grads: per-sample gradients, one array (or a list of K arrays, one per parameter tensor) with a
            leading batch dimension ``B``; float32 or float64, all of one dtype and device.
        clip: the clip radius ``C`` (L2, over all K tensors together).
        out: the K accumulators (contiguous, writable, each of one sample's size), added to in place;
            of ``grads``' dtype, or float64.
        weights: per-sample scales ``w_i`` (shape ``(B,)``), applied *before* the norm (DRO re-weighting);
            default 1.
        norms: receives ``||w_i g_i||`` (shape ``(B,)``), NaN for a non-finite sample; default: not written.
        nonfinite: what a non-finite sample (NaN/Inf in the gradient or weight) does: ``"zero"`` (default)
            drops it (its norm is reported as NaN), ``"raise"`` raises before writing anything.

    Returns:
        The number of non-finite samples (an int on the host; a one-element int64 array on CUDA).

    Raises:
        FloatingPointError: a non-finite sample under ``nonfinite="raise"``
            (:class:`dpvr.ops.NonFiniteError`).
        ValueError: an unknown ``nonfinite`` policy, an empty list or batch, mismatched counts or shapes,
            arrays on different devices, or a non-contiguous or read-only ``out``.
        TypeError: a dtype other than float32/float64, mixed dtypes, or an unsupported array type.
    """
    return _clip(grads, None, clip, out, weights, None, norms, nonfinite, ("weights", "b"))


def clip_accumulate_diff(
    grads: Array | Sequence[Array],
    grads_prev: Array | Sequence[Array],
    clip: float,
    out: Array | Sequence[Array],
    *,
    a: Array | None = None,
    b: Array | None = None,
    norms: Array | None = None,
    nonfinite: str = "zero",
) -> Any:
    """Clipped sum of same-sample differences ``u_i = a_i * grads[i] - b_i * grads_prev[i]``.

    The difference is formed per sample before clipping (never the difference of clipped terms), so sample
    i's contribution has norm at most ``clip``. Otherwise as :func:`clip_accumulate`.

    Args:
        grads: per-sample gradients at the current point (as in :func:`clip_accumulate`).
        grads_prev: per-sample gradients of the same samples at the previous point, one array per array
            of ``grads``, of the same shapes.
        clip: the clip radius ``C`` of each difference ``u_i``.
        out: the accumulators, added to in place (as in :func:`clip_accumulate`).
        a: per-sample weights of ``grads`` (shape ``(B,)``); default 1.
        b: per-sample weights of ``grads_prev`` (shape ``(B,)``); default 1.
        norms: receives ``||u_i||`` (shape ``(B,)``), NaN for a non-finite sample.
        nonfinite: ``"zero"`` (default) or ``"raise"``, as in :func:`clip_accumulate`.

    Returns:
        The number of non-finite samples, as :func:`clip_accumulate`.

    Raises:
        FloatingPointError: a non-finite difference under ``nonfinite="raise"``.
        ValueError: as :func:`clip_accumulate`, or ``grads_prev`` has a different number of arrays than
            ``grads``.
        TypeError: as :func:`clip_accumulate`.
    """
    return _clip(grads, grads_prev, clip, out, a, b, norms, nonfinite, ("a", "b"))


def per_sample_norms(
    grads: Array | Sequence[Array],
    norms: Array,
    *,
    grads_prev: Array | Sequence[Array] | None = None,
    weights: Array | None = None,
    b: Array | None = None,
) -> Any:
    """Writes ``||w_i g_i||`` (or ``||a_i g_i - b_i h_i||`` with ``grads_prev``; ``weights`` is ``a``) into
    ``norms``; NaN marks a non-finite sample. Nothing is clipped or accumulated.

    Args:
        grads: per-sample arrays ``g_i`` with a leading batch dimension ``B`` (as in
            :func:`clip_accumulate`); the norm runs over all of them together.
        norms: the output, shape ``(B,)``, written in place.
        grads_prev: per-sample arrays ``h_i`` of the same shapes: the norms are then of the differences.
        weights: per-sample scales ``w_i`` (``a_i`` with ``grads_prev``), shape ``(B,)``; default 1.
        b: per-sample scales ``b_i`` of ``grads_prev``, shape ``(B,)``; default 1.

    Returns:
        The non-finite count, as :func:`clip_accumulate` (non-finite samples are never raised on here).

    Raises:
        ValueError: invalid arrays (counts, shapes, devices), as :func:`clip_accumulate`.
        TypeError: unsupported dtypes or array types, as :func:`clip_accumulate`.
    """
    return _clip(grads, grads_prev, 1.0, None, weights, b, norms, "zero", ("weights", "b"))


def noisy_update(
    v: Array | Sequence[Array],
    *,
    generator: NoiseGenerator,
    stream: str,
    sigma: float,
    sum: Array | Sequence[Array] | None = None,  # noqa: A002 - the estimator's name for it
    scale: float = 1.0,
    reset: bool = False,
    params: Array | Sequence[Array] | None = None,
    params_prev: Array | Sequence[Array] | None = None,
    lr: float = 0.0,
) -> Any:
    """The noisy recursive estimator and parameter step, fused in one pass:

    ``v <- (0 if reset else v) + scale * sum + sigma * xi`` with ``xi ~ N(0, I)`` drawn from ``generator``'s
    stream ``stream`` (one draw: the stream's step counter advances by one), then, when ``params`` is given,
    ``params_prev <- params`` (if given) and ``params <- params - lr * v``.

    Args:
        v: the estimator, one contiguous writable array or a list (one per parameter tensor), updated in
            place.
        generator: the :class:`~dpvr.NoiseGenerator` that draws ``xi``.
        stream: the name of the generator's noise stream to draw from.
        sigma: the noise standard deviation (absolute, not a multiplier); ``>= 0``, ``0`` draws nothing.
        sum: the (clipped) signal added, one array per array of ``v``, of ``v``'s dtype or float64 (a float32
            model's sum over records kept in float64: ``v + scale * sum + sigma * xi`` is formed in float64
            and rounded once, after the noise); default: none.
        scale: the factor on ``sum`` (e.g. ``1 / b`` for a batch mean); default 1.
        reset: start from zero instead of ``v`` (a refresh); default ``False``.
        params: the parameters, stepped in place by ``-lr * v``; default: no step.
        params_prev: receives the parameters before the step (needs ``params``).
        lr: the step size of the parameter step; default 0.

    Returns:
        ``||params_new - params_old||`` (a float on the host, a one-element float64 array on CUDA), or
        ``None`` without ``params``. That norm is a function of released iterates only, which is what lets
        a difference round use it as its next clip radius.

    Raises:
        ValueError: a non-finite ``sigma``, ``scale`` or ``lr``, a negative ``sigma``, ``params_prev``
            without ``params``, mismatched array counts or sizes, read-only or non-contiguous arrays, or a
            bound generator drawing for device arrays outside a named release
            (:meth:`NoiseGenerator.for_release`).
        TypeError: ``generator`` is not a :class:`~dpvr.NoiseGenerator`, or an unsupported dtype or array.
        RuntimeError: the generator's stream has used all its steps.
    """
    call = _Call()
    vs = _as_list(v, "v")
    v_desc = [call.vector(a, f"v[{k}]", writable=True) for k, a in enumerate(vs)]
    sizes = [d[1] for d in v_desc]

    def vectors(arrays: Any, name: str, writable: bool = False, wide: bool = False) -> list[tuple[int, int]]:
        if arrays is None:
            return []
        lst = _as_list(arrays, name)
        if len(lst) != len(vs):
            raise ValueError(f"{name}: expected {len(vs)} tensors, got {len(lst)}")
        return [call.vector(a, f"{name}[{k}]", n, writable=writable, wide=wide)
                for k, (a, n) in enumerate(zip(lst, sizes))]

    s_desc = vectors(sum, "sum", wide=True)
    x_desc = vectors(params, "params", writable=True)
    p_desc = vectors(params_prev, "params_prev", writable=True)
    if params_prev is not None and params is None:
        raise ValueError("params_prev: given without params")
    _check_update(generator, sigma=sigma, scale=scale, lr=lr)
    norm, norm_address = call.scalar_buffer("float64") if params is not None else (None, 0)
    scalars = (float(scale), float(sigma), bool(reset))
    key = _noise_key(generator, stream, call, sum, scalars) if sigma > 0 else None
    _C.noisy_update(
        call.device,
        0 if call.dtype == "float32" else 1,
        v_desc,
        s_desc,
        x_desc,
        p_desc,
        float(scale),
        float(sigma),
        float(lr),
        bool(reset),
        key.seed if key else 0,
        key.stream if key else 0,
        key.step if key else 0,
        norm_address,
        call.stream,
        1 if call.wide_dtype == "float64" else 0 if call.wide_dtype == "float32" else -1,
    )
    if norm is None:
        return None
    return float(norm[0]) if call.device == CPU else norm


def _check_update(generator: NoiseGenerator, **scalars: float) -> None:
    """Refuses a generator that is not dpvr's and non-finite or negative-noise scalars of a noisy update."""
    if not isinstance(generator, NoiseGenerator):
        raise TypeError(f"generator: expected a NoiseGenerator, got {type(generator).__name__}")
    for name, value in scalars.items():
        if not np.isfinite(value):
            raise ValueError(f"{name}: must be finite, got {value}")
    if scalars["sigma"] < 0:
        raise ValueError(f"sigma: must be >= 0, got {scalars['sigma']}")


def _noise_key(generator: NoiseGenerator, stream: str, call: _Call, sum: Any, scalars: tuple) -> Any:  # noqa: A002
    """The key of one draw of ``stream``: the stream's next step, and for a bound generator a digest of
    what the draw perturbs.

    The key binds the release (its ledger entry, unique in the run) and, on the host, the signal the noise
    hides too: two draws meet only on bit-identical sums, where the releases differ by (v - v'), a function
    of earlier releases, and reveal nothing new."""
    inputs = b""
    if generator.bound:
        if call.device != CPU and not generator.release:
            raise ValueError(
                "generator: a bound generator draws noise for device arrays only inside a named release "
                "(NoiseGenerator.for_release): on the device the key is not derived from the signal"
            )
        signal = [] if sum is None or call.device != CPU else _as_list(sum, "sum")
        inputs = _digest(signal, scalars)
    return generator.next_key(stream, inputs)


# From this many bytes on, the digest hashes on the kernels' threads: BLAKE3's tree gives the same digest
# whatever the thread count, and the pool's start (about 70 us) is then well under what it saves (the
# float64 sums of 1.2 * 10^7 parameters: 19 -> 10 ms on two cores).
THREADED_DIGEST_BYTES = 1 << 24


def _digest(arrays: Sequence[Array], scalars: tuple) -> bytes:
    """A BLAKE3 digest of host ``arrays``' values (already validated by the caller) and ``scalars``:
    bit-identical inputs, and only those, give equal digests (BLAKE3 is collision resistant and, on the
    signal every release hashes, about five times faster than SHA-256). Device arrays are not hashed: a
    collision-resistant hash of them would cost a copy to the host or a kernel of its own, and the release's
    ledger entry already makes every key of a run unique (:meth:`NoiseGenerator.for_release`)."""
    hosts = [np.ascontiguousarray(a.detach().numpy() if hasattr(a, "detach") else np.asarray(a))
             .reshape(-1).view(np.uint8) for a in arrays]
    threads = _C.max_threads() if sum(h.nbytes for h in hosts) >= THREADED_DIGEST_BYTES else 1
    h = blake3(repr(scalars).encode(), max_threads=threads)
    for host in hosts:
        h.update(host)
    return h.digest()


def add_noise(out: Array | Sequence[Array], sigma: float, *, generator: NoiseGenerator, stream: str) -> None:
    """``out += sigma * xi``, ``xi ~ N(0, I)`` from one draw of ``generator``'s stream ``stream``.

    Args:
        out: the array (or list of arrays) the noise is added to in place; float32 or float64, contiguous.
        sigma: the noise standard deviation (absolute); ``>= 0``, ``0`` adds nothing.
        generator: the :class:`~dpvr.NoiseGenerator` that draws ``xi``.
        stream: the name of the generator's noise stream (its step counter advances by one).

    Raises:
        ValueError: a non-finite or negative ``sigma``, invalid arrays, or a bound generator outside a
            named release, as :func:`noisy_update`.
        TypeError: ``generator`` is not a :class:`~dpvr.NoiseGenerator`, or an unsupported array.
        RuntimeError: the generator's stream has used all its steps.
    """
    noisy_update(out, generator=generator, stream=stream, sigma=sigma)


def philox_words(n_blocks: int, seed: int, stream: int, step: int) -> np.ndarray:
    """Raw Philox-4x32-10 output (4 words per block) on the host, as the Gaussian transform consumes it."""
    out = np.empty(4 * n_blocks, dtype=np.uint32)
    _C.philox_words(CPU, out.ctypes.data, n_blocks, seed, stream, step, 0)
    return out
