"""Per-layer clipping (DPSGD's ``clipping="per_layer"``): each record's gradient on parameter group l clipped
to C_l, on the ghost, mixed and materialised paths, against float64 per-record autograd; the release priced
at sqrt(sum C_l^2); bad settings refused by name. The sensitivity and noise harnesses cover it too
(``dp-sgd/per-layer`` in tests/privacy/test_sensitivity.py, tests/privacy/test_noise_drawn.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dpvr
from dpvr.algorithms import DPSGD
from dpvr.grads import GhostClipper
from dpvr.grads.layer_clip import LayerRadii, layer_radii
from dpvr.optim import RuntimeConfig
from dpvr.optim.gradients import ClippedGradients

B = 12


def squared(output, target):
    return 0.5 * (output.squeeze(-1) - target) ** 2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1)).double()


class WithFallback(nn.Module):
    """A Linear (ghost) and a parameter used by a custom forward (materialised inside the ghost clipper)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.scale = Scale()

    def forward(self, x):
        return self.scale(self.lin(x)).sum(-1)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return torch.tanh(x) * self.gain


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 5, generator=g, dtype=torch.float64)
    y = torch.randn(B, generator=g, dtype=torch.float64)
    x[::3] *= 40.0  # large records: every group clipped for them, none for the others
    y[::3] *= 40.0
    return x, y


def reference(model: nn.Module, x, y, radii: LayerRadii) -> list[torch.Tensor]:
    """sum_i of each record's float64 autograd gradient, each group scaled by min(1, C_l / ||g_il||)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(len(x)):
        grads = torch.autograd.grad(squared(model(x[i : i + 1])[0], y[i]), params)
        for group, c in zip(radii.groups, radii.radii):
            norm = math.sqrt(sum(float((grads[k].double() ** 2).sum()) for k in group))
            factor = min(1.0, c / norm) if norm > 0 else 1.0
            for k in group:
                sums[k] += factor * grads[k].double()
    return sums


@pytest.mark.parametrize("mode", ["auto", "materialised"])
@pytest.mark.parametrize(
    "clip", [[0.3, 0.05, 0.2, 0.1], {"0": 0.3, "2": 0.2}, 0.4, {"0.weight": 0.1, "": 0.25}]
)
def test_per_layer_sums_match_float64_autograd(mode, clip):
    model = mlp()
    x, y = data()
    radii = layer_radii(model, clip)
    engine = ClippedGradients(model, squared, mode=mode)
    assert engine.mode == ("ghost" if mode == "auto" else "materialised")
    out = [torch.zeros_like(p, dtype=torch.float64).reshape(-1) for p in model.parameters()]
    norms = torch.empty(B, dtype=torch.float64)
    assert engine.sum(x, y, radii, out, norms=norms) == 0
    expected = reference(model, x, y, radii)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want.reshape(-1), rtol=1e-9, atol=1e-12)
    # the norms reported are the whole per-record gradients'
    whole = [math.sqrt(sum(float((g.double() ** 2).sum()) for g in torch.autograd.grad(
        squared(model(x[i : i + 1])[0], y[i]), list(model.parameters())))) for i in range(B)]
    torch.testing.assert_close(norms, torch.tensor(whole, dtype=torch.float64), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_ghost_clipper_backends_clip_per_layer(backend):
    """The torch backend (the CUDA path, run on the host here) and the native one give the per-layer sums,
    with a non-finite record dropped from every group (the torch path clears rows unconditionally)."""
    model = mlp()
    x, y = data()
    x[7, 1] = math.inf
    radii = layer_radii(model, [0.3, 0.05, 0.2, 0.1])
    result = GhostClipper(model, squared, backend=backend).clipped_sum(x, y, radii, wide=True)
    keep = torch.arange(B) != 7
    assert math.isnan(float(result.norms[7])) and torch.isfinite(result.norms[keep]).all()
    for got, want in zip(result.sums, reference(model, x[keep], y[keep], radii)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_each_records_group_terms_stay_within_their_radii():
    """A batch of one record: its term in group l has norm <= C_l (after rounding, float32), and the whole
    term <= sqrt(sum C_l^2); each group's term is min(||g_il||, C_l) long."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))
    radii = layer_radii(model, [0.3, 0.05, 0.2, 0.1])
    for mode in ("auto", "materialised"):
        engine = ClippedGradients(model, squared, mode=mode)
        for i in range(B):
            x, y = data()
            out = [torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()]
            engine.sum(x[i : i + 1].float(), y[i : i + 1].float(), radii, out)
            groups = [math.sqrt(sum(float((out[k] ** 2).sum()) for k in g)) for g in radii.groups]
            assert all(n <= c for n, c in zip(groups, radii.radii)), (mode, i, groups)
            grads = torch.autograd.grad(squared(model(x[i : i + 1].float())[0], y[i].float()),
                                        list(model.parameters()))
            unclipped = [math.sqrt(sum(float((grads[k].double() ** 2).sum()) for k in g))
                         for g in radii.groups]
            # each group is min(its norm, C_l) long: clipping one group leaves the others as they are
            for n, c, u in zip(groups, radii.radii, unclipped):
                assert n == pytest.approx(min(u, c), rel=1e-5), (mode, i, groups, unclipped)
            assert math.sqrt(sum(n * n for n in groups)) <= radii.total


def test_mixed_path_clips_the_fallback_layer_with_its_own_radius():
    torch.manual_seed(0)
    model = WithFallback().double()
    x, y = data()
    radii = layer_radii(model, {"lin": 0.2, "scale": 0.05})
    engine = ClippedGradients(model, lambda o, t: 0.5 * (o - t) ** 2)
    assert engine.mode == "mixed"
    out = [torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()]
    engine.sum(x, y, radii, out)
    params = list(model.parameters())
    expected = [torch.zeros_like(p) for p in params]
    for i in range(B):
        grads = torch.autograd.grad(0.5 * (model(x[i : i + 1])[0] - y[i]) ** 2, params)
        for group, c in zip(radii.groups, radii.radii):
            norm = math.sqrt(sum(float((grads[k] ** 2).sum()) for k in group))
            for k in group:
                expected[k] += min(1.0, c / norm) * grads[k]
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want.reshape(-1), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["auto", "materialised"])
def test_a_non_finite_record_is_dropped_from_every_group(mode):
    model = mlp()
    x, y = data()
    x[4, 0] = math.nan  # NaN in every group's gradient of record 4
    radii = layer_radii(model, [0.3, 0.05, 0.2, 0.1])
    engine = ClippedGradients(model, squared, mode=mode)
    out = [torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()]
    norms = torch.empty(B, dtype=torch.float64)
    assert int(engine.sum(x, y, radii, out, norms=norms)) == 1
    assert math.isnan(float(norms[4])) and torch.isfinite(norms[torch.arange(B) != 4]).all()
    keep = torch.arange(B) != 4
    for got, want in zip(out, reference(model, x[keep], y[keep], radii)):
        torch.testing.assert_close(got, want.reshape(-1), rtol=1e-9, atol=1e-12)


def test_dpsgd_prices_the_total_radius_and_releases_the_per_layer_sum():
    """One full-batch step, noise drawn from a fixed seed: the released mean is the per-layer clipped sum / n
    plus noise of std z sqrt(sum C_l^2) / n (recovered exactly from the seed's draw at std 1)."""
    x, y = data()
    radii = [0.3, 0.05, 0.2, 0.1]
    total = math.sqrt(sum(c * c for c in radii))
    model = mlp()
    start = [p.detach().clone() for p in model.parameters()]
    alg = DPSGD(model, squared, x, y, lr=1.0, clip=radii, clipping="per_layer", steps=1, sampling="full",
                noise=2.0, runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(5, reproducible=True)))
    assert total <= alg.clip.total == pytest.approx(total, rel=1e-14)
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)
    ref = reference(model, x, y, layer_radii(model, radii))
    released = []

    original = dpvr.ops.noisy_update

    def spy(v, **kwargs):
        released.append(float(kwargs["sigma"]))
        return original(v, **kwargs)

    dpvr.ops.noisy_update = spy
    try:
        alg.step()
    finally:
        dpvr.ops.noisy_update = original
    assert released == [pytest.approx(2.0 * total / B, rel=1e-14)] and released[0] >= 2.0 * total / B
    moved = torch.cat([(s - p.detach()).reshape(-1) for p, s in zip(model.parameters(), start)])
    noise = moved - torch.cat([r.reshape(-1) for r in ref]) / B
    assert 0 < float(noise.norm()) < 10 * released[0] * math.sqrt(noise.numel())


def test_scalar_clip_is_split_equally():
    model = mlp()
    radii = layer_radii(model, 0.8)
    assert radii.radii == (0.4,) * 4 and 0.8 <= radii.total == pytest.approx(0.8, rel=1e-14)


@pytest.mark.parametrize(("clip", "error", "match"), [
    ([0.1, 0.2], ValueError, "one radius per trainable parameter tensor; the model has 4"),
    ([0.1, 0.2, 0.0, 0.1], ValueError, r"clip\['2.weight'\]: a radius must be a finite number > 0"),
    ([0.1, -1.0, 0.2, 0.1], ValueError, r"clip\['0.bias'\]: a radius must be a finite number > 0"),
    ([0.1, math.inf, 0.2, 0.1], ValueError, "finite number > 0"),
    ({"0": 0.1}, ValueError, "no radius for the trainable parameter '2.weight'"),
    ({"0": 0.1, "2": 0.1, "fc": 0.3}, ValueError, r"\['fc'\] name\(s\) no trainable parameter"),
    ([0.1, "a", 0.2, 0.1], TypeError, "a radius is a number > 0"),
])
def test_bad_per_layer_radii_are_refused_by_name(clip, error, match):
    x, y = data()
    with pytest.raises(error, match=match):
        DPSGD(mlp(), squared, x, y, lr=0.1, clip=clip, clipping="per_layer", steps=1, batch_size=4, noise=1.0)


def test_radii_without_per_layer_and_per_layer_with_cyclic_are_refused():
    x, y = data()
    with pytest.raises(TypeError, match="per-parameter radii need clipping='per_layer'"):
        DPSGD(mlp(), squared, x, y, lr=0.1, clip=[0.1] * 4, steps=1, batch_size=4, noise=1.0)
    with pytest.raises(ValueError, match="sampling='cyclic' is accounted by the last-iterate bound"):
        DPSGD(mlp(), squared, x, y, lr=0.1, clip=0.5, clipping="per_layer", steps=1, batch_size=4, noise=1.0,
              sampling="cyclic", weak_convexity=0.0, smoothness=1.0)
    with pytest.raises(ValueError, match="clipping: True or 'flat'"):
        DPSGD(mlp(), squared, x, y, lr=0.1, clip=0.5, clipping="layerwise", steps=1, batch_size=4, noise=1.0)


def test_make_private_per_layer_trains_and_reports_the_total_radius():
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 2, (64,))
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    trainer = dpvr.make_private(
        model, nn.CrossEntropyLoss(), torch.utils.data.TensorDataset(x, y), algorithm="dp-sgd",
        epsilon=3.0, batch_size=16, steps=4, lr=0.1, clip={"0": 0.6, "2": 0.8}, clipping="per_layer",
    )  # fmt: skip
    trainer.run()
    alg = trainer.algorithm
    assert isinstance(alg.clip, LayerRadii) and alg.clip.total == pytest.approx(1.0)
    assert alg.privacy_spent().epsilon <= 3.0


def test_float32_model_per_layer_ghost_matches_materialised():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))
    x, y = data()
    radii = layer_radii(model, [0.3, 0.05, 0.2, 0.1])
    sums = []
    for mode in ("auto", "materialised"):
        out = [torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()]
        ClippedGradients(model, squared, mode=mode).sum(x.float(), y.float(), radii, out)
        sums.append(torch.cat(out))
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-5, atol=1e-6)
