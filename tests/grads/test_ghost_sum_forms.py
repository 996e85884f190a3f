"""The clipped sum's two forms for a non-materialised Outer part at one point (dpvr.grads.ghost.cost
SUM_FORMS): the float64 product over samples and steps, and ``"record32"``, each record's float32 matrix
summed over records in float64, whose rounding ``write_error`` prices per part with the float32 unit.

Checked on recorded parts of real layers (a Linear over a sequence, a weight shared by two modules: several
pieces, Conv2d at a few paddings and strides), float32 parameters: every record's written term within the
priced bound of its exact matrix, the sums within the sum of those bounds; a record at the radius written
alone has norm at most C, also where its steps cancel (``R_i >> ||u_i||``), which the float64 unit would not
cover; differences never take the float32 form; the cost model's choice flips with the steps.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import Tensor, nn

from dpvr import ops
from dpvr.grads import GhostClipper, per_sample_grads
from dpvr.grads.ghost import cost, norms
from dpvr.grads.ghost.linear import ConvOuter
from dpvr.grads.ghost.rules import Outer, Tied, steps_read

U32, U64 = 2.0**-24, 2.0**-53
RATES = cost.Rates(matmul32=1e11, matmul64=5e10, gram=8e9, direct=1.2e10, bandwidth=1e10)


def mse(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


class SeqLinear(nn.Module):
    """A Linear over 12 steps of a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 20)
        self.head = nn.Linear(20, 1)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(x.view(x.shape[0], 12, 24)))).sum(dim=(1, 2))


class SharedPieces(nn.Module):
    """One weight used by two modules (two pieces of one part) at 5 and 7 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16, bias=False)
        self.second = nn.Linear(16, 16, bias=False)
        self.second.weight = self.first.weight
        self.head = nn.Linear(16, 1)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.tanh(self.first(x[:, :80].reshape(-1, 5, 16)))
        b = torch.tanh(self.second(x[:, 80:192].reshape(-1, 7, 16)))
        return self.head(a).sum(dim=(1, 2)) + self.head(b).sum(dim=(1, 2))


class Conv(nn.Module):
    def __init__(self, padding: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=padding, stride=stride)
        self.head = nn.Linear(8, 1)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.conv(x.view(x.shape[0], 3, 8, 8)))
        return self.head(y.mean(dim=(2, 3))).squeeze(1)


class Cancelling(nn.Module):
    """A Linear at 8 nearby steps whose outputs enter with alternating signs: the per-record matrix is a
    sum of rank-one terms that nearly cancel (``R_i`` about 10^3-10^4 times ``||u_i||``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(48, 48, bias=False)
        self.head = nn.Linear(48, 1)
        self.head.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        steps = x.unsqueeze(1) + 1e-4 * torch.cos(torch.arange(8.0).view(1, 8, 1) * (x.unsqueeze(1) + 1))
        y = torch.tanh(self.lin(steps))  # (B, 8, 48)
        signs = torch.tensor([1.0, -1.0] * 4).view(1, 8, 1)
        return self.head((signs * y).sum(dim=1)).squeeze(1)


MODELS = {
    "sequence-linear": (SeqLinear, 12 * 24),
    "shared-pieces": (SharedPieces, 192),
    "conv-pad1-stride1": (lambda: Conv(1, 1), 192),
    "conv-pad0-stride2": (lambda: Conv(0, 2), 192),
    "conv-pad2-stride3": (lambda: Conv(2, 3), 192),
}


@pytest.fixture
def no_materialised(monkeypatch):
    """No memory for the materialised form: every Outer part takes a form whose sum is one of SUM_FORMS."""
    monkeypatch.setenv(cost.BUDGET_ENV, "0")
    with cost.pinned_rates(RATES):
        yield


@pytest.fixture
def record32_calls(monkeypatch) -> list[str]:
    """The class names of the parts whose clipped sum formed float32 per-record matrices, in call order."""
    calls: list[str] = []
    original = Outer._record32_total

    def spy(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Outer, "_record32_total", spy)
    return calls


def outer_parts(clipper: GhostClipper, x: Tensor, y: Tensor, point=None) -> list[tuple[int, Outer]]:
    """The Outer parts (a Tied part's map too) of a recorded point, as the clipper forms them."""
    rec = clipper._record(x, y, point, "params")
    parts = clipper._parts(rec, None, None, None)
    return [(k, p.outer if isinstance(p, Tied) else p) for k, p in parts if isinstance(p, (Outer, Tied))]


def exact_matrices(part: Outer) -> tuple[Tensor, Tensor]:
    """Float64 ``u_i`` of the pieces and ``R_i``: both within ``gamma64_K R_i`` of the exact values."""
    pieces = [(m.double(), n.double()) for m, n in part.pieces]
    u = Outer(pieces).per_sample()
    r = sum((m.norm(dim=-1) * n.norm(dim=-1)).reshape(m.shape[0], -1).sum(dim=1) for m, n in pieces)
    return u.reshape(u.shape[0], -1), r


def steps_of(part: Outer) -> int:
    return sum(m.shape[1] if m.dim() == 3 else 1 for m, _ in part.pieces)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_records_term_is_within_the_priced_bound(name, no_materialised) -> None:
    make, width = MODELS[name]
    torch.manual_seed(5)
    model = make()
    batch = 6
    x, y = torch.randn(batch, width), torch.randn(batch)
    for form in cost.SUM_FORMS:
        with cost.forced_sums(form):
            parts = outer_parts(GhostClipper(model, mse), x, y)
        assert parts
        for k, part in parts:
            record32 = part.sums_per_record32(torch.float64)
            assert record32 == (form == "record32")
            assert isinstance(part, ConvOuter) == name.startswith("conv")
            error = norms.write_error([(k, part)], batch, torch.float32, torch.device("cpu"),
                                      accumulate=torch.float64)
            u, r = exact_matrices(part)
            slack = 4 * (steps_of(part) + 8) * U64 * r  # the float64 reference's own rounding
            shape = torch.Size([u.shape[1]])
            for i in range(batch):
                one = torch.zeros(batch, dtype=torch.float64)
                one[i] = 1.0  # f = e_i: the sum is record i's term alone (the others add exact zeros)
                written = part.total(one, shape).double()
                assert float((written - u[i]).norm()) <= float(error[i] + slack[i])
            # the float32 rounding is priced by the float32 unit (gamma_K R_i), not the float64 one
            if record32:
                assert (error >= steps_of(part) * U32 * r).all()
            # the whole sum over records with float32 factors: within the sum of the records' bounds
            f = torch.rand(batch).to(torch.float64)
            got = part.total(f, shape).double()
            want = f @ u
            assert float((got - want).norm()) <= float(f @ (error + slack)) + batch * 4 * U64 * float(f @ r)


def test_a_convolution_unfolded_by_chunk_of_records_agrees(no_materialised) -> None:
    """Without unfolded pieces, ``ConvOuter`` unfolds each chunk of records itself (all positions): the
    same matrices within the priced bound."""
    torch.manual_seed(2)
    model = Conv(1, 2)
    x, y = torch.randn(5, 192), torch.randn(5)
    with cost.forced_sums("record32"):
        ((k, part),) = outer_parts(GhostClipper(model, mse), x, y)
    fresh = ConvOuter(part.rule, part.raw)
    fresh.sum_form = "record32"
    f = torch.rand(5).to(torch.float64)
    shape = torch.Size([8, 27])
    got = fresh.total(f, shape)
    assert "pieces" not in fresh.__dict__  # formed without unfolding the whole batch
    error = norms.write_error([(k, part)], 5, torch.float32, torch.device("cpu"), accumulate=torch.float64)
    u, r = exact_matrices(part)
    assert float((got.reshape(-1) - f @ u).norm()) <= float(f @ error) + 1e-12 * float(f @ r)


def test_chunks_of_records_add_up_to_the_whole(no_materialised, monkeypatch) -> None:
    """Records in chunks of two (the chunk's buffer, then the float64 addition of each chunk's weighted
    sum): each record's term unchanged, the sum within float64 roundings of one chunk's; a record's matrix
    in blocks of rows: within the priced bound."""
    torch.manual_seed(3)
    model = SeqLinear()
    x, y = torch.randn(7, 12 * 24), torch.randn(7)
    with cost.forced_sums("record32"):
        ((k, part),) = outer_parts(GhostClipper(model, mse), x, y)
    f = torch.rand(7).to(torch.float64)
    shape = torch.Size([20 * 24])
    whole = part.total(f, shape).clone()
    terms = [part.total(torch.eye(7, dtype=torch.float64)[i], shape).clone() for i in range(7)]
    scale = sum(f[i] * terms[i].abs() for i in range(7))
    assert not torch.equal(scale, torch.zeros_like(scale))
    monkeypatch.setattr(cost, "RECORD32_ENTRIES", 2 * 20 * 24)  # two records per chunk: four chunks
    chunked = part.total(f, shape)
    for i in range(7):
        assert torch.equal(part.total(torch.eye(7, dtype=torch.float64)[i], shape), terms[i])
    assert ((chunked - whole).abs() <= 16 * U64 * scale).all()
    # a record's matrix larger than a chunk: 3 of its 20 rows at a time, each term within the priced bound
    monkeypatch.setattr(cost, "RECORD32_ENTRIES", 3 * 24)
    error = norms.write_error([(k, part)], 7, torch.float32, torch.device("cpu"), accumulate=torch.float64)
    u, r = exact_matrices(part)
    for i in range(7):
        gap = (part.total(torch.eye(7, dtype=torch.float64)[i], shape).double() - u[i]).norm()
        assert float(gap) <= float(error[i] + 1e-12 * r[i])
    assert float((part.total(f, shape) - whole).norm()) <= 2 * float(f @ error)


def test_wide_records_are_summed_a_block_of_columns_at_a_time(no_materialised, monkeypatch) -> None:
    """A convolution's record matrices wider than tall and larger than a quarter of a chunk are summed a
    block of the sum's columns at a time (every record's block added while the block stays in cache): each
    record's term within its priced bound of the exact one, and the sum within float64 roundings plus the
    priced bounds of the records-first order's. The order follows the shapes only: a neighbour that leaves
    steps unread takes the same order (its own steps copied) and moves no other record's term."""
    torch.manual_seed(4)
    model = Conv(1, 1)
    x, y = torch.randn(6, 192), torch.randn(6)
    with cost.forced_sums("record32"):
        ((k, part),) = outer_parts(GhostClipper(model, mse), x, y)
    assert part.pieces and part.steps_formed()  # unfolded, as a norm form leaves them
    shape, f = torch.Size([8, 27]), torch.rand(6).to(torch.float64)
    records_first = part.total(f, shape).clone()
    blocks = []
    original = Outer._record32_by_block
    monkeypatch.setattr(Outer, "_record32_by_block", lambda self, *a: blocks.append(1) or original(self, *a))
    monkeypatch.setattr(cost, "RECORD32_ENTRIES", 2 * 8 * 27)  # a record fills half a chunk
    monkeypatch.setattr(cost, "RECORD32_SUM_BLOCK", 8 * 5)  # columns 5 at a time: 27 = 5 * 5 + 2
    by_block = part.total(f, shape)
    assert blocks
    error = norms.write_error([(k, part)], 6, torch.float32, torch.device("cpu"), accumulate=torch.float64)
    u, r = exact_matrices(part)
    for i in range(6):
        gap = (part.total(torch.eye(6, dtype=torch.float64)[i], shape).double().reshape(-1) - u[i]).norm()
        assert float(gap) <= float(error[i] + 1e-12 * r[i])
    assert float((by_block - records_first).norm()) <= 2 * float(f @ error) + 1e-12 * float(f @ r)
    # a neighbour that leaves steps unread (a copy of its own steps) moves no other record's term
    m, n = torch.randn(4, 30, 27), torch.randn(4, 30, 8)
    n_b = n.clone()
    n_b[3, ::2] = 0
    blocks.clear()
    terms = [Outer([(m, n_)], sum_form="record32").total(torch.eye(4, dtype=torch.float64)[0], shape)
             for n_ in (n, n_b)]
    assert len(blocks) == 2 and torch.equal(*terms)


class TiedHead(nn.Module):
    """An embedding and an output head holding one matrix (a Tied part: rows and a map of 6 steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 16)
        self.head = nn.Linear(16, 11, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x: Tensor) -> Tensor:
        keys = (x.abs() * 5).long() % 11
        return self.head(torch.tanh(self.embedding(keys))).sum(dim=1)


def written_norm_over_clip_sq(clipper: GhostClipper, x: Tensor, y: Tensor, fraction: float) -> Fraction:
    """``(||written|| / C)^2`` exactly, for one record clipped at ``fraction`` of its norm bound."""
    norm = float(clipper.clipped_sum(x, y, 1e30).norms[0])
    clip = fraction * norm
    sums = clipper.clipped_sum(x, y, clip).sums
    written = sum((Fraction(v) ** 2 for s in sums for v in s.double().flatten().tolist()), Fraction(0))
    return written / Fraction(clip) ** 2


def test_a_record_at_the_radius_written_alone_stays_within_it_where_its_steps_cancel(no_materialised) -> None:
    """The adversarial case: the per-record float32 matrix errs by about ``2^-24 R_i``, ~10^-4 of
    ``||u_i||`` here, far above the clip margin (~10^-7): priced by the float64 unit the record would be
    written above C; priced by the float32 unit (what write_error does for the part) it stays within."""
    over, ratios, worst = 0, [], 0.0
    for seed in range(12):
        torch.manual_seed(seed)
        model = Cancelling()
        x, y = 2 * torch.randn(1, 48), torch.randn(1)
        with cost.forced_sums("record32"):
            clipper = GhostClipper(model, mse)
            ((k, part),) = outer_parts(clipper, x, y)
            assert part.sums_per_record32(torch.float64)
            u, r = exact_matrices(part)
            ratios.append(float(r[0] / u[0].norm()))
            one = torch.ones(1, dtype=torch.float64)
            err = float((part.total(one, torch.Size([u.shape[1]])).double() - u[0]).norm())
            worst = max(worst, err / float(u[0].norm()))
            ratio_sq = written_norm_over_clip_sq(clipper, x, y, 0.37)
        over += ratio_sq > 1
    assert min(ratios) > 100  # the steps cancel: R_i >> ||u_i||
    # the float32 rounding of the per-record matrix exceeds what the clip margin (~1.2e-7) would absorb ...
    assert worst > 1e-6
    # ... and is priced: no record written above the radius
    assert over == 0


def test_a_tied_record_at_the_radius_written_alone_stays_within_it(no_materialised, record32_calls) -> None:
    """A tied embedding and head: its map's sum per record in float32 (priced inside the Tied part's
    E), its rows added in float64; one record clipped at 0.37 of its norm is written within C."""
    for seed in range(8):
        torch.manual_seed(seed)
        model = TiedHead()
        x, y = 2 * torch.randn(1, 6), torch.randn(1, 11)
        with cost.forced_sums("record32"):
            ratio_sq = written_norm_over_clip_sq(GhostClipper(model, mse), x, y, 0.37)
        assert ratio_sq <= 1, seed
    assert record32_calls


def test_differences_keep_the_float64_sum(no_materialised, record32_calls) -> None:
    """A difference's parts (a rule's own form and parts combined at two points, shared weights too) never
    form float32 per-record matrices, even with the float32 form forced; a plain sum at one point does."""
    calls = record32_calls
    for name in ("sequence-linear", "shared-pieces", "conv-pad1-stride1"):
        make, width = MODELS[name]
        torch.manual_seed(1)
        model = make()
        x, y = torch.randn(4, width), torch.randn(4)
        point = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        other = [p + 1e-3 * torch.randn_like(p) for p in point]
        with cost.forced_sums("record32"):
            clipper = GhostClipper(model, mse, reuse_recording=True)
            clipper.clipped_sum(x, y, 1.0, params=point)
            assert calls, name  # at one point the forced form is taken
            calls.clear()
            clipper.clipped_diff_sum(x, y, other, point, 1.0)  # the kept point's parts are combined
            clipper.clipped_diff_sum(x, y, point, other, 1.0)
        assert calls == [], name
        shown = {c.sum_form for key, c in clipper.choices.items() if key.endswith("(difference)")}
        assert shown <= {"float64", "materialised"}, name  # the choice shows the sum that runs
    a = Outer([(torch.randn(2, 3, 4), torch.randn(2, 3, 5))], sum_form="record32")
    assert a.combine(a, None, None).sum_form is None


def test_float64_parameters_never_take_the_float32_sum(no_materialised, monkeypatch) -> None:
    monkeypatch.setattr(Outer, "_record32_total", lambda *a, **k: pytest.fail("a float32 sum for float64"))
    torch.manual_seed(0)
    model = SeqLinear().double()
    x, y = torch.randn(3, 12 * 24, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    with cost.forced_sums("record32"):
        clipper = GhostClipper(model, mse)
        clipper.clipped_sum(x, y, 0.1)
    assert {c.sum_form for c in clipper.choices.values()} == {"float64"}


def test_clipped_sums_agree_with_float64_autograd(no_materialised) -> None:
    """Both sum forms against float64 per-record autograd of the same model: norms and clipped sums."""
    torch.manual_seed(4)
    model = SeqLinear()
    x, y = torch.randn(8, 12 * 24), torch.randn(8)
    model64 = SeqLinear().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    grads = per_sample_grads(model64, mse, x.double(), y.double())
    flat = torch.cat([g.reshape(8, -1) for g in grads], dim=1)
    clip = 0.5 * float(flat.norm(dim=1).min())
    f = torch.clamp(clip / flat.norm(dim=1), max=1.0)
    want = [torch.einsum("i,i...->...", f, g) for g in grads]
    for form in cost.SUM_FORMS:
        with cost.forced_sums(form):
            clipper = GhostClipper(model, mse)
            got = clipper.clipped_sum(x, y, clip)
        assert clipper.choices["lin.weight"].sum_form == form
        for s, w in zip(got.sums, want):
            torch.testing.assert_close(s.double(), w, rtol=1e-4, atol=1e-4 * clip)


@pytest.mark.parametrize(("shapes", "small", "large"), [
    ((32, 4608, 512), 64, 256),   # wide maps: float64 wins at few steps, the float32 records at many
    ((32, 1152, 128), 4, 1024),
    ((8, 768, 3072), 8, 512),
])
def test_the_sum_form_flips_with_the_steps(shapes, small, large) -> None:
    batch, p, q = shapes
    assert cost.choose_sum(batch, small, p, q, 4, RATES) == "float64"
    assert cost.choose_sum(batch, large, p, q, 4, RATES) == "record32"
    sums = cost.predict_sums(batch, large, p, q, 4, RATES)
    assert sums["record32"] < sums["float64"]
    # float64 pieces: never float32
    assert math.isinf(cost.predict_sums(batch, large, p, q, 8, RATES)["record32"])
    # the choice is recorded beside the norm form; a materialised part's sum is its matrices'
    choice = cost.choose(batch, large, p, q, 4, RATES, budget=0.0)
    assert choice.sum_form == "record32" and choice.sum_seconds == sums
    assert cost.choose(64, 64, 64, 128, 4, RATES, 2.0**40).sum_form == "materialised"


def test_forcing_a_sum_form_checks_its_name() -> None:
    with pytest.raises(ValueError, match="form"), cost.forced_sums("float16"):
        pass


def test_denormal_inputs_flushed_to_zero_are_priced() -> None:
    """Under flush-to-zero and denormals-are-zero (``torch.set_flush_denormal``), denormal activations are
    read as zeros by the float32 matmul: the record's matrix is written as 0 while its exact value is not.
    The bound's absolute term (``mu sqrt(p q) K (A_i + B_i)``) covers that; ``gamma_K R_i`` alone is ten
    million times too small here."""
    torch.manual_seed(0)
    batch, steps, p, q = 2, 4, 8, 8
    m, n = torch.randn(batch, steps, p) * 1e-39, torch.randn(batch, steps, q) * 1e30
    part = Outer([(m, n)], sum_form="record32")
    u, r = exact_matrices(part)
    with ops.torch_threads(1):
        if not torch.set_flush_denormal(True):
            pytest.skip("no flush-to-zero mode on this host")
        try:
            written = [part.total(torch.eye(batch, dtype=torch.float64)[i], torch.Size([q * p]))
                       for i in range(batch)]
        finally:
            torch.set_flush_denormal(False)
    error = norms.record32_error(part, batch, torch.device("cpu"))
    for i in range(batch):
        gap = float((written[i] - u[i]).norm())
        assert gap > 1e6 * steps * U32 * float(r[i])  # the relative term alone would not cover it
        assert gap <= float(error[i])


def _record0_term(kept: tuple[Tensor, Tensor], q: int, p: int) -> Tensor:
    """Record 0's term of the record32 sum (factor 0.7, the others' 0)."""
    f = torch.tensor([0.7, 0.0, 0.0], dtype=torch.float64)
    return Outer([kept], sum_form="record32").total(f, torch.Size([q, p]))


def _record0_materialised(kept: tuple[Tensor, Tensor], q: int, p: int) -> Tensor:
    """Record 0's materialised per-sample matrix (what the materialised form's norm and sum read)."""
    return Outer([kept]).per_sample()[0]


def _record0_gram32(kept: tuple[Tensor, Tensor], q: int, p: int) -> Tensor:
    """Record 0's squared norm, its bound and ``R`` by the float32 Gram form (what its factor reads)."""
    return torch.stack([t[0] for t in norms.gram32_term(Outer([kept]))])


def _record0_record32_error(kept: tuple[Tensor, Tensor], q: int, p: int) -> Tensor:
    """Record 0's priced error of its record32 matrix (what its factor reads beside its norm)."""
    return norms.record32_error(Outer([kept], sum_form="record32"), 3, torch.device("cpu"))[0]


# rtol: 0 for bit for bit; the priced error sums float64 step norms over the steps kept, so float64
# roundings of those sums may move with the batch (about 1e-16 relative; a step count that followed the
# batch would move it by a third here)
@pytest.mark.parametrize(("formed", "rtol"), [(_record0_term, 0.0), (_record0_materialised, 0.0),
                                              (_record0_gram32, 0.0), (_record0_record32_error, 1e-12)],
                         ids=["record32-sum", "materialised", "gram32-norm", "record32-error"])
def test_a_records_float32_matrix_does_not_follow_the_steps_its_neighbours_read(formed, rtol) -> None:
    """A neighbour that reads steps no other record reads changes the steps the batch keeps
    (:func:`read_steps`); each other record's float32 matrix, and so its term of the sum, stays bit for bit
    (products over the record's own read steps), in the record32 sum and in the materialised form, and
    so do its float32 Gram norm, that norm's bound and, up to float64 roundings, the record32 sum's priced
    error. A batched product over the kept steps changes on these shapes (a matmul orders its float32
    additions by shape), which is what the test would catch."""
    from dpvr.grads.ghost.linear import read_steps

    changed = 0
    for seed, steps, p, q in [(5, 200, 128, 32), (7, 500, 48, 48), (4, 256, 64, 64), (2, 300, 96, 256)]:
        torch.manual_seed(seed)
        m, n = torch.randn(3, steps, p), torch.randn(3, steps, q)
        n[:, ::4] = 0  # steps no record reads
        n_b = n.clone()
        n_b[2, ::4] = torch.randn(n_b[2, ::4].shape)  # a neighbour in place of record 2 reads them
        kept, kept_b = read_steps(m, n), read_steps(m, n_b)
        torch.testing.assert_close(formed(kept, q, p), formed(kept_b, q, p), rtol=rtol, atol=0.0,
                                   msg=str((steps, p, q)))
        batched = [torch.bmm(b.transpose(1, 2), a)[0] for a, b in (kept, kept_b)]
        changed += not torch.equal(*batched)
    if not changed:
        pytest.skip("this host's float32 matmul orders its additions alike at every step count tried")


def test_a_differences_pieces_are_read_as_recorded_and_grouped_by_what_each_record_reads() -> None:
    """A difference's part has a piece per point. Where every record reads every step, the float32 forms
    read the recorded pieces themselves (neither copied nor joined: the join copied 340 MB a round on the
    ResNet); where a neighbour reads fewer steps of one piece, the records are grouped by their read count
    per piece. Record 0, which reads every step, keeps its materialised matrix and its float32 Gram bound
    and ``R`` bit for bit either way, and its Gram value up to the float64 rounding of its sum: its blocks
    follow its own steps per piece, never the batch's."""
    torch.manual_seed(11)
    for steps_a, steps_b, p, q in [(200, 200, 64, 32), (130, 70, 48, 96)]:
        pieces = [(torch.randn(3, t, p), torch.randn(3, t, q)) for t in (steps_a, steps_b)]
        ((index, read),) = Outer(pieces).by_read_count()
        assert index.tolist() == [0, 1, 2]
        assert all(a.data_ptr() == m.data_ptr() and b.data_ptr() == n.data_ptr()
                   for (a, b), (m, n) in zip(read, pieces))
        neighbour = [(m, n.clone()) for m, n in pieces]
        neighbour[1][1][2, ::3] = 0  # record 2 reads a third fewer steps of the second point
        assert [i.tolist() for i, _ in Outer(neighbour).by_read_count()] == [[2], [0, 1]]
        assert torch.equal(Outer(pieces).per_sample()[0], Outer(neighbour).per_sample()[0])
        alone, beside = norms.gram32_term(Outer(pieces)), norms.gram32_term(Outer(neighbour))
        torch.testing.assert_close(alone[0][0], beside[0][0], rtol=1e-13, atol=0.0)
        assert torch.equal(alone[1][0], beside[1][0]) and torch.equal(alone[2][0], beside[2][0])


def test_steps_read_is_any_over_each_step() -> None:
    """``steps_read`` gives ``n.any(dim=-1)`` exactly: steps zero but for their last entry, zeros of either
    sign, NaN, infinities and subnormal entries, on contiguous, transposed, float64 and 2-d gradients."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        q = int(torch.randint(1, 40, (1,), generator=g))
        n = torch.randn(3, 17, q, generator=g) * (torch.rand(3, 17, 1, generator=g) < 0.5)
        n[0, 1, -1] = 2.0  # read at its last entry only (past the entries read first)
        for value in (float("nan"), float("inf"), -0.0, 1e-42, -1e-45):
            if float(torch.rand(1, generator=g)) < 0.3:
                n[tuple(int(torch.randint(0, k, (1,), generator=g)) for k in n.shape)] = value
        for x in (n, n.transpose(1, 2).contiguous().transpose(1, 2), n.double(), n[0]):
            assert torch.equal(steps_read(x), x.any(dim=-1))
