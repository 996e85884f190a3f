"""Ghost norms and clip factors in torch, for parameters off the host: the formulas of the native kernels
(:func:`dpvr.ops.ghost_norms`, :func:`dpvr.ops.clip_factors`) as device operations, with no transfer to the
host and no synchronisation (except to raise under ``nonfinite="raise"``).

Every squared norm is accumulated in float64 (inputs of either dtype convert exactly) and is returned as an
upper bound: for each part the computed value plus ``2 (chain + 8) u R^2``, where ``R`` bounds the part's
exact norm (triangle inequality over its rank-one pieces), ``chain`` bounds the roundings any one product
meets in whatever order the reductions run (it counts every addition of a sequential sum, which no summation
tree exceeds), and ``u = 2^-53``; the sum over parts adds its own bound, as in the native kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ... import ops
from .rules import Dense, Outer, Part, Rows

U64 = 2.0 ** -53
_MAX_SCRATCH = 1 << 24  # float64 entries of one chunk's per-sample matrices (128 MiB)


def _sequence(t: Tensor) -> Tensor:
    """A ``(B, w)`` or ``(B, T, w)`` piece as float64 ``(B, T, w)``."""
    return (t.unsqueeze(1) if t.dim() == 2 else t).to(torch.float64)


def _chunked(batch: int, per_sample: int,
             fn: Callable[[slice], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """``fn`` over slices of the samples, so that at most ``_MAX_SCRATCH`` scratch entries live at once."""
    size = max(1, _MAX_SCRATCH // max(per_sample, 1))
    if size >= batch:
        return fn(slice(None))
    results = [fn(slice(start, start + size)) for start in range(0, batch, size)]
    return torch.cat([s for s, _ in results]), torch.cat([r for _, r in results])


def _use_gram(steps: int, p: int, q: int, form: str) -> bool:
    """The native kernel's choice between the Gram and the direct form (the cheaper one for ``"auto"``)."""
    if form != "auto":
        return form == "gram"
    if p * q > 1 << 22:
        return True
    return 0.5 * steps * (steps + 1) * (p + q) <= steps * (p * q + p + q)


def _outer(part: Outer, form: str) -> tuple[Tensor, Tensor, float]:
    m = torch.cat([_sequence(m) for m, _ in part.pieces], dim=1)
    n = torch.cat([_sequence(n) for _, n in part.pieces], dim=1)
    batch, steps, p = m.shape
    q = n.shape[-1]
    if _use_gram(steps, p, q, form):
        def gram(s: slice) -> tuple[Tensor, Tensor]:
            mm, gg = m[s] @ m[s].transpose(1, 2), n[s] @ n[s].transpose(1, 2)
            r = (mm.diagonal(dim1=1, dim2=2).sqrt() * gg.diagonal(dim1=1, dim2=2).sqrt()).sum(dim=1)
            return (mm * gg).sum(dim=(1, 2)), r
        sumsq, r = _chunked(batch, 2 * steps * steps, gram)
        return sumsq, r * r, float(p + q + steps * steps)

    def direct(s: slice) -> tuple[Tensor, Tensor]:
        u = n[s].transpose(1, 2) @ m[s]  # (B, q, p): the per-sample matrices themselves
        r = ((m[s] * m[s]).sum(dim=2).sqrt() * (n[s] * n[s]).sum(dim=2).sqrt()).sum(dim=1)
        return (u * u).sum(dim=(1, 2)), r
    sumsq, r = _chunked(batch, p * q, direct)
    return sumsq, r * r, float(2 * steps + p * q)


def _rows(part: Rows) -> tuple[Tensor, Tensor, float]:
    if part.unique:  # coalesced: one entry per key, and zeros
        return _dense(Dense(part.flat()))
    keys = torch.cat([k.reshape(k.shape[0], -1) for k, _ in part.pieces], dim=1)
    n = torch.cat([_sequence(n) for _, n in part.pieces], dim=1)
    if part.skip is not None:
        n = n.masked_fill((keys == part.skip).unsqueeze(-1), 0)
    batch, steps, q = n.shape
    # Sum the steps that hit one table row: sort each sample's keys, number the runs of equal keys, and
    # add every step into its run's slot.
    keys, order = keys.sort(dim=1)
    n = n.gather(1, order.unsqueeze(-1).expand_as(n))
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[:, 1:] = keys[:, 1:] != keys[:, :-1]
    slots = starts.cumsum(dim=1) - 1 + steps * torch.arange(batch, device=keys.device).unsqueeze(1)
    sums = torch.zeros(batch * steps, q, dtype=torch.float64, device=n.device)
    sums.index_add_(0, slots.reshape(-1), n.reshape(-1, q))
    sumsq = (sums * sums).sum(dim=1).view(batch, steps).sum(dim=1)
    r = (n * n).sum(dim=2).sqrt().sum(dim=1)
    return sumsq, r * r, float(2 * steps + q)


def _dense(part: Dense) -> tuple[Tensor, Tensor, float]:
    u = part.u.reshape(part.u.shape[0], -1).to(torch.float64)
    sumsq = (u * u).sum(dim=1)
    return sumsq, sumsq.abs(), float(u.shape[1])


def ghost_norms(parts: Sequence[Part], batch: int, device: torch.device, form: str) -> Tensor:
    """Float64 ``(B,)`` upper bounds on the squared norms of the samples' vectors (the concatenation of all
    parts); NaN for a sample whose data is not finite. The bound of :func:`dpvr.ops.ghost_norms`."""
    sumsq = torch.zeros(batch, dtype=torch.float64, device=device)
    bound, magnitude = torch.zeros_like(sumsq), torch.zeros_like(sumsq)
    for part in parts:
        if isinstance(part, Outer):
            s, r2, chain = _outer(part, form)
        elif isinstance(part, Rows):
            s, r2, chain = _rows(part)
        else:
            s, r2, chain = _dense(part)
        sumsq += s
        magnitude += s.abs()
        bound += (2.0 * (chain + 8.0) * U64) * r2
    # Summing the parts adds at most (parts + 4) u of their magnitudes; the final (1 + 8u) covers this line.
    upper = (sumsq.clamp(min=0) + bound + ((len(parts) + 4.0) * U64) * magnitude) * (1.0 + 8.0 * U64)
    return upper.masked_fill(~torch.isfinite(upper), float("nan"))


def reduced_precision_unit(conv: bool, device: torch.device) -> float:
    """The unit roundoff to which torch may round the inputs of float32 products in a matmul (``conv``: in a
    convolution on ``device``) under its reduced-precision settings: TF32 (``2^-11``), bfloat16 (``2^-8``),
    or 0 in full precision."""
    precision = torch.get_float32_matmul_precision()
    unit = 0.0 if precision == "highest" else 2.0 ** -11 if precision == "high" else 2.0 ** -8
    if conv and device.type == "cuda" and torch.backends.cudnn.allow_tf32:
        unit = max(unit, 2.0 ** -11)
    return unit


def write_error(parts: Sequence[tuple[int, Part]], batch: int, dtype: torch.dtype,
                device: torch.device) -> Tensor | None:
    """Float64 ``(B,)`` bounds ``E_i`` on the rounding of what the clipped sums write for one sample, beyond
    one rounding per entry: ``||w_i - f_i u_i|| <= |f_i| (E_i + u ||u_i||)``, where ``w_i`` is what
    :meth:`Outer.total`, :meth:`Rows.total` and :meth:`Dense.total` write for sample i alone with the factor
    ``f_i`` (in ``dtype``, unit roundoff ``u``). None when every ``E_i`` is 0.

    A coalesced :class:`Rows` part and a :class:`Dense` part write ``fl(f_i r)`` per entry ``r``: one
    rounding, no ``E``. An :class:`Outer` part writes ``sum_t (f_i n_t) m_t^T`` over its ``K`` steps (of all
    its pieces): each of the ``K`` terms of an entry meets one rounding of the scaling, one of the product
    and at most ``K - 1`` of the additions (in any summation order: blocked, pairwise, fused), so the entry
    is ``sum_t f_i n_t m_t (1 + theta_t)`` with ``|theta_t| <= gamma = k u / (1 - k u)``, ``k = K + 1``,
    and the Frobenius norm of ``[sum_t |n_t| |m_t|^T]`` is at most ``R_i = sum_t ||n_t|| ||m_t||``:
    ``E_i = gamma R_i``. ``R_i`` may be far above ``||u_i||`` (the steps of a sequence, the calls of a shared
    layer or a difference's two pieces may cancel), which is why a bound relative to ``||u_i||`` alone (the
    clip margin) does not cover it. Under torch's TF32/bfloat16 matmul (or cuDNN TF32) settings, each
    product's two inputs may be rounded too (:func:`reduced_precision_unit`: ``u'``), which adds ``2 u'`` to
    ``k u``; a Dense part, whose sum is a matmul, then has ``k u = 2 u'`` and ``R_i = ||u_i||``. ``R_i`` is
    computed in float64 and rounded up.
    """
    unit = 2.0 ** -24 if dtype == torch.float32 else U64
    error: Tensor | None = None
    for _, part in parts:
        reduced = 0.0
        if dtype == torch.float32 and not isinstance(part, Rows):  # Rows.total multiplies elementwise
            reduced = 2.0 * reduced_precision_unit(isinstance(part, Outer) and part.by_convolution, device)
        if isinstance(part, Outer):
            r = torch.zeros(batch, dtype=torch.float64, device=device)
            terms, width = 0, 0
            for m, n in part.pieces:
                m3, n3 = (m.unsqueeze(1), n.unsqueeze(1)) if m.dim() == 2 else (m, n)
                r += (torch.linalg.vector_norm(m3, dim=-1, dtype=torch.float64)
                      * torch.linalg.vector_norm(n3, dim=-1, dtype=torch.float64)).sum(dim=1)
                terms, width = terms + m3.shape[1], max(width, m3.shape[-1] + n3.shape[-1])
            rounds = (terms + 1) * unit + reduced
        elif isinstance(part, Dense) and reduced > 0.0:
            u = part.u.reshape(part.u.shape[0], -1)
            r = torch.linalg.vector_norm(u, dim=-1, dtype=torch.float64)
            terms, width, rounds = 1, u.shape[-1], reduced
        else:
            continue
        if rounds >= 0.5:
            raise ValueError(f"a layer's clipped sum adds {terms} terms per entry: too many for the rounding "
                             f"of {dtype} to be bounded; use float64 parameters")
        # R's own float64 roundings (norms over the widths, products, the sum over the steps), rounded up.
        e = (rounds / (1.0 - rounds)) * (1.0 + 2.0 * (width + terms + 8) * U64) * r
        error = e if error is None else error + e
    # ... and the additions over the parts.
    return None if error is None else error * (1.0 + 2.0 * (len(parts) + 8) * U64)


def with_write_error(norms_sq: Tensor, error: Tensor | None) -> Tensor:
    """Upper bounds on ``(sqrt(norms_sq) + error)^2`` in float64 (each rounding covered by the factor)."""
    if error is None:
        return norms_sq
    total = (norms_sq.sqrt() + error * (1.0 + 4.0 * U64)) * (1.0 + 16.0 * U64)
    return total * total


def clip_margin(dtype: torch.dtype, columns: int) -> float:
    """The relative margin of the CUDA clip kernels for ``columns`` entries per sample: the rounding of the
    norm, the factor and the clipped entries, with room to spare."""
    unit = 2.0 ** -24 if dtype == torch.float32 else U64
    return (columns + 64.0) * U64 + 2.0 * unit


def clip_factors(norms_sq: Tensor, clip: float, dtype: torch.dtype, *, columns: int, weights: Tensor | None,
                 nonfinite: str) -> tuple[Tensor, Tensor]:
    """``(factors, norms)`` by the rule of :func:`dpvr.ops.clip_factors`: with
    ``n_i = |w_i| sqrt(norms_sq_i)``, ``factors_i = w_i min(1, C' / n_i)`` and ``C' = clip (1 - margin)``; a
    sample whose norm or weight is not finite gets factor 0 and norm NaN (``"raise"``:
    :class:`dpvr.ops.NonFiniteError`)."""
    target = clip * (1.0 - clip_margin(dtype, columns))
    n = norms_sq.sqrt()
    w = None if weights is None else weights.to(torch.float64)
    if w is not None:
        n = n * w.abs()
    bad = ~torch.isfinite(n) if w is None else ~(torch.isfinite(n) & torch.isfinite(w))
    if nonfinite == "raise" and (count := int(bad.sum())):
        raise ops.NonFiniteError(f"{count} sample(s) have non-finite gradients or weights")
    f = torch.where(n > target, target / n, torch.ones_like(n))
    if w is not None:
        f = w * f
    return f.masked_fill(bad, 0).to(dtype), n.masked_fill(bad, float("nan")).to(dtype)
