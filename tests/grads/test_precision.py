"""Precision: half-precision parameters are refused with the fix; half-precision activations under
``torch.autocast`` are clipped and summed in float32 on every gradient path (CPU autocast with bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dpvr
from dpvr.algorithms import DPSGD
from dpvr.grads import GhostClipper
from dpvr.optim import RuntimeConfig
from dpvr.optim.gradients import ClippedGradients

BATCH = 8
CLIP = 0.5
HALF = [torch.bfloat16, torch.float16]


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


class Recurrent(nn.Module):
    """A Linear, a GRU and a PReLU (fallback layers) and a Linear head. The GRU is ghost-only: under
    autocast, torch's GRU kernel has no vmap batching rule, which the materialised path needs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 6)
        self.gru = nn.GRU(6, 4, batch_first=True)
        self.act = nn.PReLU(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.gru(torch.tanh(self.inner(x)))
        return self.head(self.act(h[:, -1]))


def mlp() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, 4 * torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))


def conv() -> tuple[nn.Module, Tensor, Tensor]:
    """Conv1d and GroupNorm (ghost rules), PReLU (a fallback layer), Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4), nn.PReLU(4), nn.Flatten(), nn.Linear(16, 3))
    return model, 4 * torch.randn(BATCH, 2, 6), torch.randint(0, 3, (BATCH,))


def recurrent() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    return Recurrent(), 4 * torch.randn(BATCH, 7, 5), torch.randint(0, 3, (BATCH,))


# (mode, model): every gradient path, and ghost rules and fallback layers both.
PATHS = [("ghost", mlp), ("ghost", conv), ("ghost", recurrent), ("materialised", mlp), ("materialised", conv)]
IDS = [f"{mode}-{case.__name__}" for mode, case in PATHS]


def first_layer(model: nn.Module) -> nn.Module:
    return model.inner if isinstance(model, Recurrent) else model[0]


def point(model: nn.Module) -> list[Tensor]:
    return [p.detach() for p in model.parameters()]


def clipped_sum(gradients: ClippedGradients, x: Tensor, y: Tensor, *, previous: list[Tensor] | None = None,
                autocast: bool) -> tuple[list[Tensor], int]:
    """The float32 clipped sum (and dropped count), with the forward in bfloat16 when ``autocast``."""
    out = [torch.zeros(p.numel()) for p in gradients.model.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if previous is None:
            dropped = gradients.sum(x, y, CLIP, out)
        else:
            dropped = gradients.diff_sum(x, y, point(gradients.model), previous, CLIP, out)
    return out, dropped


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", ["auto", "ghost", "materialised"])
def test_half_precision_parameters_are_refused_with_the_fix(mode, dtype) -> None:
    model, _, _ = mlp()
    with pytest.raises(ValueError, match=rf"model: trainable parameters are {dtype}.*torch\.autocast"):
        ClippedGradients(model.to(dtype), cross_entropy, mode=mode)


def test_half_precision_is_refused_by_the_ghost_clipper_and_the_algorithms() -> None:
    model, x, y = mlp()
    with pytest.raises(ValueError, match=r"torch\.bfloat16.*Keep the parameters in float32"):
        GhostClipper(model.bfloat16(), cross_entropy)
    with pytest.raises(ValueError, match=r"torch\.float16.*with torch\.autocast\('cpu'"):
        DPSGD(model.half(), cross_entropy, x, y, lr=0.1, clip=CLIP, steps=2, batch_size=4, noise=1.0)
    model, _, _ = mlp()
    model[0].double()
    with pytest.raises(ValueError, match="several dtypes"):
        ClippedGradients(model, cross_entropy)


@pytest.mark.parametrize(("mode", "case"), PATHS, ids=IDS)
def test_autocast_forward_is_clipped_and_summed_in_float32(mode, case) -> None:
    model, x, y = case()
    gradients = ClippedGradients(model, cross_entropy, mode=mode)
    assert gradients.mode == ("ghost" if case is mlp else "mixed") if mode == "ghost" else "materialised"
    seen: list[torch.dtype] = []
    handle = first_layer(model).register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    try:
        half, dropped = clipped_sum(gradients, x, y, autocast=True)
    finally:
        handle.remove()
    full, _ = clipped_sum(gradients, x, y, autocast=False)
    assert dropped == 0 and seen and set(seen) == {torch.bfloat16}  # dpvr's forward ran in half precision
    for h, f in zip(half, full):
        assert h.dtype == torch.float32 and bool(torch.isfinite(h).all())
        torch.testing.assert_close(h, f, rtol=0.05, atol=0.02 * CLIP)
    # The bound holds as in full precision: each sample alone contributes a vector of norm <= CLIP (the
    # inputs are large, so every sample is clipped, to within rounding of CLIP).
    for i in range(BATCH):
        alone, _ = clipped_sum(gradients, x[i : i + 1], y[i : i + 1], autocast=True)
        norm = float(torch.cat(alone).double().norm())
        assert 0.99 * CLIP < norm <= CLIP


@pytest.mark.parametrize(("mode", "case"), PATHS, ids=IDS)
def test_autocast_differences_are_clipped_in_float32(mode, case) -> None:
    model, x, y = case()
    gradients = ClippedGradients(model, cross_entropy, mode=mode)
    generator = torch.Generator().manual_seed(1)
    previous = [p + 0.5 * torch.randn(p.shape, generator=generator) for p in point(model)]
    half, _ = clipped_sum(gradients, x, y, previous=previous, autocast=True)
    full, _ = clipped_sum(gradients, x, y, previous=previous, autocast=False)
    for h, f in zip(half, full):
        assert h.dtype == torch.float32
        torch.testing.assert_close(h, f, rtol=0.05, atol=0.02 * CLIP)
    for i in range(BATCH):
        alone, _ = clipped_sum(gradients, x[i : i + 1], y[i : i + 1], previous=previous, autocast=True)
        assert float(torch.cat(alone).double().norm()) <= CLIP


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_ghost_clipper_widens_autocast_activations_on_both_backends(backend, dtype) -> None:
    model, x, y = recurrent()
    ghost = GhostClipper(model, cross_entropy, backend=backend)
    with torch.autocast("cpu", dtype=dtype):
        half = ghost.clipped_sum(x, y, CLIP)
    full = ghost.clipped_sum(x, y, CLIP)
    assert half.norms.dtype == half.losses.dtype == torch.float32
    assert all(s.dtype == torch.float32 for s in half.sums)
    torch.testing.assert_close(half.norms, full.norms, rtol=0.05, atol=0.0)
    torch.testing.assert_close(half.losses, full.losses, rtol=0.05, atol=0.01)
    for h, f in zip(half.sums, full.sums):
        torch.testing.assert_close(h, f, rtol=0.05, atol=0.02 * CLIP)


def test_dp_sgd_steps_under_autocast_keep_float32_parameters() -> None:
    """A run with the forward in bfloat16 ends near the same run in float32. The noise is negligible: its
    key binds the exact sums, so any rounding difference would draw other noise."""

    def run(autocast: bool) -> list[Tensor]:
        model, x, y = mlp()
        alg = DPSGD(model, cross_entropy, x, y, lr=0.5, clip=CLIP, steps=4, batch_size=4, noise=1e-100,
                    runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed=0, reproducible=True),
                                          sampler_seed=0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            infos = alg.run(progress=False)
        assert all(info["nonfinite"] == 0 for info in infos)
        return point(model)

    half, full = run(True), run(False)
    for h, f in zip(half, full):
        assert h.dtype == torch.float32
        torch.testing.assert_close(h, f, rtol=0.05, atol=0.01)
    assert any(not torch.equal(h, f) for h, f in zip(half, full))  # the forward did run in half precision
