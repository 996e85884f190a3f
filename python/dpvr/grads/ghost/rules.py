"""The interface of per-layer ghost rules, the three kinds of per-sample terms they return, and the registry.

A rule turns what one layer saw in a recorded forward and backward pass (:class:`LayerCall`) into its
per-sample gradient (or same-sample gradient difference) expressed as *parts*, one per parameter:

- :class:`Outer`: ``u_i = sum_j sum_t N_j[i, t] M_j[i, t]^T`` (a linear map's weight; a convolution's after
  unfolding), a ``(q, p)`` matrix reshaped to the parameter;
- :class:`Rows`: ``u_i`` adds ``N_j[i, t]`` to row ``K_j[i, t]`` of a table (embeddings);
- :class:`Dense`: ``u_i`` materialised, one ``(B, *shape)`` tensor (biases, normalisation layers, fallbacks).

A parameter used by several modules gets the sum of their parts (:func:`shared`): more pieces of one part,
or a :class:`Tied` part for a table that is also a linear map's weight (a tied embedding and output head).

The clipper coalesces each sample's ``Rows`` per key (:meth:`Rows.coalesced`), computes every sample's norm
from the parts (natively on the host, with torch on other devices: both return upper bounds that include
their rounding error) plus a bound on the rounding of the ``Outer`` parts' sums
(:func:`~dpvr.grads.ghost.norms.write_error`), then the clipped sum ``sum_i f_i u_i`` of each part without
forming ``u_i`` for ``Outer`` and ``Rows``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import torch
from torch import Tensor, nn

from ... import ops
from . import cost

# Widened entries per block of a materialised part's clipped sum on the host (Dense.total): small enough to
# stay in cache, large enough that each block's product runs at the matmul's rate.
DENSE_BLOCK_BYTES = 1 << 21


def scale_rows(t: Tensor, s: Tensor | None) -> Tensor:
    """``t`` with row (sample) i scaled by ``s[i]``; ``t`` itself when ``s`` is None."""
    return t if s is None else t * s.view(-1, *([1] * (t.dim() - 1)))


def scale_rows64(t: Tensor, s: Tensor | None) -> Tensor:
    """``scale_rows(t, s)`` in float64: exact for float32 ``t`` and ``s``."""
    return scale_rows(t.to(torch.float64), None if s is None else s.to(torch.float64))


def zero_rows(t: Tensor, bad: Tensor) -> Tensor:
    """``t`` with the rows (samples) marked in ``bad`` set to zero (NaN and infinities included)."""
    return t.masked_fill(bad.view(-1, *([1] * (t.dim() - 1))), 0)


def steps(ts: Sequence[Tensor]) -> Tensor:
    """Several calls of one layer are more steps of one sequence: ``(B, T_k, w)`` -> ``(B, sum T_k, w)``."""
    return ts[0] if len(ts) == 1 else torch.cat(list(ts), dim=1)


def with_steps(pieces: Sequence[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """An Outer part's pieces with a steps dimension: ``(B, p)`` sides as ``(B, 1, p)``."""
    return [(m.unsqueeze(1), n.unsqueeze(1)) if m.dim() == 2 else (m, n) for m, n in pieces]


_HEAD = 8  # entries of a step read first by steps_read


def steps_read(n: Tensor) -> Tensor:
    """Whether each step of output gradients ``n`` (``(..., q)``) is read: has an entry that is not zero
    (NaN included, a zero of either sign not), i.e. ``n.any(dim=-1)``, with the same values.

    The first :data:`_HEAD` entries of a step almost always decide it, and only if some step's are all zero
    is every step scanned, by its largest and smallest entries (NaN propagates through both). Measured on
    two host cores: ``n.any(dim=-1)`` takes 17 ms for a convolution's ``(32, 256, 2304)`` gradients where
    the first entries take 0.15 ms, and 0.73 ms for GPT-2's ``(8, 128, 1536)`` read at one position a
    sequence where the extremes take 0.10 ms."""
    read = n[..., :_HEAD].ne(0).any(dim=-1)
    if n.shape[-1] <= _HEAD or bool(read.all()):
        return read
    return n.amax(dim=-1).ne(0) | n.amin(dim=-1).ne(0)


def summed(ts: Sequence[Tensor]) -> Tensor:
    """The sum of ``ts`` (the one tensor itself, not a copy, when there is one: a layer called once)."""
    return functools.reduce(torch.add, ts)


def read_columns(n: Tensor, width: int) -> Tensor | None:
    """The indices of the columns of output gradients ``n`` (``(B, T, q)`` or ``(B, q)``) that are nonzero for
    some sample and step; None for a map whose output is at most four times its input ``width`` (the scan
    costs about ``1 / (2 p)`` of the product per entry: worth it for an output head) or off the host (there
    the count would cost a device synchronisation).

    A column that is zero everywhere is a row of the ``(q, p)`` clipped sum that every term leaves at zero
    (a head read at a few columns: a classifier's label tokens), so only the other rows need forming: each is
    a sum of the same terms (in whatever order the product takes, which the bound of
    :func:`~dpvr.grads.ghost.norms.write_error` allows) and a row left out is an exact zero (where the whole
    product may write a zero of either sign). Which columns are kept depends on the values; the sum does
    not, only the time does (as with :func:`~dpvr.grads.ghost.linear.read_steps`)."""
    q = n.shape[-1]
    if n.device.type != "cpu" or q <= 4 * width:
        return None
    return n.reshape(-1, q).any(dim=0).nonzero().view(-1)


def same_tensor(x: Tensor, y: Tensor) -> bool:
    """Whether two recorded tensors are the same memory (the model input reaches the first layer at both
    points as one tensor). A value comparison would cost a device synchronisation per layer and step."""
    return x.shape == y.shape and x.data_ptr() == y.data_ptr() and x.stride() == y.stride()


@dataclass
class LayerCall:
    """One call of a tracked module in a recorded forward pass.

    ``args``/``kwargs``: its inputs, detached. ``grads``: per leaf of its output (``torch.utils._pytree``
    order), the gradient of the summed per-sample losses, so row i is sample i's own (None for a leaf that
    carries none, e.g. an integer tensor). ``params``: the values at the recorded point of every parameter
    of the module and its submodules (local names, as ``module.named_parameters()``). ``batch``: the number
    of samples. ``internals``/``internal_grads``: the intermediate tensors that the rule's
    :meth:`GhostRule.recording_forward` exposed (those named in ``GhostRule.internal_values``), and the
    gradients they all received (empty when the module's own forward ran).
    """

    args: tuple
    kwargs: dict
    grads: list[Tensor | None]
    params: dict[str, Tensor]
    batch: int
    versions: list[tuple[Tensor, int]] = field(default_factory=list)
    internals: dict[str, Tensor] = field(default_factory=dict)
    internal_grads: dict[str, Tensor] = field(default_factory=dict)

    @property
    def input(self) -> Tensor:
        """The first positional argument (or ``input=``)."""
        return self.args[0] if self.args else self.kwargs["input"]

    @property
    def grad(self) -> Tensor:
        """The gradient of the first output leaf."""
        g = self.grads[0]
        if g is None:
            raise ValueError("the layer's first output carries no gradient")
        return g

    def check_unmodified(self, layer: str) -> None:
        if any(t._version != v for t, v in self.versions):
            raise ValueError(f"an input of layer {layer!r} was modified in place after the layer used it")


# ---- parts: a parameter's per-sample vector, its clipped sum, its difference between two points ----

@dataclass
class Outer:
    """``u_i = sum_j sum_t N_j[i, t] M_j[i, t]^T``; ``pieces`` are ``(M_j, N_j)``, ``(B, T_j, p)`` and
    ``(B, T_j, q)`` (or ``(B, p)``/``(B, q)``); the ``(q, p)`` matrix is reshaped to the parameter.
    ``recorded_steps``: the first piece's steps as recorded, when steps that add nothing were left out
    (:func:`~dpvr.grads.ghost.linear.read_steps`), so that choices made from the sizes depend on the
    layer's shapes only, never on the values (the same at both points of a difference)."""

    pieces: list[tuple[Tensor, Tensor]]
    recorded_steps: int | None = None
    norm_form: str | None = None  # the form chosen for its norms (cost.choose); None: the caller's
    norm_scratch: float | None = None  # bytes of scratch that form may use (the float32 Gram form's blocks)
    # the form of its clipped sum (cost.SUM_FORMS; None: "float64"), set only for a part at ONE point
    sum_form: str | None = None
    by_convolution: ClassVar[bool] = False  # whether total() runs a convolution (cuDNN) rather than a matmul

    def total(self, f: Tensor, shape: torch.Size, out: Tensor | None = None) -> Tensor:
        """``sum_i f_i u_i``, computed in ``f``'s dtype (the pieces are widened to it: a float64 ``f`` sums
        over records in float64; see :meth:`GhostClipper._clip`). ``out``: a contiguous tensor of ``f``'s
        dtype with as many entries, written with the same products (the values do not depend on it).
        With :attr:`sum_form` ``"record32"`` (:meth:`sums_per_record32`): :meth:`_record32_total`. Rows
        that no term can reach are left out (:meth:`read_rows`)."""
        # (a record's float32 matrix keeps its full shape: rows kept for the batch would make it follow the
        # batch, see _record32_total)
        rows = None if self.sums_per_record32(f.dtype) else self.read_rows()
        if rows is not None:
            return self._rows_total(rows, f, shape, out)
        if self.sums_per_record32(f.dtype):
            return self._record32_total(f, shape, out)
        total = None
        for m, n in self.pieces:
            m, n = m.to(f.dtype), n.to(f.dtype)
            # Scale the narrower side by the factors; one matmul contracts samples and steps together.
            m, n = (m, scale_rows(n, f)) if n.shape[-1] <= m.shape[-1] else (scale_rows(m, f), n)
            left, right = n.reshape(-1, n.shape[-1]).t(), m.reshape(-1, m.shape[-1])
            if total is not None:  # added in place: a fresh product of a large map would take new pages
                total.addmm_(left, right)
            elif out is not None:
                total = torch.mm(left, right, out=out.view(left.shape[0], right.shape[1]))
            else:
                total = left @ right
        return total.reshape(shape)

    def read_rows(self) -> Tensor | None:
        """The rows of the ``(q, p)`` matrix that some piece's output gradients reach, when that is under a
        quarter of them (:func:`read_columns`, joined over the pieces); else None."""
        _, p, q = self.sizes()
        kept = [read_columns(n, p) for _, n in self.pieces]
        if any(k is None for k in kept):
            return None
        rows = torch.cat(kept).unique()
        return rows if 4 * rows.numel() < q else None

    def _rows_total(self, rows: Tensor, f: Tensor, shape: torch.Size, out: Tensor | None) -> Tensor:
        """:meth:`total` with only ``rows`` formed (the others are exact zeros), each by the part's own sum
        form over the pieces' columns ``rows``: the same terms per entry, so the bound that
        :func:`~dpvr.grads.ghost.norms.write_error` prices for the whole part (the same ``R_i`` and ``K``,
        and a larger ``p q``) covers it."""
        _, p, q = self.sizes()
        total = (out.view(q, p) if out is not None
                 else torch.empty(q, p, dtype=f.dtype, device=f.device)).zero_()
        if rows.numel():
            part = Outer([(m, n[..., rows]) for m, n in self.pieces], sum_form=self.sum_form)
            total.index_copy_(0, rows, part.total(f, torch.Size([rows.numel(), p])))
        return total.view(shape)

    def piece_dtype(self) -> torch.dtype:
        """The dtype of the recorded pieces."""
        return self.pieces[0][0].dtype

    def sums_per_record32(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`total` with factors of ``dtype`` forms each record's float32 matrix and sums the
        records in float64 (:meth:`_record32_total`): the part's :attr:`sum_form` is ``"record32"``, its
        pieces are float32 and the sum is accumulated in float64 (what
        :func:`~dpvr.grads.ghost.norms.write_error` prices for it)."""
        return (self.sum_form == "record32" and dtype == torch.float64
                and self.piece_dtype() == torch.float32)

    def _record32_total(self, f: Tensor, shape: torch.Size, out: Tensor | None = None) -> Tensor:
        """``sum_i f_i w_i`` in float64 with ``w_i = fl32(sum_t n_it m_it^T)``: each record's ``(q, p)``
        matrix from one float32 matmul over the steps that record reads (its steps whose output gradient is
        not zero; the others add exact zeros), a block of at most
        :data:`~dpvr.grads.ghost.cost.RECORD32_ENTRIES` entries of its rows at a time into one reused
        buffer, the blocks' weighted terms added in float64 (:func:`weighted_sum64`: the float32 factor and
        entries widened exactly, so every product ``f_i w_i`` is exact and only the additions over records
        round, in float64).

        Each record's matrix is computed from that record's pieces only, by a matmul whose shape is its own
        (its read steps, and row blocks fixed by ``p`` and ``q``), so ``w_i`` does not follow the batch: a
        neighbour that reads other steps, which changes the steps
        :func:`~dpvr.grads.ghost.linear.read_steps` keeps for the batch, leaves it bit for bit (a batched
        product over the kept steps would not: a matmul may order its float32 additions by shape, and every
        other record's term would then move by up to ``2 f_j E_j``, which no accountant prices). Its
        distance from ``f_i u_i`` is priced by :func:`~dpvr.grads.ghost.norms.record32_error` (``gamma_K R_i``
        with the float32 unit, ``K`` the steps the record reads). The records' terms are
        summed a chunk at a time (chunks fixed by ``p``, ``q`` and ``B``): a float64 sum, whose order of
        additions only moves float64 roundings. One formed piece whose records' matrices are large and wider
        than tall is summed a block of the sum's columns at a time instead (:meth:`_record32_by_block`).
        ``f``: float64 factors; ``out``: as for :meth:`total`."""
        batch = f.shape[0]
        _, p, q = self.sizes()
        total = (torch.empty(q * p, dtype=f.dtype, device=f.device) if out is None else out.view(-1))
        if 4 * p * q > cost.RECORD32_ENTRIES and p > q and len(self.pieces) == 1 and self.steps_formed():
            return self._record32_by_block(f, total, p, q).view(shape)
        size = min(batch, max(1, cost.RECORD32_ENTRIES // max(p * q, 1)))  # records whose terms join one sum
        block = min(q, max(1, cost.RECORD32_ENTRIES // max(p, 1)))  # rows of a record's matrix at a time
        buffer = torch.empty(size * block * p, dtype=torch.float32, device=f.device)
        for start in range(0, batch, size):
            rows = slice(start, min(start + size, batch))
            b = rows.stop - rows.start
            own = self._own_steps(rows)
            for lo in range(0, q, block):
                hi = min(lo + block, q)
                chunk = buffer[:b * (hi - lo) * p].view(b, hi - lo, p)
                for j, (mj, nj) in enumerate(own):
                    torch.mm(nj[:, lo:hi].t(), mj, out=chunk[j])
                weighted_sum64(f[rows], chunk.view(b, -1), total[lo * p:hi * p], accumulate=start > 0)
        return total.view(shape)

    def _record32_by_block(self, f: Tensor, total: Tensor, p: int, q: int) -> Tensor:
        """:meth:`_record32_total` for one formed piece whose records' ``(q, p)`` matrices are large and
        wider than tall (a convolution's): a block of :data:`~dpvr.grads.ghost.cost.RECORD32_SUM_BLOCK`
        entries of the sum's columns at a time, into which every record's block of its matrix is formed
        and added while the block stays in cache. Records outermost, the float64 sum (19 MB for a
        512-channel 3x3 convolution) went through memory once per record: 147 ms against 103 ms for 32
        such records on two host cores (86 against 56 ms with 16 steps).

        Which order runs follows the part's shapes only, never the values: each record's block is one
        float32 matmul over its own read steps (a view of its rows, or a copy of its read steps), of a shape
        fixed by ``p``, ``q`` and its own step count, so it follows the record alone; each entry adds the
        records' terms in their order, in float64. The copies (records that leave steps unread) are made
        once, at most the piece's size."""
        own = self._own_steps(slice(None))
        width = min(p, max(1, cost.RECORD32_SUM_BLOCK // q))
        buffer = torch.empty(q * width, dtype=torch.float32, device=f.device)
        columns = torch.empty(q * width, dtype=f.dtype, device=f.device)
        for lo in range(0, p, width):
            hi = min(lo + width, p)
            block, chunk = columns[:q * (hi - lo)], buffer[:q * (hi - lo)].view(q, hi - lo)
            for j, (mj, nj) in enumerate(own):
                torch.mm(nj.t(), mj[:, lo:hi], out=chunk)
                weighted_sum64(f[j:j + 1], chunk.view(1, -1), block, accumulate=j > 0)
            total.view(q, p)[:, lo:hi] = block.view(q, hi - lo)
        return total

    def steps_formed(self) -> bool:
        """Whether :attr:`pieces` are formed, so that reading every record's steps costs no new memory."""
        return True

    def _own_steps(self, rows: slice) -> list[tuple[Tensor, Tensor]]:
        """Per record of ``rows``, ``(M_i, N_i)`` over the steps that record reads (its steps whose output
        gradient is not zero, every piece's joined): ``(K_i, p)`` and ``(K_i, q)``, shapes that follow the
        record alone. A record that reads every step keeps a view of its rows; the others get a copy."""
        m, n = self._steps_of(rows)
        read = steps_read(n)
        every = read.all(dim=1).tolist()
        return [(m[j], n[j]) if every[j] else (m[j, read[j]], n[j, read[j]]) for j in range(len(every))]

    def by_read_count(self) -> list[tuple[Tensor, list[tuple[Tensor, Tensor]]]]:
        """The records grouped by the number of steps each reads in each piece (a step is read where its
        output gradient is not zero, :func:`steps_read`): per group, the records' indices and, per piece
        they read, their read steps, ``(b, K_j, p)`` and ``(b, K_j, q)``. Where every record reads every
        step these are the recorded pieces themselves: neither copied nor joined (a convolution's unfolded
        patches are a transposed view, which the batched products read as it is: copying it cost the
        ResNet's float32 Gram norms of a ``(32, 256, 2304)`` layer 105 ms against 61, the same values bit
        for bit; joining a difference's two points copied 340 MB a round there). Else copies.

        A record's tensors in its group depend on that record alone (its read steps per piece, in order,
        and their counts), so a batched product over a group gives each record what a product over its own
        steps would, whichever other records share the group: a batched product's batch count moves no
        record's value (as the forward pass assumes of its batched products; torch's host ``bmm`` gives the
        values of ``mm`` at every batch count tested). Pieces a record reads nothing of are left out of its
        group, and records that read nothing are in none: their matrices are exact zeros. Host only (the
        counts are read)."""
        pieces = with_steps(self.pieces)
        reads = [steps_read(n) for _, n in pieces]
        counts = torch.stack([read.sum(dim=1) for read in reads], dim=1)  # (B, pieces)
        recorded = torch.tensor([read.shape[1] for read in reads], device=counts.device)
        batch = counts.shape[0]
        if bool((counts == recorded).all()):
            return [(torch.arange(batch, device=counts.device), pieces)] if int(recorded.sum()) else []
        groups = []
        for key in counts.unique(dim=0):
            if not bool(key.any()):
                continue
            index = (counts == key).all(dim=1).nonzero().view(-1)
            group = []
            for (m, n), read, k in zip(pieces, reads, key.tolist()):
                if k:
                    kept = read[index]
                    group.append((m[index][kept].view(index.numel(), k, -1),
                                  n[index][kept].view(index.numel(), k, -1)))
            groups.append((index, group))
        return groups

    def _steps_of(self, rows: slice) -> tuple[Tensor, Tensor]:
        """``(M, N)`` of the records ``rows``: every piece's steps joined, ``(b, K, p)`` and ``(b, K, q)``."""
        pieces = with_steps(self.pieces)
        return steps([m[rows] for m, _ in pieces]), steps([n[rows] for _, n in pieces])

    def drop(self, bad: Tensor) -> Outer:
        return Outer([(zero_rows(m, bad), zero_rows(n, bad)) for m, n in self.pieces], sum_form=self.sum_form)

    def sizes(self) -> tuple[int, int, int]:
        """``(steps, p, q)``: the steps of one piece and the widths of the two sides."""
        m, n = self.pieces[0]
        steps = self.recorded_steps or (m.shape[1] if m.dim() == 3 else 1)
        return steps, m.shape[-1], n.shape[-1]

    def worth_materialising(self) -> bool:
        """Whether a sample's ``(q, p)`` matrix is no larger than the ``(T, p + q)`` recorded entries it comes
        from, i.e. the direct form costs no more than the Gram form. Materialised in the parameters' dtype
        (:meth:`per_sample`), it then replaces both the float64 norm pass over the steps and the clipped
        sum's matmul over the steps, at no more memory than the recording already holds."""
        steps, p, q = self.sizes()
        return steps > 1 and p * q <= steps * (p + q)

    def shapes(self) -> tuple[int, int, int, int, int]:
        """``(B, K, p, q, itemsize)``: the batch, the steps of all its pieces (as recorded), the widths and
        the bytes per recorded entry: what the choices read (never the values)."""
        steps, p, q = self.sizes()
        m = self.pieces[0][0]
        total = steps + sum(mj.shape[1] if mj.dim() == 3 else 1 for mj, _ in self.pieces[1:])
        return m.shape[0], total, p, q, m.element_size()

    def choice(self, budget: float | None = None, difference: bool = False) -> cost.Choice:
        """The form of this part's norms predicted fastest on this machine (:func:`cost.choose`, under
        ``budget`` bytes for the materialised form: default the whole budget), and of its clipped sum
        (``difference``: always float64), from its shapes alone (:meth:`shapes`; read from the pieces here,
        whatever a subclass reads)."""
        return cost.choose(*Outer.shapes(self), budget=budget, difference=difference)

    def sum_choice(self) -> str:
        """The form of this part's clipped sum predicted fastest (:func:`cost.choose_sum`), from
        :meth:`shapes` alone."""
        return cost.choose_sum(*self.shapes())

    def per_sample(self) -> Tensor:
        """The ``(B, q, p)`` per-sample matrices ``sum_j N_j[i]^T M_j[i]``, which the materialised form's
        norms measure and its clipped sum writes.

        On the host each record's matrix is a product over the steps that record reads, batched over the
        records that read as many (:meth:`by_read_count`), for the reason :meth:`_record32_total` gives:
        the steps :func:`~dpvr.grads.ghost.linear.read_steps` keeps follow the batch, and a batched product
        over them would let a neighbour move every other record's float32 matrix (and its term) by a
        rounding no accountant prices. Elsewhere no step is left out, and one batched product has a
        per-record shape fixed by the layer (its recorded steps), which assumes, as the forward pass does,
        that a batched product computes each record's matrix from that record's rows only."""
        if self.pieces[0][0].device.type == "cpu":
            batch, _, p, q, _ = self.shapes()
            groups = self.by_read_count()
            if len(groups) == 1 and groups[0][0].numel() == batch:  # every record reads every step
                return _products(groups[0][1])
            out = torch.zeros(batch, q, p, dtype=self.piece_dtype())
            for index, group in groups:
                out.index_copy_(0, index, _products(group))
            return out
        return _products(with_steps(self.pieces))

    def combine(self, other: Outer, a: Tensor | None, b: Tensor | None) -> Outer:
        """``a_i u_i - b_i u'_i`` as pieces of both (exact; its norm bound is relative to the two terms).

        Its clipped sum is always the float64 one (``sum_form`` left unset, whatever the two points' parts
        took): a float32 per-record matrix would round relative to ``R_i``, the sum over both points'
        steps of ``||n_t|| ||m_t||``, which may far exceed the small difference, and pricing that rounding
        would clip the difference away."""
        return Outer([(m, scale_rows(n, a)) for m, n in self.pieces]
                     + [(m, -scale_rows(n, b)) for m, n in other.pieces], norm_form=self.norm_form,
                     norm_scratch=self.norm_scratch, sum_form=None)


def _products(pieces: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """``sum_j N_j^T M_j`` per record of ``(b, K_j, p)`` and ``(b, K_j, q)`` pieces: ``(b, q, p)``, the pieces
    added in their order."""
    out = None
    for m, n in pieces:
        term = n.transpose(1, 2) @ m
        out = term if out is None else out.add_(term)
    return out


@dataclass
class Rows:
    """``u_i`` adds ``N_j[i, t]`` to row ``K_j[i, t]`` of a ``(rows, q)`` table; ``pieces`` are
    ``(K_j, N_j)``, int64 ``(B, T_j)`` and ``(B, T_j, q)``. Positions whose key is ``skip`` contribute
    nothing. ``unique``: the part is :meth:`coalesced` (one piece; within a sample, a key's rows after its
    first are zeros)."""

    pieces: list[tuple[Tensor, Tensor]]
    skip: int | None = None
    unique: bool = False

    def total(self, f: Tensor, shape: torch.Size) -> Tensor:
        """``sum_i f_i u_i`` in ``f``'s dtype (as :meth:`Outer.total`)."""
        n0 = self.pieces[0][1]
        out = torch.zeros(shape, dtype=f.dtype, device=n0.device)
        for k, n in self.pieces:
            out.index_add_(0, k.reshape(-1), scale_rows(n.to(f.dtype), f).reshape(-1, n.shape[-1]))
        if self.skip is not None:
            out[self.skip] = 0
        return out

    def coalesced(self, dtype: torch.dtype | None = None) -> Rows:
        """The same per-sample vectors with every sample's rows summed per key: what :meth:`total` then
        writes for one sample is exactly the vector that the norms measure, up to one rounding per entry.

        Each sample's keys are sorted; its rows of one key are added (in the pieces' dtype: a difference
        passes rows scaled and widened to float64, so that its rows are exact sums rounded once) into the
        slot of the key's first occurrence, and the sums are rounded to ``dtype`` (default: the pieces'
        dtype); the key's other slots hold zeros. Every table row of a sample is then one entry ``r`` in
        ``dtype`` plus zeros, which the norms measure, and for which :meth:`total` writes ``fl(f_i r)``
        (adding zeros is exact). Uncoalesced, a row written would be a float32 sum
        ``fl(f a) + fl(-f b) + ...`` of terms that may cancel (a difference's two points, repeated keys),
        whose rounding is not bounded by the small ``a - b`` that the norm measured.
        """
        dtype = self.pieces[0][1].dtype if dtype is None else dtype
        if self.unique and self.pieces[0][1].dtype == dtype:
            return self
        keys = steps([k.reshape(k.shape[0], -1) for k, _ in self.pieces])
        rows = steps([n if n.dim() == 3 else n.unsqueeze(1) for _, n in self.pieces])
        keys, order = keys.sort(dim=1)
        starts = torch.ones_like(keys, dtype=torch.bool)
        starts[:, 1:] = keys[:, 1:] != keys[:, :-1]
        position = torch.arange(keys.shape[1], device=keys.device).expand_as(keys)
        first = torch.where(starts, position, 0).cummax(dim=1).values  # sorted slot of each key's first entry
        slot = torch.empty_like(order).scatter_(1, order, first)  # ... for each entry in its own order
        batch, width, q = rows.shape
        slot += width * torch.arange(batch, device=slot.device).unsqueeze(1)
        sums = rows.new_zeros(batch * width, q).index_add_(0, slot.reshape(-1), rows.reshape(-1, q))
        return Rows([(keys, sums.view(batch, width, q).to(dtype))], self.skip, unique=True)

    def flat(self) -> Tensor:
        """``(B, T q)``: a coalesced part's entries with the skipped key's zeroed: each sample's vector (in
        some order, with zeros), whose norm is the vector's."""
        if not self.unique:
            raise ValueError("Rows.flat: coalesce the part first")
        (k, n), = self.pieces
        if self.skip is not None:
            n = n.masked_fill((k == self.skip).unsqueeze(-1), 0)
        return n.reshape(n.shape[0], -1)

    def drop(self, bad: Tensor) -> Rows:
        return Rows([(k, zero_rows(n, bad)) for k, n in self.pieces], self.skip, self.unique)

    def unskipped(self) -> Rows:
        """The same vectors without a skip key: the rows at the skipped key set to zero."""
        if self.skip is None:
            return self
        return Rows([(k, n.masked_fill((k == self.skip).unsqueeze(-1), 0)) for k, n in self.pieces],
                    None, self.unique)

    def per_sample(self, shape: torch.Size) -> Tensor:
        """The ``(B, *shape)`` per-sample tables."""
        part = self.unskipped()
        n0 = part.pieces[0][1]
        batch, rows = n0.shape[0], shape[0]
        out = n0.new_zeros(batch * rows, *shape[1:])
        offset = rows * torch.arange(batch, device=n0.device).unsqueeze(1)
        for k, n in part.pieces:
            keys = k.reshape(batch, -1) + offset
            out.index_add_(0, keys.reshape(-1), n.reshape(-1, *shape[1:]))
        return out.view(batch, *shape)

    def combine(self, other: Rows, a: Tensor | None, b: Tensor | None) -> Rows:
        """``a_i u_i - b_i u'_i``, scaled in float64 and :meth:`coalesced` to the pieces' dtype."""
        if self.skip != other.skip:
            raise ValueError("Rows parts with different skip keys cannot be combined")
        pieces = ([(k, scale_rows64(n, a)) for k, n in self.pieces]
                  + [(k, -scale_rows64(n, b)) for k, n in other.pieces])
        return Rows(pieces, self.skip).coalesced(self.pieces[0][1].dtype)


@dataclass
class Dense:
    """Materialised per-sample vectors ``u``, ``(B, *shape)``."""

    u: Tensor

    def total(self, f: Tensor, shape: torch.Size, out: Tensor | None = None) -> Tensor:
        """``sum_i f_i u_i`` in ``f``'s dtype (as :meth:`Outer.total`; ``out`` as there, used where ``u`` is
        widened on the host, else a fresh sum is returned).

        On the host, when ``u`` must be widened, the columns are widened and summed a block at a time
        (:data:`DENSE_BLOCK_BYTES` of widened entries): the same ``(1, B) @ (B, c)`` product per column
        (``tests/grads/test_dense_total.py`` checks the result bit for bit against one product, at one and
        two threads), without a widened copy of the whole ``(B, P)`` matrix. That copy, written to fresh
        pages and read back, cost a quarter of GPT-2 14M's DP-SGD step at T = 128 (materialised maps,
        B = 8)."""
        flat = self.u.reshape(self.u.shape[0], -1)
        if flat.dtype == f.dtype or flat.device.type != "cpu":
            return (f @ flat.to(f.dtype)).reshape(shape)
        out = torch.empty(flat.shape[1], dtype=f.dtype, device=flat.device) if out is None else out.view(-1)
        return weighted_sum64(f, flat, out).reshape(shape)

    def drop(self, bad: Tensor) -> Dense:
        return Dense(zero_rows(self.u, bad))

    def combine(self, other: Dense, a: Tensor | None, b: Tensor | None, out: Tensor | None = None) -> Dense:
        """``a_i u_i - b_i u'_i``, one subtraction per entry. ``out``: a tensor of the result's shape to
        write it into where its dtype is the result's (else a fresh one); it may be ``other.u``, whose every
        entry is read before it is written: the same values either way."""
        here, there = scale_rows(self.u, a), scale_rows(other.u, b)
        if out is None or out.dtype != torch.result_type(here, there):
            return Dense(here - there)
        return Dense(torch.sub(here, there, out=out))


def weighted_sum64(f: Tensor, flat: Tensor, out: Tensor, accumulate: bool = False) -> Tensor:
    """``out (+)= f @ flat`` for a ``(B, c)`` matrix ``flat`` of a narrower dtype than ``f`` on the host,
    into the ``(c,)`` tensor ``out`` of ``f``'s dtype (added to it when ``accumulate``), the columns widened
    and summed a block at a time (:data:`DENSE_BLOCK_BYTES` of widened entries): the same ``(1, B) @ (B, c)``
    product per column as one product of the widened matrix, without that widened copy (see
    :meth:`Dense.total`). Returns ``out``."""
    width = max(DENSE_BLOCK_BYTES // (flat.shape[0] * f.element_size()) // 64 * 64, 64)
    row = f.unsqueeze(0)
    # One thread: each block is too small to share, and on a busy host a team waiting for a descheduled
    # thread at every block made the loop six times slower than the whole-matrix product it replaces.
    with ops.torch_threads(1):
        for j in range(0, flat.shape[1], width):
            block = out[j:j + width].unsqueeze(0)
            if accumulate:
                block.addmm_(row, flat[:, j:j + width].to(f.dtype))
            else:
                torch.mm(row, flat[:, j:j + width].to(f.dtype), out=block)
    return out


Part = Union[Outer, Rows, Dense]


@dataclass
class Tied:
    """A ``(V, d)`` parameter shared by a table (an embedding) and a linear map (an output head) that hold the
    same matrix: ``u_i = r_i + h_i``, the table's rows ``r_i`` (:class:`Rows`, without a skip key) and the
    map's ``h_i`` (:class:`Outer`, ``(q, p) = (V, d)``). Neither matrix is formed: the norm is
    ``||r_i||^2 + ||h_i||^2 + 2 <r_i, h_i>``, the cross term from the recorded tensors
    (:func:`~dpvr.grads.ghost.norms._cross`, which bounds its rounding), and the clipped sum adds the scaled
    rows into the map's matmul (:func:`~dpvr.grads.ghost.norms.write_error` bounds that addition)."""

    rows: Rows
    outer: Outer

    def total(self, f: Tensor, shape: torch.Size, out: Tensor | None = None) -> Tensor:
        """``sum_i f_i u_i`` (as :meth:`Outer.total`, whose ``out`` it writes)."""
        out = self.outer.total(f, shape, out=out)
        for k, n in self.rows.pieces:
            out.index_add_(0, k.reshape(-1), scale_rows(n.to(f.dtype), f).reshape(-1, n.shape[-1]))
        return out

    def coalesced(self) -> Tied:
        return Tied(self.rows.coalesced(), self.outer)

    def drop(self, bad: Tensor) -> Tied:
        return Tied(self.rows.drop(bad), self.outer.drop(bad))


def per_sample(part: Part, shape: torch.Size) -> Tensor:
    """The ``(B, *shape)`` per-sample vectors of any part."""
    if isinstance(part, Dense):
        return part.u.reshape(part.u.shape[0], *shape)
    if isinstance(part, Rows):
        return part.per_sample(shape)
    u = part.per_sample()
    return u.reshape(u.shape[0], *shape)


def shared(parts: Sequence[Part], shape: torch.Size) -> Part | Tied:
    """The part of a parameter used by several modules, whose per-sample vector is the sum of theirs.

    Tables' rows join as more pieces of one :class:`Rows` part, linear maps' as more pieces of one
    :class:`Outer` (both exact: the sum of the vectors is the vector of the joined pieces); a table and a
    map holding one ``(V, d)`` matrix are a :class:`Tied` part. Any other combination (a materialised part
    among them) is materialised and summed (:class:`Dense`)."""
    tables = [p for p in parts if isinstance(p, Rows)]
    maps = [p for p in parts if isinstance(p, Outer)]
    if len(tables) + len(maps) == len(parts):
        skips = {p.skip for p in tables}
        if len(skips) > 1 or maps:  # a skip key of one module is a row like any other for the others
            tables = [p.unskipped() for p in tables]
        table = Rows([piece for p in tables for piece in p.pieces], tables[0].skip) if tables else None
        linear = Outer([piece for p in maps for piece in p.pieces]) if maps else None
        if table is None:
            return linear
        if linear is None:
            return table
        m, n = linear.pieces[0]
        # The map's (q, p) matrix must be the table itself: its rows indexed by the keys, of the rows' width.
        if len(shape) == 2 and (n.shape[-1], m.shape[-1], table.pieces[0][1].shape[-1]) == (*shape, shape[1]):
            return Tied(table, linear)
    return Dense(functools.reduce(torch.add, [per_sample(p, shape) for p in parts]))


# ---- rules ----

class GhostRule:
    """How one layer family's per-sample gradients are expressed as parts.

    A rule instance serves one module. The clipper records every call of the module at a parameter point
    (:class:`LayerCall`: inputs, output gradients, parameter values) and asks the rule for the parts of the
    per-sample gradient, one per parameter name it handles:

    - :meth:`gradient` (required): the parts of ``g_i``, summed over the module's calls;
    - :meth:`difference` (optional): the parts of ``a_i g_i(x) - b_i g_i(x')`` from the calls at two points.
      The default combines the two gradients' parts (:meth:`Outer.combine` etc.): exact, with a norm bound
      relative to the two gradients; override it for a bound relative to the difference (see the Linear
      rule).

    The clipper takes the parts of the trainable parameters (``self.trainable``; a rule may return parts for
    frozen ones too: they are ignored), bounds each sample's norm from all parts of all layers, and forms the
    clipped sums from the parts. Rules see tensors on the parameters' device and must use torch operations
    only (no host copies, no ``.item()``), so one rule serves the host and CUDA.

    Class attributes: ``parameters``: the parameter names the rule can handle (None: any); a module with a
    trainable parameter outside them falls back to materialised gradients. ``position_wise``: the module
    acts on every position of its input alike (Linear, LayerNorm, Embedding), so its calls may carry the batch
    at any dimension; the clipper learns which and records them batch-first. ``owns_submodules``: the rule
    handles the parameters of the module's submodules too (the module reads them directly, as
    ``MultiheadAttention`` does ``out_proj``'s), which are then not tracked on their own.
    ``internal_values``: the internals exposed by :meth:`recording_forward` whose values (not only their
    gradients) the rule reads; the others are not held after the recorded pass.
    """

    parameters: ClassVar[tuple[str, ...] | None] = ("weight", "bias")
    position_wise: ClassVar[bool] = False
    owns_submodules: ClassVar[bool] = False
    internal_values: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, module: nn.Module, trainable: Sequence[str]) -> None:
        self.module = module
        self.trainable = tuple(trainable)

    @classmethod
    def supports(cls, module: nn.Module) -> bool:
        """Whether this module's configuration is one the rule handles (else the module falls back)."""
        return True

    def check(self, name: str, call: LayerCall, batch: int) -> None:
        """Raises ``ValueError`` when a recorded call is not batch-first (the default layout)."""
        for g in call.grads:
            if g is not None and (g.dim() == 0 or g.shape[0] != batch):
                raise ValueError(f"layer {name!r} returned shape {tuple(g.shape)}, not batch-first (batch "
                                 f"{batch}): its per-sample gradients cannot be recovered")

    def recording_forward(self, args: tuple, kwargs: dict) -> tuple[Any, dict[str, Tensor]] | None:
        """Optional: the module's forward, computed so that intermediate tensors can be recorded too.

        Returns ``(output, internals)``, the module's output and named tensors of the computation whose
        gradients the recorded backward pass also collects (``LayerCall.internals``/``internal_grads``),
        or None to run the module's own forward. The output must be the module's function of the same
        parameters (read from ``self.module``); the per-sample gradients derived from the internals are then
        those of the computation that actually ran.
        """
        return None

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        """Parts of the per-sample gradient at one point, summed over ``calls``."""
        raise NotImplementedError

    def difference(self, calls: Sequence[LayerCall], calls_b: Sequence[LayerCall], a: Tensor | None,
                   b: Tensor | None) -> dict[str, Part]:
        """Parts of ``a_i g_i - b_i g'_i`` (``a``, ``b``: ``(B,)`` or None for 1), ``calls_b`` at the second
        point."""
        here, there = self.gradient(calls), self.gradient(calls_b)
        return {attr: part.combine(there[attr], a, b) for attr, part in here.items()}


_RULES: dict[type[nn.Module], type[GhostRule]] = {}
R = TypeVar("R", bound=type[GhostRule])


def register_ghost_rule(*module_types: type[nn.Module], replace: bool = False) -> Callable[[R], R]:
    """Class decorator: ``@register_ghost_rule(nn.Linear)`` makes the rule serve modules of these types.

    The match is on the exact type (``type(module) is nn.Linear``), never on subclasses: a subclass may
    change ``forward``, and a rule that assumed the parent's would give wrong norms. Register subclasses
    explicitly. ``replace=True`` overrides an existing registration; otherwise registering a type twice is
    an error.
    """
    def decorate(rule: R) -> R:
        if not (isinstance(rule, type) and issubclass(rule, GhostRule)):
            raise TypeError(f"register_ghost_rule decorates GhostRule subclasses, got {rule!r}")
        for kind in module_types:
            if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
                raise TypeError(f"register_ghost_rule: {kind!r} is not an nn.Module subclass")
            if kind in _RULES and not replace and _RULES[kind] is not rule:
                raise ValueError(f"{kind.__name__} already has the ghost rule {_RULES[kind].__name__}; pass "
                                 "replace=True to override it")
        _RULES.update(dict.fromkeys(module_types, rule))
        return rule
    return decorate


# Rules for other libraries' layers, keyed by the layer's qualified name: the module defining the rule is
# imported (and registers it) the first time such a layer is seen, so dpvr never imports those libraries.
_RULES_ELSEWHERE = {"transformers.pytorch_utils.Conv1D": "dpvr.grads.ghost.huggingface"}


def rule_for(module: nn.Module) -> type[GhostRule] | None:
    """The rule registered for ``type(module)`` that supports its configuration, or None."""
    kind = type(module)
    if kind not in _RULES and f"{kind.__module__}.{kind.__qualname__}" in _RULES_ELSEWHERE:
        importlib.import_module(_RULES_ELSEWHERE[f"{kind.__module__}.{kind.__qualname__}"])
    rule = _RULES.get(kind)
    return rule if rule is not None and rule.supports(module) else None
