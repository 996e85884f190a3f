"""Ghost clipping (dpvr.grads.GhostClipper) against materialised per-sample gradients + the fused kernels.

Every numerical test runs on both backends: "native" (the host kernels) and "torch" (the device code path
that CUDA parameters take, here on the host).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dpvr
from dpvr.grads import GhostClipper, per_sample_grads, per_sample_grads_at_two_points

BATCH = 10
BACKENDS = ["native", "torch"]


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def squared(output: Tensor, target: Tensor) -> Tensor:
    return 0.5 * (output.squeeze(-1) - target) ** 2


class SequenceModel(nn.Module):
    """Linear layers on (B, T, p) and (B, T, S, p) inputs, then a head on the mean over steps."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 6)
        self.deep = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inner(x))  # (B, T, 6)
        h = self.deep(torch.stack([h, h.flip(1)], dim=2))  # (B, T, 2, 4): two leading dims
        return self.head(h.mean(dim=(1, 2)))


class TokenModel(nn.Module):
    """Embedding (with padding and repeated tokens) -> LayerNorm -> mean over steps -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.relu(self.norm(self.embedding(tokens))).mean(dim=1))


class Gate(nn.Module):
    """A custom layer with a parameter of its own (a fallback layer); its output is saved by sigmoid."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x * self.scale)


class Pair(nn.Module):
    """A fallback layer returning a tuple, one leaf an integer tensor, one a float the loss never sees."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, width))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return x * self.weight, (x > 0).sum(dim=1), x * self.weight.sum()


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 8)
        self.gate = Gate(8)
        self.pair = Pair(8)
        self.norm = nn.PReLU(8)  # a torch layer without a ghost rule: a fallback layer too
        self.last = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h, _, _ = self.pair(self.gate(self.first(x)))
        return self.last(self.norm(h))


class Tied(nn.Module):
    """An embedding and an output layer sharing their weight; a Linear used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(9, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 9, bias=False)
        self.out.weight = self.embedding.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.mix(torch.tanh(self.mix(self.embedding(tokens))))
        return self.out(h.mean(dim=1))


def mlp():
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 6), nn.Softplus(),
                          nn.Linear(6, 1))
    return model, torch.randn(BATCH, 5), torch.randn(BATCH), squared


def sequence():
    return SequenceModel(), torch.randn(BATCH, 4, 5), torch.randint(0, 3, (BATCH,)), cross_entropy


def cnn():
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 4, 2, padding="same", padding_mode="reflect"),  # asymmetric 'same' padding
        nn.Softplus(),
        nn.Conv2d(4, 3, 3, stride=2, dilation=1, bias=False),
        nn.Flatten(),
        nn.Linear(3 * 2 * 2, 3),
    )
    return model, torch.randn(BATCH, 2, 6, 6), torch.randint(0, 3, (BATCH,)), cross_entropy


def tokens():
    x = torch.randint(0, 12, (BATCH, 7))
    x[:, 0] = 0  # padding in every sample
    x[:, 1] = x[:, 2]  # repeated tokens
    return TokenModel(), x, torch.randint(0, 3, (BATCH,)), cross_entropy


def mixed():
    return Mixed(), torch.randn(BATCH, 5), torch.randn(BATCH), squared


def tied():
    return Tied(), torch.randint(0, 9, (BATCH, 5)), torch.randint(0, 9, (BATCH,)), cross_entropy


CASES = {"mlp": mlp, "sequence": sequence, "cnn": cnn, "tokens": tokens, "mixed": mixed, "tied": tied}
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def build(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model, x, y, loss_fn = CASES[name]()
    model = model.to(dtype)
    x, y = (t.to(dtype) if t.is_floating_point() else t for t in (x, y))
    return model, x, y, loss_fn


def trainable(model: nn.Module) -> list[Tensor]:
    return [p.detach() for p in model.parameters() if p.requires_grad]


def moved(point: list[Tensor], scale: float = 0.2) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [p + scale * torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in point]


def median_norm(grads: list[Tensor], grads_b: list[Tensor] | None = None) -> float:
    """A clip radius that clips about half the samples."""
    norms = torch.zeros(BATCH, dtype=grads[0].dtype)
    dpvr.per_sample_norms(grads, norms, grads_prev=grads_b)
    return float(norms.median())


def materialised(grads, clip, params, *, grads_b=None, **scalars):
    out = [torch.zeros(p.numel(), dtype=p.dtype) for p in params]
    norms = torch.zeros(BATCH, dtype=params[0].dtype)
    if grads_b is None:
        dpvr.clip_accumulate(grads, clip, out, norms=norms, **scalars)
    else:
        dpvr.clip_accumulate_diff(grads, grads_b, clip, out, norms=norms, **scalars)
    return [o.view(p.shape) for o, p in zip(out, params)], norms


def assert_close(result, expected, dtype) -> None:
    sums, norms = expected
    torch.testing.assert_close(result.norms, norms, **TOL[dtype], equal_nan=True)
    assert len(result.sums) == len(sums)
    for s, e in zip(result.sums, sums):
        torch.testing.assert_close(s, e, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_clipped_sum_matches_materialised(name, dtype, backend) -> None:
    model, x, y, loss_fn = build(name, dtype)
    params = trainable(model)
    grads, losses = per_sample_grads(model, loss_fn, x, y, return_loss=True)
    clip = median_norm(grads)
    ghost = GhostClipper(model, loss_fn, backend=backend)
    assert ghost.backend == backend
    result = ghost.clipped_sum(x, y, clip)
    assert_close(result, materialised(grads, clip, params), dtype)
    torch.testing.assert_close(result.losses, losses, **TOL[dtype])
    assert result.losses_b is None

    weights = torch.linspace(-1.5, 2.0, BATCH, dtype=dtype)
    assert_close(ghost.clipped_sum(x, y, clip, weights=weights),
                 materialised(grads, clip, params, weights=weights), dtype)

    point = moved(params)
    grads_b = per_sample_grads(model, loss_fn, x, y, params=point)
    assert_close(ghost.clipped_sum(x, y, clip, params=point), materialised(grads_b, clip, params), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_clipped_diff_sum_matches_materialised(name, dtype, backend) -> None:
    model, x, y, loss_fn = build(name, dtype)
    point_a, point_b = trainable(model), moved(trainable(model))
    grads_a, grads_b, losses_a, losses_b = per_sample_grads_at_two_points(
        model, loss_fn, x, y, point_a, point_b, return_loss=True)
    clip = median_norm(grads_a, grads_b)
    ghost = GhostClipper(model, loss_fn, backend=backend)
    result = ghost.clipped_diff_sum(x, y, point_a, point_b, clip)
    assert_close(result, materialised(grads_a, clip, point_a, grads_b=grads_b), dtype)
    torch.testing.assert_close(result.losses, losses_a, **TOL[dtype])
    torch.testing.assert_close(result.losses_b, losses_b, **TOL[dtype])

    a = torch.linspace(0.5, 1.5, BATCH, dtype=dtype)
    b = torch.linspace(2.0, -1.0, BATCH, dtype=dtype)
    assert_close(ghost.clipped_diff_sum(x, y, point_a, point_b, clip, a=a, b=b),
                 materialised(grads_a, clip, point_a, grads_b=grads_b, a=a, b=b), dtype)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_differences_at_identical_points_are_exactly_zero(name, backend) -> None:
    model, x, y, loss_fn = build(name, torch.float32)
    point = trainable(model)
    ghost = GhostClipper(model, loss_fn, backend=backend)
    result = ghost.clipped_diff_sum(x, y, point, [p.clone() for p in point], 1.0)
    assert (result.norms == 0).all()
    assert all((s == 0).all() for s in result.sums)


@pytest.mark.parametrize("name", ["sequence", "cnn"])
@pytest.mark.parametrize("form", ["gram", "direct", "auto"])  # "auto" materialises these layers' matrices
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_norm_form_on_layers_with_steps(name, form, backend) -> None:
    model, x, y, loss_fn = build(name, torch.float64)
    point_a, point_b = trainable(model), moved(trainable(model))
    grads_a, grads_b = per_sample_grads_at_two_points(model, loss_fn, x, y, point_a, point_b)
    ghost = GhostClipper(model, loss_fn, norm_form=form, backend=backend)
    assert_close(ghost.clipped_diff_sum(x, y, point_a, point_b, 0.05),
                 materialised(grads_a, 0.05, point_a, grads_b=grads_b), torch.float64)


def test_layers_are_sorted_into_ghost_and_fallback() -> None:
    assert GhostClipper(*build("cnn", torch.float64)[::3]).mode == "ghost"
    ghost = GhostClipper(*build("mixed", torch.float64)[::3])
    assert ghost.mode == "mixed"
    assert ghost.supported_layers == ["first", "last"]
    assert ghost.fallback_layers == ["gate", "pair", "norm"]
    tied_model = build("tied", torch.float64)[0]
    ghost = GhostClipper(tied_model, cross_entropy)
    assert ghost.supported_layers == ["embedding", "mix", "out"] and ghost.mode == "ghost"
    assert GhostClipper(nn.Sequential(Gate(3)), squared).mode == "materialised"


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_parameters_are_skipped_in_order(backend) -> None:
    model, x, y, loss_fn = build("mlp", torch.float64)
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    params = trainable(model)
    grads = per_sample_grads(model, loss_fn, x, y)
    result = GhostClipper(model, loss_fn, backend=backend).clipped_sum(x, y, 0.1)
    assert [s.shape for s in result.sums] == [p.shape for p in params]
    assert_close(result, materialised(grads, 0.1, params), torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_indices_that_differ_between_points(backend) -> None:
    class Routed(nn.Module):
        """Token ids computed from a parameter, so they differ between the two points."""

        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(3, 4)
            self.embedding = nn.Embedding(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            scores = self.router(x)  # (B, T, 4)
            return self.embedding(scores.argmax(dim=-1)).sum(dim=1) + scores.mean(dim=(1, 2)).unsqueeze(-1)

    torch.manual_seed(3)
    model = Routed().double()
    x, y = torch.randn(BATCH, 6, 3, dtype=torch.float64), torch.randn(BATCH, dtype=torch.float64)
    loss_fn = lambda out, t: ((out - t) ** 2).sum()  # noqa: E731
    point_a, point_b = trainable(model), moved(trainable(model), 1.0)
    grads_a, grads_b = per_sample_grads_at_two_points(model, loss_fn, x, y, point_a, point_b)
    result = GhostClipper(model, loss_fn, backend=backend).clipped_diff_sum(x, y, point_a, point_b, 0.3)
    assert_close(result, materialised(grads_a, 0.3, point_a, grads_b=grads_b), torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_samples_are_dropped_or_raise(backend) -> None:
    model, x, y, loss_fn = build("mlp", torch.float64)
    x[3, 1] = float("nan")
    params = trainable(model)
    grads = per_sample_grads(model, loss_fn, x, y)
    result = GhostClipper(model, loss_fn, backend=backend).clipped_sum(x, y, 0.1)
    assert torch.isnan(result.norms[3]) and torch.isfinite(result.norms[[0, 1, 2, 4]]).all()
    assert_close(result, materialised(grads, 0.1, params), torch.float64)
    with pytest.raises(FloatingPointError, match="1 sample"):
        ghost = GhostClipper(model, loss_fn, nonfinite="raise", backend=backend)
        ghost.clipped_diff_sum(x, y, params, moved(params), 0.1)


def test_bad_arguments_are_named() -> None:
    model, x, y, loss_fn = build("mlp", torch.float64)
    ghost = GhostClipper(model, loss_fn)
    point = trainable(model)
    cases = [
        (lambda: ghost.clipped_sum(x, y, 0.0), ValueError, "clip"),
        (lambda: ghost.clipped_sum(x, y, float("nan")), ValueError, "clip"),
        (lambda: ghost.clipped_sum(x, y[:3], 1.0), ValueError, "same batch size"),
        (lambda: ghost.clipped_sum(x[:0], y[:0], 1.0), ValueError, "empty batch"),
        (lambda: ghost.clipped_sum(x, y, 1.0, weights=torch.ones(3).double()), ValueError, "weights"),
        (lambda: ghost.clipped_sum(x, y, 1.0, weights=torch.ones(BATCH)), ValueError, "weights"),
        (lambda: ghost.clipped_diff_sum(x, y, point, point, 1.0, a=[1.0] * BATCH), TypeError, "a:"),
        (lambda: ghost.clipped_diff_sum(x, y, point, point[:2], 1.0), ValueError, "params_b has 2 tensors"),
        (lambda: ghost.clipped_sum(x, y, 1.0, params=[p.float() for p in point]), ValueError, r"params\[0\]"),
        (lambda: GhostClipper(model, loss_fn, norm_form="fast"), ValueError, "norm_form"),
        (lambda: GhostClipper(model, loss_fn, nonfinite="skip"), ValueError, "nonfinite"),
        (lambda: GhostClipper(model, loss_fn, backend="cuda"), ValueError, "backend"),
        (lambda: GhostClipper(model, lambda o, t: o - t).clipped_sum(x, y, 1.0), ValueError, "per sample"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()


def test_unsupported_models_fail_loudly() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.used(x)

    class ModifiesInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 1)

        def forward(self, x: Tensor) -> Tensor:
            x = x * 1.0
            h = self.first(x)
            x.zero_()
            return self.second(h)

    class Offset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.value = nn.Parameter(torch.zeros(3))

        def forward(self) -> Tensor:
            return self.value * 1.0  # no batch dimension

    class Broadcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.offset, self.head = Offset(), nn.Linear(3, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(x + self.offset())

    class ReadsChild(nn.Module):
        """Reads its child's weight directly (as MultiheadAttention does out_proj's, which has a rule that
        owns its submodules); the child itself is never called."""

        def __init__(self) -> None:
            super().__init__()
            self.out_proj = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return (x @ self.out_proj.weight.t()).sum(dim=(1, 2)).unsqueeze(-1)

    class Owned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 1)
            self.alias = self.inner.weight

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x) * self.alias.sum()

    x, y = torch.randn(4, 3), torch.randn(4)
    for model, message in [(Unused(), "'spare' was not called"), (ModifiesInput(), "modified in place"),
                           (Broadcast(), "'offset' returned shape"),
                           (ReadsChild(), "'out_proj' was not called")]:
        inputs = torch.randn(4, 5, 4) if isinstance(model, ReadsChild) else x
        with pytest.raises(ValueError, match=message):
            GhostClipper(model, squared).clipped_sum(inputs, y, 1.0)
    with pytest.raises(ValueError, match="'<model>' and its submodule 'inner' both own"):
        GhostClipper(Owned(), squared)
    with pytest.raises(ValueError, match="BatchNorm1d"):
        GhostClipper(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), squared)


def test_model_is_not_modified() -> None:
    model, x, y, loss_fn = build("mixed", torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    ghost = GhostClipper(model, loss_fn)
    ghost.clipped_diff_sum(x, y, trainable(model), moved(trainable(model)), 1.0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


def forward_counter(model: nn.Module) -> list[int]:
    """A one-element list counting the model's forward passes."""
    count = [0]
    model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.parametrize("name", ["mlp", "mixed", "tokens", "cnn", "sequence"])  # cnn, sequence: materialised
@pytest.mark.parametrize("backend", BACKENDS)
def test_reused_recordings_equal_recomputed_ones(name, backend) -> None:
    """A DIFF2-GD sequence on one batch: the model's parameters move in place from point to point (as an
    optimiser moves them) and each difference is taken against the previous point, which was recorded by
    the previous call. With reuse, each call records only its new point; the results equal recomputation."""
    model, x, y, loss_fn = build(name, torch.float64)
    reference = GhostClipper(model, loss_fn, backend=backend)
    ghost = GhostClipper(model, loss_fn, backend=backend, reuse_recording=True)
    forwards = forward_counter(model)
    points = [trainable(model)] + [moved(trainable(model), 0.1 * k) for k in (1, 2, 3)]
    points = [[p.clone() for p in point] for point in points]

    def set_point(point: list[Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(trainable(model), point):
                p.copy_(v)

    set_point(points[0])
    got = ghost.clipped_sum(x, y, 1.0)
    assert forwards[0] == 1
    want = reference.clipped_sum(x, y, 1.0)
    for g, w in zip(got.sums, want.sums):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for k in (1, 2, 3):
        set_point(points[k])
        forwards[0] = 0
        got = ghost.clipped_diff_sum(x, y, trainable(model), points[k - 1], 0.5)
        assert forwards[0] == 1, "the previous point's recording was not reused"
        want = reference.clipped_diff_sum(x, y, trainable(model), points[k - 1], 0.5)
        torch.testing.assert_close(got.norms, want.norms, **TOL[torch.float64])
        torch.testing.assert_close(got.losses_b, want.losses_b, rtol=0, atol=0)
        for g, w in zip(got.sums, want.sums):
            torch.testing.assert_close(g, w, **TOL[torch.float64])


def test_recordings_are_reused_only_for_the_same_data_point_and_state() -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.0), nn.Linear(8, 1)).double()
    model.register_buffer("offset", torch.zeros(()))
    frozen = nn.Parameter(torch.ones(1, dtype=torch.float64), requires_grad=False)
    model.register_parameter("frozen", frozen)
    x, y = torch.randn(BATCH, 5, dtype=torch.float64), torch.randn(BATCH, dtype=torch.float64)
    ghost = GhostClipper(model, squared, reuse_recording=True)
    forwards = forward_counter(model)
    point = trainable(model)
    previous = moved(point)

    def forwards_of(call) -> int:
        forwards[0] = 0
        call()
        return forwards[0]

    def sum_at(inputs: Tensor, targets: Tensor, at: list[Tensor] = previous) -> None:
        ghost.clipped_sum(inputs, targets, 1.0, params=at)

    assert forwards_of(lambda: sum_at(x, y)) == 1
    assert forwards_of(lambda: ghost.clipped_diff_sum(x, y, point, previous, 1.0)) == 1  # `previous` reused
    assert forwards_of(lambda: sum_at(x, y, point)) == 0  # ... and the one at `point` kept
    assert forwards_of(lambda: sum_at(x.clone(), y)) == 1  # equal values, another tensor: recorded
    changes = [
        lambda: x.add_(0.0),  # the inputs modified in place
        lambda: y.mul_(1.0),
        lambda: model.get_buffer("offset").add_(1.0),
        lambda: frozen.detach().add_(0.0),
        lambda: model.eval(),
    ]
    for change in changes:
        sum_at(x, y, point)
        change()
        assert forwards_of(lambda: sum_at(x, y, point)) == 1, change
    sum_at(x, y, point)
    nudged = [p.clone() for p in point]
    nudged[0][0, 0] = torch.nextafter(nudged[0][0, 0], torch.tensor(2.0, dtype=torch.float64))
    assert forwards_of(lambda: sum_at(x, y, nudged)) == 1  # one bit apart
    assert forwards_of(lambda: GhostClipper(model, squared).clipped_sum(x, y, 1.0)) == 1


@pytest.mark.slow
def test_step_benchmark_records() -> None:
    from dpvr_lab.bench import step

    records = step.run(cases=["mlp"], quick=True, repeats=1)
    methods = [r.method for r in records]
    assert methods[:1] == ["non-private"] and "dpvr-diff2-ghost" in methods and "dpvr-dp-sgd-ghost" in methods
    assert all(r.metrics["ms"] > 0 and r.metrics["ratio_vs_non_private"] > 0 for r in records)
    assert all(r.dataset == "mlp-784-256-128-1/B=512/cpu" for r in records)
