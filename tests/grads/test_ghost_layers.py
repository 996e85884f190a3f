"""Ghost rules and the fallback, layer by layer: each model's clipped sums and clipped difference sums, on
both backends, against per-sample gradients computed one sample at a time in float64; the registry of
rules; and the same code path on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

import dpvr
from dpvr.grads import GhostClipper, GhostRule, register_ghost_rule
from dpvr.grads.ghost import Dense, Outer

BATCH = 6
BACKENDS = ["native", "torch"]
TOL = dict(rtol=1e-10, atol=1e-12)


def squared(output: Tensor, target: Tensor) -> Tensor:
    return 0.5 * ((output - target) ** 2).sum()


# ---- a user-defined layer and its rule ----

class ScaledLinear(nn.Module):
    """``y = s * (x W^T)`` with a learnt scalar ``s``."""

    def __init__(self, p: int, q: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(q, p) / p ** 0.5)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * (x @ self.weight.t())


class UnregisteredScaledLinear(ScaledLinear):
    """A subclass: rules match exact types, so this one falls back."""


@register_ghost_rule(ScaledLinear)
class ScaledLinearRule(GhostRule):
    """weight: ``s G^T X`` (an outer product over the steps); scale: ``sum <G, X W^T>`` (materialised)."""

    parameters = ("weight", "scale")

    def gradient(self, calls):
        xs = [c.input.reshape(c.batch, -1, c.input.shape[-1]) for c in calls]
        gs = [c.grad.reshape(c.batch, -1, c.grad.shape[-1]) for c in calls]
        weight, scale = calls[0].params["weight"], calls[0].params["scale"]
        return {
            "weight": Outer([(x, scale * g) for x, g in zip(xs, gs)]),
            "scale": Dense(sum((g * (x @ weight.t())).sum(dim=(1, 2)) for x, g in zip(xs, gs))),
        }


class Custom(nn.Module):
    def __init__(self, scaled: type[ScaledLinear] = ScaledLinear) -> None:
        super().__init__()
        self.scaled = scaled(5, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.scaled(x)).mean(dim=1))


# ---- models, one or two layer families each ----

class Conv1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(2, 3, 3, padding=2, dilation=2)
        self.b = nn.Conv1d(3, 2, 2, stride=2, padding="valid", bias=False)
        self.c = nn.Conv1d(2, 2, 3, padding="same", padding_mode="circular")

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).mean(dim=2)


class Conv3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 1, 0), dilation=(1, 1, 2))
        self.b = nn.Conv3d(3, 2, 2, padding="same", padding_mode="replicate")

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x))).mean(dim=(2, 3, 4))


class GroupedConv(nn.Module):
    """groups > 1: no ghost rule, the fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, groups=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x).mean(dim=(2, 3))[:, :2]


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3, padding=1)
        self.group = nn.GroupNorm(3, 6)
        self.rms = nn.RMSNorm([6], eps=1e-5) if hasattr(nn, "RMSNorm") else nn.LayerNorm(6)  # torch >= 2.4
        self.layer = nn.LayerNorm(6, bias=False)
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.group(self.conv(x)))  # (B, 6, 4, 4)
        h = self.rms(h.permute(0, 2, 3, 1))  # per position over channels
        return self.head(self.layer(torch.sigmoid(h)).mean(dim=(1, 2)))


class Bags(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.bag = nn.EmbeddingBag(9, 3, mode=mode, padding_idx=None if mode == "max" else 0)
        self.head = nn.Linear(3, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        weights = torch.linspace(0.5, 1.5, tokens.shape[1]).to(self.head.weight.dtype).expand(tokens.shape)
        h = self.bag(tokens, per_sample_weights=weights) if self.mode == "sum" else self.bag(tokens)
        return self.head(h)


class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.RNNBase], batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        extra = {"bidirectional": True} if kind is nn.GRU else {}
        self.rnn = kind(3, 4, num_layers=2, batch_first=batch_first, **extra)
        self.head = nn.Linear(4 * (2 if kind is nn.GRU else 1), 2)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        return self.head(out.mean(dim=1 if self.batch_first else 0))


class Attention(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(3, 4)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)  # (B, L, 4)
        mask = x[..., 0] > 1.0  # per-sample key padding
        h = h if self.batch_first else h.transpose(0, 1)
        out, _ = self.attention(h, h, h, key_padding_mask=mask)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(dim=1))


class TiedLinear(nn.Module):
    """Two Linear layers sharing one weight (an autoencoder-style tie)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x)))[:, :2]


def floats(*shape: int) -> Tensor:
    return torch.randn(*shape)


def tokens() -> Tensor:
    t = torch.randint(0, 9, (BATCH, 5))
    t[:, 0] = 0  # padding in every bag
    t[0] = 0  # a bag of padding only
    t[:, 1] = t[:, 2]  # repeated tokens
    return t


CASES = {
    # name: (model, input, output width, expected fallback layers)
    "custom": (lambda: Custom(), lambda: floats(BATCH, 3, 5), 2, []),
    "unregistered": (lambda: Custom(UnregisteredScaledLinear), lambda: floats(BATCH, 3, 5), 2, ["scaled"]),
    "conv1d": (Conv1d, lambda: floats(BATCH, 2, 9), 2, []),
    "conv3d": (Conv3d, lambda: floats(BATCH, 2, 4, 5, 6), 2, []),
    "grouped_conv": (GroupedConv, lambda: floats(BATCH, 4, 5, 5), 2, ["conv"]),
    "norms": (Norms, lambda: floats(BATCH, 2, 4, 4), 2, []),
    "bag_sum": (lambda: Bags("sum"), tokens, 2, []),
    "bag_mean": (lambda: Bags("mean"), tokens, 2, []),
    "bag_max": (lambda: Bags("max"), tokens, 2, ["bag"]),
    "lstm": (lambda: Recurrent(nn.LSTM, True), lambda: floats(BATCH, 5, 3), 2, []),
    "gru": (lambda: Recurrent(nn.GRU, False), lambda: floats(BATCH, 5, 3), 2, []),
    "rnn": (lambda: Recurrent(nn.RNN, True), lambda: floats(BATCH, 5, 3), 2, []),
    "attention": (lambda: Attention(True), lambda: floats(BATCH, 5, 3), 2, ["attention"]),
    "attention_seq_first": (lambda: Attention(False), lambda: floats(BATCH, 5, 3), 2, ["attention"]),
    "tied": (TiedLinear, lambda: floats(BATCH, 4), 2, []),
}


def build(name: str):
    torch.manual_seed(0)
    make_model, make_input, width, fallback = CASES[name]
    model = make_model().double().eval()
    x = make_input()
    x = x.double() if x.is_floating_point() else x
    return model, x, torch.randn(BATCH, width, dtype=torch.float64), fallback


def trainable(model: nn.Module) -> list[Tensor]:
    return [p.detach() for p in model.parameters() if p.requires_grad]


def moved(point: list[Tensor]) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [p + 0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in point]


def reference_grads(model: nn.Module, x: Tensor, y: Tensor, point: list[Tensor]) -> list[Tensor]:
    """Per-sample gradients, one backward pass per sample (no vmap, no hooks)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    per_sample = []
    for i in range(BATCH):
        leaves = [p.clone().requires_grad_() for p in point]
        out = functional_call(model, dict(zip(names, leaves)), (x[i:i + 1],))
        per_sample.append(torch.autograd.grad(squared(out[0], y[i]), leaves, allow_unused=True))
    return [torch.stack([g[k] if g[k] is not None else torch.zeros_like(point[k]) for g in per_sample])
            for k in range(len(point))]


def clipped(grads: list[Tensor], clip: float, grads_b: list[Tensor] | None = None):
    out = [torch.zeros(g[0].numel(), dtype=g.dtype) for g in grads]
    norms = torch.zeros(BATCH, dtype=grads[0].dtype)
    if grads_b is None:
        dpvr.clip_accumulate(grads, clip, out, norms=norms)
    else:
        dpvr.clip_accumulate_diff(grads, grads_b, clip, out, norms=norms)
    return [o.view(g.shape[1:]) for o, g in zip(out, grads)], norms


def assert_matches(result, expected) -> None:
    sums, norms = expected
    torch.testing.assert_close(result.norms, norms, **TOL)
    for s, e in zip(result.sums, sums, strict=True):
        torch.testing.assert_close(s, e, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_matches_per_sample_gradients(name, backend) -> None:
    model, x, y, fallback = build(name)
    point, point_b = trainable(model), moved(trainable(model))
    grads, grads_b = reference_grads(model, x, y, point), reference_grads(model, x, y, point_b)
    ghost = GhostClipper(model, squared, backend=backend)
    assert ghost.fallback_layers == fallback
    assert all(g.abs().sum() > 0 for g in grads)  # every parameter gets a gradient: the test can fail

    norms = clipped(grads, 1e9)[1]
    clip = float(norms.median())
    assert_matches(ghost.clipped_sum(x, y, clip), clipped(grads, clip))
    assert_matches(ghost.clipped_sum(x, y, clip, params=point_b), clipped(grads_b, clip))
    clip_diff = float(clipped(grads, 1e9, grads_b)[1].median())
    assert_matches(ghost.clipped_diff_sum(x, y, point, point_b, clip_diff),
                   clipped(grads, clip_diff, grads_b))


def test_custom_rule_is_a_ghost_layer() -> None:
    ghost = GhostClipper(Custom().double(), squared)
    assert ghost.supported_layers == ["scaled", "head"] and ghost.mode == "ghost"


def test_registry_rejects_bad_registrations() -> None:
    with pytest.raises(ValueError, match="already has the ghost rule ScaledLinearRule"):
        register_ghost_rule(ScaledLinear)(type("Other", (GhostRule,), {}))
    with pytest.raises(TypeError, match="GhostRule subclasses"):
        register_ghost_rule(nn.Tanh)(object)
    with pytest.raises(TypeError, match="not an nn.Module subclass"):
        register_ghost_rule(int)(ScaledLinearRule)


def test_unsupported_layouts_are_refused_with_the_fix() -> None:
    class Offsets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(9, 1, mode="sum")

        def forward(self, t: Tensor) -> Tensor:
            return self.bag(t.reshape(-1), torch.arange(0, t.numel(), t.shape[1]))

    with pytest.raises(ValueError, match="without offsets"):
        GhostClipper(Offsets(), squared).clipped_sum(torch.randint(0, 9, (4, 3)), torch.randn(4, 1), 1.0)
    lstm = Recurrent(nn.LSTM, True)  # a projected LSTM takes the per-sample vjp, which cannot replay dropout
    lstm.rnn = nn.LSTM(3, 4, num_layers=2, batch_first=True, dropout=0.5, proj_size=2)
    lstm.head = nn.Linear(2, 2)
    lstm.train()
    with pytest.raises(ValueError, match="dropout=0 or eval mode"):
        GhostClipper(lstm, squared).clipped_sum(torch.randn(4, 5, 3), torch.randn(4, 2), 1.0)
    for norm in (nn.BatchNorm1d(3), nn.BatchNorm2d(3)):
        with pytest.raises(ValueError, match="use GroupNorm or LayerNorm"):
            GhostClipper(nn.Sequential(norm), squared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("name", "sync_free"), [("custom", True), ("conv3d", True), ("norms", True),
                                               ("bag_mean", False), ("attention", False), ("tied", False)])
def test_cuda_matches_the_host_without_synchronising(name, sync_free) -> None:
    """Ghost layers add no synchronisation to a step; models whose own forward (or fallback layers, whose
    torch internals) may synchronise are checked for their results only."""
    model, x, y, _ = build(name)
    point, point_b = trainable(model), moved(trainable(model))
    host = GhostClipper(model, squared)
    expected = host.clipped_sum(x, y, 0.5), host.clipped_diff_sum(x, y, point, point_b, 0.5)
    model = model.cuda()
    ghost = GhostClipper(model, squared)
    assert ghost.backend == "torch"
    x, y, point, point_b = x.cuda(), y.cuda(), [p.cuda() for p in point], [p.cuda() for p in point_b]
    ghost.clipped_sum(x, y, 0.5)  # warm up: lazy initialisation may synchronise once
    torch.cuda.set_sync_debug_mode("error" if sync_free else "default")
    try:
        results = ghost.clipped_sum(x, y, 0.5), ghost.clipped_diff_sum(x, y, point, point_b, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for result, want in zip(results, expected):
        torch.testing.assert_close(result.norms.cpu(), want.norms, **TOL)
        for s, e in zip(result.sums, want.sums, strict=True):
            torch.testing.assert_close(s.cpu(), e, **TOL)


def test_mixed_float32_is_close_on_both_backends() -> None:
    torch.manual_seed(0)
    model, x = Norms(), torch.randn(BATCH, 2, 4, 4)
    y = torch.randn(BATCH, 2)
    native = GhostClipper(model, squared, backend="native").clipped_sum(x, y, 0.5)
    device = GhostClipper(model, squared, backend="torch").clipped_sum(x, y, 0.5)
    torch.testing.assert_close(device.norms, native.norms, rtol=1e-5, atol=1e-6)
    for s, e in zip(device.sums, native.sums, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-6)


def test_conv_activations_match_unfold() -> None:
    """The generic unfolding of the Conv rule (1-D and 3-D) against torch's own unfold for 2-D."""
    from dpvr.grads.ghost.linear import ConvRule, unfold_patches

    conv = nn.Conv2d(3, 2, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(2, 1))
    x = torch.randn(2, 3, 7, 6)
    expected = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride).transpose(1, 2)
    padded = F.pad(x, conv._reversed_padding_repeated_twice)
    torch.testing.assert_close(unfold_patches(padded, conv.kernel_size, conv.stride, conv.dilation), expected)
    torch.testing.assert_close(ConvRule(conv, ["weight"]).activations(x), expected)


@pytest.mark.parametrize("make", [
    lambda c: nn.Conv2d(c, 4, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(2, 1)),
    lambda c: nn.Conv2d(c, 4, 2, padding="same"),  # asymmetric zero padding
    lambda c: nn.Conv2d(c, 4, 3, padding=1, padding_mode="reflect"),
    lambda c: nn.Conv2d(c, 4, 3, padding="valid", bias=False),
    lambda c: nn.Conv1d(c, 4, 3, stride=2, padding=1),
    lambda c: nn.Conv1d(c, 4, 2, stride=3, dilation=2),
    lambda c: nn.Conv3d(c, 4, 2, padding="same", padding_mode="replicate"),
], ids=["strided", "same-zeros", "reflect", "valid", "1d", "1d-dilated", "3d-same"])
@pytest.mark.parametrize("channels", [1, 5], ids=["grouped", "vmap"])  # the two per-sample paths
def test_conv_clipped_sums_are_the_unfolded_matmuls(make, channels) -> None:
    """A convolution's clipped sum (its weight gradient of scaled output gradients) and its per-sample
    matrices (the weight gradient per sample) equal the matmuls of the unfolded patches that its norms are
    otherwise computed from, for a gradient and a difference, with and without dropped samples."""
    from dpvr.grads.ghost.linear import _GROUPED_MAX_CHANNELS, ConvOuter, ConvRule
    from dpvr.grads.ghost.rules import LayerCall, Outer

    assert (channels <= _GROUPED_MAX_CHANNELS) == (channels == 1)
    conv = make(channels).double()
    rule = ConvRule(conv, ["weight", "bias"])
    spatial = (9, 6, 5)[: len(conv.kernel_size)]
    x, x_b = (torch.randn(BATCH, channels, *spatial, dtype=torch.float64) for _ in range(2))
    g, g_b = (torch.randn_like(conv(x)) for _ in range(2))
    call, call_b = (LayerCall((i,), {}, [o], {}, BATCH) for i, o in ((x, g), (x_b, g_b)))
    f = torch.rand(BATCH, dtype=torch.float64)
    bad = torch.zeros(BATCH, dtype=torch.bool)
    bad[1] = True
    shape = conv.weight.shape
    for part in (rule.gradient([call])["weight"], rule.difference([call], [call_b], f, 1 - f)["weight"]):
        assert isinstance(part, ConvOuter)
        for p in (part, part.drop(bad)):
            unfolded = Outer(p.pieces)
            torch.testing.assert_close(p.total(f, shape), unfolded.total(f, shape), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(p.per_sample(), unfolded.per_sample(), rtol=1e-12, atol=1e-12)
            assert p.sizes() == unfolded.sizes()


class MaskedAttention(nn.Module):
    """Attention with the mask and attention-weight options of the decomposed forward: self-attention, or
    ``cross`` (keys and values from other tensors than the queries: three projections, not one packed)."""

    def __init__(self, batch_first: bool, masks: str, weights: str, cross: bool = False) -> None:
        super().__init__()
        self.batch_first, self.masks, self.weights, self.cross = batch_first, masks, weights, cross
        self.attention = nn.MultiheadAttention(6, 2, batch_first=batch_first)
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        kwargs: dict = {"need_weights": self.weights != "unused"}
        if self.masks in ("padding", "both"):
            kwargs["key_padding_mask"] = (x[..., 0] > 1.0) & (torch.arange(x.shape[1]) > 0)
        if self.masks == "float-padding":
            kwargs["key_padding_mask"] = x[..., 1].detach()
        if self.masks == "both":
            kwargs["attn_mask"] = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=2)
        if self.weights != "unused":
            kwargs["average_attn_weights"] = self.weights == "averaged"
        h = x if self.batch_first else x.transpose(0, 1)
        key, value = (h.flip(1 if self.batch_first else 0), 0.5 * h) if self.cross else (h, h)
        out, attn = self.attention(h, key, value, **kwargs)
        out = out if self.batch_first else out.transpose(0, 1)
        pooled = out.mean(dim=1)
        if attn is not None:  # the loss reads the attention weights too
            pooled = pooled + attn.reshape(x.shape[0], -1).mean(dim=1, keepdim=True)
        return self.head(pooled)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "padding", "float-padding", "both"])
@pytest.mark.parametrize("weights", ["unused", "averaged", "per-head"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_recorded_attention_gradients_match_per_sample_gradients(batch_first, masks, weights, cross,
                                                                  monkeypatch) -> None:
    """MultiheadAttention's decomposed forward (its projections and attended values recorded) gives the
    per-sample gradients of one backward pass per sample through the module's own forward, for every mask
    and attention-weight option it accepts — without the per-sample vector-Jacobian product."""
    from dpvr.grads.ghost import fallback

    torch.manual_seed(0)
    model = MaskedAttention(batch_first, masks, weights, cross).double()
    x, y = torch.randn(BATCH, 5, 6, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)
    point, point_b = trainable(model), moved(trainable(model))
    grads, grads_b = reference_grads(model, x, y, point), reference_grads(model, x, y, point_b)
    monkeypatch.setattr(fallback, "per_sample_vjp", None)  # any use of the fallback fails
    ghost = GhostClipper(model, squared)
    clip = float(clipped(grads, 1e9)[1].median())
    assert_matches(ghost.clipped_sum(x, y, clip), clipped(grads, clip))
    assert_matches(ghost.clipped_diff_sum(x, y, point, point_b, clip), clipped(grads, clip, grads_b))
    assert "forward" not in vars(model.attention)  # the module's own forward is back


class DetachedKeys(nn.Module):
    """A trainable layer before attention whose keys and values are the queries' tensor detached: the same
    memory, but no gradient reaches the layer through them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 6)
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        return self.head(self.attention(h, h.detach(), h.detach(), need_weights=False)[0].mean(dim=1))


def test_attention_projects_packed_only_for_one_tensor() -> None:
    """Keys and values that share the queries' memory but not their autograd identity take the three
    projections, so the layer before receives only the gradient through the queries."""
    torch.manual_seed(0)
    model = DetachedKeys().double()
    x, y = torch.randn(BATCH, 5, 6, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)
    grads = reference_grads(model, x, y, trainable(model))
    clip = float(clipped(grads, 1e9)[1].median())
    assert_matches(GhostClipper(model, squared).clipped_sum(x, y, clip), clipped(grads, clip))


def test_attention_outside_the_batched_configuration_takes_the_vjp() -> None:
    from dpvr.grads.ghost.attention import MultiheadAttentionRule
    from dpvr.grads.ghost.rules import LayerCall

    attention = nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True).double()
    x = torch.randn(BATCH, 3, 4, dtype=torch.float64)
    out, _ = attention(x, x, x, need_weights=False)
    names = [n for n, _ in attention.named_parameters()]
    call = LayerCall((x, x, x), {"need_weights": False}, [torch.randn_like(out), None],
                     {n: p.detach() for n, p in attention.named_parameters()}, BATCH)
    rule = MultiheadAttentionRule(attention, names)
    assert rule.recording_forward((x, x, x), {"need_weights": False}) is None
    assert set(rule.gradient([call])) == set(names)


def test_only_layers_with_steps_and_small_matrices_are_materialised() -> None:
    """A per-sample matrix is formed only where it is no larger than the recorded tensors it comes from."""
    from dpvr.grads.ghost.rules import Outer

    def outer(steps: int, p: int, q: int) -> Outer:
        return Outer([(torch.zeros(2, steps, p), torch.zeros(2, steps, q))])

    assert not Outer([(torch.zeros(2, 3), torch.zeros(2, 4))]).worth_materialising()  # one step: Gram
    assert not outer(1, 3, 4).worth_materialising()
    assert outer(64, 64, 128).worth_materialising()  # a transformer's feed-forward layer
    assert not outer(4, 512, 512).worth_materialising()  # a wide layer at few steps
    m, n = torch.randn(2, 3, 2, dtype=torch.float64), torch.randn(2, 3, 5, dtype=torch.float64)
    expected = 3 * torch.einsum("btq,btp->bqp", n, m)
    torch.testing.assert_close(Outer([(m, n), (2 * m, n)]).per_sample(), expected)


@pytest.mark.parametrize("kind", [nn.RNN, nn.LSTM, nn.GRU])
@pytest.mark.parametrize(("bidirectional", "batch_first", "bias"),
                         [(False, True, True), (True, False, True), (True, True, False)])
def test_recurrent_layers_are_ghost_layers_exact_per_record(kind, bidirectional, batch_first, bias) -> None:
    """The per-time-step Linear rule of the recurrent layers (two layers, both directions, either layout,
    with and without biases): per-sample norms and sums against autograd on one record at a time."""
    torch.manual_seed(0)

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = kind(3, 4, num_layers=2, bidirectional=bidirectional, batch_first=batch_first,
                            bias=bias)
            self.head = nn.Linear(4 * (1 + bidirectional), 1)

        def forward(self, x: Tensor) -> Tensor:
            out, _ = self.rnn(x if batch_first else x.transpose(0, 1))
            return self.head(out if batch_first else out.transpose(0, 1)).squeeze(-1)

    model = Tagger().double()
    x, y = torch.randn(BATCH, 6, 3, dtype=torch.float64), torch.randn(BATCH, 6, dtype=torch.float64)

    def loss(output: Tensor, target: Tensor) -> Tensor:
        return ((output - target) ** 2).mean()

    clipper = GhostClipper(model, loss)
    assert clipper.mode == "ghost"
    result = clipper.clipped_sum(x, y, 1e30)
    params = list(model.parameters())
    alone = [torch.autograd.grad(loss(model(x[i : i + 1])[0], y[i]), params) for i in range(BATCH)]
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in grads)) for grads in alone])
    torch.testing.assert_close(result.norms, norms, rtol=1e-12, atol=0)
    for k, total in enumerate(result.sums):
        torch.testing.assert_close(total.reshape(-1), sum(g[k] for g in alone).reshape(-1), rtol=1e-12,
                                   atol=1e-14)
