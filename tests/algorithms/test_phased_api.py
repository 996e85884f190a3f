"""The phased framework's interface: bad input, checkpoints, the problems' closed forms, the experiment."""

import math
import os

import numpy as np
import pytest

from dpvr.algorithms.phased.algorithm import PhasedOutputPerturbation, gaussian_ratio, paper_mu
from dpvr.algorithms.phased.problem import CertificateError, SolverResult
from dpvr.algorithms.phased.solvers import KatyushaSolver, VRExtragradientSolver
from dpvr.objectives import BilinearSaddle, LogisticRegression, QuadraticSaddle, RobustRegression
from dpvr.ops import NoiseGenerator
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.privacy import Accountant


def _logistic(n=40, l2=0.1):
    rng = np.random.default_rng(0)
    return LogisticRegression(rng.normal(size=(n, 3)), rng.random(n) < 0.5, l2=l2)


def _make(setting="sc", **options):
    def build():
        privacy = PrivacyConfig(epsilon=options.pop("epsilon", 1.0), delta=options.pop("delta", 1e-5))
        runtime = {k: options.pop(k) for k in ("generator", "nonfinite") if k in options}
        if "seed" in options:  # a fixed sampler seed takes a reproducible run
            runtime["sampler_seed"] = options.pop("seed")
            runtime.setdefault("generator", NoiseGenerator(0, reproducible=True))
        return PhasedOutputPerturbation(setting, privacy=privacy, runtime=RuntimeConfig(**runtime), **options)

    return build


class _Attr:
    """A logistic problem with one constant overridden."""

    def __init__(self, **overrides):
        base = _logistic()
        for name in (
            "n",
            "dim_x",
            "dim_y",
            "lipschitz",
            "smoothness",
            "public_smoothness",
            "moduli",
            "domain_x",
            "domain_y",
            "sample_operator",
            "public_operator",
        ):
            setattr(self, name, overrides.get(name, getattr(base, name)))


BAD = [
    ("setting", _make("strongly-convex")),
    ("epsilon", _make(epsilon=0.0)),
    ("epsilon", _make(epsilon=math.inf)),
    ("delta", _make(delta=1.0)),
    ("tolerance", _make(tolerance=-0.1)),
    ("gaussian", _make(gaussian="laplace")),
    ("classic", _make(gaussian="classic", epsilon=2.0)),
    ("mu", _make(mu=0.1)),
    ("phases", _make("c", phases=0)),
    ("mu", _make("c", mu=-1.0)),
    ("accountant", _make(accountant=Accountant("rdp", "add-remove"))),
    ("generator", _make(generator=np.random.default_rng(0))),
    ("seed", _make(seed=-3)),
    ("batch_size", lambda: KatyushaSolver(batch_size=0)),
    ("max_passes", lambda: VRExtragradientSolver(max_passes=0)),
    ("gamma", lambda: VRExtragradientSolver(gamma=1.0)),
    (
        "radius",
        lambda: paper_mu("c", lipschitz=1.0, radius=0.0, n=10, dim=2, epsilon=1.0, delta=1e-5, phases=3),
    ),
    ("labels", lambda: LogisticRegression(np.ones((3, 2)), [0, 1, 2])),
    (
        "positive definite",
        lambda: QuadraticSaddle(
            np.ones((3, 2)), np.ones((3, 2)), Q=np.zeros((2, 2)), B=np.eye(2), R=np.eye(2)
        ),
    ),
    ("b must have shape", lambda: RobustRegression(np.ones((3, 2, 2)), np.ones((3, 3)), radius=1.0)),
]


@pytest.mark.parametrize("name, build", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_arguments_raise_value_errors_naming_them(name, build):
    with pytest.raises((ValueError, TypeError), match=name):  # TypeError: a config given a wrong type
        build()


@pytest.mark.parametrize(
    "name, setting, problem, options",
    [
        ("needs a saddle problem", "sc-sc", _logistic(), {}),
        ("needs a minimisation problem", "c", QuadraticSaddle.random(20, 2, 2), {"mu": 1.0}),
        ("positive moduli", "sc", _logistic(l2=0.0), {}),
        ("positive moduli", "c-sc", BilinearSaddle.random(20, 2), {"mu": 1.0}),
        ("mu: setting 'c' needs mu, or radius", "c", _logistic(), {}),
        ("phases", "c", _logistic(n=5), {"mu": 1.0, "phases": 6}),
        ("x0", "sc", _logistic(), {"x0": np.zeros(5)}),
        ("problem.lipschitz", "sc", _Attr(lipschitz=0.0), {}),
        ("problem.moduli", "sc", _Attr(moduli=(-1.0, 0.0)), {}),
        ("problem.n", "sc", _Attr(n=0), {}),
        ("FiniteSumProblem", "sc", object(), {}),
    ],
)
def test_bad_problems_raise_value_errors(name, setting, problem, options):
    algorithm = PhasedOutputPerturbation(setting, **options, privacy=PrivacyConfig(epsilon=1.0, delta=1e-5))
    with pytest.raises(ValueError, match=name):
        algorithm.run(problem)


class _FailAt:
    def __init__(self, phase):
        self.phase, self.calls = phase, 0

    def solve(self, phase, start):
        self.calls += 1
        if self.calls == self.phase:
            return SolverResult(start, math.inf)
        return KatyushaSolver().solve(phase, start)


def _algorithm(solver):
    runtime = RuntimeConfig(generator=NoiseGenerator(7, reproducible=True), sampler_seed=3)
    return PhasedOutputPerturbation(
        "c", mu=0.5, phases=5, solver=solver, privacy=PrivacyConfig(epsilon=1.0, delta=1e-5), runtime=runtime
    )


def test_a_checkpoint_resumes_the_same_run():
    problem = _logistic(n=60, l2=0.0)
    reference = _algorithm(KatyushaSolver()).run(problem)
    interrupted = _algorithm(_FailAt(4))
    with pytest.raises(CertificateError):
        interrupted.run(problem)
    state = interrupted.state_dict()
    resumed = _algorithm(KatyushaSolver())
    resumed.load_state_dict(state)
    result = resumed.run(problem)
    assert [r.phase for r in result.phases] == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(result.x, reference.x)  # same noise draws, same solver randomness
    assert result.spent_epsilon() == reference.spent_epsilon()
    again = resumed.run(problem)  # a finished run releases the same point and spends nothing more
    np.testing.assert_array_equal(again.x, result.x)
    assert len(resumed.accountant.state_dict()["ledger"]) == 1
    with pytest.raises(ValueError, match="setting"):
        PhasedOutputPerturbation("sc", privacy=PrivacyConfig(epsilon=1.0, delta=1e-5)).load_state_dict(state)


def test_closed_form_gaps_vanish_exactly_at_the_saddle_point_and_only_there():
    rng = np.random.default_rng(0)
    problems = (QuadraticSaddle.random(50, 3, 2, seed=1), BilinearSaddle.random(50, 3, radius=10.0, seed=2))
    for problem in problems:
        z = problem.solution()
        x, y = z[: problem.dim_x], z[problem.dim_x :]
        assert abs(problem.duality_gap(x, y)) < 1e-12
        assert problem.duality_gap(x + 0.1 * rng.normal(size=x.size), y) > 0
        assert problem.duality_gap(x, y + 0.1 * rng.normal(size=y.size)) > 0


def test_operators_are_the_gradients_of_the_losses():
    """Finite differences of the documented objectives match sample and public operators."""
    rng = np.random.default_rng(1)
    logistic = _logistic()
    x = rng.normal(size=3)
    grad = logistic.sample_operator(x, np.arange(logistic.n)).mean(0) + logistic.public_operator(x)
    numeric = [(logistic.objective(x + h) - logistic.objective(x - h)) / 2e-6 for h in 1e-6 * np.eye(3)]
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    robust = RobustRegression.synthetic(30, 2, 3, radius=1.0, l2_x=0.1, l2_y=0.2, seed=1)
    z = np.concatenate([0.3 * rng.normal(size=2), rng.uniform(-1, 1, size=3)])

    def value(z):  # F(x, y) on all samples
        x, y = z[:2], z[2:]
        residual = np.einsum("kij,j->ki", robust.a, x) - robust.b
        return (residual @ y).mean() + 0.05 * x @ x - 0.1 * y @ y

    op = robust.sample_operator(z, np.arange(30)).mean(0) + robust.public_operator(z)
    numeric = np.array([(value(z + h) - value(z - h)) / 2e-6 for h in 1e-6 * np.eye(5)])
    np.testing.assert_allclose(op, numeric * np.array([1, 1, -1, -1, -1]), rtol=1e-6, atol=1e-9)


def test_declared_lipschitz_constants_bound_the_per_sample_gradients():
    rng = np.random.default_rng(2)
    robust = RobustRegression.synthetic(50, 3, 4, radius=2.0, seed=3)
    for _ in range(20):
        x = robust.domain_x.project(rng.normal(size=3) * 5)
        y = np.sign(rng.normal(size=4))  # a corner of the box: the largest ||y||
        grads = robust.sample_operator(np.concatenate([x, y]), np.arange(50))
        assert np.linalg.norm(grads, axis=1).max() <= robust.lipschitz
    logistic = LogisticRegression(rng.normal(size=(50, 4)) * 10, rng.random(50) < 0.5)
    grads = logistic.sample_operator(rng.normal(size=4) * 10, np.arange(50))
    assert np.linalg.norm(grads, axis=1).max() <= logistic.lipschitz


def test_paper_mu_and_the_classic_ratio_follow_the_formulas():
    mu = paper_mu("c", lipschitz=2.0, radius=4.0, n=1024, dim=9, epsilon=0.5, delta=1e-6, phases=10)
    assert mu == pytest.approx(0.5 * max(1 / 32, 14 * 10 * 3 * math.sqrt(math.log(2.5e6)) / 512))
    assert gaussian_ratio(0.5, 1e-6, "classic") == pytest.approx(math.sqrt(2 * math.log(1.25e6)) / 0.5)


@pytest.mark.slow  # an experiment end to end
def test_experiment_runs_on_a_small_grid(tmp_path, monkeypatch):
    from dpvr_lab.experiments import phased

    monkeypatch.setattr(phased, "_SIZES", {name: ((64, 128), ()) for name in phased._SIZES})
    records = phased.run_grid(quick=True, epsilons=[1.0], seeds=1, out_dir=tmp_path, progress=False)
    assert os.path.getsize(tmp_path / "phased.png") > 0
    assert {r.method for r in records} == {
        "phased-SC",
        "phased-C",
        "DP-SGD",
        "phased-SCSC",
        "phased-CC",
        "DP-SGDA",
    }
    by_run = {}
    for r in records:
        diagnostics = r.metrics["diagnostics"]
        assert diagnostics["private"] is False and diagnostics["grad_evals"] > 0
        assert math.isfinite(diagnostics.get("excess_risk", diagnostics.get("duality_gap")))
        by_run.setdefault((r.dataset, r.metrics["n"]), []).append(r.spent_epsilon)
    for spent in by_run.values():  # equal spent epsilon across the methods of one problem
        assert max(spent) == pytest.approx(min(spent), rel=1e-4)
        assert max(spent) == pytest.approx(1.0, rel=1e-4)
