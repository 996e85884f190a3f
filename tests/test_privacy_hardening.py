"""Regression tests for the guarantee breaks an independent review found; each failed before its fix.

1. a resume with other settings replayed released noise;
2. streams without releases shifted the SPIDER samplers;
3. full-batch DP-GD under add/remove divided by the private n;
4. a NaN record leaked into Recursive-SPIDER's s;
5. Recursive-SPIDER's s was charged twice its sensitivity;
6. noise came in a different unit per algorithm.
"""

import inspect
import math

import numpy as np
import pytest
import torch

import dpvr
from dpvr.algorithms import DIFF2, DPGD, DPSGD, DPSGDA, DoubleSpider, PrivateDiff, RecursiveSpider
from dpvr.objectives.dro import cross_entropy
from dpvr.optim import PrivacyConfig, RuntimeConfig

TINY = 1e-100  # noise this small vanishes in float64 rounding


def gen(seed=0):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


def data(n=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, (x.sum(1) > 0).to(torch.float64)


def linear(d=4):
    torch.manual_seed(3)
    return torch.nn.Linear(d, 1).double()


def logistic(output, target):
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


def dp_gd(x, y, nonfinite="zero", **kw):
    options = dict(lr=0.5, clip=1.0, steps=4, noise=1.0)
    options.update(kw)
    runtime = RuntimeConfig(generator=gen(1), nonfinite=nonfinite)
    return DPGD(linear(), logistic, x, y, **options, runtime=runtime)


# ---- 1. checkpoints bind every setting that shapes a release; noise is bound to its inputs ---------------


@pytest.mark.parametrize(
    "change, entry",
    [
        (dict(clip=0.5), "setting.clip"),
        (dict(lr=0.1), "setting.lr"),
        (dict(steps=5), "plan.steps"),
        (dict(noise=2.0), "noise.gradient"),
        (dict(nonfinite="raise"), "runtime.nonfinite"),
    ],
)
def test_a_state_is_refused_by_an_algorithm_with_other_settings(change, entry):
    x, y = data()
    first = dp_gd(x, y)
    state = first.state_dict()
    other = dp_gd(x, y, **change)
    before = [p.detach().clone() for p in other.params]
    with pytest.raises(ValueError, match=entry.replace(".", r"\.")):
        other.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(other.params, before))  # nothing changed
    dp_gd(x, y).load_state_dict(state)  # the same settings resume


def test_a_state_is_refused_on_other_data_or_another_model():
    x, y = data()
    state = dp_gd(x, y).state_dict()
    x2 = x.clone()
    x2[0, 0] += 1.0
    with pytest.raises(ValueError, match="data"):
        dp_gd(x2, y).load_state_dict(state)
    # The same output shape, other parameters.
    deeper = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)).double()
    wider = DPGD(deeper, logistic, x, y, lr=0.5, clip=1.0, steps=4, noise=1.0)
    with pytest.raises(ValueError, match="params|parameter"):
        wider.load_state_dict(state)


def _noise_of_first_step(alg, noiseless):
    """The noise the first release added, in units of its std: (x_noisy - x_noiseless) / (lr sigma)."""
    alg.step()
    noiseless.step()
    sigma = alg.noise["gradient"] * alg.clip / len(alg.records)
    return torch.cat([(p - q).detach().reshape(-1) for p, q in zip(alg.params, noiseless.params)]) / (
        alg.lr * sigma
    )


def test_a_replay_with_other_inputs_never_reuses_noise():
    """The review's attack: load a state taken before a released step into a DP-GD with another clip radius
    and step again. Before the fix the replay reused the released step's noise key, so the two releases
    differed by the noise-free gradient difference. Even when every load-time check is bypassed, the noise
    key now binds the settings and the release's inputs: the two draws are independent."""
    x, y = data()
    first = dp_gd(x, y)
    state = first.state_dict()
    # a bit-identical replay (loaded before the run released anything after the state: nothing to charge,
    # no re-run) reproduces the same release, which reveals nothing new
    again = dp_gd(x, y)
    again.load_state_dict(state)
    xi_first = _noise_of_first_step(first, dp_gd(x, y, noise=TINY))
    replay = dp_gd(x, y, clip=0.5)
    replay._restore(state)  # what a load without binding checks would do
    xi_replay = _noise_of_first_step(replay, dp_gd(x, y, clip=0.5, noise=TINY))
    assert not torch.allclose(xi_first, xi_replay, rtol=1e-3, atol=1e-3)
    xi_again = _noise_of_first_step(again, dp_gd(x, y, noise=TINY))
    torch.testing.assert_close(xi_again, xi_first, rtol=0, atol=0)


@pytest.mark.parametrize("size, changed", [(1000, 7), (100_000, 3), (100_000, 99_999)],
                         ids=["small", "large-start", "large-end"])
def test_noise_keys_bind_the_inputs_of_a_release(size, changed):
    """A one-element change anywhere in a signal, small or large, changes the key."""
    bound, plain = gen(5), gen(5)
    bound.bind(b"run settings")
    v1, v2 = [torch.zeros(size, dtype=torch.float64)], [torch.zeros(size, dtype=torch.float64)]
    s1, s2 = [torch.ones(size, dtype=torch.float64)], [torch.ones(size, dtype=torch.float64)]
    s2[0][changed] += 2.0**-40  # one element, one ulp-scale change
    for v, s in ((v1, s1), (v2, s2)):
        g = gen(5)
        g.bind(b"run settings")
        dpvr.noisy_update(v, sum=s, sigma=1.0, generator=g, stream="x")
    noise_gap = float((v1[0] - v2[0]).abs().max())
    assert noise_gap > 1.0  # independent draws, not the same draw shifted by 2**-40
    # unbound generators keep the plain (seed, stream, step) addresses the kernels document
    assert plain.next_key("x") == dpvr.ops.NoiseKey(5, 0, 0)
    assert bound.next_key("x").seed != 5


def test_distributed_aggregator_resume_refuses_other_settings(tmp_path):
    x, y = data(n=8)
    shards = [(x[:4], y[:4]), (x[4:], y[4:])]
    noise = {"restart": 5.0, "difference": 5.0}
    options = dict(lr=0.2, steps=3, restart=2, clip={"restart": 1.0, "difference": 1.0}, noise=noise)
    alg = DIFF2(linear(), logistic, shards, **options, runtime=RuntimeConfig(generator=gen()))
    alg.step()
    path = tmp_path / "aggregator.ckpt"
    alg.save_checkpoint(path)
    wider = {**options, "clip": {"restart": 1.0, "difference": 2.0}}
    other = DIFF2(linear(), logistic, shards, **wider, runtime=RuntimeConfig(generator=gen()))
    with pytest.raises(ValueError, match=r"setting\.clip"):
        other.load_checkpoint(path)
    resumed = DIFF2(linear(), logistic, shards, **options, runtime=RuntimeConfig(generator=gen()))
    resumed.load_checkpoint(path)
    assert resumed.steps_done == 1


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


# ---- 3. normalisers are public under the relation in force -----------------------------------------------


@pytest.mark.parametrize("cls, kw", [(DPGD, {}), (DPSGD, dict(sampling="full"))])
def test_full_batch_under_add_remove_is_refused(cls, kw):
    x, y = data()
    with pytest.raises(ValueError, match="private under add/remove"):
        cls(linear(), logistic, x, y, lr=0.1, clip=1.0, steps=2, noise=1.0,
            privacy=PrivacyConfig(neighbouring="add-remove"), **kw)


def test_poisson_sampling_divides_by_the_public_batch_size():
    """Add/remove neighbours (one extra record, present in the batch), noise off, same draws: the step moves
    by at most lr C / b with b the public expected batch size, and the noise std is the same on both."""
    x, y = data(n=12)
    extra_x, extra_y = torch.full((1, 4), 40.0, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    bigger = (torch.cat([x, extra_x]), torch.cat([y, extra_y]))
    options = dict(
        lr=0.5, clip=0.3, steps=1, batch_size=6, sampling="poisson", noise=TINY,
        runtime=RuntimeConfig(generator=gen()),
    )
    a = DPSGD(linear(), logistic, x, y, **options)
    b = DPSGD(linear(), logistic, *bigger, **options)
    a.sampler.draw = lambda: torch.arange(12).numpy()
    b.sampler.draw = lambda: torch.arange(13).numpy()
    a.step(), b.step()
    gap = math.sqrt(sum(float(((p - q).detach() ** 2).sum()) for p, q in zip(a.params, b.params)))
    assert 0 < gap <= 0.5 * 0.3 / 6 * (1 + 1e-9)


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


@pytest.mark.parametrize("cls", [DPSGD, DIFF2, DPSGDA, PrivateDiff, DoubleSpider, RecursiveSpider])
def test_every_algorithm_takes_the_nonfinite_policy_and_one_noise_unit(cls):
    parameters = inspect.signature(cls).parameters
    assert "runtime" in parameters and parameters["runtime"].default.nonfinite == "zero"
    assert "noise" in parameters
    paper_units = {"noise_multiplier", "sigma1", "sigma2", "sigma3", "sigma_x", "sigma_y", "sigma_x1",
                   "sigma_x2"}
    assert not paper_units & set(parameters)


def test_nonfinite_raise_stops_dp_sgd_before_the_release():
    x, y = data()
    x[2, 1] = float("inf")
    alg = dp_gd(x, y, nonfinite="raise")
    before = [p.detach().clone() for p in alg.params]
    with pytest.raises(dpvr.ops.NonFiniteError):
        alg.step()
    assert all(torch.equal(p, q) for p, q in zip(alg.params, before)) and alg.steps_done == 0
    assert not alg.accountant.streams  # nothing was charged: nothing was released
    assert dp_gd(x, y).step()["nonfinite"] == 1  # the default drops the record


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


# ---- 6. one noise unit, paper sigmas only through the converter -------------------------------------------


def test_paper_sigmas_convert_through_the_plan():
    x, y = data(n=8)
    shards = [(x[:4], y[:4]), (x[4:], y[4:])]
    common = dict(lr=0.2, steps=3, restart=2, clip={"restart": 1.0, "difference": 1.0})
    paper = DIFF2(linear(), logistic, shards, noise=dpvr.PaperSigmas(restart=0.1, difference=0.2), **common)
    assert paper.noise == {"restart": 0.1 * 4 * 2, "difference": 0.2 * 4 * 2}  # sigma * n * P
    direct = DIFF2(linear(), logistic, shards, noise=paper.noise, **common)
    assert direct.plan.mechanism(direct.noise) == paper.plan.mechanism(paper.noise)
    with pytest.raises(ValueError, match="not streams of"):
        DIFF2(linear(), logistic, shards, noise={"restart": 1.0, "y": 1.0}, **common)


# ---- phased output perturbation: the same binding, noise unit and non-finite policy -----------------------


def _phased(**kw):
    from dpvr.algorithms import PhasedOutputPerturbation
    from dpvr.optim import PrivacyConfig, RuntimeConfig

    runtime = RuntimeConfig(generator=gen(2), sampler_seed=0, nonfinite=kw.pop("nonfinite", "zero"))
    privacy = PrivacyConfig(epsilon=1.0, delta=1e-5)
    return PhasedOutputPerturbation("sc", privacy=privacy, runtime=runtime, **kw)


def _logistic(n=40, seed=0):
    from dpvr.objectives import LogisticRegression

    rng = np.random.default_rng(seed)
    return LogisticRegression(rng.normal(size=(n, 3)), rng.random(n) < 0.5, l2=0.1)


class _NaNRecord:
    """A logistic problem whose record 3 has a non-finite gradient (a corrupt record that got through)."""

    def __init__(self):
        self._inner = _logistic()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def sample_operator(self, z, rows):
        out = self._inner.sample_operator(z, rows)
        out[np.asarray(rows) == 3] = np.nan
        return out


def test_phased_resume_is_bound_to_its_settings_and_problem():
    first = _phased()
    first.run(_logistic())
    state = first.state_dict()
    with pytest.raises(ValueError, match="tolerance"):
        _phased(tolerance=0.2).load_state_dict(state)
    resumed = _phased()
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="another problem"):
        resumed.run(_logistic(seed=1))
    np.testing.assert_array_equal(resumed.run(_logistic()).x, first.run(_logistic()).x)


def test_phased_takes_noise_multipliers_and_refuses_noise_above_the_budget():
    x_only = _phased(noise={"x": 8.0})
    result = x_only.run(_logistic())
    assert result.noise_multipliers == {"x": 8.0} and result.spent_epsilon() < 1.0
    with pytest.raises(ValueError, match="spends epsilon"):
        _phased(noise=0.5)


def test_phased_nonfinite_records_contribute_nothing():
    result = _phased().run(_NaNRecord())
    assert np.isfinite(result.x).all()
    with pytest.raises(dpvr.ops.NonFiniteError):
        _phased(nonfinite="raise").run(_NaNRecord())


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


def test_releases_after_a_checkpoint_are_charged_on_resume(tmp_path):
    """A run writes a checkpoint, releases two more steps and crashes. Resuming from the checkpoint charges
    those two releases (from the run's ledger) on top of the two re-run ones, which draw fresh noise."""
    x, y = data()
    path = tmp_path / "run.ckpt"
    crashed = dp_gd(x, y)
    crashed.run(2, progress=False)
    crashed.save_checkpoint(path)
    crashed.run(2, progress=False)  # released, then the process dies
    resumed = dp_gd(x, y)
    resumed.load_checkpoint(path)
    assert resumed.steps_done == 2 and resumed.accountant.state_dict() == crashed.accountant.state_dict()
    resumed.run(progress=False)  # the two re-run steps are charged again
    six_steps = dp_gd(x, y, steps=6)
    six_steps.run(progress=False)
    assert resumed.privacy_spent().epsilon == pytest.approx(six_steps.privacy_spent().epsilon, rel=1e-9)
    assert not torch.equal(resumed.params[0], crashed.params[0])  # a re-run: fresh noise, never the same draw
    ledger = tmp_path / f"dpvr-run-{crashed.ledger.run}.ledger"
    with open(ledger, "ab") as f:
        f.write(b'{"parts": {"gradient": 1.0}, "ev')  # torn mid-write
    with pytest.raises(ValueError, match="run ledger .* unreadable"):
        dp_gd(x, y).load_checkpoint(path)
