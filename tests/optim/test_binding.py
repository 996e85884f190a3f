"""The binding of a run (:meth:`dpvr.optim.PrivateAlgorithm.binding`): each algorithm declares explicitly the
settings its binding records, and the binding holds exactly them (the model, loss and data are bound on their
own), with the same keys and values as before the declaration was explicit."""

import inspect

import pytest
import torch

import dpvr
from dpvr import registry
from dpvr.algorithms import DIFF2, DPGD, DPSGD
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.optim.guard import PrivacyGuard, resolve_noise
from tests.algorithms.test_registry import FRONT_DOOR

# Constructor arguments that are not settings: the objects the binding fingerprints on their own.
_NOT_SETTINGS = {"self", "model", "loss_fn", "problem", "inputs", "targets", "clients", "settings"}


def _squared(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (0.5 * (output.squeeze(-1) - target) ** 2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, 3, generator=g), torch.randn(12, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def test_dpsgds_binding_is_its_declared_settings_plan_noise_and_shapes():
    x, y = _data()
    alg = DPSGD(_model(), _squared, x, y, lr=0.1, clip=1.0, steps=2, batch_size=4, noise=1.0,
                privacy=PrivacyConfig(public_dataset_size=12))
    assert alg.binding(data=False) == {
        "algorithm": "DP-SGD",
        "noise.gradient": 1.0,
        "nonfinite": "zero",
        "parameter.bias": "(1,) torch.float32",
        "parameter.weight": "(1, 3) torch.float32",
        "plan.batch_size": 4.0,
        "plan.dataset_size": 12.0,
        "plan.neighbouring": "add-remove",
        "plan.sample_rate": None,
        "plan.sampling": "poisson",
        "plan.steps": 2.0,
        "runtime.chunk_size": None,
        "runtime.grad_mode": "auto",
        "runtime.nonfinite": "zero",
        "setting.batch_size": 4.0,
        "setting.bound": "last-iterate",
        "setting.clip": 1.0,
        "setting.clip_lr": None,
        "setting.clipping": True,
        "setting.count_noise": None,
        "setting.lr": 0.1,
        "setting.noise": 1.0,
        "setting.optimizer": None,
        "setting.prox": None,
        "setting.sampling": "poisson",
        "setting.smoothness": None,
        "setting.steps": 2.0,
        "setting.target_quantile": None,
        "setting.weak_convexity": None,
    }
    assert set(alg.binding()) == set(alg.binding(data=False)) | {"data"}


def test_dpgd_binds_the_settings_it_was_given():
    x, y = _data()
    alg = DPGD(_model(), _squared, x, y, lr=0.1, clip=1.0, steps=2, noise=1.0)
    assert {k for k in alg.binding(data=False) if k.startswith("setting.")} == {
        "setting.clip", "setting.lr", "setting.noise", "setting.steps",
    }  # fmt: skip
    alg = DPGD(_model(), _squared, x, y, lr=0.1, clip=1.0, steps=2, privacy=PrivacyConfig(epsilon=3.0))
    assert "setting.noise" not in alg.binding(data=False)


@pytest.mark.parametrize("name", sorted(FRONT_DOOR))
def test_every_algorithm_declares_every_constructor_argument(name):
    """The explicit declaration misses no argument: a new one must be declared (or the binding, hence the
    checkpoints and the noise keys, would not see it)."""
    (model, criterion, data), settings = FRONT_DOOR[name]
    trainer = dpvr.make_private(model(), criterion, data(), algorithm=name, epsilon=2.0, **settings)
    alg = trainer.algorithm
    cls = registry.REGISTRY[name].algorithm_class()
    if cls is DPGD:
        cls = DPSGD  # DPGD forwards its keywords to DP-SGD's constructor
    parameters = inspect.signature(cls).parameters
    expected = {
        p for p, spec in parameters.items() if p not in _NOT_SETTINGS and spec.kind is not spec.VAR_KEYWORD
    }
    if type(alg) is DPGD:
        assert set(alg.settings) <= expected
    else:
        assert set(alg.settings) == expected
    bound = alg.binding(data=False)
    assert {k.split(".", 1)[1] for k in bound if k.startswith("setting.")} == set(alg.settings) - {
        "privacy",
        "runtime",
    }


def test_diff2s_binding_keys():
    x, y = _data()
    alg = DIFF2(
        _model(), _squared, [(x[:6], y[:6]), (x[6:], y[6:])], lr=0.1, steps=2, restart=2,
        clip={"restart": 1.0, "difference": 1.0}, noise={"restart": 1.0, "difference": 1.0},
    )  # fmt: skip
    settings = {k for k in alg.binding(data=False) if k.startswith("setting.")}
    assert settings == {
        f"setting.{k}"
        for k in (
            "clip", "local_batch", "local_steps", "lr", "max_radius", "noise", "optimizer", "output",
            "restart", "reuse_recording", "routine", "steps",
        )
    }  # fmt: skip


def test_noise_is_resolved_from_explicit_arguments():
    x, y = _data()
    privacy = PrivacyConfig(epsilon=2.0)
    alg = DPSGD(_model(), _squared, x, y, lr=0.1, clip=1.0, steps=4, batch_size=4, privacy=privacy)
    assert resolve_noise(alg.plan, None, PrivacyConfig(epsilon=2.0)) == alg.noise
    assert resolve_noise(alg.plan, 1.5, PrivacyConfig()) == {"gradient": 1.5}
    with pytest.raises(ValueError, match="noise multiplier"):
        resolve_noise(alg.plan, None, PrivacyConfig())


def test_the_guard_is_the_algorithms_privacy_side():
    x, y = _data()
    gen = dpvr.NoiseGenerator(seed=3, reproducible=True)
    alg = DPSGD(
        _model(), _squared, x, y, lr=0.1, clip=1.0, steps=2, batch_size=4, noise=1.0,
        runtime=RuntimeConfig(generator=gen),
    )  # fmt: skip
    assert isinstance(alg.guard, PrivacyGuard)
    assert alg.accountant is alg.guard.accountant and alg.ledger is alg.guard.ledger
    assert alg.generator is gen is alg.guard.generator
    alg.run()
    assert alg.guard.released == {"gradient": 2} and alg.ledger.seq == 2
