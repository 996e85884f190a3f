"""The ghost clipper's bound in the output dtype: every sample's clipped contribution, as written in float32,
has norm at most C.

With one sample (B = 1) a clipped sum IS that sample's contribution, so its exact norm (the float32 entries
squared and summed in rationals) must not exceed C. The cases are the ones where the rows or entries written
are sums of large terms that nearly cancel: a same-sample difference at two nearby parameter points whose two
gradients land in the same table rows (an embedding whose keys are computed in the forward, one called twice,
an ``EmbeddingBag`` with per-sample weights), repeated keys whose gradients nearly cancel, and a weight
shared by nearby inputs (a Linear called twice, or applied at several steps; a convolution's positions). The
clip radius is a fraction of the sample's norm, so the clip is always active.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpvr.grads import GhostClipper
from dpvr.grads.ghost import Dense, Outer, Rows
from dpvr.grads.ghost.norms import ghost_norms, write_error

# native: the host's kernels (the CPU default); torch: the same rule in torch ops (CUDA's path), run here on
# the CPU as well, in the slow run only (the default run checks each case once, on the native path).
BACKENDS = ["native", pytest.param("torch", marks=pytest.mark.slow)]
SEEDS = 60
STEP = 1e-4  # the second point: every parameter moved by about 1e-4 of its largest entry
VOCAB, WIDTH = 7, 6


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def keys_of(x: Tensor) -> Tensor:
    """Table keys computed in the forward from the input: a new tensor at each point."""
    return (x.abs() * 3).long() % VOCAB


class ComputedKeys(nn.Module):
    """An embedding whose keys are computed in the forward, with repeated keys."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        k = keys_of(x)
        k = torch.cat([k, (k + 1) % VOCAB, k], dim=1)
        return self.head(torch.tanh(self.embedding(k)).sum(dim=1))


class CalledTwice(nn.Module):
    """One embedding called twice (its calls are more steps of one sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        k = keys_of(x)
        first = torch.tanh(self.embedding(k)).sum(dim=1)
        return self.head(first * torch.tanh(self.embedding(k.flip(1))).sum(dim=1))


class WeightedBag(nn.Module):
    """``nn.EmbeddingBag`` ("sum") with per-sample weights, on keys computed in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, WIDTH, mode="sum")
        self.head = nn.Linear(WIDTH, 3)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bag(keys_of(x), per_sample_weights=torch.sigmoid(x))))


class Opposed(nn.Module):
    """One key looked up at two positions whose gradients nearly cancel (a plain clipped sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        k = keys_of(x[:, :1]).expand(-1, 2)
        e = self.embedding(k)
        return self.head(torch.tanh(e[:, 0] - (1 - 1e-4) * e[:, 1]))


class SharedLinear(nn.Module):
    """A Linear called on two nearby views of the input (a siamese difference)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.linear(x)) - torch.tanh(self.linear(x + 1e-4 * torch.cos(7 * x))))


class SequenceLinear(nn.Module):
    """A Linear applied at two nearby steps of one sequence, whose outputs are subtracted."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.linear(torch.stack([x, x + 1e-4 * torch.cos(7 * x)], dim=1)))
        return self.head(y[:, 0] - y[:, 1])


class Positions(nn.Module):
    """A convolution over a nearly constant signal whose positions are added with alternating signs (its
    per-sample matrix is larger than its recorded tensors: not materialised under ``norm_form="auto"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(WIDTH, 8, 2)
        self.head = nn.Linear(8, 3)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        signal = x.unsqueeze(-1) + 1e-4 * torch.cos(torch.arange(5.0) + x.unsqueeze(-1))  # (B, WIDTH, 5)
        y = torch.tanh(self.conv(signal))  # (B, 8, 4)
        return self.head(y[:, :, 0] - y[:, :, 1] + y[:, :, 2] - y[:, :, 3])


MODELS: dict[str, Callable[[], nn.Module]] = {
    "computed-keys": ComputedKeys,
    "called-twice": CalledTwice,
    "weighted-bag": WeightedBag,
    "opposed-keys": Opposed,
    "shared-linear": SharedLinear,
    "sequence-linear": SequenceLinear,
    "conv-positions": Positions,
}
# Differences: every model but the one whose cancellation is within one point (its difference is ~0).
DIFFERENCES = [name for name in MODELS if name != "opposed-keys"]
# Plain clipped sums of the models whose cancellation is within one point.
PLAIN = ["opposed-keys", "shared-linear", "sequence-linear", "conv-positions"]


def exact_norm_sq(sums: list[Tensor]) -> Fraction:
    """The exact squared norm of the written entries."""
    return sum((Fraction(v) ** 2 for s in sums for v in s.double().flatten().tolist()), Fraction(0))


def clipped_ratio_sq(clipper: GhostClipper, x: Tensor, y: Tensor, point: list[Tensor], other: list[Tensor],
                     difference: bool) -> Fraction:
    """``(||written|| / C)^2``, exactly, for one sample clipped at an active radius: 0.37 of its norm (a
    factor with a full mantissa, not a power of two times 1 - margin)."""
    if difference:
        clipped = functools.partial(clipper.clipped_diff_sum, x, y, point, other)
    else:
        clipped = functools.partial(clipper.clipped_sum, x, y, params=point)
    norm = float(clipped(1e30).norms[0])
    assert math.isfinite(norm) and norm > 0
    clip = 0.37 * norm
    return exact_norm_sq(clipped(clip).sums) / Fraction(clip) ** 2


def worst_ratio(name: str, backend: str, difference: bool, seeds: int = SEEDS) -> tuple[float, int]:
    """The largest ||written|| / C over the seeds, and the number of seeds above 1, for one sample."""
    worst, over = 0.0, 0
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = MODELS[name]()
        x, y = 2 * torch.randn(1, WIDTH), torch.randint(0, 3, (1,))
        point = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        other = [p + STEP * p.abs().max() * torch.randn_like(p) for p in point]
        ratio_sq = clipped_ratio_sq(GhostClipper(model, cross_entropy, backend=backend), x, y, point, other,
                                    difference)
        worst = max(worst, math.sqrt(ratio_sq))
        over += ratio_sq > 1
    return worst, over


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DIFFERENCES)
def test_float32_clipped_difference_of_one_sample_stays_within_clip(name, backend) -> None:
    worst, over = worst_ratio(name, backend, difference=True)
    assert over == 0, f"{over} of {SEEDS} seeds wrote a difference of norm up to {worst:.6f} C"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", PLAIN)
def test_float32_clipped_gradient_of_one_sample_stays_within_clip(name, backend) -> None:
    worst, over = worst_ratio(name, backend, difference=False)
    assert over == 0, f"{over} of {SEEDS} seeds wrote a gradient of norm up to {worst:.6f} C"



@pytest.mark.parametrize("difference", [False, True], ids=["gradient", "difference"])
@pytest.mark.parametrize("name", ["shared-linear", "sequence-linear", "conv-positions"])
def test_bf16_autocast_clipped_contribution_of_one_sample_stays_within_clip(name, difference,
                                                                            monkeypatch) -> None:
    """Under bf16 autocast the recorded activations and output gradients are bf16; the clipper widens them to
    float32 (exactly) and forms norms, factors and sums with autocast off, so the float32 bound holds for the
    per-sample gradients of the bf16 activations: the written contribution's exact norm is at most C. The
    second point moves by 3e-2 of the largest entry: a 1e-4 move is below bf16's resolution (2^-8), where
    both points give the same bf16 activations and the difference is exactly zero."""
    monkeypatch.setattr(sys.modules[__name__], "STEP", 3e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        worst, over = worst_ratio(name, "native", difference=difference, seeds=20)
    assert over == 0, f"{over} of 20 seeds wrote a contribution of norm up to {worst:.6f} C under bf16"


# ---- the parts themselves ----


def one_slot_per_key(keys: Tensor, rows: Tensor) -> bool:
    """Whether each key of a sample has at most one nonzero row among its slots."""
    return all(
        int(rows[i][keys[i] == key].abs().sum(dim=-1).gt(0).sum()) <= 1
        for i in range(keys.shape[0])
        for key in keys[i].unique()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coalesced_rows_sum_each_samples_rows_per_key(dtype) -> None:
    torch.manual_seed(0)
    keys = torch.randint(0, 5, (3, 9))
    rows = torch.randn(3, 9, 4, dtype=dtype)
    part = Rows([(keys[:, :4], rows[:, :4]), (keys[:, 4:], rows[:, 4:])], skip=2)
    got = part.coalesced()
    assert got.unique and got.coalesced() is got
    ((k, n),) = got.pieces
    assert n.dtype == dtype and k.shape == (3, 9) and one_slot_per_key(k, n)
    for i in range(3):
        want = torch.zeros(5, 4, dtype=dtype).index_add_(0, keys[i], rows[i])
        torch.testing.assert_close(torch.zeros(5, 4, dtype=dtype).index_add_(0, k[i], n[i]), want)
    shape = torch.Size([5, 4])
    f = torch.rand(3, dtype=dtype)
    torch.testing.assert_close(got.total(f, shape), part.total(f, shape))
    assert torch.equal(got.total(f, shape)[2], torch.zeros(4, dtype=dtype))  # the skipped key


def test_combined_rows_are_exact_differences_rounded_once() -> None:
    """A difference's rows: ``a g - b g'`` per key, summed in float64 and rounded once to float32."""
    torch.manual_seed(1)
    keys, keys_b = torch.randint(0, 4, (2, 6)), torch.randint(0, 4, (2, 6))
    g = torch.randn(2, 6, 3)
    g_b = g + 1e-4 * torch.randn_like(g)
    a, b = torch.rand(2) + 0.5, torch.rand(2) + 0.5
    got = Rows([(keys, g)]).combine(Rows([(keys_b, g_b)]), a, b)
    ((k, n),) = got.pieces
    assert got.unique and n.dtype == torch.float32 and one_slot_per_key(k, n)
    for i in range(2):
        for key in range(4):
            exact = [
                sum(
                    (
                        Fraction(float(a[i])) * Fraction(float(g[i, t, j]))
                        for t in range(6)
                        if keys[i, t] == key
                    ),
                    Fraction(0),
                )
                - sum(
                    (
                        Fraction(float(b[i])) * Fraction(float(g_b[i, t, j]))
                        for t in range(6)
                        if keys_b[i, t] == key
                    ),
                    Fraction(0),
                )
                for j in range(3)
            ]
            slot = n[i][k[i] == key].sum(dim=0) if (k[i] == key).any() else torch.zeros(3)
            for j in range(3):
                # Within one float32 rounding of the exact value (float64's own error is far below it).
                assert abs(Fraction(float(slot[j])) - exact[j]) <= abs(exact[j]) * Fraction(2**-24) * (
                    1 + 1e-6
                )


def test_coalesced_rows_norm_is_the_written_vectors() -> None:
    """Differences of rows that nearly cancel: the norm bound is of the coalesced (written) rows."""
    torch.manual_seed(1)
    keys = torch.randint(0, 4, (2, 6))
    g = 1e3 * torch.randn(2, 6, 5)
    part = Rows([(keys, g), (keys.clone(), -(g + 1e-3 * torch.randn_like(g)))]).coalesced()
    ((_, n),) = part.pieces
    bound = ghost_norms([part], 2, torch.device("cpu"), "auto")
    exact = [sum(Fraction(v) ** 2 for v in n[i].double().flatten().tolist()) for i in range(2)]
    for i in range(2):
        assert Fraction(float(bound[i])) >= exact[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_write_error_bounds_the_rounding_of_an_outer_sum(dtype) -> None:
    """The written ``sum_t f n_t m_t^T`` of one sample is within ``f * write_error`` of the exact one."""
    torch.manual_seed(2)
    m = torch.randn(1, 40, 8, dtype=dtype)
    m = m[:, :1] + 1e-5 * m  # nearly equal steps whose output gradients nearly cancel
    n = torch.randn(1, 40, 5, dtype=dtype)
    n = n - n.mean(dim=1, keepdim=True)
    part = Outer([(m, n)])
    f = torch.tensor([0.37], dtype=dtype)
    written = part.total(f, torch.Size([5, 8]))
    exact = [
        [
            sum(
                Fraction(float(f[0])) * Fraction(float(n[0, t, a])) * Fraction(float(m[0, t, b]))
                for t in range(40)
            )
            for b in range(8)
        ]
        for a in range(5)
    ]
    err_sq = sum((Fraction(float(written[a, b])) - exact[a][b]) ** 2 for a in range(5) for b in range(8))
    bound = write_error([(0, part)], 1, dtype, torch.device("cpu"))
    assert bound is not None and err_sq <= (Fraction(float(f[0])) * Fraction(float(bound[0]))) ** 2
    assert write_error([(0, Dense(n[:, 0]))], 1, dtype, torch.device("cpu")) is None
