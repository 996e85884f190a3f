"""The audit: its statistics, every algorithm's bound below its claim, and power against broken variants."""

import inspect
import json
import logging
import math

import numpy as np
import pytest
import torch

from dpvr import ops
from dpvr.algorithms import DIFF2, DPGD, DPSGD, DoubleSpider, PrivateDiff, RecursiveSpider
from dpvr.algorithms.diff2.audit import diff2_gd
from dpvr.algorithms.double_spider.audit import double_spider, double_spider_difference, double_spider_eta
from dpvr.algorithms.dp_gd.audit import dp_gd
from dpvr.algorithms.dp_sgda.audit import dp_sgda
from dpvr.algorithms.last_iterate.audit import last_iterate
from dpvr.algorithms.private_diff.audit import private_diff, private_diff_difference, private_diff_y_output
from dpvr.algorithms.recursive_spider.audit import (
    recursive_spider,
    recursive_spider_difference,
    recursive_spider_s,
    recursive_spider_u,
)
from dpvr.audit import (
    DEFAULT_DELTA,
    audit,
    clopper_pearson,
    epsilon_from_rates,
    one_run_audit,
    one_run_lower_bound,
    threshold_lower_bound,
)
from dpvr.audit.targets import games
from dpvr.cli import main
from dpvr.grads import per_sample_grads_at_two_points
from dpvr.registry import audit_games, audit_targets

logging.getLogger("absl").setLevel(logging.ERROR)  # dp_accounting's RDP convergence chatter


def test_clopper_pearson_matches_the_beta_quantiles_and_covers():
    lower, upper = clopper_pearson(0, 100, 0.05)
    assert lower == 0.0 and upper == pytest.approx(1 - 0.05 ** (1 / 100))
    rng = np.random.default_rng(0)
    misses = sum(clopper_pearson(int(rng.binomial(200, 0.1)), 200, 0.05)[1] < 0.1 for _ in range(400))
    assert misses / 400 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 400)


def test_rates_to_epsilon():
    assert epsilon_from_rates(0.01, 0.5, 0.0) == pytest.approx(math.log(50))
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0


def test_threshold_bound_is_valid_and_has_power_on_gaussians():
    rng = np.random.default_rng(1)
    same = threshold_lower_bound(rng.normal(size=2000), rng.normal(size=2000), delta=0.0, rng=rng)
    assert same.epsilon < 0.3
    apart = threshold_lower_bound(rng.normal(4, 1, 2000), rng.normal(size=2000), delta=0.0, rng=rng)
    assert 3.0 < apart.epsilon < 8.0  # 4-GDP; a thousand evaluation runs per side cap the bound
    # 0.9-GDP is (2.0, 0.01)-DP: a threshold chosen by its plug-in rates lands in a tail and bounds ~0.
    near = threshold_lower_bound(rng.normal(0.9, 1, 2000), rng.normal(size=2000), delta=0.01, rng=rng)
    assert 0.6 < near.epsilon < 2.0


def test_one_run_bound():
    assert one_run_lower_bound(50, 100) == 0.0
    assert one_run_lower_bound(100, 100) > 2.5
    rng = np.random.default_rng(2)
    included = rng.random(1000) < 0.5
    result = one_run_audit(np.where(included, 3.0, 0.0) + rng.normal(size=1000), included, guesses=200)
    assert result.correct >= 190 and result.epsilon_lower_bound > 2.0


@pytest.mark.slow  # a minute in all; the power tests below (broken variants caught) run by default
@pytest.mark.parametrize("name", sorted(audit_targets()))
def test_every_algorithm_audits_below_its_claim(name):
    """Honest runs of every game stay below their claim (with this few trials the bound has little power:
    the deliberately broken variants below are what shows the audit catches bugs)."""
    sampled = (
        "dp-sgd",
        "diff2-bvr-l-sgd",
        "recursive-spider",
        "recursive-spider-difference",
        "recursive-spider-u",
    )
    trials = 60 if name in sampled else 200  # sampled accounting is the slow part
    result = audit(audit_targets()[name].make(), trials, seed=5)
    assert 0 < result.claimed_epsilon < 2.5
    assert result.epsilon_lower_bound <= result.claimed_epsilon


def test_every_row_builds_its_game_under_a_name_of_its_own():
    """Every algorithm's GAMES holds the games its entry declares, under their own names (two rows of one
    name are refused); every row builds its game (calibrating its noise), and the games' names, which an
    audit's results carry, differ too."""
    targets = audit_targets()
    assert set(targets) == set(audit_games()) and all(name == t.name for name, t in targets.items())
    with pytest.raises(ValueError, match="two audit games are named 'dp-gd'"):
        games(*[targets["dp-gd"]] * 2)
    games_ = [target.make() for target in targets.values()]
    assert all(callable(game.play) and game.delta == DEFAULT_DELTA for game in games_)
    assert len({game.name for game in games_}) == len(games_)


DOUBLE_SPIDER = ("eta-refresh", "eta-difference", "x-refresh", "x-difference")
RECURSIVE_SPIDER = ("v-refresh", "v-difference", "u-refresh", "u-difference", "s")


@pytest.mark.parametrize(
    ("make", "streams", "expected"),
    [
        (dp_sgda, ("x", "y"), 2 * 2 / 8),  # two steps of lr 1, each moved by 2 C / n between the sides
        (private_diff, ("checkpoint", "y"), 2 * 2 / 8),
        (double_spider, ("eta-refresh", "x-refresh"), 2 * 2 / 8),
        (recursive_spider, ("v-refresh", "u-refresh", "s"), 2 / 8),  # one step; the score is the estimator
        # Difference steps and dual variables: each audited release, over its radius, moves by 2 / n.
        (private_diff_difference, ("checkpoint", "difference", "y"), 2 / 200),
        (private_diff_y_output, ("checkpoint", "y"), 2 / 8),  # the inner maximiser moves by 2 / n
        (double_spider_difference, DOUBLE_SPIDER, 2 / 200),
        (double_spider_eta, DOUBLE_SPIDER, 2 * 2 / 200),  # the eta refresh and the eta difference
        (recursive_spider_difference, RECURSIVE_SPIDER, 2 / 200),
        (recursive_spider_u, RECURSIVE_SPIDER, 2 / 200),
        (recursive_spider_s, ("v-refresh", "u-refresh", "s"), 1.0),  # s = C5 against 0
    ],
)
def test_white_box_canary_spends_the_whole_sensitivity(make, streams, expected):
    # Without noise the two sides' scores differ by the canary's full replace-one sensitivity along e
    # (difference canaries: the difference clipped to +- its whole radius).
    game = make(**dict.fromkeys(streams, 1e-9))
    scores = [game.play(side, ops.NoiseGenerator(3, reproducible=True), 3, False)[0] for side in (0, 1)]
    assert scores[0] - scores[1] == pytest.approx(expected, rel=1e-6)


# ---- deliberately broken variants -------------------------------------------------------------------


def quieter(cls, streams, factor):
    """``cls`` adding ``factor`` times the noise it accounts for to ``streams`` (0: released unnoised)."""

    class Quieter(cls):
        def step(self):  # every release draws its noise through ops.noisy_update; the accountant is untouched
            draw = ops.noisy_update

            def quieter_draw(v, **kwargs):
                if kwargs["stream"] in streams:
                    kwargs["sigma"] *= factor
                return draw(v, **kwargs)

            ops.noisy_update = quieter_draw
            try:
                return super().step()
            finally:
                ops.noisy_update = draw

    return Quieter


def unclipped(cls, method):
    """``cls`` accounting for clipping but passing the sums of ``self.gradients.<method>`` unclipped."""

    class Unclipped(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            compute = getattr(self.gradients, method)
            signature = inspect.signature(compute)

            def call(*a, **kw):
                bound = signature.bind(*a, **kw)
                bound.arguments["clip"] = 1e30
                return compute(*bound.args, **bound.kwargs)

            setattr(self.gradients, method, call)

    return Unclipped


HalvedNoise = quieter(DPGD, ("gradient",), 0.5)


class HalvedYSensitivity(PrivateDiff):
    """Scales y's output noise to half the inner maximiser's replace-one sensitivity (as if it were an
    add/remove one)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.y_sensitivity /= 2
SkippedClipping = unclipped(DPGD, "sum")


class LeakedGradient(DPGD):
    """Logs the unnoised clipped gradient sum in each step's information (which the caller receives)."""

    def step(self):
        info = super().step()
        info["grad_sum"] = float(torch.cat([s.reshape(-1) for s in self._sum]).sum())
        return info


class MismatchedDifference(DIFF2):
    """Pairs sample i at the current point with sample i + 1 at the previous one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        def diff_sum(x, y, point, previous, clip, out):
            now, before = per_sample_grads_at_two_points(
                self.model, self.loss_fn, x, y, list(point), list(previous)
            )
            return int(ops.clip_accumulate_diff(now, [torch.roll(b, -1, 0) for b in before], clip, list(out)))

        self.gradients.diff_sum = diff_sum


def test_power_clipping_skipped():
    game = dp_gd(algorithm=SkippedClipping, noise_multiplier=4.0)
    result = audit(game, 300, seed=6)
    assert result.epsilon_lower_bound > result.claimed_epsilon


def test_power_unprivatised_value_released():
    game = dp_gd(algorithm=LeakedGradient, noise_multiplier=4.0)
    game.score = lambda trace, _: trace.infos[-1]["grad_sum"]  # the auditor reads what the step returned
    result = audit(game, 300, seed=7)
    assert result.epsilon_lower_bound > result.claimed_epsilon


def test_power_last_iterate_noise_scaled_twice():
    """The last-iterate game catches noise far below the priced std (a release that rescales the plan's
    parameter-space sigma again draws lr C / b times it: 1/80 in the review's configuration)."""
    result = audit(last_iterate(algorithm=quieter(DPSGD, ("gradient",), 0.05)), 300, seed=9)
    assert result.epsilon_lower_bound > result.claimed_epsilon


@pytest.mark.slow
def test_power_noise_halved():
    # Two steps at noise multiplier 2 sqrt(2): mu = 1 claimed, mu = 2 run.
    result = audit(dp_gd(algorithm=HalvedNoise, noise_multiplier=2 * math.sqrt(2)), 4000, seed=8)
    assert result.epsilon_lower_bound > result.claimed_epsilon


@pytest.mark.slow
def test_power_difference_on_different_samples():
    # Restart rounds nearly free (mu = 0.2) so the claim is the difference round's (mu = 1); pairing
    # different samples doubles the canary's weight in it.
    noise = {"restart": 10.0 / 200, "difference": 2.0 / 200}
    honest = audit(diff2_gd(**noise), 2000, seed=9)
    broken = audit(diff2_gd(algorithm=MismatchedDifference, **noise), 4000, seed=9)
    assert honest.epsilon_lower_bound <= honest.claimed_epsilon
    assert broken.epsilon_lower_bound > broken.claimed_epsilon


@pytest.mark.parametrize(
    ("make", "broken"),
    [
        (private_diff_difference, unclipped(PrivateDiff, "diff_sum")),
        (double_spider_difference, unclipped(DoubleSpider, "diff_sum")),
        (double_spider_eta, quieter(DoubleSpider, ("eta-refresh", "eta-difference"), 0.0)),
        # A twentieth of the accounted noise. (Recursive-SPIDER's other records' differences move with their
        # dual weights, so a wrong clip radius hides behind them; the one-record s stream is sampled, which
        # makes its accounting, every run, slow.)
        pytest.param(
            recursive_spider_difference,
            quieter(RecursiveSpider, ("v-difference",), 0.05),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            recursive_spider_u, quieter(RecursiveSpider, ("u-difference",), 0.05), marks=pytest.mark.slow
        ),
        (recursive_spider_s, quieter(RecursiveSpider, ("s",), 0.0)),
        (private_diff_y_output, quieter(PrivateDiff, ("y",), 0.05)),
    ],
)
def test_power_difference_and_dual_releases(make, broken):
    # At a claim of epsilon = 1, 100 runs bound epsilon above 1.8 when the sides never overlap.
    result = audit(make(epsilon=1.0, algorithm=broken), 100, seed=10)
    assert result.epsilon_lower_bound > result.claimed_epsilon


@pytest.mark.slow
def test_power_y_output_sensitivity_halved():
    # A claim of epsilon = 2 at delta = 1e-2 run with twice the accounted signal-to-noise ratio.
    honest = audit(private_diff_y_output(), 4000, seed=11)
    broken = audit(private_diff_y_output(algorithm=HalvedYSensitivity), 4000, seed=11)
    assert honest.epsilon_lower_bound <= honest.claimed_epsilon
    assert broken.epsilon_lower_bound > broken.claimed_epsilon


@pytest.mark.parametrize("name", ["dp-gd", "double-spider-eta"])
def test_cli_json(name, tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert main(["audit", name, "--trials", "40", "--seed", "1", "--json", str(out)]) == 0
    assert "audited lower bound" in capsys.readouterr().out
    record = json.loads(out.read_text())["records"][0]
    assert record["spent_epsilon"] == pytest.approx(2.0, rel=1e-3)
    assert set(record["metrics"]) >= {"epsilon_lower_bound", "confidence", "trials"}
    assert record["metrics"]["trials"] == 40
