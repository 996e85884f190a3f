"""PrivateDiff with y released by output perturbation: the worst-case sensitivity of the inner maximiser,
the solver's certificate, one round against a float64 reference, resume, refusals and calibration."""

import json
import math

import pytest
import torch

import dpvr
from dpvr import PaperSigmas, ops
from dpvr.algorithms import PrivateDiff, PrivateDiffOutputY
from dpvr.algorithms.private_diff.rounding import YRounding
from dpvr.audit.games import CanaryMinimax
from dpvr.cli import main
from dpvr.objectives import AUCMargin, AUCModel
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.privacy import account
from dpvr.problems import MinimaxProblem
from dpvr.problems.minimax import YSensitivity

TINY = 1e-100  # noise this small is absorbed by float64 rounding: the run is noise-free
CLIP = {"checkpoint": 1e6, "difference": (1e6, 0.0)}


def logit_model() -> AUCModel:
    """Scores ``sigmoid(input)``: the records' scores are set by their inputs."""
    net = torch.nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        net.weight.fill_(1.0)
    return AUCModel(net).double()


def mlp() -> AUCModel:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return AUCModel(net).double()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = (torch.rand(40, generator=g) < 0.3).long()
    return x, y


def output_diff(model, problem, x, y, **kw) -> PrivateDiff:
    options = dict(
        lr=0.3, steps=1, restart=1, y_steps=4, batch_size=None, sampling="full", clip=CLIP,
        y_release="output", noise=PaperSigmas(checkpoint=TINY, y=TINY),
        runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(seed=0, reproducible=True)),
    )  # fmt: skip
    options.update(kw)
    return PrivateDiff(model, problem, x, y, **options)


def closed_form(problem: AUCMargin, scores: torch.Tensor, labels: torch.Tensor) -> float:
    """AUC-M's exact maximiser in float64: ``Proj_[0, Lambda]((c + mean(s)) / (mu / 2))``."""
    pos = (labels == 1).double()
    p, h = problem.p, scores.double()
    if problem.version == "v1":
        c, s = p * (1 - p) * problem.margin, p * h * (1 - pos) - (1 - p) * h * pos
    else:
        c, s = problem.margin, h * (1 - pos) / (1 - p) - h * pos / p
    return min(max((c + float(s.mean())) / (problem.strong_concavity / 2), 0.0), problem.diameter)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_worst_case_neighbours_move_the_solution_by_at_most_delta(version, p):
    """A positive of score 1 replaced by a negative of score 1 moves the exact maximiser by exactly the
    stated stability ``1 / (n p (1-p))`` (the bound is tight); random replacements, and a record whose score
    is NaN, stay within ``Delta``. Margin 0 and a wide ``Y`` keep the solutions inside ``Y``."""
    problem = AUCMargin(p, version=version, margin=0.0, alpha_max=1e3)
    n = 30
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, 1, generator=g, dtype=torch.float64)
    labels = (torch.rand(n, generator=g) < p).long()
    logits[0], labels[0] = 40.0, 1  # sigmoid(40) is 1 in float64
    swapped_logits, swapped_labels = logits.clone(), labels.clone()
    swapped_labels[0] = 0
    a = output_diff(logit_model(), problem, logits, labels)
    b = output_diff(logit_model(), problem, swapped_logits, swapped_labels)
    stability = 1 / (n * p * (1 - p))
    assert a.y_constants.stability(n) == pytest.approx(stability, rel=1e-12)
    assert a.y_sensitivity == pytest.approx(1.02 * stability, rel=1e-12)  # default tau: 1% of it
    gap = float((a._solve_y()[0] - b._solve_y()[0]).abs())
    assert stability * (1 - 1e-9) <= gap <= a.y_sensitivity
    for trial in range(20):
        x, y = logits.clone(), labels.clone()
        i = trial % n
        x[i] = float("nan") if trial % 5 == 0 else 10 * torch.randn(1, generator=g, dtype=torch.float64)
        y[i] = 1 - y[i] if trial % 2 else y[i]
        other = output_diff(logit_model(), problem, x, y)
        solved, dropped = other._solve_y()
        assert dropped == (trial % 5 == 0)
        assert float((a._solve_y()[0] - solved).abs()) <= a.y_sensitivity


@pytest.mark.parametrize(("version", "step"), [("v1", None), ("v1", 0.3), ("v2", 0.05)])
def test_certificate_bounds_the_distance_to_the_float64_solution(data, version, step):
    """``y_hat`` is within ``tau`` of the exact maximiser for the default step (exact after one step) and
    for short steps that need many iterations, and the solver stops once it can certify that."""
    x, y = data
    problem = AUCMargin(0.3, version=version)
    tolerance = 1e-6
    alg = output_diff(mlp(), problem, x, y, y_tolerance=tolerance, y_steps=500, lr_y=step)
    alg.y.fill_(1.5)  # a warm start away from the solution
    solved, _ = alg._solve_y()
    with torch.no_grad():
        exact = closed_form(problem, alg.model.scores(x), y)
    assert abs(float(solved) - exact) <= tolerance
    # too few iterations to certify: refused loudly, nothing released
    short = output_diff(mlp(), problem, x, y, y_tolerance=tolerance, y_steps=1, lr_y=step)
    short.y.fill_(1.5)
    with pytest.raises(RuntimeError, match=r"not solved to y_tolerance=1e-06 in y_steps=1 .*: raise y_steps"):
        short._solve_y()


def test_one_noise_free_round_matches_a_float64_reference(data):
    """Round 1: y_1 is the exact maximiser at x_0, and x_1 = x_0 - lr grad_x L(x_0, y_1) (no clipping)."""
    x, y = data
    problem = AUCMargin(0.3)
    reference = mlp()
    with torch.no_grad():
        alpha = torch.tensor([closed_form(problem, reference.scores(x), y)], dtype=torch.float64)
    params = list(reference.parameters())
    grads = torch.autograd.grad(problem.objective(reference(x), y, alpha), params)
    alg = output_diff(mlp(), problem, x, y)
    alg.step()
    torch.testing.assert_close(alg.y, alpha, rtol=0, atol=alg.y_tolerance)
    for p, q, g in zip(alg.params, params, grads):
        torch.testing.assert_close(p.detach(), (q - 0.3 * g).detach(), rtol=1e-9, atol=1e-9)


def test_output_noise_is_sigma_times_delta(data):
    """The release is ``y_hat + N(0, (sigma_y Delta)^2)``: over rounds at a fixed x (lr = 0), the released
    y's spread matches the accounted std."""
    x, y = data
    problem = AUCMargin(0.3, alpha_max=1e3)  # the solution and its noise stay inside Y
    sigma = 2.0
    rounds = 200
    alg = output_diff(
        mlp(), problem, x, y, lr=1e-300, steps=rounds, noise=PaperSigmas(checkpoint=1.0, y=sigma), y_steps=6
    )
    with torch.no_grad():
        exact = closed_form(problem, alg.model.scores(x), y)
    released = []
    for _ in range(rounds):
        alg.step()
        released.append(float(alg.y))
    std = sigma * alg.y_sensitivity
    values = torch.tensor(released, dtype=torch.float64)
    # Both bands are about 4.2 standard errors (the sample std's relative one is 1 / sqrt(2 (rounds - 1)),
    # 0.050 here; 0.15 at 400 rounds was the same 4.2), so a std off by a factor sqrt(2) or 2 (a sensitivity
    # taken as add/remove's, or doubled) still fails.
    assert abs(float(values.mean()) - exact) < 4.2 * std / math.sqrt(rounds)
    assert float(values.std()) == pytest.approx(std, rel=4.2 / math.sqrt(2 * (rounds - 1)))


def test_checkpoint_resume_is_bit_identical(data):
    x, y = data
    options = dict(
        steps=6, restart=2, y_steps=3, batch_size=8, sampling="wor",
        clip={"checkpoint": 1.0, "difference": (1.0, 0.1)},
        noise=PaperSigmas(checkpoint=0.05, difference=0.05, y=0.5),
    )  # fmt: skip

    def runtime(seed: int) -> RuntimeConfig:
        return RuntimeConfig(generator=dpvr.NoiseGenerator(seed=seed, reproducible=True), sampler_seed=3)

    problem = AUCMargin(0.3)
    full = output_diff(mlp(), problem, x, y, **options, runtime=runtime(7))
    full.run(progress=False)
    first = output_diff(mlp(), problem, x, y, **options, runtime=runtime(7))
    first.run(3, progress=False)
    resumed = output_diff(mlp(), problem, x, y, **options, runtime=runtime(99))
    resumed.load_state_dict(first.state_dict())
    resumed.run(progress=False)
    for a, b in zip(full.params, resumed.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(full.y, resumed.y, rtol=0, atol=0)
    assert resumed.privacy_spent().epsilon == pytest.approx(full.privacy_spent().epsilon, rel=1e-12)
    ascent = dict(options, clip={**options["clip"], "y": 1.0}, y_release="ascent", lr_y=0.1)
    with pytest.raises(ValueError, match="y_release"):  # a state of the other release is refused
        output_diff(mlp(), problem, x, y, **ascent, runtime=runtime(7)).load_state_dict(first.state_dict())


def test_output_release_is_a_subclass_chosen_at_construction(data):
    """``y_release="output"`` constructs :class:`PrivateDiffOutputY` (the default, ``"ascent"``, stays a
    PrivateDiff); a user's subclass keeps its own methods ahead of the variant's, and its name, and releases
    the same values under the same binding as PrivateDiff does; the variant refuses the other release."""
    x, y = data
    problem = AUCMargin(0.3)
    options = dict(steps=3, restart=2, y_steps=6, batch_size=8, sampling="wor",
                   clip={"checkpoint": 1.0, "difference": (1.0, 0.1)},
                   noise=PaperSigmas(checkpoint=0.05, difference=0.05, y=0.5))  # fmt: skip

    def seeded() -> RuntimeConfig:  # a generator of its own for each run, the same keys and batches
        return RuntimeConfig(generator=dpvr.NoiseGenerator(seed=0, reproducible=True), sampler_seed=3)

    plain = output_diff(mlp(), problem, x, y, **options, runtime=seeded())
    assert type(plain) is PrivateDiffOutputY and isinstance(plain, PrivateDiff)
    assert plain.name == "PrivateDiff" and dpvr.algorithms.PrivateDiffOutputY is PrivateDiffOutputY
    ascent = output_diff(mlp(), problem, x, y, **dict(options, y_release="ascent", lr_y=0.1,
                                                     clip={**options["clip"], "y": 1.0}))
    assert type(ascent) is PrivateDiff and ascent.y_sensitivity is None

    class Counting(PrivateDiff):
        def _release_y(self) -> int:  # overrides the variant's method of the same name
            self.y_releases = getattr(self, "y_releases", 0) + 1
            return super()._release_y()

    mine, again = (Counting(mlp(), problem, x, y, lr=0.3, y_release="output", runtime=seeded(), **options)
                   for _ in range(2))
    assert isinstance(mine, Counting) and isinstance(mine, PrivateDiffOutputY)
    assert type(mine) is type(again) and type(mine).__qualname__ == Counting.__qualname__  # made once
    assert mine.binding() == plain.binding()
    plain.run(progress=False)
    mine.run(progress=False)
    assert mine.y_releases == 3  # the user's override ran once a round, ahead of the variant's
    torch.testing.assert_close(mine.y, plain.y, rtol=0, atol=0)  # and the variant's release ran under it
    for a, b in zip(mine.params, plain.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="y_release"):
        PrivateDiffOutputY(mlp(), problem, x, y, lr=0.3, y_release="ascent", lr_y=0.1,
                           **dict(options, clip={**options["clip"], "y": 1.0}))


def test_bad_inputs(data):
    x, y = data
    with pytest.raises(ValueError, match="CanaryMinimax states no public worst-case sensitivity"):
        output_diff(torch.nn.Linear(5, 1).double(), CanaryMinimax(), x, y[:, None].double())
    problem = AUCMargin(0.3)
    for kw, match in [
        ({"y_tolerance": 0.0}, "y_tolerance"),
        ({"y_tolerance": math.inf}, "y_tolerance"),
        ({"y_release": "closed-form"}, "y_release"),
        ({"clip": {**CLIP, "y": 1.0}}, "clip"),  # output mode clips no y-gradient
        ({"y_release": "ascent", "clip": {**CLIP, "y": 1.0}}, "lr_y"),
        ({"y_release": "ascent", "clip": {**CLIP, "y": 1.0}, "lr_y": 0.1, "y_tolerance": 1.0}, "y_tolerance"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            output_diff(mlp(), problem, x, y, **kw)
    nan = x.clone()
    nan[0] = float("nan")
    strict = output_diff(mlp(), problem, nan, y, runtime=RuntimeConfig(nonfinite="raise"))
    with pytest.raises(ops.NonFiniteError, match="non-finite model outputs"):
        strict._solve_y()


def test_calibration_spends_its_epsilon_and_matches_the_account_cli(data, capsys):
    x, y = data
    problem = AUCMargin(0.3)
    kw = dict(
        steps=6, restart=2, y_steps=3, batch_size=10, sampling="wor",
        clip={"checkpoint": 1.0, "difference": (1.0, 0.1)},
    )  # fmt: skip
    for shares in (None, "auto"):
        alg = output_diff(
            mlp(), problem, x, y, **kw, noise=None,
            runtime=RuntimeConfig(generator=dpvr.NoiseGenerator(0, reproducible=True), sampler_seed=0),
            privacy=PrivacyConfig(epsilon=2.0, delta=1e-4, **({"shares": shares} if shares else {})),
        )  # fmt: skip
        alg.run(progress=False)
        spent = alg.privacy_spent()
        assert spent.epsilon == pytest.approx(2.0, rel=1e-3) and spent.epsilon <= 2.0 * (1 + 1e-9)
        assert set(spent.shares) == {"checkpoint", "difference", "y"}
        # the plan charges exactly one unsampled y-release per round
        assert account(alg.plan(alg.noise), 1e-4, accountant=spent.accountant).epsilon == pytest.approx(
            spent.epsilon, rel=1e-9
        )
    assert main([
        "account", "private-diff", "--dataset-size", "40", "--batch-size", "10", "--steps", "6",
        "--restart", "2", "--y-steps", "3", "--y-release", "output",
        "--sigma-x1", _paper_sigma(alg, "checkpoint"), "--sigma-x2", _paper_sigma(alg, "difference"),
        "--sigma-y", _paper_sigma(alg, "y"), "--delta", "1e-4", "--json",
    ]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["epsilon"] == pytest.approx(spent.epsilon, rel=1e-9)


class SignMean(MinimaxProblem):
    """``f(o, t, y) = t y - y^2 / 2`` on ``Y = [-1, 1]`` with targets ``t`` in ``{-1, +1}``: the inner
    maximiser is the mean of the targets, exactly computable from their counts (``gradient_range = 2``,
    ``mu = L = 1``). The model's output does not enter; ``y_grads`` is the default's vmapped gradient
    ``t - y`` as one vectorised expression, so that millions of records take a fraction of a second."""

    y_dim, strong_concavity, diameter, y_lipschitz = 1, 1.0, 2.0, 2.0

    def loss(self, output, target, y):
        return target.to(y.dtype) * y[0] - 0.5 * (y**2).sum() + 0.0 * output.sum()

    def y_grads(self, outputs, targets, y):
        return targets.to(y.dtype)[:, None] - y

    def project(self, y):
        return y.clamp(-1.0, 1.0)

    def y_sensitivity(self):
        return YSensitivity(gradient_range=2.0, strong_concavity=1.0, smoothness=1.0)

    def bounded_outputs(self, outputs):
        return torch.nan_to_num(outputs, nan=0.0, posinf=0.0, neginf=0.0)


def sign_mean_diff(n: int, **kw) -> PrivateDiff:
    """PrivateDiff with y by output perturbation over ``n`` records of :class:`SignMean` (zero inputs, a
    scalar model; every third record has target ``+1``, the others ``-1``), the default tolerance unless
    ``kw`` says otherwise."""
    inputs = torch.zeros(1, 1, dtype=torch.float64).expand(n, 1)  # one stored value: the output is public
    targets = torch.where(torch.arange(n) % 3 == 0, 1, -1).to(torch.int8)
    model = torch.nn.Linear(1, 1, bias=False).double()
    return output_diff(model, SignMean(), inputs, targets, batch_size=8, sampling="wor", **kw)


def test_default_tolerance_certifies_ten_million_records():
    """Privacy review item 12: the rounding allowance grew as ``n eps`` while the default tolerance shrinks
    as ``1/n``, so above a few million records the default configuration could not certify (and the error
    named ``y_steps``). The default must certify at any ``n``, its ``y_hat`` within the tolerance of the
    exact maximiser."""
    n = 10_000_000
    alg = sign_mean_diff(n)
    assert alg.y_tolerance == pytest.approx(0.01 * 2 / n, rel=1e-12)  # still 1% of the stability here
    y_hat, dropped = alg._solve_y()
    assert dropped == 0
    positives = (n + 2) // 3
    exact = (positives - (n - positives)) / n  # the exact mean of the targets
    assert abs(float(y_hat) - exact) <= alg.y_tolerance


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("p", [0.5, 0.02])
def test_default_tolerance_stays_above_the_rounding_allowance_at_any_n(version, p):
    """The allowance is public and grows as ``log2 n``: in float64 the default stays 1% of the stability to
    ``1e10`` records, and at every ``n`` it is at least ``4 A``; a float32 ``y`` adds its own rounding."""
    problem = AUCMargin(p, version=version)
    constants = problem.y_sensitivity()
    step = 1 / constants.smoothness
    for exponent in range(1, 19):
        n = 10**exponent
        rounding = YRounding.of(problem, constants, n, step, torch.float64)
        stability = constants.stability(n)
        tolerance = rounding.default_tolerance(stability)
        assert tolerance >= 4 * rounding.allowance > 0
        if n <= 10**10:
            assert tolerance == 0.01 * stability
        assert rounding.allowance < 1e-12  # log2 n, not n: ~1e-13 even at n = 1e18
        single = YRounding.of(problem, constants, n, step, torch.float32)
        assert single.default_tolerance(stability) >= 4 * single.allowance + 2**-24 * problem.diameter


def test_an_uncertifiable_tolerance_is_refused_naming_y_tolerance(data):
    """A tolerance below what float rounding lets any number of iterations certify is refused at
    construction (a public check: nothing is read or released), with the knob that fixes it and the
    numbers; the smallest accepted tolerance does certify."""
    x, y = data
    problem = AUCMargin(0.3)
    constants = problem.y_sensitivity()
    rounding = YRounding.of(problem, constants, len(x), 1 / constants.smoothness, torch.float64)
    minimum = rounding.minimum_tolerance
    with pytest.raises(ValueError) as refused:
        output_diff(mlp(), problem, x, y, y_tolerance=1e-16)
    message = str(refused.value)
    assert message.startswith(f"y_tolerance=1e-16 is below {minimum:.3g}")
    for part in ("n=40 records", f"allowance is {rounding.allowance:.3g}", "Raise y_tolerance to at least",
                 "more y_steps cannot help"):  # fmt: skip
        assert part in message
    alg = output_diff(mlp(), problem, x, y, y_tolerance=minimum, y_steps=50)
    alg.y.fill_(1.5)
    solved, _ = alg._solve_y()
    with torch.no_grad():
        assert abs(float(solved) - closed_form(problem, alg.model.scores(x), y)) <= minimum
    # a float32 y cannot be certified closer than its own rounding: the message says so
    single = AUCModel(torch.nn.Linear(5, 1))
    with pytest.raises(ValueError, match=r"y_tolerance=1e-09 is below 1\.\d+e-07.*rounding y to float32"):
        output_diff(single, problem, x.float(), y, y_tolerance=1e-9)


def test_a_problem_whose_y_lipschitz_is_false_is_caught():
    """The allowance trusts ``y_lipschitz`` to bound each record's gradient: a computed gradient longer than
    that stops the solve instead of certifying with a wrong allowance."""

    class Understated(SignMean):
        y_lipschitz = 0.5  # the gradients t - y reach 2

    inputs = torch.zeros(10, 1, dtype=torch.float64)
    targets = torch.tensor([1, -1] * 5, dtype=torch.int8)
    alg = output_diff(torch.nn.Linear(1, 1, bias=False).double(), Understated(), inputs, targets)
    with pytest.raises(RuntimeError, match="longer than its y_lipschitz=0.5"):
        alg._solve_y()


def _paper_sigma(alg, stream: str) -> str:
    """The paper's sigma of ``stream`` (the ``dpvr account`` flags take it), from the noise multiplier."""
    return repr(alg.plan.sigma(alg.noise[stream], stream))
