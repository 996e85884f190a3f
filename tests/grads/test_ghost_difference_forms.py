"""What a DIFF2 difference round shares between its two points: the previous point's recording, kept from the
previous round and reused only at bit-identical parameters; and the norm forms of the difference's own parts,
chosen for the difference's shapes. Every check is against float64 per-record autograd or a recomputation."""

import dataclasses

import pytest
import torch
from torch import nn

import dpvr
from dpvr import PaperSigmas
from dpvr.algorithms import DIFF2
from dpvr.grads import GhostClipper, per_sample_grads
from dpvr.grads.ghost import cost
from dpvr.optim import RuntimeConfig

TINY = 1e-100  # absorbed by float64 rounding: the runs are noise-free
STEPS = 8  # the sequence length of Seq's inputs


class Seq(nn.Module):
    """A first convolution (its input the data, the same at both points: one piece) and two linear maps on
    ``STEPS - 2`` positions (inputs that differ between the points: two pieces, twice the steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 3)
        self.lin = nn.Linear(6, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).transpose(1, 2)
        return self.head(torch.tanh(self.lin(h))).mean(dim=(1, 2))


def _data(dtype: torch.dtype, batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return (torch.randn(batch, 3, STEPS, generator=g, dtype=dtype),
            torch.randn(batch, generator=g, dtype=dtype))


def _points(model: nn.Module, scale: float = 0.02) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    a = [p.detach().clone() for p in model.parameters()]
    return a, [p + scale * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in a]


def _forced(monkeypatch, at_point: str, at_difference: str) -> None:
    """Every point's linear maps take ``at_point``, every difference's with doubled steps ``at_difference``
    (the choice is made from the steps the part spans: a point's ``STEPS - 2``, a difference's twice that)."""
    real = cost.choose

    def choose(batch, steps, p, q, itemsize, rates=None, budget=None, **kwargs):
        got = real(batch, steps, p, q, itemsize, rates, budget, **kwargs)
        return dataclasses.replace(got, form=at_difference if steps > STEPS else at_point)

    monkeypatch.setattr(cost, "choose", choose)


def _reference(model, x, y, clip, point_a, point_b):
    """Float64 autograd: each record's difference's norm and the clipped sum."""
    model64 = model.double() if next(model.parameters()).dtype == torch.float64 else _as64(model)
    wide = [[t.double() for t in point] for point in (point_a, point_b)]
    g_a = per_sample_grads(model64, nn.functional.mse_loss, x.double(), y.double(), params=wide[0])
    g_b = per_sample_grads(model64, nn.functional.mse_loss, x.double(), y.double(), params=wide[1])
    diffs = [u - v for u, v in zip(g_a, g_b)]
    norms = torch.cat([d.reshape(len(x), -1) for d in diffs], dim=1).norm(dim=1)
    f = torch.clamp(clip / norms, max=1.0)
    return norms, [torch.einsum("i,i...->...", f, d) for d in diffs]


def _as64(model: nn.Module) -> nn.Module:
    copy = Seq().double()
    copy.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return copy


@pytest.mark.parametrize("form", ["gram", "direct", "chunked", "gram32", "materialise"])
def test_a_difference_takes_the_form_chosen_for_its_own_steps(monkeypatch, form) -> None:
    """The difference's parts of the linear maps are given the form chosen for their shapes (the point's
    form is the native Gram form throughout), and the clipped difference still matches float64 autograd:
    each record's written term within the radius, norms bounding the float64 ones."""
    torch.manual_seed(1)
    model = Seq()
    x, y = _data(torch.float32)
    point_a, point_b = _points(model)
    _forced(monkeypatch, "gram", form)
    seen: list[list[str]] = []
    raw = dpvr.ops.ghost_norms

    def ghost_norms(*args, **kwargs):
        seen.append(list(kwargs.get("form", [])))
        return raw(*args, **kwargs)

    monkeypatch.setattr(dpvr.ops, "ghost_norms", ghost_norms)
    ghost = GhostClipper(model, nn.functional.mse_loss)
    clip = 1e-4  # below every record's difference: every record is clipped
    got = ghost.clipped_diff_sum(x, y, point_a, point_b, clip)
    difference = {k: c.form for k, c in ghost.choices.items() if k.endswith("(difference)")}
    assert difference == {"lin.weight (difference)": form, "head.weight (difference)": form,
                          "conv.weight (difference)": "gram"}  # the conv: one piece, a point's steps
    if form in ("gram", "direct"):  # the native forms: the kernels are told the chosen form, not "auto"
        assert seen[-1].count(form) >= 2 and "auto" not in seen[-1]
    norms, sums = _reference(model, x, y, clip, point_a, point_b)
    assert (norms > clip).all()
    assert (got.norms.double() >= norms * (1 - 1e-5)).all()
    torch.testing.assert_close(got.norms.double(), norms, rtol=1e-3, atol=0)
    for s, r in zip(got.sums, sums):
        torch.testing.assert_close(s.double(), r, rtol=1e-3, atol=1e-3 * clip)
    for i in range(len(x)):  # each record's term as written, alone, within the radius
        one = ghost.clipped_diff_sum(x[i:i + 1], y[i:i + 1], point_a, point_b, clip).sums
        assert float(torch.sqrt(sum(t.double().pow(2).sum() for t in one))) <= clip


def test_a_point_differing_only_in_the_sign_of_a_zero_is_recorded_again() -> None:
    """A kept recording is reused at bit-identical parameters only: -0.0 is not the +0.0 it recorded."""
    torch.manual_seed(1)
    model = Seq().double()
    x, y = _data(torch.float64)
    with torch.no_grad():
        model.lin.weight[0, 0] = 0.0
    ghost = GhostClipper(model, nn.functional.mse_loss, reuse_recording=True)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    point = [p.detach().clone() for p in model.parameters()]
    ghost.clipped_sum(x, y, 1.0, params=point)
    same = [p.clone() for p in point]
    signed = [p.clone() for p in point]
    signed[2][0, 0] = -0.0
    forwards[0] = 0
    ghost.clipped_sum(x, y, 1.0, params=same)
    assert forwards[0] == 0  # equal bits, other tensors: reused
    ghost.clipped_sum(x, y, 1.0, params=signed)
    assert forwards[0] == 1


def _diff2(dtype: torch.dtype, reuse: bool):
    torch.manual_seed(1)
    model = Seq().to(dtype)
    x, y = _data(dtype, 12)
    alg = DIFF2(model, lambda o, t: 0.5 * (o - t) ** 2, [(x, y)], lr=0.3, steps=7, restart=4,
                clip={"restart": 0.05, "difference": 0.5}, noise=PaperSigmas(restart=TINY, difference=TINY),
                reuse_recording=reuse, runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed=5,
                                                                                          reproducible=True)))
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    passes, iterates = [], []
    for _ in range(alg.steps):
        forwards[0] = 0
        alg.step()
        passes.append(forwards[0])
        iterates.append([p.detach().clone() for p in alg.params])
    return passes, iterates


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_diff2_gd_records_each_round_once_and_releases_what_recomputing_releases(dtype) -> None:
    """Full-batch DIFF2-GD: after the first round, every round (restart or difference) runs one forward
    pass, and its iterates are bit for bit those of a run that records both points again (noise-free:
    ``TINY`` is absorbed by the float64 sums, so the runs' different noise keys do not matter)."""
    passes, kept = _diff2(dtype, reuse=True)
    again, recomputed = _diff2(dtype, reuse=False)
    assert passes == [1] * 7
    assert again == [1, 2, 2, 2, 1, 2, 2]  # restart rounds 1 and 5 record one point
    for mine, theirs in zip(kept, recomputed):
        for p, q in zip(mine, theirs):
            assert torch.equal(p, q)
