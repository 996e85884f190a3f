"""A checkpoint binds every setting that shapes a release, and noise is bound to its inputs: a resume
with other settings, data or model is refused, never replays released noise, and releases made after
the checkpoint are charged on resume (regressions of an independent privacy review)."""

import pytest
import torch

import dpvr
from dpvr.algorithms import DIFF2, DPGD
from dpvr.optim import RuntimeConfig
from toys import TINY, data, dp_gd, gen, linear, logistic

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
