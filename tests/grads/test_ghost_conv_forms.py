"""Convolutions' norm forms and clipped sums on the host: the form is chosen from the recorded calls without
unfolding the patches, and the clipped sum over unfolded patches (one float64 matmul per chunk of samples)
agrees with float64 per-record autograd within :func:`~dpvr.grads.ghost.norms.write_error`'s bound."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpvr.grads import GhostClipper, per_sample_grads
from dpvr.grads.ghost import cost, linear, norms
from dpvr.grads.ghost.linear import ConvOuter, ConvRule
from dpvr.grads.ghost.rules import LayerCall, Outer

U64 = 2.0 ** -53
RATES = cost.Rates(matmul32=1e11, matmul64=5e10, gram=8e9, direct=1.2e10, bandwidth=1e10)
# Rates under which the float32 Gram form beats every other form that may run (the native Gram form too).
GRAM32 = cost.Rates(matmul32=1e20, matmul64=1e10, gram=1e3, direct=1e3, bandwidth=1e20)

CONVS = [  # (module, input shape without the batch)
    (nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), (3, 19)),
    (nn.Conv2d(4, 6, 3, stride=1, padding=1), (4, 9, 9)),
    (nn.Conv2d(5, 3, (2, 3), stride=(2, 1), padding=0, dilation=(1, 2)), (5, 10, 11)),
    (nn.Conv2d(4, 4, 3, padding="same", padding_mode="reflect"), (4, 7, 8)),
    (nn.Conv3d(2, 3, 2, stride=2, padding=1), (2, 5, 6, 5)),
]


def conv_part(conv: nn.Module, shape: tuple[int, ...], batch: int, seed: int,
              dtype: torch.dtype = torch.float32) -> tuple[ConvOuter, torch.Tensor, torch.Tensor]:
    """The weight's ConvOuter part of one recorded call on random data, with its input and output grad."""
    g = torch.Generator().manual_seed(seed)
    conv = conv.to(dtype)
    x = torch.randn(batch, *shape, generator=g, dtype=dtype)
    with torch.no_grad():
        out = conv(x)
    grad = torch.randn(out.shape, generator=g, dtype=dtype)
    call = LayerCall((x,), {}, [grad], {}, batch)
    part = ConvRule(conv, ["weight", "bias"]).gradient([call])["weight"]
    assert isinstance(part, ConvOuter)
    return part, x, grad


def exact_per_sample(conv: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Float64 autograd, one record at a time: the ``(B, C_out, -1)`` weight gradients of
    ``sum grad * conv(x)``."""
    conv64 = type(conv)(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                        conv.dilation, padding_mode=conv.padding_mode).double()
    conv64.load_state_dict({k: v.double() for k, v in conv.state_dict().items()})
    out = []
    for xi, gi in zip(x.double(), grad.double()):
        (w,) = torch.autograd.grad((conv64(xi[None]) * gi[None]).sum(), conv64.weight)
        out.append(w.reshape(w.shape[0], -1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index", range(len(CONVS)))
def test_the_choice_reads_the_calls_and_never_unfolds(index, dtype) -> None:
    conv, shape = CONVS[index]
    part, _, _ = conv_part(conv, shape, 5, seed=index, dtype=dtype)
    with cost.pinned_rates(RATES):
        for budget in (0.0, 2.0 ** 12, None):
            got = part.choice(budget)
            assert "pieces" not in part.__dict__  # the patches were not unfolded to choose
            reference = Outer.choice(part, budget)  # from the unfolded pieces (forms them)
            assert got == reference
            del part.__dict__["pieces"]
    assert got.itemsize == torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("chunk_bytes", [float(1 << 26), 1.0, 3000.0])
@pytest.mark.parametrize("index", range(len(CONVS)))
def test_the_unfolded_sum_is_within_the_rounding_bound(index, chunk_bytes, monkeypatch) -> None:
    """Every record alone: ``||w_i - f_i u_i|| <= f_i E_i`` in float64, with ``u_i`` from float64 autograd
    and ``E_i`` the bound the clipper prices; the batch's total agrees with the convolution's own float64
    weight gradient (the other path) to float64 rounding, whatever the chunks (down to one sample)."""
    monkeypatch.setattr(linear, "_TOTAL_CHUNK_BYTES", chunk_bytes)
    conv, shape = CONVS[index]
    batch = 6
    part, x, grad = conv_part(conv, shape, batch, seed=10 + index)
    exact = exact_per_sample(conv, x, grad)
    f = torch.linspace(0.25, 1.5, batch, dtype=torch.float64)
    weight_shape = conv.weight.shape
    _ = part.pieces  # as a norm form leaves it: unfolded
    total = part.total(f, weight_shape)
    assert total.dtype == torch.float64
    by_convolution = ConvOuter(part.rule, part.raw).total(f, weight_shape)
    scale = float(torch.einsum("i,ijk->jk", f, exact.abs()).norm())
    assert float((total - by_convolution).norm()) <= 1e-12 * scale
    torch.testing.assert_close(total.reshape(weight_shape[0], -1), torch.einsum("i,ijk->jk", f, exact),
                               rtol=0, atol=1e-12 * scale)
    for i in range(batch):
        one = ConvOuter(part.rule, [([x[i:i + 1]], [grad[i:i + 1]])])
        _ = one.pieces
        written = one.total(f[i:i + 1], weight_shape).reshape(weight_shape[0], -1)
        error = norms.write_error([(0, one)], 1, torch.float32, x.device, accumulate=torch.float64)
        assert error is not None and float(error[0]) > 0
        miss = float((written - f[i] * exact[i]).norm())
        assert miss <= float(f[i] * error[0])


class ConvNet(nn.Module):
    """Convolutions (a stride, a 1x1 projection) with GroupNorm, pooled into a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.body = nn.Conv2d(8, 12, 3, stride=2, padding=1)
        self.skip = nn.Conv2d(8, 12, 1, stride=2)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.stem(x)))
        h = torch.relu(self.body(h) + self.skip(h))
        return self.head(h.mean(dim=(2, 3)))


def _float64_copy(model: nn.Module) -> nn.Module:
    model64 = ConvNet().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return model64


@pytest.mark.parametrize("forms", [("gram32",), ("gram",), ("chunked",), ("materialise", "gram32")])
def test_the_clipped_sums_agree_with_float64_autograd(forms, monkeypatch) -> None:
    """The clipper on a CNN with its convolutions' norms in each form (every form but materialising sums
    over the unfolded patches): norms are upper bounds on the float64 per-record norms and close to them,
    the clipped sums agree with float64 per-record autograd, and each record's written contribution alone
    has norm at most the radius."""
    monkeypatch.setattr(cost, "FORMS", forms)
    # the stem's and the projection's matrices fit the materialised form's budget, the body's do not
    monkeypatch.setenv(cost.BUDGET_ENV, "0.05")
    torch.manual_seed(5)
    model = ConvNet()
    batch = 7
    x, y = torch.randn(batch, 3, 10, 10), torch.randint(0, 3, (batch,))
    loss_fn = nn.functional.cross_entropy
    grads = per_sample_grads(_float64_copy(model), loss_fn, x.double(), y)
    exact = torch.cat([g.reshape(batch, -1) for g in grads], dim=1).norm(dim=1)
    clip = float(exact.median())  # about half of the records clipped
    with cost.pinned_rates(GRAM32):
        ghost = GhostClipper(model, loss_fn, backend="native")
        got = ghost.clipped_sum(x, y, clip)
        chosen = {name: c.form for name, c in ghost.choices.items() if name != "head.weight"}
        each = [ghost.clipped_sum(x[i:i + 1], y[i:i + 1], clip).sums for i in range(batch)]
    assert set(chosen.values()) <= set(forms) and forms[-1] in chosen.values()
    assert (got.norms.double() >= exact * (1 - 1e-6)).all()  # a float32 copy of an upper bound
    torch.testing.assert_close(got.norms.double(), exact, rtol=1e-4, atol=0)
    f = torch.clamp(clip / exact, max=1.0)
    for s, g in zip(got.sums, grads):
        torch.testing.assert_close(s.double(), torch.einsum("i,i...->...", f, g), rtol=1e-4, atol=1e-5 * clip)
    for sums in each:
        assert math.sqrt(sum(float(s.double().pow(2).sum()) for s in sums)) <= clip
