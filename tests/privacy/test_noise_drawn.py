"""The noise harness: every release draws the noise std its accountant prices.

The sensitivity harness (``sensitivity.py``) runs with the noise off, so it checks what a release adds noise
*to*; this one checks the noise itself. Each algorithm of the registry runs with the noise on, every call of
:func:`dpvr.ops.noisy_update` is intercepted, and the noise it drew is recovered exactly as
``v_after - (0 if reset else v_before) - scale * sum``. Divided by the std the accountant prices for that
release — the stream's noise multiplier ``z`` (the accountant's convention: std over the add/remove bound)
times the released value's sensitivity, written out below from each paper's mechanism, not from the
algorithm's code — the pooled draws of a stream must be standard normal: their mean square lies within a
chi-square interval (two-sided, probability 1e-6 of a false alarm with the seeds fixed), which at the
sample sizes used pins the std to a few percent.

Difference streams are configured with a huge per-move constant, so their radius is always its public cap
(the iterates move under noise): the expected sensitivity is then a constant of the configuration.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import pytest
import torch
from scipy import stats

import dpvr.ops
import sensitivity as harness
from dpvr import registry
from dpvr.optim import PrivateAlgorithm
from sensitivity import REPLACE_ONE

WIDE = 48  # features of the harness's models here: enough draws per release for a tight estimate
FALSE_ALARM = 1e-6
HUGE_K = 1e6  # per-move constant: a difference radius is always its cap

Expected = Callable[[PrivateAlgorithm, str], float]


@contextlib.contextmanager
def drawn_noise() -> Iterator[dict[str, list[np.ndarray]]]:
    """Every release's drawn noise, per stream, recovered from the release's inputs and output."""
    draws: dict[str, list[np.ndarray]] = defaultdict(list)
    original = dpvr.ops.noisy_update

    def flat(arrays):
        arrays = arrays if isinstance(arrays, (list, tuple)) else [arrays]
        return np.concatenate([np.asarray(torch.as_tensor(a).detach().double()).reshape(-1) for a in arrays])

    def intercepted(v, **kwargs):
        before = flat(v).copy()
        signal = flat(kwargs["sum"]) * kwargs.get("scale", 1.0) if kwargs.get("sum") is not None else 0.0
        result = original(v, **kwargs)
        base = 0.0 if kwargs.get("reset", False) else before
        draws[kwargs["stream"]].append((flat(v) - base - signal, float(kwargs["sigma"])))
        return result

    dpvr.ops.noisy_update = intercepted
    try:
        yield draws
    finally:
        dpvr.ops.noisy_update = original


def assert_standard_normal(stream: str, normalised: np.ndarray) -> None:
    """``normalised`` (draws over their priced std) has unit variance, to the chi-square interval."""
    n = normalised.size
    low, high = stats.chi2.ppf([FALSE_ALARM / 2, 1 - FALSE_ALARM / 2], n) / n
    mean_square = float(np.mean(normalised**2))
    assert low <= mean_square <= high, (
        f"stream {stream!r}: drawn std is {math.sqrt(mean_square):.4f} x the priced std over {n} draws "
        f"(1 within [{math.sqrt(low):.4f}, {math.sqrt(high):.4f}])"
    )


def run_and_check(alg: PrivateAlgorithm, expected: Expected, steps: int | None = None) -> dict[str, int]:
    """Runs ``alg`` and checks each stream's pooled draws against ``expected(alg, stream)``; returns the
    number of draws per stream."""
    with drawn_noise() as draws:
        alg.run(steps)
    assert draws, "no release was made"
    counts = {}
    for stream, releases in draws.items():
        priced = expected(alg, stream)
        normalised = np.concatenate([noise / priced for noise, _ in releases])
        assert_standard_normal(stream, normalised)
        counts[stream] = normalised.size
    return counts


@pytest.fixture(autouse=True)
def _wide_models(monkeypatch):
    for task in (harness.Regression, harness.AUC, harness.Classification):
        monkeypatch.setattr(task, "d", WIDE)


def _data(n: int, task, classes: bool = False, sizes=None):
    rng = torch.Generator().manual_seed(0)
    if sizes is not None:
        return [task.records(m, rng) for m in sizes]
    return task.records(n, rng)


def _config(options: Mapping, **extra) -> dict:
    return {"seed": 0, "relation": REPLACE_ONE, "z": 1.5, "options": dict(options), **extra}


# ---- per algorithm: a configuration and the std its paper's mechanism prices ---------------------------
# A mean of b records each clipped to C moves by C / b when one record is added or removed: std z C / b.
DPSGD_CASES = {
    "poisson": ({"sampling": "poisson", "batch_size": 8}, 8),
    "wor": ({"sampling": "wor", "batch_size": 8}, 8),
    "full": ({"sampling": "full"}, 32),
    "random-allocation": ({"sampling": "random-allocation", "batch_size": 8}, 8),
    "cyclic": ({"sampling": "cyclic", "batch_size": 8}, 8),
}


@pytest.mark.parametrize("sampling", sorted(DPSGD_CASES))
def test_dpsgd_draws_the_priced_noise(sampling):
    options, b = DPSGD_CASES[sampling]
    relation = "add-remove" if sampling in ("poisson", "random-allocation") else REPLACE_ONE
    config = _config({**options, "lr": 0.05, "clip": 2.0, "steps": 40}, relation=relation, accountant="pld",
                     n=32)  # under add/remove the size is stated public
    if sampling == "cyclic":
        config["accountant"] = "rdp"
    alg = harness.build_dpsgd(_data(32, harness.REGRESSION), config)
    run_and_check(alg, lambda a, s: a.noise[s] * 2.0 / b)


@pytest.mark.parametrize("clipping", [True, False])
def test_last_iterate_parameter_noise_is_the_priced_sigma(clipping):
    """The cyclic plan prices parameter-space noise ``sigma = lr z C / b`` (Kong & Ribero's sigma): the
    released last iterate of a zero-gradient run has moved by exactly that noise, summed over the steps."""
    from dpvr.algorithms import DPSGD

    n, b, lr, clip, steps = 32, 8, 0.05, 2.0, 12
    x = torch.zeros(n, 400, dtype=torch.float64)
    y = torch.zeros(n, dtype=torch.float64)
    model = torch.nn.Linear(400, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    alg = DPSGD(
        model, harness.Regression.loss, x, y, lr=lr, clip=clip, steps=steps, batch_size=b, sampling="cyclic",
        noise=1.5, weak_convexity=0.0, smoothness=1.0, clipping=clipping,
        runtime=dpvr.RuntimeConfig(generator=dpvr.NoiseGenerator(1, reproducible=True)),
    )  # fmt: skip
    alg.run()
    priced = alg.plan.sigma(alg.noise["gradient"])  # the parameter-space std the bound was computed for
    assert priced == pytest.approx(lr * 1.5 * clip / b)
    moved = model.weight.detach().reshape(-1).numpy()  # zero gradients: the sum of `steps` noise draws
    assert_standard_normal("gradient", moved / (priced * math.sqrt(steps)))


@pytest.mark.parametrize("clipping", [True, False])
def test_make_private_last_iterate_draws_the_priced_parameter_noise(clipping):
    """The review's measurement, through the front door: lr 0.05, C 2, b 8, one step of a zero loss. The
    drawn parameter noise was 79.7x (clipping=False) and 79.9x (clipping=True) below the priced sigma."""
    x, y = torch.zeros(32, 2000), torch.zeros(32, 1)
    model = torch.nn.Linear(2000, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    trainer = dpvr.make_private(
        model, torch.nn.MSELoss(), torch.utils.data.TensorDataset(x, y), algorithm="last-iterate",
        epsilon=1.0, batch_size=8, steps=1, lr=0.05, clip=2.0, weak_convexity=0.0, smoothness=1.0,
        clipping=clipping,
    )  # fmt: skip
    trainer.run()
    alg = trainer.algorithm
    priced = alg.plan.sigma(alg.noise["gradient"])
    assert priced == pytest.approx(0.05 * alg.noise["gradient"] * 2.0 / 8)
    assert_standard_normal("gradient", model.weight.detach().double().reshape(-1).numpy() / priced)


@pytest.mark.parametrize("sampling", ["poisson", "wor"])
def test_dpsgd_per_layer_draws_noise_priced_on_the_total_radius(sampling):
    """Per-layer radii (0.6 on the weight, 0.8 on the bias): one record moves the sum by at most
    sqrt(0.6^2 + 0.8^2) = 1, so the std is z * 1 / b, not z * max C_l / b nor z * sum C_l / b."""
    relation = "add-remove" if sampling == "poisson" else REPLACE_ONE
    config = _config({"sampling": sampling, "batch_size": 8, "lr": 0.05, "clip": [0.6, 0.8],
                      "clipping": "per_layer", "steps": 40}, relation=relation, accountant="pld", n=32)
    alg = harness.build_dpsgd(_data(32, harness.REGRESSION), config)
    run_and_check(alg, lambda a, s: a.noise[s] * 1.0 / 8)


def test_dpgd_draws_the_priced_noise():
    config = _config({"lr": 0.05, "clip": 2.0, "steps": 40})
    alg = harness.build_dpgd(_data(32, harness.REGRESSION), config)
    run_and_check(alg, lambda a, s: a.noise[s] * 2.0 / 32)


@pytest.mark.parametrize("local", [False, True])
def test_diff2_draws_the_priced_noise(local):
    sizes, cap = (10, 12), 1.5
    options = {
        "steps": 30, "restart": 3, "lr": 0.05, "max_radius": cap,
        "clip": {"restart": 1.0, "difference": HUGE_K},
    }  # fmt: skip
    if local:
        options.update(routine="bvr-l-sgd", local_steps=3, local_batch=4,
                       clip={**options["clip"], "local": HUGE_K})  # fmt: skip
    alg = harness.build_diff2(_data(0, harness.REGRESSION, sizes=sizes), _config(options, sizes=sizes))
    n_p = min(sizes) * len(sizes)  # the mean over P clients of at least n_min records each
    unit = {"restart": 1.0 / n_p, "difference": cap / n_p, "local": cap / 4}
    counts = run_and_check(alg, lambda a, s: a.noise[s] * unit[s])
    assert set(counts) == ({"restart", "difference", "local"} if local else {"restart", "difference"})


def test_dpsgda_draws_the_priced_noise():
    options = {"sampling": "wor", "batch_size": 8, "steps": 200, "lr": 0.05, "lr_y": 0.05,
               "clip": {"x": 1.0, "y": 0.5}}  # fmt: skip
    alg = harness.build_dpsgda(_data(32, harness.MINIMAX), _config(options))
    unit = {"x": 1.0 / 8, "y": 0.5 / 8}
    run_and_check(alg, lambda a, s: a.noise[s] * unit[s])


def test_private_diff_draws_the_priced_noise():
    cap = 0.8
    options = {"sampling": "wor", "batch_size": 8, "steps": 200, "restart": 3, "y_steps": 2, "lr": 0.05,
               "lr_y": 0.05, "max_radius": cap,
               "clip": {"y": 0.5, "checkpoint": 0.4, "difference": (HUGE_K, 0.0)}}  # fmt: skip
    alg = harness.build_private_diff(_data(32, harness.MINIMAX), _config(options))
    unit = {"checkpoint": 0.4 / 8, "difference": cap / 8, "y": 0.5 / 8}
    run_and_check(alg, lambda a, s: a.noise[s] * unit[s])


def test_private_diff_output_y_draws_the_priced_noise():
    """``y`` by output perturbation: a replace-one sensitivity ``Delta`` (proved in PrivateDiff's docstring)
    is twice the accountant's unit."""
    from dpvr.algorithms import PrivateDiff

    x, y = _data(32, harness.MINIMAX)
    alg = PrivateDiff(
        harness.MINIMAX.model(False), harness.MINIMAX.problem, x, y, lr=0.05, steps=200, restart=3,
        batch_size=8, y_steps=50, y_release="output", clip={"checkpoint": 0.4, "difference": (HUGE_K, 0.0)},
        max_radius=0.8, noise={"checkpoint": 1.5, "difference": 1.5, "y": 1.5},
        runtime=dpvr.RuntimeConfig(generator=dpvr.NoiseGenerator(2, reproducible=True)),
    )  # fmt: skip
    delta = alg.y_constants.stability(len(x)) + 2 * alg.y_tolerance
    unit = {"checkpoint": 0.4 / 8, "difference": 0.8 / 8, "y": delta / 2}
    run_and_check(alg, lambda a, s: a.noise[s] * unit[s])


def test_double_spider_draws_the_priced_noise():
    b, c = 8, 0.5
    options = {"divergence": "chi2", "lam": 1.0, "steps": 300, "restart": 3, "batch_sizes": (b, b, b, b),
               "lr": 0.05, "lr_eta": 0.05, "max_move": 1.0, "eta0": 3.0,
               "clip": {"eta-refresh": c, "eta-difference": (HUGE_K, HUGE_K), "x-refresh": c,
                        "x-difference": (HUGE_K, HUGE_K)}}  # fmt: skip
    alg = harness.build_double_spider(_data(32, harness.DRO), _config(options))
    cap = {"eta": alg.eta_radius.cap, "x": alg.x_radius.cap}
    # an eta-refresh term 1 - (psi*)' lies in [-C, min(1, C)]: a replace-one range, half of it the unit
    unit = {"eta-refresh": (c + min(1.0, c)) / 2 / b, "eta-difference": cap["eta"] / b,
            "x-refresh": c / b, "x-difference": cap["x"] / b}  # fmt: skip
    assert cap == {"eta": 2 * c, "x": 2 * c}  # the public caps the radius rules document
    run_and_check(alg, lambda a, s: a.noise[s] * unit[s])


def test_recursive_spider_draws_the_priced_noise():
    b, c, beta = 8, 0.5, 0.6
    options = {"rho": 0.5, "lam0": 0.1, "lam_init": 1.0, "steps": 300, "restart": 3,
               "batch_sizes": (b, b, b, b), "lr": 0.01, "lr_lam": 0.01, "beta": beta, "loss_bound": 10.0,
               "clip": {"v-refresh": c, "v-difference": HUGE_K, "u-refresh": c, "u-difference": HUGE_K,
                        "s": 1.0}}  # fmt: skip
    alg = harness.build_recursive_spider(_data(32, harness.DRO), _config(options))
    # u-refresh terms lie in [0, C] (half a ball's range); s terms in [-(1 - beta), 1] (range 2 - beta)
    unit = {"v-refresh": c / b, "v-difference": 2 * c / b, "u-refresh": c / 2 / b, "u-difference": 2 * c / b,
            "s": (2 - beta) / 2}  # fmt: skip
    run_and_check(alg, lambda a, s: a.noise[s] * unit[s])


@pytest.mark.parametrize("setting", ["sc", "c"])
def test_phased_output_perturbation_draws_the_priced_noise(setting):
    """Each phase releases its solver's point plus noise of std ``z Delta / 2``: ``Delta`` is the replace-one
    sensitivity of the phase's certified output, ``(1 + 2 tau) 2 L / (m sqrt(mu mu_x))`` on its ``m``
    records (the paper's stability bound widened by the certified radius), and dpvr's unit is half of it."""
    from dpvr.algorithms import PhasedOutputPerturbation
    from dpvr.objectives import LogisticRegression
    from dpvr.optim import PrivacyConfig, RuntimeConfig

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, WIDE))
    problem = LogisticRegression(x / np.linalg.norm(x, axis=1, keepdims=True), rng.random(64) < 0.5, l2=0.3)
    options = {"mu": 0.05, "phases": 4} if setting == "c" else {}
    draws, priced = [], []
    for seed in range(6):
        alg = PhasedOutputPerturbation(
            setting, privacy=PrivacyConfig(epsilon=1.0, delta=1e-6), tolerance=0.05,
            runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed, reproducible=True), sampler_seed=seed),
            **options,
        )  # fmt: skip
        with drawn_noise() as drawn:
            result = alg.run(problem)
        z = result.noise_multipliers["x"]
        for entry in result.accountant.state_dict()["ledger"]:
            assert _gaussian_multiplier(entry["event"]) == pytest.approx(z, rel=1e-12)
        for phase, (noise, _) in zip(result.phases, drawn["phased/x"]):
            m = phase.rows[1] - phase.rows[0]
            mu_x = phase.moduli[0]  # a minimisation: x's is the only modulus
            delta = (1 + 2 * 0.05) * 2 * problem.lipschitz / (m * mu_x)
            draws.append(noise)
            priced.append(np.full(noise.size, z * delta / 2))
    assert_standard_normal("phased/x", np.concatenate(draws) / np.concatenate(priced))


def _gaussian_multiplier(event: Mapping) -> float:
    while "event" in event:
        event = event["event"]
    return event["noise_multiplier"]


def test_every_registry_algorithm_has_a_noise_check():
    """A new algorithm must come with its noise check here."""
    covered = {"dp-sgd", "dp-gd", "last-iterate", "diff2", "dp-sgda", "private-diff", "double-spider",
               "recursive-spider", "phased"}  # fmt: skip
    missing = sorted(set(registry.REGISTRY) - covered)
    assert not missing, f"no noise check for {missing}"


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_the_noise_harness_flags_a_miscalibrated_release(factor):
    """The check can fail: a DP-SGD whose releases draw ``factor`` times the priced std is caught."""
    config = _config({"sampling": "wor", "batch_size": 8, "lr": 0.05, "clip": 2.0, "steps": 20})
    alg = harness.build_dpsgd(_data(32, harness.REGRESSION), config)
    with pytest.raises(AssertionError, match="drawn std"):
        run_and_check(alg, lambda a, s: a.noise[s] * 2.0 / 8 / factor)

