"""Ghost rules of linear maps: ``nn.Linear`` (any leading dimensions) and ``nn.Conv1d/2d/3d`` (``groups=1``,
any padding, stride and dilation), a convolution being a linear map of its unfolded input patches.

A weight's per-sample gradient is ``G^T A`` over the steps (positions); a bias's is ``sum_t G_t``. The
difference ``a_i G^T A - b_i G'^T A'`` is the two pieces ``(A, a G - b G')`` and ``(A - A', b G')``: its norm
bound is relative to the difference, exactly zero at identical points, and a layer whose input is the same
tensor at both points (the first layer) has one piece.

A convolution's clipped sum ``sum_i f_i G_i^T A_i`` is its own weight gradient for the output gradients
scaled by the factors, and its per-sample matrices are that weight gradient per sample (:class:`ConvOuter`):
the unfolded patches are formed only for the Gram and direct norm forms.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cost
from .rules import (
    Dense,
    GhostRule,
    LayerCall,
    Outer,
    Part,
    register_ghost_rule,
    same_tensor,
    scale_rows,
    steps,
    steps_read,
    with_steps,
    zero_rows,
)

# Pieces in the module's own layout: per piece, the inputs and the output gradients of each call.
Pieces = list[tuple[list[Tensor], list[Tensor]]]


class LinearMapRule(GhostRule):
    """A layer ``y = W x + b`` applied at several steps: subclasses give the ``(B, T, p)`` activations of an
    input and the ``(B, T, q)`` view of an output gradient, in the layout of ``weight.view(q, p)``."""

    def activations(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def output_grads(self, g: Tensor) -> Tensor:
        raise NotImplementedError

    def weight(self, pieces: Pieces) -> Outer:
        """The weight's part from pieces of inputs and output gradients (only the steps that carry any)."""
        recorded = [(steps([self.activations(x) for x in xs]), steps([self.output_grads(g) for g in gs]))
                    for xs, gs in pieces]
        m, _ = recorded[0]
        return Outer([read_steps(m, n) for m, n in recorded], m.shape[1] if m.dim() == 3 else 1)

    def _parts(self, pieces: Pieces, bias: list[Tensor]) -> dict[str, Part]:
        g = steps([self.output_grads(g) for g in bias])
        # One step: the output gradient is the bias's per-sample gradient itself (a view, no copy).
        return {"weight": self.weight(pieces), "bias": Dense(g[:, 0] if g.shape[1] == 1 else g.sum(dim=1))}

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        grads = [c.grad for c in calls]
        return self._parts([([c.input for c in calls], grads)], grads)

    def difference(self, calls, calls_b, a, b):
        grads_b = [scale_rows(c.grad, b) for c in calls_b]
        bias = [scale_rows(c.grad, a) - g_b for c, g_b in zip(calls, grads_b)]
        pieces = [([c.input for c in calls], bias)]
        inputs = [(c.input, c_b.input) for c, c_b in zip(calls, calls_b)]
        if not all(same_tensor(x, x_b) for x, x_b in inputs):
            # The activation map is linear: the difference of activations is that of the inputs.
            pieces.append(([x - x_b for x, x_b in inputs], grads_b))
        return self._parts(pieces, bias)


def read_steps(m: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """``(M, N)`` without the steps at which every sample's output gradient is zero.

    Such a step adds ``N[i, t] M[i, t]^T = 0`` to every sample's matrix, to its norm in either form, to the
    cross term of a tied part and to the clipped sum, so leaving it out changes no value (it shortens
    rounding chains only, which the bounds count from the steps kept). These are the positions a loss does
    not read: a sequence classified from its last position, labels set to be ignored, padding. On the host
    only: elsewhere the kept steps' count would cost a device synchronisation per layer.
    """
    if n.dim() != 3 or n.shape[1] == 1 or n.device.type != "cpu":
        return m, n
    kept = steps_read(n).any(dim=0)
    if bool(kept.all()):
        return m, n
    return m[:, kept], n[:, kept]


@register_ghost_rule(nn.Linear)
class LinearRule(LinearMapRule):
    """``nn.Linear`` on ``(B, ..., p)`` inputs: every leading position is a step."""

    position_wise = True

    def activations(self, x):
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def output_grads(self, g):
        return g.reshape(g.shape[0], -1, g.shape[-1])


def unfold_patches(x: Tensor, kernel: Sequence[int], stride: Sequence[int],
                   dilation: Sequence[int]) -> Tensor:
    """``(B, positions, C * prod(kernel))`` input patches of an already padded ``(B, C, *spatial)`` input, in
    the layout of a convolution weight ``(C_out, C * prod(kernel))``, for any number of spatial dimensions."""
    dims = len(kernel)
    for d in range(dims):
        # Windows along spatial dimension d (appended last), then every dilation-th entry of each.
        span = dilation[d] * (kernel[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])[..., :: dilation[d]]
    # (B, C, O_1..O_n, k_1..k_n) -> (B, O_1..O_n, C, k_1..k_n) -> (B, positions, C * prod(k))
    order = [0, *range(2, 2 + dims), 1, *range(2 + dims, 2 + 2 * dims)]
    return x.permute(order).reshape(x.shape[0], math.prod(x.shape[2:2 + dims]), -1)


_WEIGHT_GRADS = {
    1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight
}
_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
# Up to this many input channels (a first layer on grey or colour images), per-sample weight gradients come
# from one grouped convolution, 1-4x faster than vmap's batched weight gradient on the host; above it, vmap.
_GROUPED_MAX_CHANNELS = 3
# Bytes of widened copies one chunk of a clipped sum over unfolded patches may hold. Below the C library's
# 32 MiB threshold for mapping a buffer afresh, so that the chunks' buffers are reused from its heap: at
# 64 MiB each chunk took new pages, and a ResNet's DIFF2 round 270 000 page faults (2.2 s; 16 MiB: 135 000,
# 2.0 s). A chunk still holds at least one sample (a product over its steps).
_TOTAL_CHUNK_BYTES = float(1 << 24)


class ConvOuter(Outer):
    """A convolution weight's :class:`Outer` part, kept as the convolution sees it: per piece and call, the
    input and the output gradient in the module's layout (``convs``, with the zero padding left to apply).

    Its clipped sum is the convolution's own weight gradient of the scaled output gradients, and its
    per-sample matrices are that weight gradient taken per sample (``vmap``): neither needs the unfolded
    patches, which are formed only when a norm form asks for :attr:`pieces`.
    """

    by_convolution = True

    def __init__(self, rule: ConvRule, raw: Pieces) -> None:
        self.rule, self.raw = rule, raw

    @functools.cached_property
    def pieces(self) -> list[tuple[Tensor, Tensor]]:  # type: ignore[override]
        return LinearMapRule.weight(self.rule, self.raw).pieces

    @property
    def convs(self) -> list[tuple[Tensor, tuple[int, ...], Tensor]]:
        """``(input, padding still to apply, output gradient)`` of every call of every piece."""
        return [(*self.rule.padded(x), g) for xs, gs in self.raw for x, g in zip(xs, gs)]

    def sizes(self) -> tuple[int, int, int]:
        weight = self.rule.module.weight
        steps = sum(math.prod(g.shape[2:]) for g in self.raw[0][1])
        return steps, weight[0].numel(), weight.shape[0]

    def shapes(self) -> tuple[int, int, int, int, int]:
        """As :meth:`Outer.shapes` (the batch, the steps of all pieces as recorded, the widths and the
        recorded dtype), read from the recorded calls: choosing never unfolds the patches, which a part
        then materialised never needs."""
        steps, p, q = self.sizes()
        steps += sum(math.prod(g.shape[2:]) for _, gs in self.raw[1:] for g in gs)
        x = self.raw[0][0][0]
        return x.shape[0], steps, p, q, x.element_size()

    def choice(self, budget: float | None = None, difference: bool = False) -> cost.Choice:
        """As :meth:`Outer.choice`, from :meth:`shapes`: never unfolds the patches."""
        return cost.choose(*self.shapes(), budget=budget, difference=difference)

    def piece_dtype(self) -> torch.dtype:
        return self.raw[0][0][0].dtype

    def _weight_grad(self, x: Tensor, g: Tensor, padding: tuple[int, ...], shape: Sequence[int]) -> Tensor:
        m = self.rule.module
        return _WEIGHT_GRADS[len(m.kernel_size)](x, shape, g, tuple(m.stride), padding, tuple(m.dilation))

    def total(self, f: Tensor, shape: torch.Size) -> Tensor:
        """``sum_i f_i u_i`` in ``f``'s dtype (as :meth:`Outer.total`). On the host, once a norm form has
        unfolded the patches, one matmul over samples and steps per chunk of samples (:meth:`_unfolded_total`:
        the host's float64 convolution forms the same products about 1.5x slower); else the convolution's own
        weight gradient of the scaled output gradients. With :attr:`sum_form` ``"record32"``: each record's
        float32 matrix from its unfolded patches, a chunk of records at a time, summed over records in
        float64 (:meth:`Outer._record32_total`; unfolded by chunk of records when no norm form unfolded
        them), whose rounding :func:`~dpvr.grads.ghost.norms.write_error` prices as for any Outer part:
        explicit sums over the positions, where a convolution's own algorithm (Winograd, FFT) would not be
        covered by that bound. Off the host, today's float64 path (the clipper chooses it there)."""
        if self.sums_per_record32(f.dtype):
            return self._record32_total(f, shape)
        if "pieces" in self.__dict__ and f.device.type == "cpu":
            return self._unfolded_total(f, shape)
        out = None
        for x, padding, g in self.convs:
            term = self._weight_grad(x.to(f.dtype), scale_rows(g.to(f.dtype), f), padding, shape)
            out = term if out is None else out.add_(term)
        return out

    def steps_formed(self) -> bool:
        """Whether a norm form unfolded the patches already."""
        return "pieces" in self.__dict__

    def _steps_of(self, rows: slice) -> tuple[Tensor, Tensor]:
        """As :meth:`Outer._steps_of`; without unfolded :attr:`pieces`, the records ``rows`` of every call
        unfolded alone (the steps that add nothing kept: they add exact zeros)."""
        if "pieces" in self.__dict__:
            return Outer._steps_of(self, rows)
        ms, ns = [], []
        for xs, gs in self.raw:
            for x, g in zip(xs, gs):
                ms.append(self.rule.activations(x[rows]))
                ns.append(self.rule.output_grads(g[rows]))
        return steps(ms), steps(ns)

    def _unfolded_total(self, f: Tensor, shape: torch.Size) -> Tensor:
        """``sum_i f_i sum_t n_it m_it^T`` from the unfolded pieces, widened to ``f``'s dtype a chunk of
        samples at a time (at most :data:`_TOTAL_CHUNK_BYTES` of widened copies), each chunk's products
        added into the total by one matmul. Each entry is a sum of the same rounded terms as
        :meth:`Outer.total`'s (the output gradients scaled by the factors, each product, the additions over
        samples and steps in some order), so the rounding bound of
        :func:`~dpvr.grads.ghost.norms.write_error` holds unchanged."""
        out = None
        for m3, n3 in with_steps(self.pieces):
            per_sample = m3.shape[1] * (m3.shape[2] + n3.shape[2]) * f.element_size()
            size = max(1, int(_TOTAL_CHUNK_BYTES // max(per_sample, 1)))
            for start in range(0, m3.shape[0], size):
                rows = slice(start, start + size)
                # Widened straight into row-major (samples * steps, width) buffers: the unfolded patches are
                # a transposed view, which a widening then a reshape would copy twice.
                mc = torch.empty(m3[rows].shape, dtype=f.dtype).copy_(m3[rows])
                nc = torch.empty(n3[rows].shape, dtype=f.dtype).copy_(n3[rows])
                nc = scale_rows(nc, f[rows])
                a, b = nc.reshape(-1, nc.shape[-1]).t(), mc.reshape(-1, mc.shape[-1])
                out = a @ b if out is None else out.addmm_(a, b)
        return out.reshape(shape)

    def per_sample(self) -> Tensor:
        shape = self.rule.module.weight.shape
        out = None
        for x, padding, g in self.convs:
            if x.shape[1] <= _GROUPED_MAX_CHANNELS:
                term = self._grouped_weight_grads(x, g, padding)
            else:
                one = functools.partial(self._one_weight_grad, padding=padding, shape=shape)
                term = torch.vmap(one)(x, g)
            out = term if out is None else out.add_(term)
        return out.reshape(out.shape[0], shape[0], -1)

    def _one_weight_grad(self, x: Tensor, g: Tensor, padding: tuple[int, ...],
                         shape: Sequence[int]) -> Tensor:
        """One sample's weight gradient (under ``vmap``)."""
        return self._weight_grad(x[None], g[None], padding, shape)

    def _grouped_weight_grads(self, x: Tensor, g: Tensor, padding: tuple[int, ...]) -> Tensor:
        """``(B, C_out, C_in, *kernel)`` weight gradients per sample as one grouped convolution: input
        channels as the batch, each sample a group whose kernels are its output gradients. The weight
        gradient ``sum_t g[t] x[stride t + dilation u]`` is a convolution of ``x`` with ``g`` dilated by the
        stride, at a step of the dilation, cropped to the kernel."""
        m = self.rule.module
        batch, c_in, c_out, dims = x.shape[0], x.shape[1], g.shape[1], len(m.kernel_size)
        kernels = g.reshape(batch * c_out, 1, *g.shape[2:])
        r = _CONVS[dims](x.transpose(0, 1), kernels, padding=padding, stride=tuple(m.dilation),
                         dilation=tuple(m.stride), groups=batch)
        r = r[(..., *(slice(0, k) for k in m.kernel_size))]
        return r.reshape(c_in, batch, c_out, *m.kernel_size).permute(1, 2, 0, *range(3, 3 + dims))

    def drop(self, bad: Tensor) -> ConvOuter:
        dropped = ConvOuter(self.rule, [([zero_rows(x, bad) for x in xs], [zero_rows(g, bad) for g in gs])
                                        for xs, gs in self.raw])
        dropped.sum_form = self.sum_form
        return dropped


@register_ghost_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(LinearMapRule):
    """``nn.Conv1d/2d/3d`` with ``groups=1``: the steps are the output positions and the activations the
    input patches, laid out as ``weight.view(C_out, C_in * prod(kernel))``."""

    @classmethod
    def supports(cls, module):
        return module.groups == 1

    def padded(self, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """``x`` as the convolution reads it, and the symmetric zero padding still to apply."""
        m = self.module
        if m.padding_mode == "zeros" and not isinstance(m.padding, str):
            return x, tuple(m.padding)
        if any(m._reversed_padding_repeated_twice):  # the module's own padding ('same' may be asymmetric)
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
        return x, (0,) * len(m.kernel_size)

    def activations(self, x):
        m = self.module
        x, padding = self.padded(x)
        if len(m.kernel_size) == 2:  # torch's im2col writes the patches in one pass
            return F.unfold(x, m.kernel_size, m.dilation, padding, m.stride).transpose(1, 2)
        if any(padding):  # symmetric zeros
            x = F.pad(x, m._reversed_padding_repeated_twice)
        return unfold_patches(x, m.kernel_size, m.stride, m.dilation)

    def output_grads(self, g):
        return g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2)

    def weight(self, pieces: Pieces) -> ConvOuter:
        return ConvOuter(self, pieces)
