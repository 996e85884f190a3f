"""The per-layer choice of norm form by predicted time (dpvr.grads.ghost.cost): choices from shapes and
rates only, the memory budget, the per-machine cache, and every form's clipped sums against float64
per-record autograd."""

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from dpvr.grads import GhostClipper, per_sample_grads
from dpvr.grads.ghost import cost
from dpvr.grads.ghost.rules import Outer

RATES = cost.Rates(matmul32=1e11, matmul64=5e10, gram=8e9, direct=1.2e10, bandwidth=1e10)
MIB = 2.0**20


def test_predictions_follow_the_formulas() -> None:
    b, t, p, q = 8, 16, 32, 24
    got = cost.predict(b, t, p, q, 4, RATES, budget=1e9)
    sums = cost.predict_sums(b, t, p, q, 4, RATES)
    # the clipped sum: the float64 product with its widened pieces, or each record's float32 matrix then
    # the float64 sum over records; the non-materialised forms pay the faster of the two
    assert sums["float64"] == pytest.approx(
        2 * b * t * p * q / RATES.matmul64 + b * t * (p + q) * (4 + 16) / RATES.bandwidth, rel=1e-12)
    assert sums["record32"] == pytest.approx(
        2 * b * t * p * q / RATES.matmul32 + (b * p * q * 24 + 2 * b * t * (p + q) * 4) / RATES.bandwidth,
        rel=1e-12)
    total64 = min(sums.values())
    assert got["gram"] == pytest.approx(b * t * (t + 1) / 2 * (p + q) / RATES.gram + total64, rel=1e-12)
    assert got["direct"] == pytest.approx(b * t * p * q / RATES.direct + total64, rel=1e-12)
    assert got["chunked"] == pytest.approx(
        2 * b * t * p * q / RATES.matmul64 + b * p * q * 24 / RATES.bandwidth + total64, rel=1e-12)
    assert math.isinf(cost.predict(b, 1, p, q, 4, RATES, budget=1e9)["chunked"])  # no steps, no matrices
    assert got["materialise"] == pytest.approx(
        2 * b * t * p * q / RATES.matmul32 + b * p * q * (3 * 4 + 8) / RATES.bandwidth, rel=1e-12)


def test_the_choice_is_by_time_from_shapes() -> None:
    # a feed-forward layer on 64 steps: the batched float32 matmul beats both float64 native forms
    assert cost.choose(64, 64, 64, 128, 4, RATES, 256 * MIB).form == "materialise"
    # one step (an MLP's layer): nothing to materialise; the Gram form is O(p + q) per sample
    assert cost.choose(512, 1, 784, 256, 4, RATES, 256 * MIB).form == "gram"
    # many steps of narrow widths (a first convolution) and no memory budget: a streamed direct form beats
    # the Gram form's T^2; torch's float64 chunks beat the native one sample at a time at these rates ...
    assert cost.choose(256, 784, 9, 16, 4, RATES, 0.0).form == "chunked"
    # ... and not where the float64 matmul is slow
    slow64 = cost.Rates(matmul32=1e11, matmul64=1e9, gram=8e9, direct=1.2e10, bandwidth=1e10)
    assert cost.choose(256, 784, 9, 16, 4, slow64, 0.0).form == "direct"
    # ... and the Gram form wins at few steps and wide maps, whatever the budget
    assert cost.choose(4, 3, 512, 512, 4, RATES, 1e12).form == "gram"
    # slower float32 matmuls move the same layer to the native form: the rates decide, not a fixed rule
    slow = cost.Rates(matmul32=1e8, matmul64=5e10, gram=8e9, direct=1.2e10, bandwidth=1e10)
    assert cost.choose(64, 64, 64, 128, 4, slow, 256 * MIB).form != "materialise"


def test_the_budget_refuses_the_materialised_form() -> None:
    b, t, p, q = 64, 64, 64, 128
    need = b * p * q * (4 + 8)  # the matrices and their float64 copy in the sum
    assert cost.choose(b, t, p, q, 4, RATES, need).form == "materialise"
    refused = cost.choose(b, t, p, q, 4, RATES, need - 1)
    assert refused.form != "materialise" and math.isinf(refused.seconds["materialise"])


def test_the_budget_setting(monkeypatch) -> None:
    monkeypatch.delenv(cost.BUDGET_ENV, raising=False)
    assert cost.direct_budget_bytes() == cost.DEFAULT_DIRECT_MIB * MIB
    monkeypatch.setenv(cost.BUDGET_ENV, "3")
    assert cost.direct_budget_bytes() == 3 * MIB
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(cost.BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=cost.BUDGET_ENV):
            cost.direct_budget_bytes()


def test_rates_are_measured_once_per_machine_and_cached(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(cost.CALIBRATE_ENV, "1")
    monkeypatch.setattr(cost, "_measured", {})
    calls = []
    monkeypatch.setattr(cost, "calibrate", lambda: calls.append(1) or RATES)
    monkeypatch.setattr(cost, "_matmul32_rate", lambda m, n: RATES.matmul32)  # as quiet as the calibration
    assert cost.machine_rates() == RATES and cost.machine_rates() == RATES
    assert len(calls) == 1  # memoised in the process
    stored = json.loads((tmp_path / "dpvr" / "ghost_rates.json").read_text())
    assert stored == {cost.machine_key(): {k: getattr(RATES, k) for k in cost.Rates.__dataclass_fields__}}
    monkeypatch.setattr(cost, "_measured", {})
    assert cost.machine_rates() == RATES and len(calls) == 1  # a new process reads the file
    # a corrupt file is measured again, never an error
    (tmp_path / "dpvr" / "ghost_rates.json").write_text("{not json")
    monkeypatch.setattr(cost, "_measured", {})
    assert cost.machine_rates() == RATES and len(calls) == 2
    # calibration off: the fixed rates; pinned rates win over everything
    monkeypatch.setenv(cost.CALIBRATE_ENV, "0")
    assert cost.machine_rates() == cost.DEFAULT_RATES
    with cost.pinned_rates(RATES):
        assert cost.machine_rates() == RATES


def test_rates_measured_on_a_busy_machine_are_measured_again(monkeypatch, tmp_path) -> None:
    """A cached matmul rate well below a fresh probe's is measured again, each rate kept at the higher of
    its two measurements; a probe slower than the cache (the machine busy now) keeps the cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(cost.CALIBRATE_ENV, "1")
    path = tmp_path / "dpvr" / "ghost_rates.json"
    path.parent.mkdir(parents=True)
    busy = dataclasses.replace(RATES, matmul32=RATES.matmul32 / 2, gram=RATES.gram * 2)
    path.write_text(json.dumps({cost.machine_key(): dataclasses.asdict(busy)}))
    calls = []
    monkeypatch.setattr(cost, "calibrate", lambda: calls.append(1) or RATES)
    for probe, want, measured in ((busy.matmul32, busy, 0), (RATES.matmul32, dataclasses.replace(
            RATES, gram=busy.gram), 1), (RATES.matmul32 / 3, dataclasses.replace(RATES, gram=busy.gram), 1)):
        monkeypatch.setattr(cost, "_measured", {})
        monkeypatch.setattr(cost, "_matmul32_rate", lambda m, n, probe=probe: probe)
        assert cost.machine_rates() == want and len(calls) == measured
        stored = json.loads(path.read_text())[cost.machine_key()]
        assert stored == dataclasses.asdict(want)


def test_calibration_measures_positive_finite_rates() -> None:
    rates = cost.calibrate()
    assert all(0 < v < math.inf for v in vars(rates).values())


# Rates under which one form is predicted fastest for every layer with steps (the float64 sum's widening
# is paid at the copy rate, so that rate stays moderate where the forms that sum so must win).
FORCING = {
    "materialise": cost.Rates(matmul32=1e20, matmul64=1e10, gram=1e3, direct=1e3, bandwidth=1e20),
    "gram": cost.Rates(matmul32=1e3, matmul64=1e10, gram=1e20, direct=1e3, bandwidth=1e6),
    "direct": cost.Rates(matmul32=1e3, matmul64=1e10, gram=1e3, direct=1e20, bandwidth=1e6),
    "chunked": cost.Rates(matmul32=1e3, matmul64=1e20, gram=1e3, direct=1e3, bandwidth=1e20),
}


class SeqNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3)
        self.lin = nn.Linear(5, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).transpose(1, 2)  # (B, T, 5)
        return self.head(torch.tanh(self.lin(h))).mean(dim=(1, 2))


def _reference(model, loss_fn, x, y, clip, params=None, other=None):
    """Float64 per-record autograd: the norms and the clipped sums."""
    grads = per_sample_grads(model, loss_fn, x, y, params=params)
    if other is not None:
        grads = [g - h for g, h in zip(grads, per_sample_grads(model, loss_fn, x, y, params=other))]
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1)
    norms = flat.norm(dim=1)
    f = torch.clamp(clip / norms, max=1.0)
    return norms, [torch.einsum("i,i...->...", f, g) for g in grads]


@pytest.mark.parametrize("form", sorted(FORCING))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_form_bounds_the_float64_norms_and_clips_as_autograd(form, dtype) -> None:
    torch.manual_seed(3)
    model = SeqNet().to(dtype)
    x, y = torch.randn(6, 3, 9, dtype=dtype), torch.randn(6, dtype=dtype)
    loss_fn = nn.functional.mse_loss
    clip = 0.05  # below every record's norm: every record is clipped
    with cost.pinned_rates(FORCING[form]):
        ghost = GhostClipper(model, loss_fn)
        got = ghost.clipped_sum(x, y, clip)
    chosen = {c.form for c in ghost.choices.values() if c.shapes[1] > 1}
    assert chosen == {form}
    model64 = SeqNet().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    norms, sums = _reference(model64, loss_fn, x.double(), y.double(), clip)
    assert (norms > clip).all()
    # upper bounds on the float64 norms (the exact ones up to 2^-53), tight to the dtype's precision
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    assert (got.norms.double() >= norms * (1 - 1e-12) - (tol if dtype == torch.float32 else 0)).all()
    torch.testing.assert_close(got.norms.double(), norms, rtol=tol, atol=0)
    for s, r in zip(got.sums, sums):
        torch.testing.assert_close(s.double(), r, rtol=tol, atol=tol * clip)


@pytest.mark.parametrize("form", sorted(FORCING))
def test_every_form_clips_differences_as_autograd(form) -> None:
    torch.manual_seed(4)
    model = SeqNet().double()
    x, y = torch.randn(5, 3, 8, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    point_a = [p.detach().clone() for p in model.parameters()]
    point_b = [p + 0.01 * torch.randn_like(p) for p in point_a]
    loss_fn = nn.functional.mse_loss
    with cost.pinned_rates(FORCING[form]):
        ghost = GhostClipper(model, loss_fn)
        got = ghost.clipped_diff_sum(x, y, point_a, point_b, 1e-4)
    assert {c.form for c in ghost.choices.values() if c.shapes[1] > 1} == {form}
    norms, sums = _reference(model, loss_fn, x, y, 1e-4, params=point_a, other=point_b)
    assert (got.norms >= norms * (1 - 1e-12)).all()
    torch.testing.assert_close(got.norms, norms, rtol=1e-10, atol=0)
    for s, r in zip(got.sums, sums):
        torch.testing.assert_close(s, r, rtol=1e-9, atol=1e-15)


def test_the_choice_ignores_values() -> None:
    """The same shapes choose the same forms whatever the data (zeros, huge values, NaN)."""
    model = SeqNet()
    forms = []
    for fill in (0.0, 1e30, float("nan")):
        x = torch.full((6, 3, 9), fill)
        ghost = GhostClipper(model, nn.functional.mse_loss)
        with cost.pinned_rates(RATES):
            ghost.clipped_sum(x, torch.zeros(6), 1.0)
        forms.append({k: c.form for k, c in ghost.choices.items()})
    assert forms[0] == forms[1] == forms[2] and forms[0]


def test_an_outer_part_reports_its_shapes() -> None:
    part = Outer([(torch.zeros(3, 7, 5), torch.zeros(3, 7, 2)), (torch.zeros(3, 4, 5), torch.zeros(3, 4, 2))])
    with cost.pinned_rates(RATES):
        assert part.choice().shapes == (3, 11, 5, 2)


def test_the_chunked_form_streams_samples_with_the_same_result(monkeypatch) -> None:
    from dpvr.grads.ghost import norms

    torch.manual_seed(5)
    model = SeqNet().double()
    x, y = torch.randn(6, 3, 9, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    with cost.pinned_rates(FORCING["chunked"]):
        whole = GhostClipper(model, nn.functional.mse_loss).clipped_sum(x, y, 0.05)
        seen = []
        chunked = norms._chunked
        monkeypatch.setattr(norms, "_MAX_SCRATCH", 20)  # below one sample's 5 x 9 and 4 x 5 matrices
        monkeypatch.setattr(norms, "_chunked",
                            lambda b, n, fn: seen.append(max(1, 20 // n)) or chunked(b, n, fn))
        streamed = GhostClipper(model, nn.functional.mse_loss).clipped_sum(x, y, 0.05)
    assert len(seen) == 3 and min(seen) == 1 and max(seen) < 6  # every part in chunks, some of one sample
    torch.testing.assert_close(streamed.norms, whole.norms, rtol=1e-14, atol=0)
    for s, w in zip(streamed.sums, whole.sums):
        torch.testing.assert_close(s, w, rtol=1e-14, atol=1e-18)


def test_the_torch_forms_widen_a_chunk_of_samples_at_a_time_with_the_same_values(monkeypatch) -> None:
    """A difference's pieces (one of them step-less) widened chunk by chunk give, bit for bit, what the
    float64 concatenation of all samples gives, and each norm is the float64 norm of the per-sample matrix
    within its bound."""
    from dpvr.grads.ghost import norms
    from dpvr.grads.ghost.rules import Outer

    torch.manual_seed(11)
    b, t, p, q = 6, 5, 7, 4
    pieces = [(torch.randn(b, t, p), torch.randn(b, t, q)), (torch.randn(b, p), -torch.randn(b, q)),
              (torch.randn(b, 2, p), torch.randn(b, 2, q))]
    part = Outer(pieces)
    m = torch.cat([x.double().reshape(b, -1, p) for x, _ in pieces], dim=1)
    n = torch.cat([y.double().reshape(b, -1, q) for _, y in pieces], dim=1)
    assert torch.equal(norms._widened([x for x, _ in pieces], slice(1, 4)), m[1:4])
    exact = (n.transpose(1, 2) @ m).square().sum(dim=(1, 2))
    for form in ("direct", "gram"):
        whole = norms._outer(part, form)
        monkeypatch.setattr(norms, "_MAX_SCRATCH", 1)  # one sample a chunk
        streamed = norms._outer(part, form)
        monkeypatch.undo()
        assert all(torch.equal(a, c) for a, c in zip(whole[:2], streamed[:2])) and whole[2] == streamed[2]
        sumsq, r2, chain = whole
        assert bool(((sumsq - exact).abs() <= 2.0 * (chain + 8.0) * norms.U64 * r2).all())


class TwoMaps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))).mean(dim=(1, 2))


def test_the_budget_bounds_all_materialised_parts_together(monkeypatch) -> None:
    torch.manual_seed(6)
    model = TwoMaps()
    x, y = torch.randn(6, 7, 5), torch.randn(6)
    entries = 6 * 5 * 5  # one layer's (B, q, p) matrices
    # room for one layer's matrices and their float64 copy, then not for the second's
    monkeypatch.setenv(cost.BUDGET_ENV, str(entries * (4 + 8) / MIB))
    with cost.pinned_rates(FORCING["materialise"]):
        ghost = GhostClipper(model, nn.functional.mse_loss)
        got = ghost.clipped_sum(x, y, 0.01)
        forms = [ghost.choices[k].form for k in ("first.weight", "second.weight")]
        assert forms[0] == "materialise" and forms[1] != "materialise"
        monkeypatch.setenv(cost.BUDGET_ENV, str(2 * entries * (4 + 8) / MIB))
        ghost.clipped_sum(x, y, 0.01)
        assert {ghost.choices[k].form for k in ("first.weight", "second.weight")} == {"materialise"}
    model64 = TwoMaps().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    norms, sums = _reference(model64, nn.functional.mse_loss, x.double(), y.double(), 0.01)
    assert (got.norms.double() >= norms * (1 - 1e-6)).all()
    for s, r in zip(got.sums, sums):
        torch.testing.assert_close(s.double(), r, rtol=1e-4, atol=1e-6)


def test_ghost_norms_takes_a_form_per_outer_term() -> None:
    from dpvr import ops

    g = torch.Generator().manual_seed(7)
    a = (torch.randn(4, 6, 3, generator=g), torch.randn(4, 6, 5, generator=g))
    b = (torch.randn(4, 2, 7, generator=g), torch.randn(4, 2, 2, generator=g))
    exact = sum(torch.einsum("btq,btp->bqp", n.double(), m.double()).pow(2).sum(dim=(1, 2))
                for m, n in (a, b))
    for forms in (["gram", "direct"], ["direct", "gram"], ("auto", "auto")):
        out = torch.empty(4, dtype=torch.float64)
        ops.ghost_norms(out, outer=[[a], [b]], form=forms)
        assert (out >= exact).all()
        torch.testing.assert_close(out, exact, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="form: 1 forms given for 2 outer terms"):
        ops.ghost_norms(torch.empty(4, dtype=torch.float64), outer=[[a], [b]], form=["gram"])
    with pytest.raises(ValueError, match="form: must be one of"):
        ops.ghost_norms(torch.empty(4, dtype=torch.float64), outer=[[a], [b]], form=["gram", "fast"])
