"""Sums over records hold their sensitivity in float32 models: accumulated in float64 on every path (the
native kernels' three schedules, ghost clipping's matmuls, the materialised path, micro-batches) and kept in
float64 until the noise is added.

A float32 sum of ``n`` clipped terms rounds at the magnitude of its partial sums (up to ``n C``), so replacing
one record could move it by ``2C`` plus roundings that grow with ``n``: at ``n = 10^5`` a float32 result
moved by 2.0078C where 2C is priced. Here the records are extreme (every gradient far beyond the clip radius,
so each clipped term has norm C exactly), either all aligned (the sum is ``n C``) or cancelling (the first
half against the second, so the partial sums grow to ``n C / 2`` and fall back), and the neighbour replaces
one record by its opposite (replace-one: at most 2C) or adds one (add/remove: at most C). Noise is off: the
released value is the sum itself.
"""

from __future__ import annotations

import math
import os
import socket
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dpvr import ops
from dpvr.algorithms import DPGD, DPSGD
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.optim import gradients as engine
from dpvr.optim.gradients import ClippedGradients, accumulators
from dpvr.optim.sampling import BatchSampler
from dpvr.trainer.parallel import AllReducedGradients

N = 10**6  # records
D = 4  # features: a tiny model keeps 10^6 records fast
CLIP = 1.0
HUGE = 1e3  # features of that size make every gradient far longer than CLIP
SLACK = 1e-9  # relative: float64 roundings of sums of 10^6 terms of norm C stay far below this


def _direction() -> torch.Tensor:
    u = torch.tensor([3.0, 1.0, 2.0, 0.5], dtype=torch.float64)
    return u / u.norm()


def _records(n: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` float32 records of the regression ``0.5 (w.x - y)^2``: features ``HUGE * e``, targets
    ``-/+HUGE^2`` whose sign sets the gradient's direction (``aligned``: all one sign; ``cancelling``:
    the first half one sign, the second half the other)."""
    x = (HUGE * _direction()).to(torch.float32).expand(n, D).contiguous()
    y = torch.full((n,), -HUGE * HUGE, dtype=torch.float32)
    if layout == "cancelling":
        y[n // 2:] = HUGE * HUGE
    return x, y


def _neighbour(x: torch.Tensor, y: torch.Tensor, relation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace-one: record 7 with the opposite target (its clipped gradient flips: 2C apart); add/remove: one
    more record, inserted at the front (every later record moves one place)."""
    if relation == "replace-one":
        y2 = y.clone()
        y2[7] = -y2[7]
        return x, y2
    return torch.cat([x[:1], x]), torch.cat([-y[:1], y])


def _model() -> nn.Module:
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (output.squeeze() - target) ** 2


def _bound(relation: str) -> float:
    return (2.0 if relation == "replace-one" else 1.0) * CLIP


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(((s - t).double() ** 2).sum()) for s, t in zip(a, b)))


# ---- the native kernel -------------------------------------------------------------------------------------
def _kernel_grads(y: torch.Tensor) -> np.ndarray:
    """The per-record gradients of the regression at w = 0: ``-y x``, float32."""
    g = (-y.double()[:, None] * (HUGE * _direction())[None, :]).to(torch.float32)
    return g.numpy()


@pytest.mark.parametrize("relation", ["replace-one", "add-remove"])
@pytest.mark.parametrize("layout", ["aligned", "cancelling"])
def test_kernel_sum_of_a_million_float32_records_moves_by_at_most_the_priced_bound(relation, layout) -> None:
    x, y = _records(N, layout)
    _, y2 = _neighbour(x, y, relation)
    sums = []
    for targets in (y, y2):
        out = np.zeros(D, dtype=np.float64)  # float64 accumulators beside float32 gradients
        ops.clip_accumulate(_kernel_grads(targets), CLIP, out)
        sums.append(out)
    gap = float(np.linalg.norm(sums[0] - sums[1]))
    assert gap <= _bound(relation) * (1 + SLACK), f"{relation}, {layout}: moved by {gap / CLIP:.6f} C"
    # ... and the sum is the float64 sum of the clipped terms (each one record's own sum), not a float32 one.
    term = np.zeros(D, dtype=np.float64)
    ops.clip_accumulate(_kernel_grads(torch.tensor([-HUGE * HUGE])), CLIP, term)
    exact = np.sign(-y.double().numpy()).sum() * term
    assert np.linalg.norm(sums[0] - exact) <= (N + 64) * 2.0**-53 * N * CLIP  # float64: chain of N additions


@pytest.mark.parametrize("batch, width", [(64, 9000), (3, 70000), (1000, 40)])
def test_every_kernel_schedule_sums_over_records_in_float64(batch, width) -> None:
    """Narrow (double accumulators), wide sample-parallel and column-parallel schedules: unclipped float32
    terms of mixed magnitudes, whose float32 running sum would lose the small ones, summed as math.fsum
    does to float64 accuracy."""
    rng = np.random.default_rng(5)
    g = (rng.standard_normal((batch, width)) * 10.0 ** rng.integers(-4, 5, (batch, 1))).astype(np.float32)
    exact = np.array([math.fsum(col) for col in g.astype(np.float64).T])
    scale = np.abs(g.astype(np.float64)).sum(axis=0)
    for dtype in (np.float64, np.float32):
        out = np.zeros(width, dtype=dtype)
        ops.clip_accumulate(g, 1e30, out)  # nothing is clipped: the sum is the plain sum
        # float64 out: float64 accuracy; float32 out: the float64 sum rounded once (half a unit of float32).
        tol = 1e-12 * scale if dtype == np.float64 else 2.0**-24 * np.abs(exact) + 1e-12 * scale
        assert np.all(np.abs(out - exact) <= tol), f"{batch}x{width} into {np.dtype(dtype).name}"


def test_noisy_update_adds_a_float64_sum_to_float32_values_before_rounding() -> None:
    """The release rounds to float32 once, after the noise: ``v + scale * sum`` from a float64 sum."""
    v = np.zeros(3, dtype=np.float32)
    total = np.array([1e5 + 0.375, -2.0**-30, 3.0], dtype=np.float64)
    ops.noisy_update([v], generator=ops.NoiseGenerator(), stream="s", sigma=0.0, sum=[total], scale=0.5)
    assert v.tolist() == [np.float32(0.5 * total[0]), np.float32(0.5 * total[1]), np.float32(1.5)]
    with pytest.raises(TypeError, match="sum"):
        ops.noisy_update([v.astype(np.float64)], generator=ops.NoiseGenerator(), stream="s",
                         sigma=0.0, sum=[total.astype(np.float32)])


# ---- ghost and materialised paths ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ghost", "materialised"])
@pytest.mark.parametrize("relation", ["replace-one", "add-remove"])
@pytest.mark.parametrize("layout", ["aligned", "cancelling"])
def test_clipped_sum_of_a_million_float32_records_moves_by_at_most_the_priced_bound(mode, relation,
                                                                                    layout) -> None:
    model = _model()
    x, y = _records(N, layout)
    x2, y2 = _neighbour(x, y, relation)
    sums = []
    for inputs, targets in ((x, y), (x2, y2)):
        gradients = ClippedGradients(model, _loss, mode=mode, chunk_size=N // 4)
        out = accumulators([p.detach().reshape(-1) for p in model.parameters()])
        gradients.sum(inputs, targets, CLIP, out)
        sums.append(out)
    gap = _gap(*sums)
    assert gap <= _bound(relation) * (1 + SLACK), f"{mode}, {relation}, {layout}: moved by {gap / CLIP:.6f} C"


def test_float32_out_gets_the_float64_sum_rounded_once() -> None:
    """Callers that keep a float32 buffer get one rounding of the float64 sum (not one per micro-batch)."""
    model = _model()
    x, y = _records(1000, "aligned")
    for mode in ("ghost", "materialised"):
        out32 = [torch.zeros(D, dtype=torch.float32)]
        out64 = accumulators(out32)
        for out in (out32, out64):
            ClippedGradients(model, _loss, mode=mode, chunk_size=7).sum(x, y, CLIP, out)
        assert torch.equal(out32[0], out64[0].to(torch.float32)), mode



@pytest.mark.parametrize("mode", ["ghost", "materialised"])
@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_replace_writes_the_sum_that_adding_into_zeros_writes(mode, chunk, dtype) -> None:
    """``sum(..., replace=True)`` into a buffer holding anything is bit for bit the sum added into zeros
    (what DP-SGD releases without zeroing its buffer first); an empty batch leaves zeros."""
    model = _model()
    x, y = _records(40, "cancelling")
    engine_ = ClippedGradients(model, _loss, mode=mode, chunk_size=chunk)
    added = [torch.zeros(D, dtype=dtype)]
    engine_.sum(x, y, CLIP, added)
    dirty = [torch.full((D,), 123.0, dtype=dtype)]
    assert engine_.sum(x, y, CLIP, dirty, replace=True) == 0
    assert torch.equal(dirty[0], added[0])
    assert engine_.sum(x[:0], y[:0], CLIP, dirty, replace=True) == 0
    assert torch.equal(dirty[0], torch.zeros(D, dtype=dtype))

def test_accumulators_are_float64_zeros_shaped_like_the_parameters() -> None:
    acc = accumulators([torch.ones(3, dtype=torch.float32), torch.ones(2, 2)])
    assert [(t.dtype, tuple(t.shape), float(t.abs().sum())) for t in acc] == [
        (torch.float64, (3,), 0.0), (torch.float64, (2, 2), 0.0)]
    assert engine._wide(acc)[0] is acc[0]


# ---- the release: what DP-SGD and DP-GD hand to the noise ------------------------------------------------
def _clipped_term() -> np.ndarray:
    """One record's clipped gradient (targets ``-HUGE^2``) on the ghost path, in float64."""
    x, y = _records(1, "aligned")
    out = accumulators([torch.zeros(D)])
    ClippedGradients(_model(), _loss, mode="ghost").sum(x, y, CLIP, out)
    return out[0].numpy()


def _adversarial_imbalance(term: np.ndarray, relation: str) -> int:
    """An even ``K`` near ``N`` such that, with ``(N + K) / 2`` records of clipped term ``term`` and the rest
    of ``-term`` (the sum ``K term``), a float32 sum moves by more than the priced bound to the neighbour's
    ``(K - 2) term`` (replace-one: one record flipped) or ``(K - 1) term`` (add/remove: one of ``-term``
    added): the float32 roundings of the two sums fall on opposite sides."""
    ks = np.arange(N - N // 10, N + 1, 2)
    other = ks - 2 if relation == "replace-one" else ks - 1
    rounded = lambda k: (k[:, None] * term[None, :]).astype(np.float32).astype(np.float64)  # noqa: E731
    gaps = np.linalg.norm(rounded(ks) - rounded(other), axis=1)
    return int(ks[np.argmax(gaps > _bound(relation) * 1.01)])


def _handed_to_the_noise(monkeypatch, build, inputs, targets) -> tuple[np.ndarray, float, float, list[str]]:
    """One step of ``build(inputs, targets)``, its batch every record (Poisson's draw steered so: the
    differing record is in it, the worst case): the clipped sum the release adds the noise to, as it is
    handed over (before any rounding to the parameters' dtype), its scale, the noise std and the sum's
    dtypes."""
    seen = []
    original = ops.noisy_update

    def capture(v, **kwargs):
        seen.append((np.concatenate([s.detach().double().numpy() for s in kwargs["sum"]]),
                     float(kwargs["scale"]), float(kwargs["sigma"]), [str(s.dtype) for s in kwargs["sum"]]))
        return original(v, **kwargs)

    monkeypatch.setattr(ops, "noisy_update", capture)
    monkeypatch.setattr(BatchSampler, "draw", lambda sampler: np.arange(sampler.n))
    build(inputs, targets).step()
    ((total, scale, sigma, dtypes),) = seen
    return total, scale, sigma, dtypes


@pytest.mark.parametrize("name, relation", [("dp-sgd", "replace-one"), ("dp-sgd", "add-remove"),
                                            ("dp-gd", "replace-one")])
def test_released_sum_of_a_million_float32_records_moves_by_at_most_the_priced_bound(monkeypatch, name,
                                                                                      relation) -> None:
    """The release adds noise to ``scale * sum``: a float32 DP-SGD (Poisson) and DP-GD step on 10^6
    extreme records against the neighbour that flips one record (replace-one: 2C) or adds one (add/remove,
    the dataset size stated public: C), the records' signs laid out so that float32 sums would round apart.
    With the algorithms' sum buffers in float32 (the float64 sum rounded once into them) the handed sums
    moved by 2.030C (replace-one) and 1.037C (add/remove); kept in float64 they move by the clipped terms'
    difference, up to float64 roundings."""
    term = _clipped_term()
    imbalance = _adversarial_imbalance(term, relation)
    x = (HUGE * _direction()).to(torch.float32).expand(N, D).contiguous()
    y = torch.full((N,), HUGE * HUGE, dtype=torch.float32)
    y[: (N + imbalance) // 2] = -HUGE * HUGE  # gradient +term; the rest -term
    x2, y2 = _neighbour(x, y, relation)  # record 7 flipped to -term, or one -term record added

    def build(inputs, targets):
        runtime = RuntimeConfig(grad_mode="ghost", chunk_size=N // 4)
        if name == "dp-gd":
            return DPGD(_model(), _loss, inputs, targets, lr=0.1, clip=CLIP, steps=1, noise=1.0,
                        runtime=runtime)
        public = {"public_dataset_size": N} if relation == "add-remove" else {}
        return DPSGD(_model(), _loss, inputs, targets, lr=0.1, clip=CLIP, steps=1, batch_size=1000,
                     noise=1.0, privacy=PrivacyConfig(neighbouring=relation, **public), runtime=runtime)

    total, scale, sigma, dtypes = _handed_to_the_noise(monkeypatch, build, x, y)
    total2, scale2, sigma2, _ = _handed_to_the_noise(monkeypatch, build, x2, y2)
    assert (scale, sigma) == (scale2, sigma2)  # public: the same on both sides
    gap = float(np.linalg.norm(total - total2))
    assert gap <= _bound(relation) * (1 + SLACK), f"{name}, {relation}: moved by {gap / CLIP:.6f} C"
    assert dtypes == ["torch.float64"], dtypes  # kept in float64 until the noise is added
    # The sum is the float64 sum of the clipped terms, and the layout has teeth: rounded to float32, the
    # same two sums would move by more than the bound.
    assert np.linalg.norm(total - imbalance * term) <= 1e-9 * N * CLIP
    rounded = float(np.linalg.norm(total.astype(np.float32).astype(np.float64)
                                   - total2.astype(np.float32).astype(np.float64)))
    assert rounded > _bound(relation) * 1.01, rounded



# ---- the data-parallel all-reduce -------------------------------------------------------------------------
SHARED = 10**4  # records split over two processes


def _double_rounding_layout(term: np.ndarray) -> int:
    """A count ``p`` of records of clipped term ``term`` (the other ``SHARED - p`` of ``-term``, the shares
    interleaved as a data-parallel run's ``rank::2``) whose float32 share sums, added in float32, differ from
    the float64 batch sum rounded once to float32."""
    f32 = lambda v: np.asarray(v, dtype=np.float64).astype(np.float32)  # noqa: E731
    for p in range(SHARED // 2, SHARED):
        net = [sum(1 if i < p else -1 for i in range(r, SHARED, 2)) for r in range(2)]
        shares = [k * term for k in net]
        if np.any(f32(f32(shares[0]) + f32(shares[1])) != f32(shares[0] + shares[1])):
            return p
    raise AssertionError("no layout rounds apart")


def _all_reduced_sums(rank: int, world: int, port: int, out: str, positive: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = (HUGE * _direction()).to(torch.float32).expand(SHARED, D).contiguous()
        y = torch.full((SHARED,), HUGE * HUGE, dtype=torch.float32)
        y[:positive] = -HUGE * HUGE
        engine = AllReducedGradients(ClippedGradients(_model(), _loss, mode="ghost"), None)
        narrow = [torch.zeros(D, dtype=torch.float32)]
        wide = accumulators(narrow)
        for sums in (narrow, wide):
            engine.sum(x[rank::world], y[rank::world], CLIP, sums)
        torch.save({"float32": narrow[0], "float64": wide[0]}, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")
def test_the_all_reduce_sums_the_processes_shares_in_float64(tmp_path) -> None:
    """Two gloo processes, each clipping its share of the batch: the all-reduced sum is formed in float64
    (equal on both ranks, the float64 sum of the terms), and a float32 ``out`` gets it rounded once. Before,
    the scratch buffers took ``out``'s dtype: each share was rounded to float32 and the shares added in
    float32, which for this layout differs from the batch's sum rounded once."""
    term = _clipped_term()
    positive = _double_rounding_layout(term)
    out = str(tmp_path / "rank")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_all_reduced_sums, args=(2, port, out, positive), nprocs=2)
    ranks = [torch.load(f"{out}-{r}.pt") for r in range(2)]
    assert torch.equal(ranks[0]["float64"], ranks[1]["float64"])
    assert ranks[0]["float64"].dtype == torch.float64
    net = 2 * positive - SHARED
    assert np.linalg.norm(ranks[0]["float64"].numpy() - net * term) <= 1e-12 * SHARED * CLIP
    for r in ranks:
        assert torch.equal(r["float32"], ranks[0]["float64"].to(torch.float32))  # one rounding


# ---- ghost clipping's rounding bound, for sums formed in float64 ------------------------------------------
def _exact_error_sq(written: torch.Tensor, exact: list[list[Fraction]]) -> Fraction:
    return sum((Fraction(float(w)) - e) ** 2 for row_w, row_e in zip(written.tolist(), exact)
               for w, e in zip(row_w, row_e))


def _norm_up(exact: list[list[Fraction]]) -> Fraction:
    """An upper bound on the Frobenius norm of exact entries (a rational above the square root)."""
    sq = sum(e * e for row in exact for e in row)
    root = Fraction(math.sqrt(float(sq)))
    return root * (1 + Fraction(1, 2**40)) if root * root >= sq else root * (1 + Fraction(1, 2**30))


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_write_error_of_a_float64_sum_prices_its_roundings_then_one_rounding_to_float32(precision) -> None:
    """An Outer part whose 40 steps nearly cancel (``R_i`` far above ``||u_i||``), summed in float64 from
    float32 factors and rounded once to float32, as :meth:`GhostClipper._clip` does: the written entries are
    within ``f (E + u ||u||)`` of the exact ones with ``E`` the float64-priced bound, which is ~2^-29 of the
    float32 one (and is not raised by a TF32 matmul setting, which float64 matmuls ignore), so the clip
    radius is no longer shrunk for roundings the sum does not make."""
    from dpvr.grads.ghost.norms import write_error
    from dpvr.grads.ghost.rules import Outer

    torch.manual_seed(2)
    m = torch.randn(1, 40, 8)
    m = m[:, :1] + 1e-5 * m
    n = torch.randn(1, 40, 5)
    n = n - n.mean(dim=1, keepdim=True)
    part = Outer([(m, n)])
    f = torch.tensor([0.37])
    fq = Fraction(float(f[0]))
    exact = [[sum(fq * Fraction(float(n[0, t, a])) * Fraction(float(m[0, t, b])) for t in range(40))
              for b in range(8)] for a in range(5)]
    written = part.total(f.double(), torch.Size([5, 8])).to(torch.float32)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        wide = write_error([(0, part)], 1, torch.float32, torch.device("cpu"), accumulate=torch.float64)
        narrow = write_error([(0, part)], 1, torch.float32, torch.device("cpu"))
    finally:
        torch.set_float32_matmul_precision(saved)
    allowed = Fraction(float(wide[0])) * fq + Fraction(2**-24) * _norm_up(exact)
    assert _exact_error_sq(written, exact) <= allowed**2
    assert float(wide[0]) <= 2.0**-28 * float(narrow[0])
    with pytest.raises(ValueError, match="accumulate"):
        write_error([(0, part)], 1, torch.float64, torch.device("cpu"), accumulate=torch.float32)


def test_write_error_of_a_float64_tied_sum() -> None:
    """A Tied part whose table rows nearly cancel the map at their keys, summed in float64 and rounded once
    to float32: within ``f (E + u ||u||)`` of ``f (r + h)``, ``E`` priced for the float64 sum."""
    from dpvr.grads.ghost.norms import write_error
    from dpvr.grads.ghost.rules import Outer, Rows, Tied

    vocab, width = 7, 3
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        keys = torch.randint(0, vocab, (1, 5), generator=g)
        m = torch.randn(1, 4, width, generator=g)
        n = torch.randn(1, 4, vocab, generator=g)
        h = torch.einsum("bsv,bsd->bvd", n.double(), m.double())
        rows = (-h.gather(1, keys.unsqueeze(-1).expand(-1, -1, width))
                * (1 + 1e-5 * torch.randn(1, 5, width, generator=g, dtype=torch.float64))).to(torch.float32)
        part = Tied(Rows([(keys, rows)]).coalesced(), Outer([(m, n)]))
        f = torch.tensor([0.37])
        fq = Fraction(float(f[0]))
        ((ck, cr),) = part.rows.pieces
        table = [[Fraction(0)] * width for _ in range(vocab)]
        for k in range(ck.shape[1]):
            for j in range(width):
                table[int(ck[0, k])][j] += Fraction(float(cr[0, k, j]))
        exact = [[fq * (table[v][j] + sum(Fraction(float(n[0, s, v])) * Fraction(float(m[0, s, j]))
                                          for s in range(4))) for j in range(width)] for v in range(vocab)]
        written = part.total(f.double(), torch.Size([vocab, width])).to(torch.float32)
        bound = write_error([(0, part)], 1, torch.float32, torch.device("cpu"), accumulate=torch.float64)
        allowed = Fraction(float(bound[0])) * fq + Fraction(2**-24) * _norm_up(exact)
        assert _exact_error_sq(written, exact) <= allowed**2, seed
