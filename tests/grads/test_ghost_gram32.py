"""The float32 Gram form of the ghost norms (dpvr.grads.ghost.norms.gram32_term, cost form "gram32"): its
value plus its a-priori rounding bound is never below the exact squared norm, on adversarial inputs (wide
dynamic range, steps that cancel, up to 512 steps); the allowance is needed (the raw float32 value falls
below the exact norm, and without the allowance a clipped record's contribution exceeds the radius); the
clipped sums agree with float64 per-record autograd; the cost model takes the form by time where it is
fastest and never where its memory or its dtype forbids."""

import math

import pytest
import torch
from torch import nn

from dpvr.grads import GhostClipper, per_sample_grads
from dpvr.grads.ghost import cost, norms
from dpvr.grads.ghost.rules import Outer

U32, U64 = 2.0**-24, 2.0**-53
MIB = 2.0**20
RATES = cost.Rates(matmul32=1e11, matmul64=5e10, gram=8e9, direct=1.2e10, bandwidth=1e10)
# Rates under which the float32 Gram form beats the native Gram form (and every form but materialising).
GRAM32 = cost.Rates(matmul32=1e20, matmul64=1e10, gram=1e3, direct=1e3, bandwidth=1e20)


@pytest.fixture
def gram32_only(monkeypatch):
    """The clipper offered the native and the float32 Gram forms only, at rates where the float32 one wins
    whenever it may run: every float32 linear map's norms take it (the tests here are of its norms)."""
    monkeypatch.setattr(cost, "FORMS", ("gram", "gram32"))
    # the float64 sums: a float32 per-record sum's priced rounding (relative to R_i, large where the steps
    # cancel) would clip these records further and hide what the norms' own allowance does
    with cost.pinned_rates(GRAM32), cost.forced_sums("float64"):
        yield


def exact_norms(m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Float64 autograd: per sample, the gradient of ``sum_t n_t . (W m_t)`` in ``W`` (that is,
    ``sum_t n_t m_t^T``), squared and summed; with the magnitude ``R^2`` that bounds its own rounding."""
    out = []
    for mi, ni in zip(m.double(), n.double()):
        w = torch.zeros(ni.shape[-1], mi.shape[-1], dtype=torch.float64, requires_grad=True)
        (grad,) = torch.autograd.grad((ni * (mi @ w.t())).sum(), w)
        out.append(grad.pow(2).sum())
    return torch.stack(out)


def magnitude(m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``R = sum_t ||m_t|| ||n_t||`` in float64."""
    return (m.double().norm(dim=-1) * n.double().norm(dim=-1)).sum(dim=1)


def reference_slack(m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """A bound on the float64 reference's own rounding (its products and sums over steps and widths)."""
    steps, p, q = m.shape[1], m.shape[-1], n.shape[-1]
    return 4.0 * (steps + p + q + 8) * U64 * magnitude(m, n) ** 2


def adversarial(kind: str, batch: int, steps: int, p: int, q: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(batch, steps, p, generator=g)
    n = torch.randn(batch, steps, q, generator=g)
    if kind == "range":  # steps and entries over 12 decades
        m *= 10.0 ** (12 * torch.rand(batch, steps, 1, generator=g) - 6)
        n *= 10.0 ** (12 * torch.rand(batch, steps, 1, generator=g) - 6)
        m *= 10.0 ** (4 * torch.rand(batch, 1, p, generator=g) - 2)
    elif kind == "cancel":  # pairs of steps whose rank-one terms nearly cancel
        half = steps // 2
        m[:, half:2 * half] = m[:, :half] * (1 + 1e-4 * torch.randn(batch, half, p, generator=g))
        n[:, half:2 * half] = -n[:, :half]
    elif kind == "aligned":  # every step the same direction: R^2 = ||u||^2 times the steps
        m[:] = m[:, :1]
        n[:] = n[:, :1]
    return m.contiguous(), n.contiguous()


CASES = [(kind, steps) for kind in ("random", "range", "cancel", "aligned") for steps in (1, 7, 130, 512)]


@pytest.mark.parametrize(("kind", "steps"), CASES)
def test_the_upper_bound_covers_the_exact_norm(kind, steps) -> None:
    batch, p, q = 4, 24, 40
    m, n = adversarial(kind, batch, steps, p, q, seed=steps)
    value, bound, r = norms.gram32_term(Outer([(m, n)]))
    exact = exact_norms(m, n)
    assert torch.isfinite(value).all() and (bound >= 0).all()
    # the upper bound covers the exact norm (up to the float64 reference's own rounding, ~1e-13 R^2) ...
    assert (value + bound >= exact - reference_slack(m, n)).all()
    # ... and is within twice the allowance of it, the allowance within its a-priori worst case
    assert (value + bound <= exact + 2 * bound + reference_slack(m, n)).all()
    g_p, g_q, _, _, coef_r = norms.gram32_constants(steps, p, q, 0.0)
    worst = (g_p + g_q) * (1 + max(g_p, g_q)) + coef_r
    assert (bound <= 1.001 * worst * magnitude(m, n) ** 2).all()
    # R from the diagonal entries: an upper bound on sum_t ||m_t|| ||n_t||, within float32 rounding of it
    assert (r >= magnitude(m, n)).all() and (r <= magnitude(m, n) * (1 + g_p + g_q)).all()
    if kind == "random":  # uncorrelated steps: the weighted form keeps the allowance near (p + q) u ||u||^2
        assert (bound <= exact * (g_p + g_q) * (2 + 2 * steps / math.sqrt(min(p, q)))).all()
        assert (bound <= 4e-4 * exact).all()  # 512 steps, p + q = 64: measured 2.8e-4 to 3.0e-4


def test_the_bound_holds_across_pieces_blocks_and_chunks(monkeypatch) -> None:
    """Pieces of different lengths (a difference, a shared layer), blocks cut inside pieces, sample chunks
    of one: the same value up to float64 rounding, the bound covering the exact norm."""
    g = torch.Generator().manual_seed(1)
    pieces = [(torch.randn(5, t, 9, generator=g), torch.randn(5, t, 6, generator=g)) for t in (40, 3, 17)]
    pieces.append((torch.randn(5, 9, generator=g), torch.randn(5, 6, generator=g)))  # one step, 2-d
    m = torch.cat([a if a.dim() == 3 else a.unsqueeze(1) for a, _ in pieces], dim=1)
    n = torch.cat([b if b.dim() == 3 else b.unsqueeze(1) for _, b in pieces], dim=1)
    exact = exact_norms(m, n)
    whole = norms.gram32_term(Outer(pieces))
    monkeypatch.setattr(norms, "GRAM32_BLOCK", 8)
    cut = norms.gram32_term(Outer(pieces), scratch=1.0)  # blocks of 8 steps, one sample at a time
    for value, bound, _ in (whole, cut):
        assert (value + bound >= exact).all()
        torch.testing.assert_close(value, exact, rtol=1e-5, atol=0)
    torch.testing.assert_close(cut[0], whole[0], rtol=1e-6, atol=0)


def test_transposed_recordings_are_read_in_place_with_the_same_values() -> None:
    """A convolution's unfolded patches and output gradients are transposed views ``(B, T, w)`` of
    ``(B, w, T)`` tensors: when every record reads every step they are read as they are (no copy), and the
    Gram norms, their bounds and ``R`` equal those of contiguous copies bit for bit. A record's bound and
    ``R`` equal its own in a batch of one bit for bit, and its value up to the float64 rounding of the sum
    over its Gram entries (as with contiguous copies: a neighbour moves only float64 roundings)."""
    g = torch.Generator().manual_seed(3)
    m = torch.randn(6, 72, 80, generator=g).transpose(1, 2)  # (B, T, p) = (6, 80, 72), steps of stride 1
    n = torch.randn(6, 40, 80, generator=g).transpose(1, 2)
    (_, [(read_m, read_n)]), = Outer([(m, n)]).by_read_count()
    assert read_m.data_ptr() == m.data_ptr() and read_n.data_ptr() == n.data_ptr()
    in_place = norms.gram32_term(Outer([(m, n)]))
    copied = norms.gram32_term(Outer([(m.contiguous(), n.contiguous())]))
    alone = norms.gram32_term(Outer([(m[:1], n[:1])]))  # still transposed views
    for a, b in zip(in_place, copied):
        assert torch.equal(a, b)
    torch.testing.assert_close(in_place[0][:1], alone[0], rtol=1e-13, atol=0.0)
    for a, c in zip(in_place[1:], alone[1:]):
        assert torch.equal(a[:1], c)
    assert (in_place[0] + in_place[1] >= exact_norms(m, n)).all()


def test_no_steps() -> None:
    """A part whose steps were all left out (every output gradient zero) has norm 0 exactly."""
    value, bound, r = norms.gram32_term(Outer([(torch.zeros(3, 0, 4), torch.zeros(3, 0, 5))], 6))
    assert value.tolist() == bound.tolist() == r.tolist() == [0.0] * 3


def test_the_rounding_allowance_is_needed() -> None:
    """On steps that cancel, the raw float32 Gram value falls below the exact squared norm, by far more than
    the clip margin; only the priced allowance covers it. Drop the allowance and this test fails."""
    m, n = adversarial("cancel", 64, 512, 32, 32, seed=5)
    value, bound, _ = norms.gram32_term(Outer([(m, n)]))
    exact = exact_norms(m, n)
    slack = reference_slack(m, n)
    below = value < exact - slack
    assert below.any()
    # the shortfall is far beyond what the clip margin (2 u32 and float64 terms) could absorb
    shortfall = (exact - value) / exact
    assert shortfall.max() > 1e3 * 2 * U32
    assert (value + bound >= exact - slack).all()


class Cancelling(nn.Module):
    """One bias-free linear map over a sequence: with the loss ``sum_t target_t . y_t`` a record's gradient
    is ``sum_t target_t x_t^T``, whose steps the test makes cancel."""

    def __init__(self, p: int, q: int) -> None:
        super().__init__()
        self.map = nn.Linear(p, q, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.map(x)


def _dot_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output * target).sum()


def _contributions(model, x, y, clip) -> tuple[torch.Tensor, list[str]]:
    """Each record's written contribution (the clipped sum of a batch of that record alone), its float64
    norm, under rates that choose the float32 Gram form; and the forms chosen."""
    got, forms = [], set()
    ghost = GhostClipper(model, _dot_loss)
    for i in range(x.shape[0]):
        sums = ghost.clipped_sum(x[i:i + 1], y[i:i + 1], clip).sums
        got.append(torch.sqrt(sum(s.double().pow(2).sum() for s in sums)))
        forms |= {c.form for c in ghost.choices.values()}
    return torch.stack(got), sorted(forms)


def test_a_clipped_record_stays_within_the_radius_only_with_the_allowance(monkeypatch, gram32_only) -> None:
    x, y = adversarial("cancel", 12, 256, 32, 32, seed=7)
    model = Cancelling(32, 32)
    exact = exact_norms(x, y).sqrt()
    clip = float(exact.min()) / 2  # every record clipped
    norms_with, forms = _contributions(model, x, y, clip)
    # the shortfall of the raw value is real for these records (test_the_rounding_allowance_is_needed)
    assert forms == ["gram32"]
    assert (norms_with <= clip).all()
    # the same records with the allowance dropped: the raw value as the bound, which some record exceeds
    raw = norms.gram32_term

    def unpriced(part, scratch=None):
        value, bound, r = raw(part, scratch)
        return value, torch.zeros_like(bound), r
    monkeypatch.setattr(norms, "gram32_term", unpriced)
    norms_without, _ = _contributions(model, x, y, clip)
    assert (norms_without > clip).any()


class SeqNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3)
        self.lin = nn.Linear(5, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).transpose(1, 2)  # (B, T, 5)
        return self.head(torch.tanh(self.lin(h))).mean(dim=(1, 2))


def test_the_clipped_sums_agree_with_float64_autograd(gram32_only) -> None:
    torch.manual_seed(3)
    model = SeqNet()
    x, y = torch.randn(6, 3, 40), torch.randn(6)
    loss_fn = nn.functional.mse_loss
    clip = 0.05
    ghost = GhostClipper(model, loss_fn)
    got = ghost.clipped_sum(x, y, clip)
    each = [ghost.clipped_sum(x[i:i + 1], y[i:i + 1], clip).sums for i in range(6)]
    assert {c.form for c in ghost.choices.values() if c.shapes[1] > 1} == {"gram32"}
    model64 = SeqNet().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    grads = per_sample_grads(model64, loss_fn, x.double(), y.double())
    flat = torch.cat([g.reshape(6, -1) for g in grads], dim=1)
    exact = flat.norm(dim=1)
    assert (exact > clip).all()  # every record is clipped
    assert (got.norms.double() >= exact * (1 - 1e-12)).all()
    torch.testing.assert_close(got.norms.double(), exact, rtol=1e-4, atol=0)
    f = torch.clamp(clip / exact, max=1.0)
    for s, g in zip(got.sums, grads):
        torch.testing.assert_close(s.double(), torch.einsum("i,i...->...", f, g), rtol=1e-4, atol=1e-4 * clip)
    for sums in each:  # every record's written contribution within the radius
        assert math.sqrt(sum(float(s.double().pow(2).sum()) for s in sums)) <= clip


def test_overflowing_and_nonfinite_samples() -> None:
    """A finite record whose float32 Gram entries overflow is measured in float64 (never dropped as
    non-finite); a record with a NaN is NaN."""
    g = torch.Generator().manual_seed(2)
    m, n = torch.randn(3, 6, 8, generator=g), torch.randn(3, 6, 5, generator=g)
    m[0] *= 1e25  # ||a_t||^2 ~ 1e51: beyond float32
    m[2, 3, 1] = float("nan")
    value, bound, _ = norms.gram32_term(Outer([(m, n)]))
    exact = exact_norms(m, n)
    assert torch.isfinite(value[:2]).all() and torch.isfinite(bound[:2]).all()
    assert (value[:2] + bound[:2] >= exact[:2]).all()
    torch.testing.assert_close(value[0], exact[0], rtol=1e-10, atol=0)  # the float64 form's precision
    torch.testing.assert_close(value[1], exact[1], rtol=1e-5, atol=0)
    assert not torch.isfinite(value[2] + bound[2])
    with pytest.raises(ValueError, match="float32 pieces"):
        norms.gram32_term(Outer([(m.double(), n.double())]))


def test_reduced_precision_matmuls_are_priced() -> None:
    """Under torch's reduced-precision float32 matmul settings the inputs' rounding is in the bound."""
    m, n = adversarial("cancel", 8, 130, 24, 40, seed=9)
    exact = exact_norms(m, n)
    previous = torch.get_float32_matmul_precision()
    try:
        for precision in ("high", "medium"):
            torch.set_float32_matmul_precision(precision)
            value, bound, _ = norms.gram32_term(Outer([(m, n)]))
            assert (value + bound >= exact - reference_slack(m, n)).all()
            unit = norms.reduced_precision_unit(False, m.device)
            g_p = norms.gram32_constants(130, 24, 40, unit)[0]
            assert g_p >= 2 * unit
    finally:
        torch.set_float32_matmul_precision(previous)


# ---- the cost model ----

def test_the_prediction_follows_the_formula() -> None:
    b, t, p, q = 8, 300, 64, 96
    got = cost.predict(b, t, p, q, 4, RATES, budget=1e9)["gram32"]
    blocks = [128, 128, 44]
    pairs = (sum(blocks) ** 2 + sum(k * k for k in blocks)) / 2
    traffic = b * pairs * cost.GRAM32_ENTRY_TRAFFIC + 4.0 * b * t * (p + q) * (len(blocks) + 1)
    expected = 2 * b * pairs * (p + q) / RATES.matmul32 + traffic / RATES.bandwidth \
        + min(cost.predict_sums(b, t, p, q, 4, RATES).values())  # the sum form chosen
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_cost_model_takes_the_float32_gram_form_where_it_is_fastest() -> None:
    # a transformer's feed-forward maps at 128 and 512 steps (GPT-2 small widths), too large to materialise
    for steps in (128, 512):
        choice = cost.choose(32, steps, 768, 3072, 4, RATES, 256 * MIB)
        assert choice.form == "gram32"
        assert choice.seconds["gram32"] < choice.seconds["gram"]
    # ... not at one step (the native Gram form is O(p + q) there), nor for narrow maps on many steps
    assert cost.choose(512, 1, 784, 256, 4, RATES, 256 * MIB).form == "gram"
    assert cost.choose(256, 784, 9, 16, 4, RATES, 0.0).form != "gram32"
    # the rates decide: with a slow float32 matmul the native Gram form wins the same layer
    slow = cost.Rates(matmul32=1e9, matmul64=5e10, gram=8e9, direct=1.2e10, bandwidth=1e10)
    assert cost.choose(32, 128, 768, 3072, 4, slow, 256 * MIB).form == "gram"


def test_the_float32_gram_form_is_refused_only_where_its_bound_or_dtype_forbids() -> None:
    """Its blocks are freed with the part's norm, so a spent memory budget does not refuse it (as it does
    not refuse the chunked form's one-sample float64 matrix): it then runs one sample at a time."""
    b, t, p, q = 32, 512, 768, 3072
    for budget in (24.0 * 128 * 128, 0.0):  # (the materialised form's matrices do not fit these)
        chosen = cost.choose(b, t, p, q, 4, GRAM32, budget)
        assert chosen.form == "gram32" and math.isfinite(chosen.seconds["gram32"])
    assert math.isinf(cost.predict(b, t, p, q, 8, GRAM32, 1e12)["gram32"])  # float64 parameters
    assert math.isinf(cost.predict(b, 2, 1 << 23, 4, 4, GRAM32, 1e12)["gram32"])  # no bound at this width
    assert cost.gram32_scratch(1e12) == cost.GRAM32_SCRATCH and cost.gram32_scratch(1e3) == 1e3
    assert cost.gram32_scratch(-5.0) == 0.0  # a budget spent by the materialised parts


def test_the_clipper_keeps_the_float32_gram_form_within_the_budget(monkeypatch, gram32_only) -> None:
    torch.manual_seed(4)
    x, y = torch.randn(4, 3, 40), torch.randn(4)
    seen = []
    raw = norms.gram32_term
    monkeypatch.setattr(norms, "gram32_term", lambda part, scratch=None: seen.append(scratch)
                        or raw(part, scratch))
    ghost = GhostClipper(SeqNet(), nn.functional.mse_loss)
    results = {}
    for mib in ("0", "0.25"):
        monkeypatch.setenv(cost.BUDGET_ENV, mib)
        seen.clear()
        results[mib] = ghost.clipped_sum(x, y, 1.0)
        assert {c.form for c in ghost.choices.values()} == {"gram32"}
        assert len(seen) == 3 and all(s == float(mib) * MIB for s in seen)  # 0: one sample at a time
    # chunks of samples change no sample's value: the same norms and sums
    torch.testing.assert_close(results["0"].norms, results["0.25"].norms, rtol=0, atol=0)
    # float64 parameters never take it
    ghost64 = GhostClipper(SeqNet().double(), nn.functional.mse_loss)
    ghost64.clipped_sum(x.double(), y.double(), 1.0)
    assert {c.form for c in ghost64.choices.values()} == {"gram"}


class WideThenNarrow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide, self.narrow = nn.Linear(64, 48), nn.Linear(48, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.narrow(torch.tanh(self.wide(x))).mean(dim=(1, 2))


def test_the_scratch_leaves_room_for_parts_materialised_after_the_choice(monkeypatch) -> None:
    """The wide map takes the float32 Gram form (its matrices do not fit the budget), the narrow map after it
    is materialised: the Gram blocks, which run while those matrices are held, get what is left."""
    monkeypatch.setattr(cost, "FORMS", ("materialise", "gram", "gram32"))
    budget = 100_000.0  # bytes: below the wide map's 6 x 64 x 48 matrices (221 kB with their float64 copy)
    monkeypatch.setenv(cost.BUDGET_ENV, str(budget / MIB))
    seen = []
    raw = norms.gram32_term
    monkeypatch.setattr(norms, "gram32_term", lambda part, scratch=None: seen.append(scratch)
                        or raw(part, scratch))
    torch.manual_seed(8)
    x, y = torch.randn(6, 20, 64), torch.randn(6)
    with cost.pinned_rates(GRAM32):
        ghost = GhostClipper(WideThenNarrow(), nn.functional.mse_loss)
        ghost.clipped_sum(x, y, 1.0)
    assert ghost.choices["wide.weight"].form == "gram32"
    assert ghost.choices["narrow.weight"].form == "materialise"
    assert seen == [budget - 6 * 48 * 2 * 4]  # the narrow map's float32 matrices are held meanwhile


def test_explain_shows_the_float32_gram_form() -> None:
    """``dpvr bench step --explain`` prints a predicted time for every form, this one included."""
    step = pytest.importorskip("dpvr_lab.bench.step")
    with cost.pinned_rates(RATES):
        text = step.explain(cases=["cnn"], batch=4, rounds=1)
    lines = text.splitlines()
    header = lines[1].split()
    assert header[-2:] == ["gram32", "ms"] and len(cost.FORMS) == 5
    rows = [line.split() for line in lines[2:]]
    assert rows and all(len(r) == 7 + len(cost.FORMS) for r in rows)  # name, B, T, p, q, form, sum
    steps = {r[0]: int(r[2]) for r in rows}
    # float32 layers with steps have a finite gram32 prediction; one-step layers too (Gram of one entry)
    assert all(r[-1] != "-" for r in rows) and max(steps.values()) > 1
