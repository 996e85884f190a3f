"""The SPIDER algorithms' per-stream releases (regressions of an independent privacy review): streams
without releases do not shift the batch sizes, per-stream settings are keyed by name, a NaN record
adds nothing to Recursive-SPIDER's s, and s and the one-sided u-refresh terms are charged their true
sensitivity."""

import pytest
import torch

import dpvr
from dpvr.algorithms import DoubleSpider, RecursiveSpider
from dpvr.objectives.dro import cross_entropy
from dpvr.optim import RuntimeConfig
from toys import TINY, data, gen

# ---- 2. per-stream settings are keyed by stream name ------------------------------------------------------


def _spider(cls, x, y, clip=None, nonfinite="zero", **kw):
    """A small SPIDER run; ``clip`` overrides some streams' radii (every radius is 1 otherwise)."""
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3).double()
    common = dict(steps=3, restart=1, batch_sizes=(12, 6, 12, 8), lr=0.1,
                  runtime=RuntimeConfig(generator=gen(), sampler_seed=0, nonfinite=nonfinite))
    if cls is RecursiveSpider:
        radii = dict.fromkeys(("v-refresh", "v-difference", "u-refresh", "u-difference", "s"), 1.0)
        options = dict(rho=0.5, lam0=1e-3, lr_lam=0.05, beta=0.5, loss_bound=5.0,
                       noise=dict.fromkeys(("v-refresh", "u-refresh", "s"), 1.0))
    else:
        from dpvr.objectives import ChiSquare

        radii = {"eta-refresh": 1.0, "eta-difference": (1.0, 1.0),
                 "x-refresh": 1.0, "x-difference": (1.0, 1.0)}
        options = dict(divergence=ChiSquare(), lam=1.0, lr_eta=0.1, max_move=1.0,
                       noise=dict.fromkeys(("eta-refresh", "x-refresh"), 1.0))
    radii.update(clip or {})
    return cls(model, cross_entropy, x, y.long() % 3, clip=radii, **{**common, **options, **kw})


@pytest.mark.parametrize("cls", [DoubleSpider, RecursiveSpider])
def test_streams_without_releases_do_not_shift_the_batch_sizes(cls):
    """restart=1 leaves the difference streams without releases; before the fix the remaining streams
    took the batch sizes of the dropped ones by position (Recursive-SPIDER's one-record s drew 8 records)."""
    x, y = data(n=12)
    alg = _spider(cls, x, y)
    drawn: dict[str, list[int]] = {}
    draw = alg._draw

    def spy(stream):
        batch = draw(stream)
        drawn.setdefault(stream, []).append(len(batch))
        return batch

    alg._draw = spy
    alg.run(progress=False)
    charged = {s.name: s for s in alg.plan.mechanism(alg.noise).streams}
    assert set(drawn) == set(charged)
    for stream, sizes in drawn.items():
        sampling = charged[stream].sampling
        expected = 12 if sampling.scheme == "full" else sampling.batch_size
        assert sizes == [expected] * charged[stream].count, stream
    if cls is RecursiveSpider:
        assert drawn["s"] == [1, 1, 1]


def test_batch_sizes_by_stream_name():
    x, y = data(n=12)
    named = _spider(RecursiveSpider, x, y, batch_sizes={"v-refresh": 12, "v-difference": 6, "u-refresh": 12,
                                                         "u-difference": 8})
    assert named.plan == _spider(RecursiveSpider, x, y).plan
    with pytest.raises(ValueError, match="must name the streams"):
        _spider(RecursiveSpider, x, y, batch_sizes={"v-refresh": 12, "s": 3})


# ---- 4. every released value goes through the non-finite policy -------------------------------------------


def test_a_nan_record_contributes_nothing_to_recursive_spiders_s():
    x, y = data(n=12)
    x[:] = float("nan")  # every record's loss, hence its inner value, is NaN
    alg = _spider(RecursiveSpider, x, y, noise=dict.fromkeys(("v-refresh", "u-refresh", "s"), TINY))
    s0 = float(alg.s)
    info = alg.step()
    assert float(alg.s) == pytest.approx((1 - alg.beta) * s0, rel=1e-12)  # the term is exactly 0
    assert info["nonfinite"] >= 1
    strict = _spider(RecursiveSpider, x, y, nonfinite="raise")
    with pytest.raises(dpvr.ops.NonFiniteError):
        strict.step()


# ---- 5. Recursive-SPIDER's s is charged its true sensitivity ---------------------------------------------


def _noise_stds_of_one_step(alg):
    """The noise std of each release of one step, by stream."""
    seen = {}
    original = dpvr.ops.noisy_update

    def spy(v, **kw):
        seen[kw["stream"]] = kw["sigma"]
        return original(v, **kw)

    dpvr.ops.noisy_update = spy
    try:
        alg.step()
    finally:
        dpvr.ops.noisy_update = original
    return seen


def test_s_noise_is_the_replace_one_range_over_two():
    """The s term of one record lies in [-(1 - beta) C5, C5]: replace-one sensitivity (2 - beta) C5, which in
    dpvr's unit (the replace-one accountant charges twice the unit) is a unit of (2 - beta) C5 / 2."""
    x, y = data(n=12)
    alg = _spider(RecursiveSpider, x, y, clip={"s": 0.8})
    seen = _noise_stds_of_one_step(alg)
    assert seen["s"] == pytest.approx(alg.noise["s"] * (2 - 0.5) * 0.8 / 2, rel=1e-15)


def test_one_sided_refresh_terms_are_charged_their_range():
    """Recursive-SPIDER's u-refresh terms d g / d lam are >= 0: clipped at C3 they span [0, C3], so a replaced
    record moves the sum by C3 (attained: a loss of B - lam against one at the cap), twice the unit C3 / 2."""
    from dpvr.problems import inner_lambda_grads

    lam, bound, clip3 = 1.0, 5.0, 0.2
    worst = inner_lambda_grads(torch.tensor([bound - lam, bound], dtype=torch.float64), lam, bound)
    assert float(worst.clamp_max(clip3)[0] - worst.clamp_max(clip3)[1]) == pytest.approx(clip3)
    x, y = data(n=12)
    alg = _spider(RecursiveSpider, x, y, clip={"u-refresh": clip3})
    seen = _noise_stds_of_one_step(alg)
    assert seen["u-refresh"] == pytest.approx(alg.noise["u-refresh"] * clip3 / 2 / 12, rel=1e-15)
