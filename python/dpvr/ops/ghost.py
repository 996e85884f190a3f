"""Ghost norms and clip factors: per-sample clipping from layer activations and output gradients.

:func:`ghost_norms` computes per-sample squared gradient norms from what each layer saw in the forward and
backward passes (no per-sample gradient is formed); :func:`clip_factors` turns them into the clip factors of
:func:`~dpvr.ops.clip_accumulate` (same rule, margin, weights and non-finite policy), so a clipped sum formed
with those factors bounds each sample's contribution as the fused kernel does. Host arrays only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .. import _C
from .arrays import ArrayView, view
from .kernels import NONFINITE_POLICIES, Array, _Call, _device_name, check_nonfinite

NORM_FORMS = {"auto": 0, "gram": 1, "direct": 2}


class IndexTerm(NamedTuple):
    """Embedding-style term: ``u_i = sum_j sum_t e_{k_j[i,t]} grads_j[i,t]^T`` (rows of a table).

    ``pieces`` are ``(indices, grads)`` pairs, int64 ``(B, T)`` and ``(B, T, q)``; positions whose index
    equals ``skip`` (an embedding's ``padding_idx``) contribute nothing.
    """

    pieces: Sequence[tuple[Array, Array]]
    skip: int | None = None


def _sequence(call: _Call, a: Array, name: str) -> tuple[int, int, int, int, int, int, int]:
    """(B, w) or (B, T, w) array -> (address, B, T, w, sample stride, step stride, entry stride)."""
    v = call.add(a, name)
    if len(v.shape) == 2:
        return v.address, v.shape[0], 1, v.shape[1], v.strides[0], 0, v.strides[1]
    if len(v.shape) == 3:
        return (v.address, *v.shape, *v.strides)
    raise ValueError(f"{name}: expected shape (B, width) or (B, steps, width), got {v.shape}")


def _indices(call: _Call, a: Array, name: str) -> tuple[int, int, int, int, int]:
    v = view(a, name)
    if v.dtype != "int64":
        raise TypeError(f"{name}: dtype must be int64, got {v.dtype}")
    if call.device is not None and v.device != call.device:
        raise ValueError(f"{name}: on {_device_name(v.device)}, the other arrays are on "
                         f"{_device_name(call.device)}")
    if len(v.shape) != 2:
        raise ValueError(f"{name}: expected shape (B, steps), got {v.shape}")
    call.keep.append(v)
    return (v.address, *v.shape, *v.strides)


def _host_buffer(a: Array, name: str, batch: int | None, dtype: str | None, *, writable: bool) -> ArrayView:
    v = view(a, name)
    if dtype is not None and v.dtype != dtype:
        raise TypeError(f"{name}: dtype must be {dtype}, got {v.dtype}")
    if v.device != -1:
        raise ValueError(f"{name}: on {_device_name(v.device)}; ghost norms run on the host only")
    if len(v.shape) != 1 or (batch is not None and v.shape[0] != batch):
        raise ValueError(f"{name}: expected shape ({batch if batch is not None else 'B'},), got {v.shape}")
    if v.shape[0] == 0:
        raise ValueError(f"{name}: the batch is empty")
    if not v.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if writable and not v.writable:
        raise ValueError(f"{name}: array is read-only")
    return v


def ghost_norms(
    norms_sq: Array,
    *,
    outer: Sequence[Sequence[tuple[Array, Array]]] = (),
    index: Sequence[IndexTerm] = (),
    dense: Sequence[Array] = (),
    form: str | Sequence[str] = "auto",
    outer_bounds: Array | None = None,
) -> None:
    """Writes into ``norms_sq`` (float64, ``(B,)``) an upper bound on ``||u_i||^2``, where sample i's vector
    ``u_i`` is the concatenation of these terms (each a layer's per-sample gradient or gradient difference):

    - ``outer``: each term a list of ``(activations, grads)`` pieces, ``(B, p)``/``(B, q)`` or
      ``(B, T, p)``/``(B, T, q)``: ``u_i = sum_j sum_t grads_j[i,t] activations_j[i,t]^T`` (a Linear
      layer's weight gradient; a convolution's after unfolding). The same-sample difference
      ``a_i G^T A - b_i G'^T A'`` is the two pieces ``(A, a_i G - b_i G')`` and ``(A - A', b_i G')``, whose
      norm is accurate relative to the difference and exactly 0 at identical points.
    - ``index``: :class:`IndexTerm` s (embedding tables).
    - ``dense``: ``(B, ...)`` arrays, one materialised vector per sample (biases, normalisation layers).

    ``form`` picks how outer terms are computed: ``"gram"`` (pairs of steps, cost ~T^2 (p + q)),
    ``"direct"`` (the q x p matrix per sample, cost ~T p q) or ``"auto"``, the cheaper one per term; or a
    sequence of these, one per outer term. Every form returns the bound below, so the choice changes the
    time only, never the guarantee.

    The value is the squared norm computed in double plus an explicit bound on its rounding error, so it is
    never below the exact squared norm of the given data: clipping with it bounds every sample's exact
    contribution. It is NaN for a sample whose data is not finite.

    ``outer_bounds`` (float64, ``(len(outer), B)``), when given, receives each outer term's
    ``R_i = sum_j sum_t ||activations_j[i,t]|| ||grads_j[i,t]||`` computed in double (no bound added:
    the magnitude that bounds the rounding of the term's clipped-sum matmul, which the caller bounds), read
    off the same pass.
    """
    forms = [form] * len(outer) if isinstance(form, str) else list(form)
    if len(forms) != len(outer):
        raise ValueError(f"form: {len(forms)} forms given for {len(outer)} outer terms")
    for f in forms:
        if f not in NORM_FORMS:
            raise ValueError(f"form: must be one of {sorted(NORM_FORMS)}, got {f!r}")
    out = _host_buffer(norms_sq, "norms_sq", None, "float64", writable=True)
    batch = out.shape[0]
    call = _Call()

    def pieces(term: Any, name: str) -> Sequence[tuple[Array, Array]]:
        if not isinstance(term, (list, tuple)) or not all(isinstance(p, tuple) and len(p) == 2 for p in term):
            raise TypeError(f"{name}: expected a list of (array, array) pieces")
        return term

    outer_desc = []
    for k, t in enumerate(outer):
        ps = pieces(t, f"outer[{k}]")
        acts = [_sequence(call, m, f"outer[{k}][{j}].activations") for j, (m, _) in enumerate(ps)]
        grads = [_sequence(call, n, f"outer[{k}][{j}].grads") for j, (_, n) in enumerate(ps)]
        outer_desc.append((acts, grads, NORM_FORMS[forms[k]]))
    index_desc = []
    for k, t in enumerate(index):
        if not isinstance(t, IndexTerm):
            raise TypeError(f"index[{k}]: expected an IndexTerm, got {type(t).__name__}")
        ps = pieces(t.pieces, f"index[{k}]")
        grads = [_sequence(call, n, f"index[{k}][{j}].grads") for j, (_, n) in enumerate(ps)]
        ids = [_indices(call, i, f"index[{k}][{j}].indices") for j, (i, _) in enumerate(ps)]
        index_desc.append((ids, grads, -1 if t.skip is None else int(t.skip)))
    dense_desc = [call.matrix(d, f"dense[{k}]") for k, d in enumerate(dense)]
    if call.device is not None and call.device != out.device:
        raise ValueError(f"norms_sq: on the host, the other arrays are on {_device_name(call.device)}")
    bounds = 0
    if outer_bounds is not None:
        held = view(outer_bounds, "outer_bounds")
        if held.dtype != "float64" or held.device != -1:
            raise TypeError("outer_bounds: must be a float64 host array")
        if tuple(held.shape) != (len(outer_desc), batch) or not held.is_contiguous() or not held.writable:
            raise ValueError(f"outer_bounds: expected a writable contiguous ({len(outer_desc)}, {batch}) "
                             f"array, got shape {tuple(held.shape)}")
        call.keep.append(held)
        bounds = held.address
    _C.ghost_norms(out.device, 1 if call.dtype == "float64" else 0, batch, outer_desc, index_desc, dense_desc,
                   out.address, bounds)


def clip_factors(
    norms_sq: Array,
    clip: float,
    factors: Array,
    *,
    columns: int,
    weights: Array | None = None,
    norms: Array | None = None,
    nonfinite: str = "zero",
) -> int:
    """Clip factors from per-sample squared norms, by the rule of :func:`~dpvr.ops.clip_accumulate`.

    With ``n_i = |w_i| sqrt(norms_sq_i)`` (``w_i = 1`` without ``weights``), writes
    ``factors_i = w_i min(1, C' / n_i)`` where ``C' = clip * (1 - margin)`` and the margin is the one
    ``clip_accumulate`` uses for ``columns`` per-sample entries (the model's trainable dimension): the two
    paths give the same factors for the same norms. ``factors_i * u_i`` has norm at most ``clip`` whenever
    ``sqrt(norms_sq_i) >= ||u_i||`` — which :func:`ghost_norms` guarantees — so each sample's contribution to
    ``sum_i factors_i u_i`` is bounded by ``clip``. ``norms`` (optional) receives ``n_i``.

    ``factors``, ``weights`` and ``norms`` are ``(B,)`` host arrays of one dtype (float32 or float64);
    ``norms_sq`` is float64. Non-finite samples: ``"zero"`` gives them factor 0 and norm NaN, ``"raise"``
    raises ``FloatingPointError`` before writing anything. Returns the number of non-finite samples.
    """
    check_nonfinite(nonfinite)
    if not isinstance(columns, int) or isinstance(columns, bool) or columns < 0:
        raise ValueError(f"columns: must be an integer >= 0, got {columns!r}")
    sq = _host_buffer(norms_sq, "norms_sq", None, "float64", writable=False)
    batch = sq.shape[0]
    out = _host_buffer(factors, "factors", batch, None, writable=True)
    if out.dtype not in ("float32", "float64"):
        raise TypeError(f"factors: dtype must be float32 or float64, got {out.dtype}")
    w = None if weights is None else _host_buffer(weights, "weights", batch, out.dtype, writable=False)
    n = None if norms is None else _host_buffer(norms, "norms", batch, out.dtype, writable=True)
    return int(_C.clip_factors(-1, 1 if out.dtype == "float64" else 0, batch, sq.address,
                               w.address if w else 0, out.address, n.address if n else 0, float(clip),
                               columns, NONFINITE_POLICIES[nonfinite]))
