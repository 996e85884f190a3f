"""Each phase's noise equals the Gaussian mechanism's for the stated sensitivity and budget, and the
accountant records what was released (phases of one run once, by parallel composition)."""

import math

import numpy as np
import pytest
from scipy.stats import norm

from dpvr.algorithms import PhasedPlan
from dpvr.algorithms.phased.algorithm import PhasedOutputPerturbation, gaussian_ratio, release_ratio
from dpvr.algorithms.phased.problem import SolverResult
from dpvr.objectives import BilinearSaddle, LogisticRegression, QuadraticSaddle, RobustRegression
from dpvr.ops import NoiseGenerator
from dpvr.optim import PrivacyConfig, RuntimeConfig

EPS, DELTA = 0.8, 1e-6


def _logistic(n=64, l2=0.0, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return LogisticRegression(rng.normal(size=(n, d)), rng.random(n) < 0.5, l2=l2)


PROBLEMS = {  # setting -> a small problem of that kind, with zero moduli where the setting phases them in
    "sc": lambda: _logistic(l2=0.3),
    "c": lambda: _logistic(),
    "sc-sc": lambda: QuadraticSaddle.random(64, 3, 2, seed=1),
    "c-c": lambda: BilinearSaddle.random(64, 2, radius=3.0, seed=2),
    "c-sc": lambda: RobustRegression.synthetic(64, 2, 3, radius=1.0, l2_y=0.4, seed=3),
}
PHASED_MU = {"c": 0.05, "c-c": 0.05, "c-sc": 0.05}


def _run(setting, problem, **options):
    extra = {"mu": PHASED_MU[setting], "phases": 4} if setting in PHASED_MU else {}
    algorithm = PhasedOutputPerturbation(
        setting,
        **extra,
        **options,
        privacy=PrivacyConfig(epsilon=EPS, delta=DELTA),
        runtime=RuntimeConfig(generator=NoiseGenerator(0, reproducible=True), sampler_seed=0),
    )
    return algorithm.run(problem)


def _exact_weighted_sensitivity(problem, record):
    m = record.rows[1] - record.rows[0]
    moduli = record.moduli if problem.dim_y else record.moduli[:1]
    return 2 * problem.lipschitz / (m * math.sqrt(min(moduli)))


@pytest.mark.parametrize("setting", sorted(PROBLEMS))
def test_sigma_is_the_classic_gaussian_mechanism_for_the_certified_sensitivity(setting):
    problem, tolerance = PROBLEMS[setting](), 0.1
    result = _run(setting, problem, gaussian="classic", tolerance=tolerance)
    releases = len(PhasedPlan(setting).streams)
    eps, delta = EPS / releases, DELTA / releases
    assert result.phases
    for record in result.phases:
        exact = _exact_weighted_sensitivity(problem, record)
        assert record.target == pytest.approx(tolerance * exact, rel=1e-12)
        assert record.certified <= record.target
        for name, sigma in record.sigma.items():
            modulus = record.moduli["xy".index(name)]
            # exact solution's sensitivity plus twice the certified radius, in the released block
            sensitivity = (exact + 2 * record.target) / math.sqrt(modulus)
            assert record.sensitivity[name] == pytest.approx(sensitivity, rel=1e-12)
            classic = sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / eps
            assert sigma == pytest.approx(classic, rel=1e-12)


def _paper_sigma(setting, problem, record, mu):
    """The paper's printed sigma (Algorithms 1-5, Sec. 4.3) for this phase."""
    lip, m = problem.lipschitz, record.rows[1] - record.rows[0]
    if setting == "sc":
        return {"x": 4 * lip * math.sqrt(2 * math.log(2.5 / DELTA)) / (problem.moduli[0] * m * EPS)}
    if setting == "c":
        return {"x": 4 * lip * math.sqrt(2 * math.log(2.5 / DELTA)) / (record.rho[0] * m * EPS)}
    if setting == "sc-sc":
        mu_min = min(problem.moduli)
        return {
            name: 8 * lip / (m * EPS) * math.sqrt(2 * math.log(5 / DELTA) / (modulus * mu_min))
            for name, modulus in zip("xy", problem.moduli)
        }
    if setting == "c-c":
        mu_k = max(record.rho)
        name = "x" if record.run == 0 else "y"
        return {name: 8 * lip / (m * EPS) * math.sqrt(2 * math.log(5 / DELTA) / (mu_k * mu))}
    mu_k, mu_y = record.rho[0], problem.moduli[1]
    return {"x": 4 * lip / (m * EPS) * math.sqrt(2 * math.log(2.5 / DELTA) / (mu_k * min(mu_k, mu_y)))}


@pytest.mark.parametrize("setting", sorted(PROBLEMS))
def test_paper_calibration_reproduces_the_printed_sigma(setting):
    """With the paper's tolerance (1/2) and delta split, sigma is exactly the paper's closed form, and the
    noise multiplier is the accounting layer's ``Phased.paper_noise``."""
    problem = PROBLEMS[setting]()
    result = _run(setting, problem, gaussian="paper", tolerance=0.5)
    for record in result.phases:
        expected = _paper_sigma(setting, problem, record, PHASED_MU.get(setting))
        assert record.sigma == pytest.approx(expected, rel=1e-12)
    assert result.noise_multipliers == pytest.approx(PhasedPlan(setting).paper_noise(EPS, DELTA), rel=1e-12)


def _analytic_delta(ratio, epsilon):
    """Balle and Wang's exact delta of the Gaussian mechanism with sigma/Delta = ratio, from scipy."""
    a, b = 1 / (2 * ratio), epsilon * ratio
    return norm.cdf(a - b) - math.exp(epsilon) * norm.cdf(-a - b)


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-6, 1e-9])
def test_analytic_ratio_is_balle_wangs_calibration(epsilon, delta):
    ratio = gaussian_ratio(epsilon, delta, "analytic")
    assert _analytic_delta(ratio, epsilon) <= delta
    assert _analytic_delta(ratio * (1 - 1e-6), epsilon) > delta
    if epsilon <= 1:  # the classic mechanism is valid there: it never adds less noise
        assert gaussian_ratio(epsilon, delta, "classic") >= ratio


@pytest.mark.parametrize("setting", ["sc", "c", "sc-sc", "c-c"])
@pytest.mark.parametrize("gaussian", ["analytic", "tight"])
def test_accountant_reports_the_budget(setting, gaussian):
    """One release (any number of phases) spends exactly epsilon; two at half budget each spend less;
    calibrated jointly they spend exactly epsilon. Each stream is recorded once."""
    result = _run(setting, PROBLEMS[setting](), gaussian=gaussian)
    ledger = result.accountant.state_dict()["ledger"]
    assert sorted(entry["streams"].popitem()[0] for entry in ledger) == sorted(PhasedPlan(setting).streams)
    assert all(entry["count"] == 1 for entry in ledger)
    spent = result.spent_epsilon()
    assert spent <= EPS * (1 + 1e-6)  # the PLD accountant's pessimistic discretisation adds ~1e-8
    if gaussian == "tight" or len(ledger) == 1:
        assert spent == pytest.approx(EPS, rel=1e-6)
    else:
        assert spent < 0.9 * EPS
    assert release_ratio(setting, EPS, DELTA, gaussian) == pytest.approx(
        result.noise_multipliers["x"] / 2, rel=1e-12
    )  # dpvr's unit: twice sigma/Delta under replace-one


class _Exact:
    """A bring-your-own solver that returns the exact solution with a zero certificate."""

    def __init__(self, problem):
        self.problem = problem

    def solve(self, phase, start):
        return SolverResult(self.problem.solution(phase.rows, phase.rho, phase.centre), 0.0)


def test_the_added_noise_has_the_calibrated_scale():
    rng = np.random.default_rng(5)
    d, n = 300, 50
    problem = QuadraticSaddle(
        rng.normal(size=(n, d)) / 40,
        rng.normal(size=(n, d)) / 40,
        Q=np.eye(d),
        B=np.zeros((d, d)),
        R=2 * np.eye(d),
    )
    result = _run("sc-sc", problem, solver=_Exact(problem))
    exact = problem.solution()
    for name, released, block in (("x", result.x, exact[:d]), ("y", result.y, exact[d:])):
        noise = released - block
        sigma = result.phases[0].sigma[name]
        assert abs(noise.mean()) < 4 * sigma / math.sqrt(d)
        # the sample std of d = 300 draws has a relative sd of 1/sqrt(2d) = 4 %: 20 % is five of them
        assert noise.std() == pytest.approx(sigma, rel=0.2)
