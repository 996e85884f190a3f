"""A materialised part's clipped sum on the host (``Dense.total``) is formed a block of columns at a time,
widened to float64 block by block instead of as one ``(B, P)`` copy. The release must not change: each
column is the same ``(1, B) @ (B, c)`` product, so the sums, and a DP-SGD step's released parameters, are
bit for bit those of the one-product form they replaced (the reference below)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpvr import ops
from dpvr.grads import GhostClipper
from dpvr.grads.ghost import cost, rules
from dpvr.grads.ghost.rules import Dense


def one_product(self: Dense, f: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The form before blocks: the whole matrix widened, then one product."""
    return (f @ self.u.reshape(self.u.shape[0], -1).to(f.dtype)).reshape(shape)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block", [1 << 10, rules.DENSE_BLOCK_BYTES])
@pytest.mark.parametrize("batch,width", [(1, 7), (3, 64), (8, 4097), (8, 589_824), (13, 1000), (64, 65_539),
                                         (256, 4_096)])
def test_blocks_equal_one_product_bit_for_bit(monkeypatch, threads, block, batch, width):
    monkeypatch.setattr(rules, "DENSE_BLOCK_BYTES", block)
    gen = torch.Generator().manual_seed(batch * 7919 + width)
    # Rows of very different scales, some zero factors: roundings that a changed order would show.
    u = torch.randn(batch, width, generator=gen) * torch.logspace(-3, 3, batch).unsqueeze(1)
    f = torch.rand(batch, generator=gen).to(torch.float32).to(torch.float64)
    f[::3] = 0.0
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = Dense(u).total(f, torch.Size([width]))
        want = one_product(Dense(u), f, torch.Size([width]))
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == torch.float64
    assert torch.equal(got, want)


def test_float64_parameters_take_one_product():
    u = torch.randn(5, 300, dtype=torch.float64)
    f = torch.rand(5, dtype=torch.float64)
    assert torch.equal(Dense(u).total(f, torch.Size([20, 15])), (f @ u).reshape(20, 15))


class _Sequence(nn.Module):
    """Linear maps on sequences, a LayerNorm and a head: materialised parts, Dense biases and norms."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 96)
        self.norm = nn.LayerNorm(96)
        self.down = nn.Linear(96, 24)
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.norm(self.up(x)))).mean(dim=1))


def _released(seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model = _Sequence()
    x, y = torch.randn(16, 32, 24), torch.randint(0, 3, (16,))
    clipper = GhostClipper(model, lambda out, t: nn.functional.cross_entropy(out, t))
    generator = ops.NoiseGenerator(seed, reproducible=True)
    generator.bind(b"dense-total")  # each key then hashes the sums it perturbs
    params = [p.data.view(-1) for p in model.parameters()]
    velocity = [torch.zeros_like(p) for p in params]
    for step in range(3):
        generator.for_release(step.to_bytes(8, "little"))
        sums = clipper.clipped_sum(x, y, 0.5, wide=True).sums
        ops.noisy_update(velocity, sum=[s.view(-1) for s in sums], scale=1 / 16, sigma=0.5 / 16, reset=True,
                         generator=generator, stream="dp-sgd", params=params, lr=0.1)
    return [p.detach().clone() for p in model.parameters()]


def test_dp_sgd_release_unchanged(monkeypatch):
    """Three DP-SGD steps (clipped sums in float64, the noise keyed by their digest) release the same
    parameters bit for bit with the blocks as with the one-product form, whichever forms the parts take."""
    monkeypatch.setattr(rules, "DENSE_BLOCK_BYTES", 1 << 12)  # many blocks per part
    blocks = _released(5)
    monkeypatch.setattr(Dense, "total", one_product)
    reference = _released(5)
    assert all(torch.equal(a, b) for a, b in zip(blocks, reference))


def _wide_mlp_release(monkeypatch, pooled_bytes: int) -> tuple[list[torch.Tensor], int]:
    from dpvr.grads.ghost import clipper as module

    monkeypatch.setattr(module, "POOLED_BYTES", pooled_bytes)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(40, 300), nn.ReLU(), nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 4))
    x, y = torch.randn(32, 40), torch.randint(0, 4, (32,))
    clipper = GhostClipper(model, lambda out, t: nn.functional.cross_entropy(out, t))
    generator = ops.NoiseGenerator(3, reproducible=True)
    generator.bind(b"pooled")
    params = [p.data.view(-1) for p in model.parameters()]
    velocity = [torch.zeros_like(p) for p in params]
    for step in range(3):
        generator.for_release(step.to_bytes(8, "little"))
        sums = clipper.clipped_sum(x, y, 0.5, wide=True).sums
        ops.noisy_update(velocity, sum=[s.view(-1) for s in sums], scale=1 / 32, sigma=0.5 / 32, reset=True,
                         generator=generator, stream="dp-sgd", params=params, lr=0.1)
    return [p.detach().clone() for p in model.parameters()], sum(len(b) for b in clipper._pool.values())


def test_pooled_sums_release_unchanged(monkeypatch):
    """Large parameters' float64 sums written into kept buffers (every parameter's here, the threshold
    lowered: three weights and three biases) release the same parameters bit for bit as fresh ones."""
    pooled, kept = _wide_mlp_release(monkeypatch, 0)
    fresh, none = _wide_mlp_release(monkeypatch, 1 << 60)
    assert kept == 6 and none == 0
    assert all(torch.equal(a, b) for a, b in zip(pooled, fresh))


def test_maps_of_one_size_each_keep_a_buffer(monkeypatch):
    """Three maps of one shape (a transformer's blocks) each write into a kept buffer of their own, step
    after step, with the values fresh buffers get."""
    from dpvr.grads.ghost import clipper as module

    torch.manual_seed(6)
    model = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(24, 24), nn.Tanh())), nn.Linear(24, 3))
    x, y = torch.randn(10, 24), torch.randint(0, 3, (10,))
    got = {}
    for pooled in (0, 1 << 60):
        monkeypatch.setattr(module, "POOLED_BYTES", pooled)
        clipper = GhostClipper(model, lambda out, t: nn.functional.cross_entropy(out, t))
        got[pooled] = [clipper.clipped_sum(x * (1 + step), y, 0.5, wide=True).sums for step in range(3)]
        assert len(clipper._pool.get(24 * 24, [])) == (3 if pooled == 0 else 0)
    for a, b in zip(got[0], got[1 << 60]):
        assert all(torch.equal(s, t) for s, t in zip(a, b))


def _pooling_mlp(monkeypatch, seed: int, widths: tuple[int, int, int], batch: int):
    """A two-layer MLP's clipper with every sum pooled (the threshold at 0), and a batch for it."""
    from dpvr.grads.ghost import clipper as module

    monkeypatch.setattr(module, "POOLED_BYTES", 0)
    torch.manual_seed(seed)
    d_in, hidden, classes = widths
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    clipper = GhostClipper(model, lambda out, t: nn.functional.cross_entropy(out, t))
    return clipper, torch.randn(batch, d_in), torch.randint(0, classes, (batch,))


def test_pooled_sum_still_held_is_never_overwritten(monkeypatch):
    """A caller that keeps a sum (or only a view of it) across calls keeps its values: the pool writes a
    buffer again only when nothing else refers to it."""
    clipper, x, y = _pooling_mlp(monkeypatch, 4, (30, 50, 3), 16)
    first = clipper.clipped_sum(x, y, 1.0, wide=True).sums
    view = first[0].view(-1)
    kept = view.clone()
    del first
    second = clipper.clipped_sum(x * 2, y, 1.0, wide=True).sums
    assert torch.equal(view, kept)  # the first call's buffer survived through its view
    assert not torch.equal(second[0].view(-1), kept)
    del view, second
    third = clipper.clipped_sum(x, y, 1.0, wide=True).sums
    assert torch.equal(third[0].view(-1), kept)  # recomputed, into a buffer now free again


def test_copies_leave_the_pooled_buffers_behind(monkeypatch):
    import copy

    clipper, x, y = _pooling_mlp(monkeypatch, 5, (12, 20, 2), 8)
    want = clipper.clipped_sum(x, y, 1.0, wide=True).sums
    assert clipper._pool
    twin = copy.deepcopy(clipper)
    assert twin._pool == {} and clipper._pool
    got = twin.clipped_sum(x, y, 1.0, wide=True).sums
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_pool_keeps_at_most_its_bytes(monkeypatch):
    """Past POOL_BYTES kept per clipper, sums go to fresh buffers, with the same values."""
    from dpvr.grads.ghost import clipper as module

    torch.manual_seed(7)
    model = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(24, 24), nn.Tanh())), nn.Linear(24, 3))
    x, y = torch.randn(10, 24), torch.randint(0, 3, (10,))
    monkeypatch.setattr(module, "POOLED_BYTES", 0)
    got = {}
    for cap in (8 * (2 * 24 * 24 + 24), 1 << 40):
        monkeypatch.setattr(module, "POOL_BYTES", cap)
        clipper = GhostClipper(model, lambda out, t: nn.functional.cross_entropy(out, t))
        got[cap] = [clipper.clipped_sum(x * (1 + step), y, 0.5, wide=True).sums for step in range(2)]
        kept = 8 * sum(b.numel() for held in clipper._pool.values() for b in held)
        assert kept <= cap
    assert all(torch.equal(s, t) for a, b in zip(*got.values()) for s, t in zip(a, b))


def test_a_difference_written_over_the_second_points_matrices_is_unchanged():
    """``Dense.combine`` into the second point's own matrices gives the fresh difference bit for bit (the
    scalars of the entries' dtype; float64 scalars, which widen the result, get a fresh tensor)."""
    torch.manual_seed(8)
    here, there = torch.randn(6, 5, 7), torch.randn(6, 5, 7)
    for a, b in ((None, None), (torch.rand(6), torch.rand(6)), (torch.rand(6, dtype=torch.float64), None)):
        want = Dense(here).combine(Dense(there.clone()), a, b).u
        other = Dense(there.clone())
        got = Dense(here).combine(other, a, b, out=other.u).u
        assert torch.equal(got, want) and got.dtype == want.dtype
        assert (got.data_ptr() == other.u.data_ptr()) == (want.dtype == torch.float32)


def test_difference_rounds_written_over_the_second_point_release_unchanged(monkeypatch):
    """Difference rounds of a clipper that keeps its recording and pools its sums (the difference of the
    per-sample matrices materialised at both points written over the second point's when no later call
    reads them) give the sums of a clipper that does neither, bit for bit, round after round: the kept
    point's matrices are never written over, whichever of the two points it is."""
    from dpvr.grads.ghost import clipper as module

    torch.manual_seed(10)
    model = _Sequence()
    x, y = torch.randn(16, 32, 24), torch.randint(0, 3, (16,))
    base = [p.detach().clone() for p in model.parameters()]
    points = [[p + 0.01 * k * torch.randn_like(p) for p in base] for k in range(3)]
    calls = [(1, 0), (2, 1), (2, 1), (2, 2), (0, 2), (1, 0)]
    got = {}
    with cost.pinned_rates(cost.DEFAULT_RATES):
        for pooled, reuse in ((0, True), (1 << 60, False)):
            monkeypatch.setattr(module, "POOLED_BYTES", pooled)
            clipper = GhostClipper(model, lambda out, t: nn.functional.cross_entropy(out, t),
                                   reuse_recording=reuse)
            got[reuse] = [clipper.clipped_diff_sum(x, y, points[i], points[j], 0.05, wide=True).sums
                          for i, j in calls]
            assert "materialise" in {c.form for c in clipper.choices.values()}
    for a, b in zip(got[True], got[False]):
        assert all(torch.equal(s, t) for s, t in zip(a, b))
