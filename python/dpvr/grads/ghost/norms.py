"""Ghost norms and clip factors in torch, for parameters off the host: the formulas of the native kernels
(:func:`dpvr.ops.ghost_norms`, :func:`dpvr.ops.clip_factors`) as device operations, with no transfer to the
host and no synchronisation (except to raise under ``nonfinite="raise"``).

Every squared norm is accumulated in float64 (inputs of either dtype convert exactly) and is returned as an
upper bound: for each part the computed value plus ``2 (chain + 8) u R^2``, where ``R`` bounds the part's
exact norm (triangle inequality over its rank-one pieces), ``chain`` bounds the roundings any one product
meets in whatever order the reductions run (it counts every addition of a sequential sum, which no summation
tree exceeds), and ``u = 2^-53``; the sum over parts adds its own bound, as in the native kernel. The
float32 Gram form (:func:`gram32_term`, the cost model's ``"gram32"``, on the host) forms its Gram blocks
in float32 and prices that rounding in its own bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ... import ops
from .cost import GRAM32_BLOCK, GRAM32_ENTRY_BYTES, GRAM32_SCRATCH
from .rules import Dense, Outer, Part, Rows, Tied, with_steps

U64 = 2.0 ** -53
SCRATCH_ENTRIES = 1 << 24  # float64 entries of one chunk's per-sample matrices (128 MiB)
_MAX_SCRATCH = SCRATCH_ENTRIES


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


def _widened(pieces: Sequence[Tensor], rows: slice) -> Tensor:
    """The samples ``rows`` of ``(B, w)`` or ``(B, K_j, w)`` pieces as one float64 ``(b, sum K_j, w)``
    tensor, each piece widened straight into its steps (the values of their float64 concatenation, in one
    pass: no float64 copy of the whole batch, no second copy to join them)."""
    steps = [t.unsqueeze(1) if t.dim() == 2 else t for t in pieces]
    first = steps[0][rows]
    out = torch.empty(first.shape[0], sum(t.shape[1] for t in steps), first.shape[2], dtype=torch.float64,
                      device=first.device)
    start = 0
    for t in steps:
        out[:, start : start + t.shape[1]].copy_(t[rows])
        start += t.shape[1]
    return out


def _outer(part: Outer, form: str) -> tuple[Tensor, Tensor, float]:
    ms, ns = [m for m, _ in part.pieces], [n for _, n in part.pieces]
    batch, p, q = ms[0].shape[0], ms[0].shape[-1], ns[0].shape[-1]
    steps = sum(1 if m.dim() == 2 else m.shape[1] for m in ms)
    widened = steps * (p + q)  # a sample's float64 steps, formed a chunk of samples at a time
    if _use_gram(steps, p, q, form):
        def gram(s: slice) -> tuple[Tensor, Tensor]:
            m, n = _widened(ms, s), _widened(ns, s)
            mm, gg = m @ m.transpose(1, 2), n @ n.transpose(1, 2)
            r = (mm.diagonal(dim1=1, dim2=2).sqrt() * gg.diagonal(dim1=1, dim2=2).sqrt()).sum(dim=1)
            return (mm * gg).sum(dim=(1, 2)), r
        sumsq, r = _chunked(batch, 2 * steps * steps + widened, gram)
        return sumsq, r * r, float(p + q + steps * steps)

    def direct(s: slice) -> tuple[Tensor, Tensor]:
        m, n = _widened(ms, s), _widened(ns, s)
        u = n.transpose(1, 2) @ m  # (b, q, p): the per-sample matrices themselves
        r = ((m * m).sum(dim=2).sqrt() * (n * n).sum(dim=2).sqrt()).sum(dim=1)
        return (u * u).sum(dim=(1, 2)), r
    sumsq, r = _chunked(batch, p * q + widened, direct)
    return sumsq, r * r, float(2 * steps + p * q)


def _rows(part: Rows) -> tuple[Tensor, Tensor, float]:
    if part.unique:  # coalesced: one entry per key, and zeros
        return _dense(Dense(part.flat()))
    keys = torch.cat([k.reshape(k.shape[0], -1) for k, _ in part.pieces], dim=1)
    n = _widened([n for _, n in part.pieces], slice(None))
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


def _cross(part: Tied) -> tuple[Tensor, Tensor]:
    """``2 <r_i, h_i>`` of a coalesced :class:`Tied` part, computed in float64, and a bound on its rounding.

    With the table's rows ``r_k`` (keys ``K_k``, the ``K`` slots of the coalesced part) and the map's pieces
    ``(M, N)`` (steps ``s``), ``<r, h> = sum_k sum_s N[s, K_k] <r_k, M_s>``: the ``(K, S)`` dot products of
    width ``d`` and the gathered entries of ``N``, ``O(B K S d)`` work and ``O(K S)`` scratch per sample, no
    ``(V, d)`` matrix.

    Bound: the inputs convert to float64 exactly, so every elementary product ``N r m`` of the exact sum
    meets the roundings of one chain of at most ``chain = d + 1 + sum_j K S_j + pieces`` operations (the
    dot product's ``d`` products and additions in any order, the product with ``N``, the additions over all
    slots, steps and pieces), hence the computed value is within ``gamma_chain R`` of the exact one, where
    ``R = sum_{k,s} |N[s, K_k]| ||r_k|| ||M_s||`` bounds the sum of the products' magnitudes (Cauchy-Schwarz
    over ``d``). ``R`` is computed in float64 with a relative error below ``gamma_{chain + 8}`` (``d``
    squares, a square root, ``K`` and ``S`` additions, ``K + S <= K S + 1``), so for
    ``(chain + 8) u <= 1/100`` the returned ``2 * 2 (chain + 8) u R`` exceeds twice the error (doubling is
    exact) even after its own float64 product; the summation of terms (:func:`_upper_sum`) adds the rest.
    """
    ((keys, rows),) = part.rows.pieces
    batch = keys.shape[0]
    keys = keys.reshape(batch, -1)
    slots = keys.shape[1]
    r = rows.reshape(batch, slots, -1).to(torch.float64)
    r_norms = torch.linalg.vector_norm(r, dim=2)
    value = torch.zeros(batch, dtype=torch.float64, device=r.device)
    magnitude = torch.zeros_like(value)
    chain = float(r.shape[2] + 1 + len(part.outer.pieces))
    for m3, n3 in with_steps(part.outer.pieces):
        steps = m3.shape[1]
        chain += steps * slots

        def piece(s: slice, m3=m3, n3=n3, steps=steps) -> tuple[Tensor, Tensor]:
            mm = m3[s].to(torch.float64)
            # N[s, K_k]: the entries of the map's side that the table's keys index, gathered exactly.
            g = n3[s].gather(2, keys[s].unsqueeze(1).expand(-1, steps, -1)).to(torch.float64)  # (b, S, K)
            v = (g * (mm @ r[s].transpose(1, 2))).sum(dim=(1, 2))
            bound = ((g.abs() @ r_norms[s].unsqueeze(-1)).squeeze(-1)
                     * torch.linalg.vector_norm(mm, dim=2)).sum(dim=1)
            return v, bound
        v, bound = _chunked(batch, 3 * steps * slots, piece)
        value += v
        magnitude += bound
    if (chain + 8.0) * U64 > 0.01:
        raise ValueError(f"a tied parameter's cross term sums {chain:.0f} terms: too many for its rounding "
                         "to be bounded")
    return 2.0 * value, (4.0 * (chain + 8.0) * U64) * magnitude


def _upper_sum(terms: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """An upper bound on the sum of exact values, each given as a float64 ``(value, bound)`` pair with
    ``exact <= value + bound``; NaN where a value is not finite. Summing the terms adds at most
    ``(terms + 4) u`` of their magnitudes; the final ``(1 + 8u)`` covers the rounding of this line (the
    bounds carry slack for their own)."""
    sumsq, bound = terms[0][0].clone(), terms[0][1].clone()
    magnitude = sumsq.abs()
    for s, b in terms[1:]:
        sumsq += s
        bound += b
        magnitude += s.abs()
    upper = (sumsq.clamp(min=0) + bound + ((len(terms) + 4.0) * U64) * magnitude) * (1.0 + 8.0 * U64)
    return upper.masked_fill(~torch.isfinite(upper), float("nan"))


def chunked_terms(parts: Sequence[Outer]) -> list[tuple[Tensor, Tensor]]:
    """Each Outer part's squared norms by the direct form in float64 chunks of samples (the torch path's
    formula and bound, :func:`_outer`), as ``(value, bound)`` pairs for :func:`_upper_sum`: the native
    clipper's ``"chunked"`` form (:mod:`~dpvr.grads.ghost.cost`)."""
    return [_term(p, "direct") for p in parts]


# ---- the float32 Gram form ----

U32 = 2.0 ** -24
TINY32 = 2.0 ** -126  # float32's smallest normal number: any underflow, flush or denormal read moves less


def _gamma(k: float, unit: float) -> float:
    """``gamma_k = k u / (1 - k u)``, rounded up (an error bound is never rounded down)."""
    if not k * unit < 0.5:
        raise ValueError(f"the float32 Gram form rounds {k:.0f} terms per product: too many to bound; use "
                         "another norm form")
    return (k * unit / (1.0 - k * unit)) * (1.0 + 8.0 * U64)


def gram32_constants(steps: int, p: int, q: int, reduced: float) -> tuple[float, float, float, float, float]:
    """``(g_p, g_q, c_p, c_q, coef_R)`` of :func:`gram32_term`'s bound for ``steps`` steps in all, widths
    ``p`` and ``q`` and inputs rounded by ``reduced`` (0: full float32 products)."""
    g = []
    shifts = []
    for width in (p, q):
        gamma = _gamma(width, U32)
        gw = ((1.0 + reduced) ** 2 * (1.0 + gamma) - 1.0) * (1.0 + 8.0 * U64)
        ratio = _kappa(width, gw) / gw
        g.append(gw)
        shifts.append(max(ratio, math.sqrt(ratio)) * (1.0 + 8.0 * U64))
    g_p, g_q = g
    gamma64 = _gamma(2.0 * steps * steps + 8.0, U64)
    coef_r = (g_p * g_q + gamma64 * (1.0 + g_p) * (1.0 + g_q)) * (1.0 + 16.0 * U64)
    return g_p, g_q, shifts[0], shifts[1], coef_r


def gram32_term(part: Outer, scratch: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """An Outer part's squared norms from float32 Gram blocks: float64 ``(value, bound, R)`` per sample,
    with ``exact <= value + bound`` (``exact``: the squared Frobenius norm of ``u_i = sum_t b_t a_t^T`` of
    the stored float32 pieces, ``a_t`` the ``p``-wide activations and ``b_t`` the ``q``-wide gradients of
    step ``t`` of all pieces, ``K`` steps) and an upper bound on ``R = sum_t ||a_t|| ||b_t||`` (the
    magnitude :func:`write_error` reads). Where a float32 Gram entry is not finite (the data is not, or an
    entry overflows), the float64 form of the torch path (:func:`_term`) gives the sample's value and bound
    (NaN for data that is not finite), and ``R`` is computed from the data in float64. ``scratch``: bytes
    the blocks may use (default :data:`~dpvr.grads.ghost.cost.GRAM32_SCRATCH`; at least one sample's
    largest pair of blocks is used).

    The identity: ``||u_i||^2 = sum_{s,t} G_st H_st`` with ``G = A A^T`` (``G_st = a_s . a_t``) and
    ``H = B B^T``. Each piece's steps are cut into blocks of at most
    :data:`~dpvr.grads.ghost.cost.GRAM32_BLOCK`; for each pair of blocks ``I <= J`` the float32 blocks
    ``G^_IJ``, ``H^_IJ`` are batched float32 matmuls, widened to float64 (exactly) and ``sum G^_st H^_st``
    over the pair is a float64 dot product, counted twice off the diagonal (``G`` and ``H`` are symmetric;
    the one computed entry stands for both ``(s, t)`` and ``(t, s)``). Memory: ``24`` bytes per entry of a
    chunk of samples' pair of blocks, at most ``scratch``.

    The rounding bound (``u = 2^-24``, ``gamma_k = k u / (1 - k u)``, ``u'`` the reduced-precision unit of
    torch's float32 matmul setting (:func:`reduced_precision_unit`, 0 at ``"highest"``), ``mu = 2^-126``):

    1. One float32 entry ``G^_st``, a dot product of ``p`` terms in any order (blocked, vectorised, fused):
       reading an input may round it to ``u'`` (TF32/bfloat16) and, under denormals-are-zero, lose less
       than ``mu``; every product and addition rounds relatively by ``u`` (at most ``p`` of them on any one
       term's path: ``gamma_p``) and absolutely by less than ``mu`` (gradual underflow, or a flush to zero;
       at most ``4 p`` such, each amplified by at most ``1 + gamma_p``), and the entry's widening to float64
       by less than ``mu`` (a flushed denormal). With ``||x||_1 <= sqrt(p) ||x||`` this gives
       ``|G^_st - G_st| <= g_p ||a_s|| ||a_t|| + kappa_p (||a_s|| + ||a_t|| + 1)``, where
       ``g_p = (1 + u')^2 (1 + gamma_p) - 1`` and ``kappa_p = (5 p + 1) mu (1 + gamma_p) (1 + u')``. With
       ``c_p = max(kappa_p / g_p, sqrt(kappa_p / g_p))`` and ``alpha_t >= ||a_t|| + c_p`` it is at most
       ``g_p alpha_s alpha_t``; likewise ``|H^_st - H_st| <= g_q beta_s beta_t``. The norms come from the
       diagonal entries, with no pass of their own: at ``s = t`` the inequality says ``(1 - g_p) x^2 -
       2 kappa_p x - (kappa_p + G^_tt) <= 0`` for ``x = ||a_t||``, so ``x <= (kappa_p + sqrt(kappa_p^2 +
       (1 - g_p) (kappa_p + G^_tt))) / (1 - g_p)``, evaluated in float64 and rounded up. No overflow occurred
       when ``G^_st`` is finite (an infinite partial sum or product stays infinite or becomes NaN), and a
       non-finite entry makes the sample's value non-finite (it is then recomputed, above).
    2. The float64 products ``G^_st H^_st`` of two float32 numbers are exact (48 significant bits, and
       ``2^-298`` or more in magnitude: no float64 underflow), and every partial sum is a multiple of
       ``2^-298``, so the float64 sums of ``n <= 2 K^2 + 8`` terms per sample (blocks, pairs, doubling)
       round by at most ``gamma64_n sum |G^ H^| <= gamma64_n (1 + g_p) (1 + g_q) R'^2``, where
       ``R' = sum_t alpha_t beta_t`` and ``|G^_st| <= (1 + g_p) alpha_s alpha_t``.
    3. ``|G^ H^ - G H| <= |dG| |H^| + |G^| |dH| + |dG| |dH|``, so summed over ``(s, t)``:

           |value - exact| <= g_p W_a + g_q W_b + (g_p g_q + gamma64_n (1 + g_p) (1 + g_q)) R'^2,

       with ``W_a = sum_{s,t} alpha_s alpha_t |H^_st|`` and ``W_b = sum_{s,t} beta_s beta_t |G^_st|``,
       computed in float64 from the same blocks (non-negative terms: the computed sums, times
       ``1 + 2 (n + 8) u64``, bound the exact ones from above). ``W_a <= (1 + g_q) R'^2`` always; where the
       steps are uncorrelated the off-diagonal ``|H_st|`` are about ``1 / sqrt(q)`` of the diagonal ones,
       so the allowance is about ``(g_p + g_q) (1 + K / sqrt(min(p, q))) ||u_i||^2`` there instead of the
       ``K (g_p + g_q) ||u_i||^2`` of a bound by ``R^2``. The sums giving ``alpha``, ``R'`` and ``W`` are
       rounded up by explicit factors (``2 k u64`` for ``k`` roundings in a row).

    So ``value + bound >= exact``, and the clipper forms its factor from that upper bound, as from the native
    forms' (:func:`dpvr.ops.ghost_norms`): each record's contribution stays within the clip radius. The
    bound costs two float64 passes over the blocks; its size, relative to the squared norm, is about
    ``(g_p + g_q)`` times ``1`` (uncorrelated steps) to ``K`` (steps aligned, or cancelling: the latter
    ``R^2 >> ||u_i||^2``), which over-clips by that much and is the form's price besides its speed.
    Pieces must be float32 (the form is offered for float32 parameters only).

    Each record's terms come from its own read steps (``K`` its own count), batched over the records that
    read as many (:meth:`~dpvr.grads.ghost.rules.Outer.by_read_count`): the blocks' shapes, and so the
    float32 Gram entries and the constants of the bound, follow the record alone. Blocks over the steps
    some record of the batch reads (:func:`~dpvr.grads.ghost.linear.read_steps`) would let a neighbour move
    every other record's norm, and so its factor and term, within its bound: a shift no accountant prices.
    """
    pieces = with_steps(part.pieces)
    if any(m.dtype != torch.float32 or n.dtype != torch.float32 for m, n in pieces):
        raise ValueError("the float32 Gram form takes float32 pieces; use the float64 forms for "
                         f"{pieces[0][0].dtype}")
    batch, device = pieces[0][0].shape[0], pieces[0][0].device
    value, bound, r_up = (torch.zeros(batch, dtype=torch.float64, device=device) for _ in range(3))
    for index, group in part.by_read_count():  # records that read nothing: u_i = 0 exactly
        for total, got in zip((value, bound, r_up), _gram32_group(group, scratch)):
            total.index_copy_(0, index, got)
    return value, bound, r_up


def _gram32_group(pieces: Sequence[tuple[Tensor, Tensor]], scratch: float | None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`gram32_term` of records that each read all ``K = sum_j K_j`` steps of the ``(b, K_j, p)`` and
    ``(b, K_j, q)`` pieces, each piece's steps cut into blocks of its own (never a copy joining them)."""
    (batch, _, p), q, device = pieces[0][0].shape, pieces[0][1].shape[-1], pieces[0][0].device
    steps = sum(m.shape[1] for m, _ in pieces)
    g_p, g_q, c_p, c_q, coef_r = gram32_constants(steps, p, q, reduced_precision_unit(False, device))
    kappas = [_kappa(width, g) for width, g in ((p, g_p), (q, g_q))]
    chain = 2.0 * steps * steps + 8.0
    # (m block, n block, first step)
    blocks, first = [], 0
    for m, n in pieces:
        blocks += [(m[:, s:s + GRAM32_BLOCK], n[:, s:s + GRAM32_BLOCK], first + s)
                   for s in range(0, m.shape[1], GRAM32_BLOCK)]
        first += m.shape[1]
    value = torch.zeros(batch, dtype=torch.float64, device=device)
    # The diagonal pairs first: they give the norms (alpha, beta) that every pair's bound reads.
    pairs = [(i, i) for i in range(len(blocks))]
    pairs += [(i, j) for i in range(len(blocks)) for j in range(i + 1, len(blocks))]
    largest = max(mb.shape[1] for mb, _, _ in blocks)
    room = GRAM32_SCRATCH if scratch is None else min(float(scratch), GRAM32_SCRATCH)
    size = max(1, int(room // (GRAM32_ENTRY_BYTES * largest * largest)))
    w_a, w_b = torch.zeros_like(value), torch.zeros_like(value)
    norms_ab = torch.zeros(2, batch, steps, dtype=torch.float64, device=device)  # upper bounds on the norms
    for lo in range(0, batch, size):
        s = slice(lo, min(lo + size, batch))
        b = s.stop - s.start
        for i, j in pairs:
            (mi, ni, fi), (mj, nj, fj) = blocks[i], blocks[j]
            g = torch.bmm(mi[s], mj[s].transpose(1, 2)).to(torch.float64)  # (b, Ti, Tj), widened exactly
            h = torch.bmm(ni[s], nj[s].transpose(1, 2)).to(torch.float64)
            if i == j:
                for side, gram, kappa, width in ((0, g, kappas[0], g_p), (1, h, kappas[1], g_q)):
                    norms_ab[side, s, fi:fi + mi.shape[1]] = _norms_from_diagonal(gram, kappa, width)
            ai, aj = norms_ab[0, s, fi:fi + mi.shape[1]] + c_p, norms_ab[0, s, fj:fj + mj.shape[1]] + c_p
            bi, bj = norms_ab[1, s, fi:fi + mi.shape[1]] + c_q, norms_ab[1, s, fj:fj + mj.shape[1]] + c_q
            weight = 1.0 if i == j else 2.0
            value[s] += weight * torch.bmm(g.view(b, 1, -1), h.view(b, -1, 1)).view(b)
            g.abs_()
            h.abs_()
            w_a[s] += weight * torch.bmm(torch.bmm(ai.unsqueeze(1), h), aj.unsqueeze(2)).view(b)
            w_b[s] += weight * torch.bmm(torch.bmm(bi.unsqueeze(1), g), bj.unsqueeze(2)).view(b)
    # alpha + c and beta + c were each one float64 addition above the bounds: the 8 u64 below cover it.
    r_shift = ((norms_ab[0] + c_p) * (norms_ab[1] + c_q)).sum(dim=1) * (1.0 + 2.0 * (steps + 8) * U64)
    r_up = (norms_ab[0] * norms_ab[1]).sum(dim=1) * (1.0 + 2.0 * (steps + 8) * U64)
    up = (1.0 + 2.0 * (chain + 8.0) * U64) * (1.0 + 8.0 * U64)
    bound = ((g_p * w_a + g_q * w_b) * up + coef_r * (r_shift * r_shift)) * (1.0 + 8.0 * U64)
    bad = ~torch.isfinite(value + bound)
    if bool(bad.any()):  # not finite data, or float32 entries that overflowed: in float64
        rows = bad.nonzero().squeeze(1)
        v64, b64 = _term(Outer([(m[rows], n[rows]) for m, n in pieces]), "auto")
        r64 = outer_bound([(m[rows], n[rows]) for m, n in pieces], rows.numel(), device)
        value, bound = value.index_put((rows,), v64), bound.index_put((rows,), b64)
        r_up = r_up.index_put((rows,), r64)
    return value, bound, r_up


def _kappa(width: int, g: float) -> float:
    """``kappa`` of :func:`gram32_term`'s step 1 for a side of ``width`` entries (``g``: its ``g_p``; the
    factor ``1 + g`` covers ``(1 + gamma_p) (1 + u')``)."""
    return (5.0 * width + 1.0) * TINY32 * (1.0 + g) * (1.0 + 8.0 * U64)


def _norms_from_diagonal(gram: Tensor, kappa: float, g: float) -> Tensor:
    """Float64 upper bounds on the norms ``x_t`` of a diagonal block's steps from its float32 entries
    ``G^_tt`` (:func:`gram32_term`, step 1): ``(kappa + sqrt(kappa^2 + (1 - g) (kappa + G^_tt))) / (1 - g)``,
    each of its six roundings covered by the final factor."""
    d = gram.diagonal(dim1=1, dim2=2).clamp(min=0)
    return (kappa + torch.sqrt(kappa * kappa + (1.0 - g) * (kappa + d))) / (1.0 - g) * (1.0 + 16.0 * U64)


def gram32_terms(parts: Sequence[Outer], room: float | None = None) -> tuple[list[tuple[Tensor, Tensor]],
                                                                           list[Tensor]]:
    """Each Outer part's ``(value, bound)`` pair by the float32 Gram form (:func:`gram32_term`, with the
    scratch its choice allowed, :attr:`Outer.norm_scratch`, and at most ``room`` bytes) for
    :func:`_upper_sum`, and its ``R``."""
    got = []
    for p in parts:
        caps = [c for c in (p.norm_scratch, room) if c is not None]
        got.append(gram32_term(p, min(caps, default=None)))
    return [(v, b) for v, b, _ in got], [r for _, _, r in got]


def with_terms(norms_sq: Tensor, terms: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """Upper bounds on ``norms_sq`` (upper bounds themselves) plus exact values bounded by ``terms``."""
    return _upper_sum([(norms_sq, torch.zeros_like(norms_sq)), *terms]) if terms else norms_sq


def _term(part: Part, form: str) -> tuple[Tensor, Tensor]:
    """A part's squared norm and the bound on its rounding."""
    if isinstance(part, Outer):
        s, r2, chain = _outer(part, form)
    elif isinstance(part, Rows):
        s, r2, chain = _rows(part)
    else:
        s, r2, chain = _dense(part)
    return s, (2.0 * (chain + 8.0) * U64) * r2


def ghost_norms(parts: Sequence[Part | Tied], batch: int, device: torch.device, form: str) -> Tensor:
    """Float64 ``(B,)`` upper bounds on the squared norms of the samples' vectors (the concatenation of all
    parts); NaN for a sample whose data is not finite. The bound of :func:`dpvr.ops.ghost_norms`; a
    :class:`Tied` part adds its cross term (:func:`_cross`)."""
    terms: list[tuple[Tensor, Tensor]] = []
    for part in parts:
        if isinstance(part, Tied):
            terms += [_term(part.rows, form), _term(part.outer, form), _cross(part)]
        else:
            terms.append(_term(part, form))
    return _upper_sum(terms) if terms else torch.zeros(batch, dtype=torch.float64, device=device)


def with_cross_terms(norms_sq: Tensor, parts: Sequence[Part | Tied]) -> Tensor:
    """``norms_sq``, upper bounds on the squared norms of the parts with every :class:`Tied` part taken as
    its two parts apart (as the native kernels measure them), plus the Tied parts' cross terms: upper bounds
    on the squared norms of the samples' vectors."""
    cross = [_cross(p) for p in parts if isinstance(p, Tied)]
    if not cross:
        return norms_sq
    return _upper_sum([(norms_sq, torch.zeros_like(norms_sq)), *cross])


def reduced_precision_unit(conv: bool, device: torch.device) -> float:
    """The unit roundoff to which torch may round the inputs of float32 products in a matmul (``conv``: in a
    convolution on ``device``) under its reduced-precision settings: TF32 (``2^-11``), bfloat16 (``2^-8``),
    or 0 in full precision. Where torch (2.9 on) refuses its legacy getters because its per-backend
    settings (``torch.backends.*.fp32_precision``) were used, those are read instead, every backend's matmul
    and convolution setting counted (an upper bound whatever backend runs the product)."""
    try:
        precision = torch.get_float32_matmul_precision()
        tf32_conv = conv and device.type == "cuda" and torch.backends.cudnn.allow_tf32
    except RuntimeError:
        backends = torch.backends
        settings = [backends.cuda.matmul.fp32_precision, backends.mkldnn.matmul.fp32_precision]
        if conv:
            settings += [backends.cudnn.conv.fp32_precision, backends.mkldnn.conv.fp32_precision]
        return max(_precision_unit(s, backends.fp32_precision) for s in settings)
    unit = 0.0 if precision == "highest" else 2.0 ** -11 if precision == "high" else 2.0 ** -8
    return max(unit, 2.0 ** -11) if tf32_conv else unit


def _precision_unit(setting: str, inherited: str) -> float:
    """The unit of one ``fp32_precision`` setting (``"none"``: the inherited one); an unknown name counts as
    bfloat16's, the coarsest torch offers."""
    value = inherited if setting == "none" else setting
    return {"ieee": 0.0, "none": 0.0, "tf32": 2.0 ** -11, "bf16": 2.0 ** -8}.get(value, 2.0 ** -8)


def write_error(parts: Sequence[tuple[int, Part | Tied]], batch: int, dtype: torch.dtype,
                device: torch.device, known: Mapping[int, Tensor] | None = None, *,
                accumulate: torch.dtype | None = None) -> Tensor | None:
    """Float64 ``(B,)`` bounds ``E_i`` on the rounding of what the clipped sums write for one sample, beyond
    one rounding per entry: ``||w_i - f_i u_i|| <= |f_i| (E_i + u ||u_i||)``, where ``w_i`` is what
    :meth:`Outer.total`, :meth:`Rows.total`, :meth:`Dense.total` and :meth:`Tied.total` write for sample i
    alone with the factor ``f_i`` (in ``dtype``, unit roundoff ``u``). None when every ``E_i`` is 0.
    ``known`` maps ``id(part)`` of Outer parts to their ``R_i`` already computed by the native ghost norms.

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

    A :class:`Tied` part (``u_i = r_i + h_i``, rows coalesced) writes ``w = fl(o + fl(f r))`` per entry,
    ``o`` its Outer part's matmul: ``||o - f h|| <= f E_h`` (above), ``||fl(f r) - f r|| <= u f ||r||``,
    and the final addition adds at most ``u ||o + fl(f r)|| <= u f (||u_i|| + E_h + u ||r||)``, so
    ``E_i = (1 + u) (E_h + u ||r_i||)``: relative to ``||r_i||``, which may be far above ``||u_i||`` when
    the table's and the map's terms cancel.

    ``accumulate``: the dtype the totals are formed in (default ``dtype``). ``torch.float64`` beside float32
    ``dtype`` (the factors and the parts' entries float32, widened exactly; :meth:`GhostClipper._clip` sums
    so) prices the float64 sum, then its one rounding to ``dtype``. The argument above holds with the
    float64 unit ``u64`` for every rounding inside the sum, and without reduced precision (TF32 and bfloat16
    matmul and cuDNN settings, and autocast, apply to float32 inputs, never to float64). Per entry ``x`` (the
    exact ``f_i u_i`` entry) and ``w`` (its float64 value), the stored ``fl(w)`` is within ``u |x| + (1 + u)
    |w - x|`` of ``x``: the ``u |x|`` are the contract's one rounding per entry, so each part's ``E`` is its
    float64 one times ``1 + u``. A Rows or Dense entry ``f r`` is a product of two float32 numbers, exact in
    float64 (``E = 0``); an Outer part has ``E = gamma R_i`` with ``k u64``; a Tied part's ``fl(f r)`` is
    exact and its final addition rounds by ``u64 |o + f r| <= u64 (|x| + |o - f h|)``: with ``||x|| <=
    f (||r_i|| + R_h)`` (``||h|| <= R_h``) and ``E_h >= 2 u64 R_h`` (the map has a step), ``||w - x|| <=
    f ((1 + u64) E_h + u64 ||r_i|| + E_h / 2)``, so ``E = (1 + u) (2 E_h + u64 ||r_i||)``. The per-record
    rounding of the float32 factors (``f' <= f (1 + u)``, :meth:`GhostClipper._clip`'s step 2) is the
    caller's and stays priced there.

    The error is priced per part, for the form of its sum: an Outer part whose sum forms each record's
    float32 matrix (:meth:`Outer.sums_per_record32`: ``sum_form="record32"``, float32 pieces, summed in
    float64) has its own ``E`` (:func:`record32_error`: ``gamma_K R_i`` with the float32 unit, and the
    reduced-precision unit where torch's settings allow it), every other part the float64 one above.
    """
    unit = 2.0 ** -24 if dtype == torch.float32 else U64
    accumulate = dtype if accumulate is None else accumulate
    wide = accumulate == torch.float64 and dtype == torch.float32
    if not wide and accumulate != dtype:
        raise ValueError(f"accumulate: sums of {dtype} factors are priced in float64 or {dtype}, "
                         f"not {accumulate}")
    inner = U64 if wide else unit  # the unit roundoff of the additions and products inside the sums
    known = known or {}
    error: Tensor | None = None
    for _, part in parts:
        if isinstance(part, Tied):
            e = _part_error(part.outer, batch, accumulate, device, inner, known.get(id(part.outer)))
            rows = part.rows.flat()
            r = (torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64)
                 * (1.0 + 2.0 * (rows.shape[-1] + 8) * U64))  # rounded up
            if wide:  # 2 E_h + u64 ||r|| (see above; E_h >= 2 u64 R_h as the map has a step)
                e = U64 * r if e is None else 2.0 * e + U64 * r
                e = e * (1.0 + 16.0 * U64)  # this line's float64 roundings
            else:
                e = unit * r if e is None else e + unit * r
                e = e * (1.0 + unit + 16.0 * U64)  # (1 + u), and this line's float64 roundings
        else:
            e = _part_error(part, batch, accumulate, device, inner, known.get(id(part)))
        if e is not None:
            error = e if error is None else error + e
    if error is None:
        return None
    # ... and the additions over the parts; a float64 sum's one rounding to dtype: (1 + u).
    return error * ((1.0 + 2.0 * (len(parts) + 8) * U64) * (1.0 + unit + 4.0 * U64 if wide else 1.0))


def _part_error(part: Part, batch: int, dtype: torch.dtype, device: torch.device,
                unit: float, known: Tensor | None = None) -> Tensor | None:
    """One part's ``E_i`` (see :func:`write_error`), or None when it is 0. ``known``: an Outer part's
    ``R_i`` as :func:`dpvr.ops.ghost_norms` computed it (``outer_bounds``) from the same pieces: the same
    float64 products of norms summed over the same steps, so the same bound on its own rounding holds."""
    if isinstance(part, Outer) and part.sums_per_record32(dtype):
        return record32_error(part, batch, device, known)
    reduced = 0.0
    if dtype == torch.float32 and not isinstance(part, Rows):  # Rows.total multiplies elementwise
        reduced = 2.0 * reduced_precision_unit(isinstance(part, Outer) and part.by_convolution, device)
    if isinstance(part, Outer):
        pieces = with_steps(part.pieces)
        r = outer_bound(pieces, batch, device) if known is None else known
        terms = sum(m.shape[1] for m, _ in pieces)
        width = max(m.shape[-1] + n.shape[-1] for m, n in pieces)
        rounds = (terms + 1) * unit + reduced
    elif isinstance(part, Dense) and reduced > 0.0:
        u = part.u.reshape(part.u.shape[0], -1)
        r = torch.linalg.vector_norm(u, dim=-1, dtype=torch.float64)
        terms, width, rounds = 1, u.shape[-1], reduced
    else:
        return None
    if rounds >= 0.5:
        raise ValueError(f"a layer's clipped sum adds {terms} terms per entry: too many for the rounding "
                         f"of {dtype} to be bounded; use float64 parameters")
    # R's own float64 roundings (norms over the widths, products, the sum over the steps), rounded up.
    return (rounds / (1.0 - rounds)) * (1.0 + 2.0 * (width + terms + 8) * U64) * r


def record32_error(part: Outer, batch: int, device: torch.device, known: Tensor | None = None) -> Tensor:
    """``E_i`` of an Outer part whose clipped sum forms each record's matrix in float32
    (:meth:`Outer._record32_total`): a float64 ``(B,)`` bound on ``||w^_i - u_i||``, where ``w^_i`` is
    record i's float32 matrix as widened to float64 and ``u_i = sum_t n_t m_t^T`` the exact matrix of the
    pieces (widths ``p`` and ``q``), formed over the ``K_i`` steps record i reads (its steps whose output
    gradient is not zero, over all pieces). ``known``: ``R_i`` as the native norms computed it (see
    :func:`_part_error`).

    The bound (``u = 2^-24``, ``gamma_K = K u / (1 - K u)``, ``u'`` the reduced-precision unit of torch's
    float32 matmul setting (:func:`reduced_precision_unit`; 0 at ``"highest"``), ``mu = 2^-126``): an
    entry of ``w^_i`` is a float32 sum of ``K = K_i`` products in any order (blocked, vectorised, fused):
    reading an input may round it relatively by ``u'`` and, under denormals-are-zero, absolutely by less
    than ``mu``; each product and each addition rounds relatively by ``u`` (at most ``K`` such on any
    term's path: ``gamma_K``) and absolutely by less than ``mu`` (gradual underflow or a flush to zero: at
    most ``2 K`` per entry, each amplified by at most ``1 + gamma_K``); widening the entry to float64 is
    exact but for a flushed denormal (less than ``mu``). So, per entry ``(a, b)``, ``|w^ - x| <= g sum_t
    |n_ta| |m_tb| + mu (1 + gamma_K) (1 + u') (sum_t (|m_tb| + |n_ta|) + 3 K + 1)`` with ``g = (1 + u')^2
    (1 + gamma_K) - 1``, and over the entries (Frobenius; ``||[|n_t| |m_t|^T]|| = ||n_t|| ||m_t||``, the
    entries of ``m_t`` at most ``A_i`` and of ``n_t`` at most ``B_i`` in magnitude over the record's read
    steps):

        ||w^_i - u_i|| <= g R_i + mu (1 + gamma_K) (1 + u') sqrt(p q) (K (A_i + B_i) + 3 K + 1),

    ``R_i = sum_t ||n_t|| ||m_t||``. ``A_i`` and ``B_i`` are float32 maxima (exact); everything else is
    computed in float64 and rounded up. Every quantity follows record i alone (``K_i`` and the maxima over
    its read steps, never over the steps the batch keeps), so a neighbour moves no other record's bound,
    and so no other record's factor. The factors and entries then widen exactly and ``f_i w^_i`` is exact in
    float64 (two float32 significands), so for a record alone the float64 value is ``f_i w^_i``, within
    ``f_i E_i`` of ``f_i u_i``; :func:`write_error` adds the sums' one rounding to the parameters' dtype.
    The cancelling steps, calls or pieces that make ``R_i`` far exceed ``||u_i||`` are why the bound is not
    relative to ``||u_i||``.
    """
    pieces = with_steps(part.pieces)
    p, q = pieces[0][0].shape[-1], pieces[0][1].shape[-1]
    largest_m = torch.cat([_step_max_abs(m) for m, _ in pieces], dim=1)
    largest_n = torch.cat([_step_max_abs(n) for _, n in pieces], dim=1)
    read = largest_n.ne(0)  # as Outer._own_steps reads a step (NaN included)
    steps = read.sum(dim=1).to(torch.float64)
    if batch and not float(steps.max()) * U32 < 0.5:
        raise ValueError(f"a layer's float32 per-record sum adds {int(steps.max())} terms per entry: too "
                         "many for its rounding to be bounded")
    unit = reduced_precision_unit(False, device)  # the per-record product is a matmul, never a conv
    gamma = steps * U32 / (1.0 - steps * U32) * (1.0 + 8.0 * U64)
    g = ((1.0 + unit) ** 2 * (1.0 + gamma) - 1.0) * (1.0 + 8.0 * U64)
    r = outer_bound(pieces, batch, device) if known is None else known
    r = r * (1.0 + 2.0 * (p + q + steps + 8) * U64)  # R's own float64 roundings, rounded up
    largest = torch.zeros(batch, dtype=torch.float64, device=device)
    if read.shape[1]:  # (a part whose every step was left out has none)
        largest = (largest_m.where(read, 0.0).amax(dim=1) + largest_n.amax(dim=1)).to(torch.float64)
    tiny = TINY32 * (1.0 + gamma) * (1.0 + unit) * math.sqrt(p * q) * (1.0 + 4.0 * U64)
    return (g * r + tiny * (steps * largest + (3.0 * steps + 1.0))) * (1.0 + 16.0 * U64)


def _step_max_abs(t: Tensor) -> Tensor:
    """Each step's largest entry in magnitude of a ``(B, T, w)`` piece, exactly (a float32 maximum and
    minimum, negated exactly): ``(B, T)``, NaN where the step is not finite. ``abs`` would write a copy of
    the piece, and a maximum-norm reduction ran 3-7 times slower on the host."""
    return torch.maximum(t.amax(dim=-1), -t.amin(dim=-1))


def outer_bound(pieces: Sequence[tuple[Tensor, Tensor]], batch: int, device: torch.device) -> Tensor:
    """Float64 ``(B,)`` ``R_i = sum_t ||m_it|| ||n_it||`` over ``(B, T, w)`` pieces, before its own
    roundings (the callers round it up)."""
    r = torch.zeros(batch, dtype=torch.float64, device=device)
    for m, n in pieces:
        r += (torch.linalg.vector_norm(m, dim=-1, dtype=torch.float64)
              * torch.linalg.vector_norm(n, dim=-1, dtype=torch.float64)).sum(dim=1)
    return r


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
