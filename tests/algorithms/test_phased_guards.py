"""Phased output perturbation under the same guards as the other algorithms: a resume bound to its
settings and problem, noise multipliers within the budget, the non-finite policy."""

import numpy as np
import pytest

import dpvr


def gen(seed=0):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


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
