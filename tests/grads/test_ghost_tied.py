"""A parameter shared by several modules (a tied embedding and output head, two tied Linears, two embeddings
of one table): ghost clipping without per-sample matrices of the shared weight, checked against float64
autograd run on one record at a time, and the float32 bound (what is written for one sample has norm at
most C) where the table's and the head's terms nearly cancel."""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpvr.grads import GhostClipper
from dpvr.grads.ghost import Dense, Outer, Rows, Tied, clipper, cost
from dpvr.grads.ghost.norms import _cross, write_error
from tests.grads.test_ghost_rounding import clipped_ratio_sq

BATCH = 6
BACKENDS = ["native", "torch"]


def sequence_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


class TiedLanguageModel(nn.Module):
    """Embedding (with padding) -> Linear -> LayerNorm -> a head holding the embedding's weight, at every
    position."""

    def __init__(self, vocab: int = 40, width: int = 6, padding: int | None = 0) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width, padding_idx=padding)
        self.mix = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(torch.tanh(self.mix(self.embedding(tokens)))))


class Gpt2(nn.Module):
    """A tiny ``transformers`` GPT-2 (random weights from a config; ``wte`` and ``lm_head`` tied)."""

    def __init__(self) -> None:
        super().__init__()
        tf = pytest.importorskip("transformers")
        config = tf.GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                               eos_token_id=0, use_cache=False)
        self.gpt2 = tf.GPT2LMHeadModel(config)
        assert self.gpt2.lm_head.weight is self.gpt2.transformer.wte.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.gpt2(tokens).logits


class ReadsTwoColumns(nn.Module):
    """A classifier from the tied head's first two columns at the last position (as the step benchmark's
    GPT-2): the head's output gradients are zero in every other column, whose rows of the clipped sum are
    left out (:func:`dpvr.grads.ghost.rules.read_columns`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLanguageModel()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lm(tokens)[:, -1, :2]


class TiedLinear(nn.Module):
    """Two Linears holding one weight, one of them at several steps."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 5)
        self.second = nn.Linear(5, 5, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x)))


class TwoEmbeddings(nn.Module):
    """Two embeddings of one table with different padding keys, and a head reading it too."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Embedding(30, 8, padding_idx=0)
        self.second = nn.Embedding(30, 8, padding_idx=1)
        self.second.weight = self.first.weight
        self.head = nn.Linear(8, 30, bias=False)
        self.head.weight = self.first.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.first(tokens) + self.second(tokens.flip(1))))


class ReadsWeight(nn.Module):
    """A module without a ghost rule holding the embedding's weight (a fallback layer)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x) @ self.weight.t()


class WithFallback(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 5)
        self.head = ReadsWeight(self.embedding.weight)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embedding(tokens))


def tokens(vocab: int, length: int = 5) -> Tensor:
    t = torch.randint(0, vocab, (BATCH, length))
    t[:, 0] = 0  # padding in every record
    t[:, 1] = t[:, 2]  # repeated tokens
    return t


def prompt_ignored(vocab: int, length: int) -> Tensor:
    """Targets whose first positions the loss ignores in every record, and one more in one record: the
    output gradients are zero there, and the steps every record ignores are left out
    (:func:`dpvr.grads.ghost.linear.read_steps`)."""
    t = tokens(vocab, length)
    t[:, :3] = -100
    t[0, 4] = -100
    return t


# Rates under which the host's cost model materialises every Outer part with steps.
MATERIALISE = cost.Rates(matmul32=1e20, matmul64=1e10, gram=1e3, direct=1e3, bandwidth=1e20)

# name: (model, inputs, targets, the shared parameter's part for norm_form="auto")
CASES = {
    "embedding-head": (TiedLanguageModel, lambda: tokens(40), lambda: tokens(40), Tied),
    "no-padding": (lambda: TiedLanguageModel(padding=None), lambda: tokens(40), lambda: tokens(40), Tied),
    # A head at more steps than its matrix has rows: materialised, the table's rows added to it.
    "materialised-head": (lambda: TiedLanguageModel(vocab=8, width=3), lambda: tokens(8, 9),
                          lambda: tokens(8, 9), Dense),
    "gpt2": (Gpt2, lambda: tokens(40, 7), lambda: tokens(40, 7), Tied),
    "gpt2-prompt-ignored": (Gpt2, lambda: tokens(40, 7), lambda: prompt_ignored(40, 7), Tied),
    "head-read-at-two-columns": (ReadsTwoColumns, lambda: tokens(40), lambda: torch.randint(0, 2, (BATCH,)),
                                 Tied),
    "prompt-ignored": (TiedLanguageModel, lambda: tokens(40), lambda: prompt_ignored(40, 5), Tied),
    "two-linears": (TiedLinear, lambda: torch.randn(BATCH, 2, 5), lambda: torch.randint(0, 5, (BATCH, 2)),
                    Outer),
    "two-embeddings-and-head": (TwoEmbeddings, lambda: tokens(30), lambda: tokens(30), Tied),
    "fallback": (WithFallback, lambda: tokens(12), lambda: tokens(12), Dense),
}


def build(name: str, dtype: torch.dtype = torch.float64):
    torch.manual_seed(0)
    make, inputs, targets, kind = CASES[name]
    model = make().to(dtype).eval()
    x = inputs()
    return model, (x.to(dtype) if x.is_floating_point() else x), targets(), kind


def trainable(model: nn.Module) -> list[Tensor]:
    return [p.detach() for p in model.parameters() if p.requires_grad]


def moved(point: list[Tensor], scale: float = 0.1) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [p + scale * torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in point]


def one_at_a_time(model: nn.Module, x: Tensor, y: Tensor, point: list[Tensor]) -> list[list[Tensor]]:
    """Float64 per-record gradients: each record alone through autograd, at ``point``."""
    model = copy.deepcopy(model).double()
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, v in zip(params, point):
            p.copy_(v)
    x = x.double() if x.is_floating_point() else x
    out = []
    for i in range(len(x)):
        loss = sequence_loss(model(x[i:i + 1])[0], y[i])
        out.append([g.detach() for g in torch.autograd.grad(loss, params)])
    return out


def clipped(records: list[list[Tensor]], clip: float) -> tuple[list[Tensor], Tensor]:
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in r)) for r in records])
    factors = torch.clamp(clip / norms, max=1.0)
    return [sum(f * r[k] for f, r in zip(factors, records)) for k in range(len(records[0]))], norms


def assert_matches(result, expected, dtype: torch.dtype) -> None:
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-4, atol=1e-5)
    sums, norms = expected
    torch.testing.assert_close(result.norms.double(), norms, **tol)
    for s, e in zip(result.sums, sums, strict=True):
        torch.testing.assert_close(s.double(), e, **tol)


@pytest.fixture
def shared_kinds(monkeypatch) -> list[type]:
    """The kinds of the parts the clipper forms for shared parameters."""
    kinds: list[type] = []

    def spy(parts, shape):
        part = shared(parts, shape)
        kinds.append(type(part))
        return part

    shared = clipper.shared
    monkeypatch.setattr(clipper, "shared", spy)
    return kinds


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_norms_sums_and_differences_match_float64_autograd(name, backend, dtype, shared_kinds,
                                                          monkeypatch) -> None:
    if name == "materialised-head":  # rates under which the host materialises the head (the torch path's
        monkeypatch.setattr(cost, "_pinned", [MATERIALISE])  # memory rule does so already)
    else:  # no memory for materialising: the ghost (Tied) part, whatever this machine's rates predict
        monkeypatch.setenv(cost.BUDGET_ENV, "0")
    model, x, y, kind = build(name, dtype)
    point, point_b = trainable(model), moved(trainable(model))
    truth, truth_b = one_at_a_time(model, x, y, point), one_at_a_time(model, x, y, point_b)
    ghost = GhostClipper(model, sequence_loss, backend=backend)
    assert ghost.mode == ("mixed" if name == "fallback" else "ghost")

    clip = float(clipped(truth, math.inf)[1].median())
    assert_matches(ghost.clipped_sum(x, y, clip), clipped(truth, clip), dtype)
    assert set(shared_kinds) == {kind}
    assert_matches(ghost.clipped_sum(x, y, clip, params=point_b), clipped(truth_b, clip), dtype)

    gaps = [[g - g_b for g, g_b in zip(r, r_b)] for r, r_b in zip(truth, truth_b)]
    clip = float(clipped(gaps, math.inf)[1].median())
    assert_matches(ghost.clipped_diff_sum(x, y, point, point_b, clip), clipped(gaps, clip), dtype)
    a = torch.linspace(0.5, 1.5, BATCH, dtype=dtype)
    b = torch.linspace(2.0, -1.0, BATCH, dtype=dtype)
    scaled = [[float(a[i]) * g - float(b[i]) * g_b for g, g_b in zip(r, r_b)]
              for i, (r, r_b) in enumerate(zip(truth, truth_b))]
    assert_matches(ghost.clipped_diff_sum(x, y, point, point_b, clip, a=a, b=b), clipped(scaled, clip), dtype)


@pytest.mark.parametrize("form", ["gram", "direct"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_norm_form_keeps_the_tied_part(form, backend, shared_kinds) -> None:
    model, x, y, _ = build("materialised-head")  # materialised under "auto" only
    point, point_b = trainable(model), moved(trainable(model))
    truth, truth_b = one_at_a_time(model, x, y, point), one_at_a_time(model, x, y, point_b)
    ghost = GhostClipper(model, sequence_loss, norm_form=form, backend=backend)
    assert_matches(ghost.clipped_sum(x, y, 0.3), clipped(truth, 0.3), torch.float64)
    gaps = [[g - g_b for g, g_b in zip(r, r_b)] for r, r_b in zip(truth, truth_b)]
    assert_matches(ghost.clipped_diff_sum(x, y, point, point_b, 0.3), clipped(gaps, 0.3), torch.float64)
    assert set(shared_kinds) == {Tied}


@pytest.mark.parametrize("backend", BACKENDS)
def test_differences_at_identical_points_are_exactly_zero(backend) -> None:
    model, x, y, _ = build("embedding-head", torch.float32)
    point = trainable(model)
    result = GhostClipper(model, sequence_loss, backend=backend).clipped_diff_sum(
        x, y, point, [p.clone() for p in point], 1.0)
    assert (result.norms == 0).all() and all((s == 0).all() for s in result.sums)


def test_the_step_benchmarks_gpt2_is_all_ghost() -> None:
    pytest.importorskip("transformers")
    from dpvr_lab.bench.step import Decoder

    model = Decoder(vocab=50, width=8, layers=1, length=8, heads=2)
    assert GhostClipper(model, sequence_loss).mode == "ghost"


# ---- rounding: what is written for one sample in float32 has norm at most C ----

SEEDS = 60
VOCAB, WIDTH = 7, 6


class Opposed(nn.Module):
    """A table row read by the embedding and, through the head, by the logits at that key, with opposite
    signs: the table's and the head's per-sample terms nearly cancel (``u = r + h`` with ``||u|| ~ 1e-4
    ||r||``), so the float32 rows added into the head's matmul are far less accurate than ``u``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x: Tensor) -> Tensor:
        key = ((x[:, :1].abs() * 3).long() % VOCAB)  # (B, 1)
        views = torch.stack([x, torch.cos(x), torch.sin(3 * x)], dim=1)  # (B, 3, WIDTH)
        by_table = (self.embedding(key) * views).sum(dim=-1)  # <W[k], v_j>
        by_head = self.head(views).gather(2, key.unsqueeze(1).expand(-1, 3, 1))[..., 0]  # the same
        return torch.tanh(by_table) - (1 - 1e-4) * torch.tanh(by_head)


def worst_ratio(make, backend: str, difference: bool) -> tuple[float, int]:
    worst, over = 0.0, 0
    for seed in range(SEEDS):
        torch.manual_seed(seed)
        model = make()
        x = 2 * torch.randn(1, WIDTH) if isinstance(model, Opposed) else torch.randint(0, 8, (1, 9))
        y = torch.randint(0, 3, (1,)) if isinstance(model, Opposed) else torch.randint(0, 8, (1, 9))
        point = trainable(model)
        other = [p + 1e-4 * p.abs().max() * torch.randn_like(p) for p in point]
        ghost = GhostClipper(model, sequence_loss, backend=backend, norm_form="gram")
        ratio_sq = clipped_ratio_sq(ghost, x, y, point, other, difference)
        worst = max(worst, math.sqrt(ratio_sq))
        over += ratio_sq > 1
    return worst, over


ROUNDING = {
    "opposed-plain": (Opposed, False),
    "opposed-difference": (Opposed, True),
    "language-model-difference": (lambda: TiedLanguageModel(vocab=8, width=3), True),
}


# The rounding of the cancelling sum follows the summation order, which differs between the two paths'
# tensor layouts: the opposed cases run on both.
@pytest.mark.parametrize(("case", "backend"), [
    ("opposed-plain", "native"), ("opposed-plain", "torch"),
    ("opposed-difference", "native"), ("opposed-difference", "torch"),
    ("language-model-difference", "native"),
    pytest.param("language-model-difference", "torch", marks=pytest.mark.slow),
])
def test_float32_clipped_tied_gradient_of_one_sample_stays_within_clip(case, backend) -> None:
    make, difference = ROUNDING[case]
    worst, over = worst_ratio(make, backend, difference)
    assert over == 0, f"{over} of {SEEDS} seeds wrote a vector of norm up to {worst:.6f} C"


def random_tied(seed: int, dtype: torch.dtype) -> Tied:
    """A coalesced tied part whose rows and map nearly cancel at every key."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, VOCAB, (2, 5), generator=g)
    m = torch.randn(2, 4, WIDTH, generator=g, dtype=dtype)
    n = torch.randn(2, 4, VOCAB, generator=g, dtype=dtype)
    rows = -torch.einsum("bsv,bsd->bvd", n.double(), m.double()).gather(
        1, keys.unsqueeze(-1).expand(-1, -1, WIDTH))  # -h at the keys ...
    rows = (rows * (1 + 1e-5 * torch.randn(rows.shape, generator=g, dtype=torch.float64))).to(dtype)
    return Tied(Rows([(keys, rows)]).coalesced(), Outer([(m, n)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cross_term_bounds_its_rounding(dtype) -> None:
    for seed in range(5):
        part = random_tied(seed, dtype)
        value, bound = _cross(part)
        ((keys, rows),) = part.rows.pieces
        (m, n), = part.outer.pieces
        for i in range(2):
            exact = Fraction(0)
            for k in range(keys.shape[1]):
                for s in range(m.shape[1]):
                    dot = sum((Fraction(float(rows[i, k, j])) * Fraction(float(m[i, s, j]))
                               for j in range(WIDTH)), Fraction(0))
                    exact += Fraction(float(n[i, s, keys[i, k]])) * dot
            assert abs(Fraction(float(value[i])) - 2 * exact) <= Fraction(float(bound[i]))


def test_write_error_bounds_the_rounding_of_a_tied_sum() -> None:
    """The written ``fl(o + fl(f r))`` of one sample is within ``f (E + u ||u||)`` of ``f (r + h)``."""
    for seed in range(5):
        part = random_tied(seed, torch.float32).drop(torch.tensor([False, True]))  # sample 0 alone
        f = torch.tensor([0.37, 0.0])
        written = part.total(f, torch.Size([VOCAB, WIDTH]))
        exact = (part.rows.per_sample(torch.Size([VOCAB, WIDTH]))[0].double()
                 + torch.einsum("sv,sd->vd", part.outer.pieces[0][1][0].double(),
                                part.outer.pieces[0][0][0].double()))  # exact enough: far below the bound
        err_sq = sum((Fraction(float(w)) - Fraction(float(f[0])) * Fraction(float(e))) ** 2
                     for w, e in zip(written.flatten().tolist(), exact.flatten().tolist()))
        bound = write_error([(0, part)], 2, torch.float32, torch.device("cpu"))
        assert bound is not None
        allowed = Fraction(float(f[0])) * (Fraction(float(bound[0]))
                                           + Fraction(2 ** -24) * Fraction(float(exact.norm())))
        assert err_sq <= allowed ** 2


def test_steps_no_sample_reads_are_left_out_on_the_host() -> None:
    from dpvr.grads.ghost.linear import read_steps

    m, n = torch.randn(3, 5, 4), torch.randn(3, 5, 2)
    n[:, 1] = 0
    n[:, 3] = 0
    n[0, 4] = 0  # read by the other samples: kept
    kept_m, kept_n = read_steps(m, n)
    assert torch.equal(kept_m, m[:, [0, 2, 4]]) and torch.equal(kept_n, n[:, [0, 2, 4]])
    assert read_steps(m, torch.randn(3, 5, 2))[0] is m  # every step read: the tensors themselves
    full = Outer([(m, n)])
    torch.testing.assert_close(Outer([(kept_m, kept_n)]).per_sample(), full.per_sample())


def test_rows_no_sample_reads_are_left_out_of_a_heads_sum_on_the_host() -> None:
    from dpvr.grads.ghost.rules import read_columns

    torch.manual_seed(0)
    m, n = torch.randn(3, 4, 5), torch.zeros(3, 4, 40)
    n[:, :, 7] = torch.randn(3, 4)
    n[2, 1, 31] = -0.5  # one sample at one step, negative: kept
    assert read_columns(n, 5).tolist() == [7, 31]
    assert read_columns(n, 10) is None  # a map not over four times wider than its input: not scanned
    assert read_columns(torch.zeros(3, 4, 40), 5).numel() == 0
    assert Outer([(m, n)]).read_rows().tolist() == [7, 31]
    n2 = torch.zeros(3, 2, 40)
    n2[0, 1, 3] = 1.0  # the rows of several pieces are joined
    assert Outer([(m, n), (m[:, :2], n2)]).read_rows().tolist() == [3, 7, 31]
    n[:, 0, :10] = 1.0  # a quarter or more of the rows reached: the whole product
    assert read_columns(n, 5).numel() == 11 and Outer([(m, n)]).read_rows() is None
    n[:, 0, :10] = 0.0
    f = torch.rand(3, dtype=torch.float64)
    dense = (n.double() * f.view(3, 1, 1)).reshape(-1, 40).t() @ m.double().reshape(-1, 5)
    for out in (None, torch.full((200,), float("nan"), dtype=torch.float64)):
        total = Outer([(m, n)]).total(f, torch.Size([40, 5]), out=out)
        torch.testing.assert_close(total, dense, rtol=1e-15, atol=0)
        assert (total[[i for i in range(40) if i not in (7, 31)]] == 0).all()  # written, not left as it was
        assert out is None or total.data_ptr() == out.data_ptr()
    # a second piece that reads every column adds to the rows formed by the first
    n2 = torch.randn(3, 2, 40)
    m2 = torch.randn(3, 2, 5)
    both = Outer([(m, n), (m2, n2)]).total(f, torch.Size([40, 5]))
    torch.testing.assert_close(both, dense + (n2.double() * f.view(3, 1, 1)).reshape(-1, 40).t()
                               @ m2.double().reshape(-1, 5), rtol=1e-13, atol=1e-15)


def test_choices_from_the_sizes_ignore_the_steps_left_out() -> None:
    """Which steps carry an output gradient depends on the values, so it may differ between the two points
    of a difference; the materialisation choice must not (a layer materialised at one point only had its
    recording dropped there, and the next difference failed)."""
    from dpvr.grads.ghost.linear import LinearRule

    rule = LinearRule(nn.Linear(4, 4), ("weight", "bias"))
    x = torch.randn(3, 8, 4)
    reads_last = torch.zeros(3, 8, 4)
    reads_last[:, -1] = 1.0
    sparse, dense = rule.weight([([x], [reads_last])]), rule.weight([([x], [torch.randn(3, 8, 4)])])
    assert sparse.pieces[0][0].shape[1] == 1 and sparse.sizes() == dense.sizes() == (8, 4, 4)
    assert sparse.worth_materialising() == dense.worth_materialising()
    assert sparse.choice() == dense.choice()


def test_repeated_difference_rounds_on_a_classifier_from_the_last_position() -> None:
    from dpvr_lab.bench import step

    case = step.make_case("gpt2", batch=4)
    for options in ({}, {"reuse_recording": True}):
        round_ = step._restarted(case, **options).diff_round
        for _ in range(3):
            round_()


@pytest.mark.parametrize("name", ["embedding-head", "head-read-at-two-columns"])
def test_tied_sums_written_into_kept_buffers_are_unchanged(name, monkeypatch) -> None:
    """A tied part's float64 sum goes into the clipper's kept buffers (the threshold lowered to 0) with the
    same values as a fresh one, the head's rows left out or not."""
    monkeypatch.setenv(cost.BUDGET_ENV, "0")  # the ghost (Tied) part
    model, x, y, _ = build(name, torch.float32)
    table = model.lm.embedding.weight if name != "embedding-head" else model.embedding.weight
    got = {}
    for pooled in (0, 1 << 60):
        monkeypatch.setattr(clipper, "POOLED_BYTES", pooled)
        ghost = GhostClipper(model, sequence_loss)
        sums = [ghost.clipped_sum(x, y, 0.5, wide=True).sums for _ in range(2)]
        assert (table.numel() in ghost._pool) == (pooled == 0)
        got[pooled] = sums
    for a, b in zip(got[0], got[1 << 60]):
        assert all(torch.equal(s, t) for s, t in zip(a, b))
