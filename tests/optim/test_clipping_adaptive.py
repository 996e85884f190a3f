"""Private adaptive clipping (DPSGD's ``clipping="adaptive"``, Andrew et al. 2021): the count release's
sensitivity and noise, the gradient release's at the radius in force, epsilon of the combined run against
dp_accounting computed here, the radius converging to the target quantile of the per-record norms, and bad
settings refused by name. The generated sensitivity cases are ``dp-sgd/adaptive`` in
privacy/test_sensitivity.py."""

from __future__ import annotations

import logging
import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from torch import nn

import dpvr
import sensitivity as harness
from dpvr import registry
from dpvr.algorithms import DPSGD
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.optim.clipping import split_noise
from dpvr.trainer.parallel import DataParallel
from sensitivity import ADD_REMOVE, ALGORITHMS, REPLACE_ONE
from tests.privacy.test_noise_drawn import assert_standard_normal, drawn_noise


@pytest.fixture(autouse=True)
def _quiet_accounting():
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    yield
    absl.setLevel(level)


def squared(output, target):
    return 0.5 * (output.squeeze(-1) - target) ** 2


def _seeded(seed: int) -> RuntimeConfig:
    return RuntimeConfig(generator=dpvr.NoiseGenerator(seed, reproducible=True), sampler_seed=seed)


# ---- the count release: its sensitivity, attained ----------------------------------------------------------
@pytest.mark.parametrize(("relation", "sampling", "move"),
                         [(REPLACE_ONE, "wor", 1.0), (ADD_REMOVE, "poisson", 0.5)])
def test_the_count_moves_by_its_priced_sensitivity_and_no_more(relation, sampling, move):
    """Noise off, lockstep on neighbours: a benign record (gradient norm below the large initial radius,
    indicator 1) replaced by a huge one (indicator 0) moves the shifted count by 1; a huge record added moves
    it by 1/2 (its -1/2). Both are exactly the charge: ``factor * sigma_b / (2 sigma_b)``."""
    config = {"n": 8, "seed": 0, "index": 2, "adversary": "huge", "relation": relation, "accountant": "pld",
              "options": {"sampling": sampling, "batch_size": 4, "steps": 3, "lr": 0.01, "clip": 1e4,
                          "clipping": "adaptive", "count_noise": 3.0}}  # fmt: skip
    outcome = harness.lockstep(ALGORITHMS["dp-sgd/adaptive"], config)
    harness.assert_within_sensitivity(outcome)
    harness.assert_accounting_matches(ALGORITHMS["dp-sgd/adaptive"], outcome)
    counts = [c for c in outcome.comparisons if c.stream == "clip-count"]
    assert len(counts) == 3
    assert all(c.bound == pytest.approx(move, rel=1e-12) for c in counts)
    assert max(c.gap for c in counts) == pytest.approx(move, rel=1e-12)  # attained
    gradients = [c for c in outcome.comparisons if c.stream == "gradient"]
    assert len(gradients) == 3 and all(c.gap <= c.bound * (1 + 1e-9) for c in gradients)


def test_the_gradient_release_is_priced_at_the_radius_in_force():
    """The opposed record (clipped at every radius) moves each gradient release by exactly 2 C_t / b, with
    C_t the radius of that step (it changes between steps), and the charge follows C_t."""
    config = {"n": 6, "seed": 0, "index": 1, "adversary": "opposed", "relation": REPLACE_ONE,
              "options": {"sampling": "wor", "batch_size": 3, "steps": 4, "lr": 0.1, "clip": 0.5,
                          "clipping": "adaptive", "clip_lr": 1.0, "count_noise": 2.0}}  # fmt: skip
    spec = ALGORITHMS["dp-sgd/adaptive"]
    pair = harness.neighbours(spec.task, config)
    outcome = harness.lockstep(spec, config, pair)
    gradients = [c for c in outcome.comparisons if c.stream == "gradient"]
    radii = [c.bound * 3 / 2 for c in gradients]  # charge = 2 C_t / b
    assert radii[0] == pytest.approx(0.5, rel=1e-12)
    assert len(set(round(r, 12) for r in radii)) > 1  # the radius moved
    for c in gradients:
        assert c.gap == pytest.approx(c.bound, rel=1e-9)


# ---- noise -------------------------------------------------------------------------------------------------
def test_both_releases_draw_their_priced_noise(monkeypatch):
    """Over 300 steps: the count's draws have std sigma_b, the gradient's z_g C_t / b at each step's radius,
    with z_g = (z^-2 - (2 sigma_b)^-2)^-1/2 (written out here)."""
    monkeypatch.setattr(harness.Regression, "d", 24)
    z, sigma_b, b = 1.5, 1.2, 8
    x, y = harness.REGRESSION.records(64, torch.Generator().manual_seed(0))
    alg = DPSGD(harness.REGRESSION.model(True), harness.Regression.loss, x, y, lr=0.02, clip=0.3,
                clipping="adaptive", count_noise=sigma_b, clip_lr=0.5, steps=300, batch_size=b,
                sampling="wor", noise=z, runtime=_seeded(1))  # fmt: skip
    z_g = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    assert alg.noise == {"gradient": pytest.approx(z_g, rel=1e-14), "clip-count": 2 * sigma_b}
    with drawn_noise() as draws:
        infos = alg.run()
    radii = [info["clip"] for info in infos]
    assert len(draws["clip-count"]) == len(draws["gradient"]) == 300
    counts = np.concatenate([noise for noise, _ in draws["clip-count"]]) / sigma_b
    gradients = np.concatenate([noise / (z_g * c / b) for (noise, _), c in zip(draws["gradient"], radii)])
    assert_standard_normal("clip-count", counts)
    assert_standard_normal("gradient", gradients)
    assert max(radii) / min(radii) > 1.5  # the check covered radii that differ


def test_the_noise_check_flags_a_count_drawn_at_the_wrong_std():
    """The check can fail: pricing the count's draws at 2 sigma_b (its multiplier, not its std) is caught."""
    x, y = harness.REGRESSION.records(64, torch.Generator().manual_seed(0))
    alg = DPSGD(harness.REGRESSION.model(True), harness.Regression.loss, x, y, lr=0.02, clip=0.3,
                clipping="adaptive", count_noise=1.2, steps=300, batch_size=8, sampling="wor", noise=1.5,
                runtime=_seeded(1))  # fmt: skip
    with drawn_noise() as draws:
        alg.run()
    with pytest.raises(AssertionError, match="drawn std"):
        assert_standard_normal("clip-count", np.concatenate([n for n, _ in draws["clip-count"]]) / 2.4)


# ---- accounting --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_of_the_run_is_dp_accountings_for_one_gaussian_at_z(accountant):
    """The pair per step is one Gaussian on the concatenated release: with 1/z^2 = 1/z_g^2 + 1/(2 sigma_b)^2
    it costs exactly a Poisson-sampled Gaussian at z, composed over the steps (dp_accounting, here)."""
    z, sigma_b, b, n, steps, delta = 1.1, 2.0, 16, 200, 30, 1e-5
    x, y = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    alg = DPSGD(nn.Linear(3, 1).double(), squared, x, y, lr=0.05, clip=1.0, clipping="adaptive",
                count_noise=sigma_b, steps=steps, batch_size=b, noise=z, runtime=_seeded(2),
                privacy=PrivacyConfig(accountant=accountant, delta=delta, public_dataset_size=n))  # fmt: skip
    alg.run()
    z_g = alg.noise["gradient"]
    assert z_g == pytest.approx((z**-2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-14)
    joint = (z_g**-2 + (2 * sigma_b) ** -2) ** -0.5
    assert joint == pytest.approx(z, rel=1e-14) and joint >= z * (1 - 1e-15)
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(b / n, dpa.GaussianDpEvent(joint)), steps)
    if accountant == "rdp":
        reference = dpa.rdp.RdpAccountant().compose(event).get_epsilon(delta)
    else:
        pld = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
        reference = pld.compose(event).get_epsilon(delta)
    spent = alg.privacy_spent().epsilon
    assert spent == pytest.approx(reference, rel=1e-3 if accountant == "pld" else 1e-9)
    # ... the cost of plain DP-SGD at z: the count is paid for by the gradient's extra noise
    plain = DPSGD(nn.Linear(3, 1).double(), squared, x, y, lr=0.05, clip=1.0, steps=steps, batch_size=b,
                  noise=z, runtime=_seeded(2),
                  privacy=PrivacyConfig(accountant=accountant, delta=delta, public_dataset_size=n))
    plain.run()
    assert spent == pytest.approx(plain.privacy_spent().epsilon, rel=1e-9)


@pytest.mark.parametrize("shares", [None, "auto"])
def test_calibrated_noise_is_split_after_calibrating_the_pair(shares):
    """With a budget and no noise, z is calibrated for the plain plan and the pair gets it: spent <= budget
    and close to it (shares="auto" has one stream to calibrate, not two)."""
    n = 256
    x, y = torch.randn(n, 3), torch.randn(n)
    alg = DPSGD(nn.Linear(3, 1), squared, x, y, lr=0.05, clip=1.0, clipping="adaptive", steps=20,
                batch_size=32, runtime=_seeded(0),
                privacy=PrivacyConfig(epsilon=2.0, public_dataset_size=n, shares=shares))
    alg.run()
    spent = alg.privacy_spent().epsilon
    assert 1.9 < spent <= 2.0
    assert alg.noise["clip-count"] == pytest.approx(2 * 32 / 20)  # Andrew et al.'s default sigma_b = b / 20


def test_split_noise_never_prices_below_z():
    for z in (0.3, 0.7, 1.0, 1.7, 3.3, 10.0):
        for sigma_b in (z / 2 * 1.0001, z, 5 * z, 1e3):
            z_g, z_b = split_noise(z, sigma_b)
            assert math.fsum((z_g**-2, z_b**-2)) ** -0.5 >= z
            assert z_g == pytest.approx((z**-2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-12)


# ---- the radius follows the target quantile ----------------------------------------------------------------
@pytest.mark.parametrize("quantile", [0.3, 0.8])
def test_the_radius_converges_to_the_target_quantile_of_the_norms(quantile):
    """A fixed problem (zero features: each record's gradient is its residual on the bias, norm |y_i|, and a
    step size too small to move the model) whose per-record norms are known: after 400 steps the radius's
    geometric mean over the last 100 is within 15% of the norms' quantile (fixed seed; the released
    fraction's noise sigma_b / b = 0.05 makes log C wander by about 0.02 at clip_lr 0.2)."""
    n, b = 1024, 64
    y = torch.linspace(0.5, 10.0, n, dtype=torch.float64)
    x = torch.zeros(n, 2, dtype=torch.float64)
    model = nn.Linear(2, 1).double()
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    alg = DPSGD(model, squared, x, y, lr=1e-12, clip=0.5, clipping="adaptive", target_quantile=quantile,
                clip_lr=0.2, steps=400, batch_size=b, noise=1.0, runtime=_seeded(3),
                privacy=PrivacyConfig(public_dataset_size=n))  # fmt: skip
    radii = [info["clip"] for info in alg.run()]
    target = float(np.quantile(y.abs().numpy(), quantile))
    settled = math.exp(float(np.mean(np.log(radii[-100:]))))
    assert settled == pytest.approx(target, rel=0.15), (settled, target)
    assert radii[0] == 0.5 and alg.clip != 0.5  # it started from the given radius and moved


# ---- bad settings ------------------------------------------------------------------------------------------
def _build(**options):
    x, y = torch.randn(32, 3), torch.randn(32)
    base = {"lr": 0.1, "clip": 1.0, "clipping": "adaptive", "steps": 2, "batch_size": 8, "noise": 1.0,
            "sampling": "wor"}
    return DPSGD(nn.Linear(3, 1), squared, x, y, **{**base, **options})


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"target_quantile": 0.0}, ValueError, r"target_quantile: .* in \(0, 1\); got 0.0"),
    ({"target_quantile": 1.0}, ValueError, r"target_quantile: .* in \(0, 1\); got 1.0"),
    ({"target_quantile": -0.2}, ValueError, "target_quantile"),
    ({"clip_lr": 0.0}, ValueError, "clip_lr: the geometric step of the radius must be > 0, got 0.0"),
    ({"clip_lr": -1.0}, ValueError, "clip_lr"),
    ({"count_noise": 0.4, "noise": 1.0}, ValueError,
     r"count_noise: .* sigma_b = 0.4 is too small for the noise multiplier z = 1: .* sigma_b > z/2 = 0.5"),
    ({"count_noise": 0.0}, ValueError, "count_noise: the count's noise std must be > 0"),
    ({"clip": 0.0}, ValueError, "clip: must be a finite number > 0"),
    ({"clip": [1.0, 2.0]}, TypeError, "one radius"),
    ({"sampling": "cyclic", "weak_convexity": 0.0, "smoothness": 1.0}, ValueError,
     "sampling='cyclic' is accounted by the last-iterate bound"),
    ({"clipping": True, "target_quantile": 0.5}, ValueError,
     "target_quantile: settings of clipping='adaptive', given with clipping=True"),
    ({"clipping": "per_layer", "count_noise": 2.0}, ValueError,
     "count_noise: settings of clipping='adaptive'"),
])  # fmt: skip
def test_bad_adaptive_settings_are_refused_by_name(options, error, match):
    with pytest.raises(error, match=match):
        _build(**options)


def test_the_default_count_noise_too_small_for_z_says_so():
    """Andrew et al.'s default sigma_b = b / 20 is 0.4 at b = 8: too small for z = 1 (needs > 0.5)."""
    with pytest.raises(ValueError, match=r"count_noise: .* sigma_b = 0.4 is too small .* batch_size / 20"):
        _build(noise=1.0)


def test_data_parallel_adaptive_clipping_is_refused():
    parallel = object.__new__(DataParallel)
    with pytest.raises(ValueError, match="clipping: 'adaptive' releases a count .* not all-reduced"):
        parallel.check(registry.get("dp-sgd"), nn.Linear(3, 1), {"clipping": "adaptive"})
    parallel.check(registry.get("dp-sgd"), nn.Linear(3, 1), {"clipping": "per_layer"})  # all-reduced, as flat


def test_make_private_adaptive_trains_reports_and_resumes(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(256, 5), torch.randint(0, 2, (256,))
    data = torch.utils.data.TensorDataset(x, y)

    def build():
        torch.manual_seed(1)
        return dpvr.make_private(
            nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)), nn.CrossEntropyLoss(), data,
            algorithm="dp-sgd", epsilon=3.0, batch_size=32, steps=6, lr=0.1, clip=0.1, clipping="adaptive",
            target_quantile=0.6, clip_lr=0.3, runtime=_seeded(4),
        )  # fmt: skip

    trainer = build()
    infos = trainer.algorithm.run(3)
    path = tmp_path / "run.ckpt"
    trainer.algorithm.save_checkpoint(str(path))
    radius = trainer.algorithm.clip
    assert radius != 0.1 and infos[-1]["clip"] != radius  # the radius after step 3 is the next one's
    resumed = build()
    resumed.algorithm.load_checkpoint(str(path))
    assert resumed.algorithm.clip == radius
    assert resumed.algorithm.run()[0]["clip"] == radius
    assert resumed.privacy_spent().epsilon <= 3.0
