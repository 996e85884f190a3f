"""Certificates are never violated, phase k reads only its own chunk, and a solver that cannot certify makes
the run fail loudly without releasing anything."""

import math

import numpy as np
import pytest

from dpvr.algorithms.phased.algorithm import PhasedOutputPerturbation
from dpvr.algorithms.phased.problem import CertificateError, PhaseProblem, SolverResult
from dpvr.algorithms.phased.solvers import KatyushaSolver, VRExtragradientSolver
from dpvr.objectives import BilinearSaddle, LogisticRegression, QuadraticSaddle
from dpvr.ops import NoiseGenerator
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.problems import Ball, Box


class Separable:
    """A user-defined problem (the FiniteSumProblem protocol) with constraints active at the solution:
    ``min_{||x|| <= r} max_{y in [-1, 1]^dy} (1/n) sum_i (u_i^T x - v_i^T y) + lx ||x||^2/2 - ly ||y||^2/2``.
    Its regularised solutions are projections, in closed form."""

    smoothness = 0.0

    def __init__(self, u, v, lam_x, lam_y, radius):
        self.u, self.v = u, v
        self.n, self.dim_x = u.shape
        self.dim_y = v.shape[1]
        self.lipschitz = float(np.linalg.norm(np.hstack([u, v]), axis=1).max())
        self.public_smoothness = max(lam_x, lam_y)
        self.moduli = (lam_x, lam_y)
        self.domain_x, self.domain_y = Ball(radius), Box(-1.0, 1.0)

    def sample_operator(self, z, rows):
        return np.hstack([self.u[rows], self.v[rows]])

    def public_operator(self, z):
        return np.concatenate([self.moduli[0] * z[: self.dim_x], self.moduli[1] * z[self.dim_x :]])

    def solution(self, rows=None, rho=(0.0, 0.0), centre=None):
        rows = np.arange(self.n) if rows is None else rows
        c = np.zeros(self.dim_x + self.dim_y) if centre is None else centre
        x = (rho[0] * c[: self.dim_x] - self.u[rows].mean(0)) / (self.moduli[0] + rho[0])
        y = (rho[1] * c[self.dim_x :] - self.v[rows].mean(0)) / (self.moduli[1] + rho[1])
        return np.concatenate([self.domain_x.project(x), self.domain_y.project(y)])


def _separable(n=60, lam_x=0.0, lam_y=0.5, seed=0):
    rng = np.random.default_rng(seed)
    return Separable(rng.normal(size=(n, 3)) + 1.0, rng.normal(size=(n, 4)) + 0.8, lam_x, lam_y, 0.5)


def _distance(phase, z, exact):
    return math.sqrt(
        sum(mu * float((z[b] - exact[b]) @ (z[b] - exact[b])) for b, mu in zip(phase.blocks, phase.moduli))
    )


def _phase(problem, rho, centre, rng, target=1e-8):
    return PhaseProblem(problem, np.arange(problem.n), rho, centre, target, rng)


CASES = {  # name -> (problem, rho): constrained and coupled, minimisation and saddle
    "separable-ball-box": (_separable(lam_x=0.2), (1.5, 0.3)),
    "quadratic-scsc": (QuadraticSaddle.random(40, 3, 2, seed=4), (0.0, 0.0)),
    "bilinear-cc-phase": (BilinearSaddle.random(40, 3, radius=20.0, seed=5), (2.0, 0.1)),
    "logistic": (
        LogisticRegression(
            np.random.default_rng(6).normal(size=(40, 3)), np.random.default_rng(7).random(40) < 0.5, l2=0.1
        ),
        (0.5, 0.0),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_certificate_bounds_the_distance_at_any_point(case):
    """``certify`` at interior and boundary points (projected far-away points) is an upper bound."""
    problem, rho = CASES[case]
    rng = np.random.default_rng(1)
    dim = problem.dim_x + problem.dim_y
    centre = rng.normal(size=dim)
    phase = _phase(problem, rho, centre, rng)
    exact = problem.solution(phase.rows, phase.rho, centre)
    for scale in (1e-6, 1e-2, 1.0, 100.0):
        for _ in range(5):
            z = phase.project(exact + scale * rng.normal(size=dim))
            assert _distance(phase, z, exact) <= phase.certify(z) * (1 + 1e-9) + 1e-12
    assert phase.certify(exact) < 1e-9


@pytest.mark.parametrize("case", sorted(CASES))
def test_built_in_solvers_certify_truthfully(case):
    problem, rho = CASES[case]
    solvers = [VRExtragradientSolver()] + ([] if problem.dim_y else [KatyushaSolver()])
    rng = np.random.default_rng(2)
    for solver in solvers:
        for target in (1e-1, 1e-3, 1e-6):
            centre = rng.normal(size=problem.dim_x + problem.dim_y)
            phase = _phase(problem, rho, centre, rng, target)
            result = solver.solve(phase, centre)
            assert result.radius <= target
            exact = problem.solution(phase.rows, phase.rho, centre)
            assert _distance(phase, result.point, exact) <= result.radius
            assert np.array_equal(phase.project(result.point), result.point)


class Spy:
    """Wraps a problem and checks that every data access stays inside the chunk being solved."""

    def __init__(self, problem):
        self._problem = problem
        self.allowed = None
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
        ):
            setattr(self, name, getattr(problem, name))

    def sample_operator(self, z, rows):
        assert self.allowed is not None and set(rows.tolist()) <= self.allowed
        return self._problem.sample_operator(z, rows)

    def public_operator(self, z):
        return self._problem.public_operator(z)


class Checked:
    """A bring-your-own wrapper around a built-in solver: opens the spy to the phase's chunk only (for the
    solver and the framework's verification, until the next phase), logs the chunks and checks the
    certificate against the exact regularised solution."""

    def __init__(self, spy, problem, inner):
        self.spy, self.problem, self.inner = spy, problem, inner
        self.chunks, self.centres, self.points = [], [], []

    def solve(self, phase, start):
        self.spy.allowed = set(phase.rows.tolist())
        result = self.inner.solve(phase, start)
        exact = self.problem.solution(phase.rows, phase.rho, phase.centre)
        assert _distance(phase, result.point, exact) <= result.radius <= phase.target
        self.chunks.append(phase.rows.tolist())
        self.centres.append(phase.centre.copy())
        self.points.append(result.point)
        return result


SETTINGS = {
    "sc": lambda: LogisticRegression(
        np.random.default_rng(0).normal(size=(90, 3)), np.random.default_rng(1).random(90) < 0.5, l2=0.2
    ),
    "c": lambda: LogisticRegression(
        np.random.default_rng(0).normal(size=(90, 3)), np.random.default_rng(1).random(90) < 0.5
    ),
    "sc-sc": lambda: QuadraticSaddle.random(90, 3, 2, seed=3),
    "c-c": lambda: BilinearSaddle.random(90, 2, radius=50.0, seed=4),
    "c-sc": lambda: _separable(n=90),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_phases_read_only_their_chunk_and_certify_truthfully(setting):
    problem = SETTINGS[setting]()
    spy = Spy(problem)
    inner = VRExtragradientSolver() if problem.dim_y else KatyushaSolver()
    solver = Checked(spy, problem, inner)
    phased = setting in ("c", "c-c", "c-sc")
    algorithm = PhasedOutputPerturbation(
        setting,
        solver=solver,
        **({"mu": 0.5, "phases": 5} if phased else {}),
        privacy=PrivacyConfig(epsilon=1.0, delta=1e-5),
        runtime=RuntimeConfig(generator=NoiseGenerator(0, reproducible=True), sampler_seed=0),
    )
    result = algorithm.run(spy)
    runs = 2 if setting == "c-c" else 1
    assert len(solver.chunks) == runs * (5 if phased else 1)
    for r in range(runs):  # each run's chunks partition the data, in order
        chunks = solver.chunks[r * len(solver.chunks) // runs : (r + 1) * len(solver.chunks) // runs]
        assert sum(chunks, []) == list(range(problem.n))
    if phased:  # phase k > 1 is centred at the previous *released* (noisy, projected) point
        for record, centre in zip(result.phases, solver.centres):
            released = slice(0, problem.dim_x) if record.run == 0 else slice(problem.dim_x, None)
            other = slice(problem.dim_x, None) if record.run == 0 else slice(0, problem.dim_x)
            assert np.any(centre[released] != 0) == (record.phase > 1)
            assert not np.any(centre[other])  # the other block's regulariser stays at the public start
        for previous, centre, record in zip(solver.points, solver.centres[1:], result.phases[1:]):
            if record.phase > 1:  # never the solver's unreleased point itself
                assert not np.allclose(centre, previous)


def _failing(setting="c", **options):
    problem = SETTINGS[setting]()
    generator = NoiseGenerator(0, reproducible=True)
    algorithm = PhasedOutputPerturbation(
        setting,
        **({"mu": 0.5, "phases": 5} if setting == "c" else {}),
        **options,
        privacy=PrivacyConfig(epsilon=1.0, delta=1e-5),
        runtime=RuntimeConfig(generator=generator, sampler_seed=0),
    )
    return problem, algorithm, generator


def test_a_solver_out_of_budget_fails_loudly_and_releases_nothing():
    problem, algorithm, generator = _failing("sc", solver=KatyushaSolver(max_passes=1.0), tolerance=1e-6)
    with pytest.raises(CertificateError, match="above the target"):
        algorithm.run(problem)
    state = algorithm.state_dict()
    assert state["records"] == [] and state["accountant"]["ledger"] == []
    assert generator.state_dict()["streams"] == {}  # no noise was drawn: nothing was released


class _Broken:
    def __init__(self, point=None, radius=0.0, fail_at=None, inner=None):
        self.point, self.radius, self.fail_at, self.inner, self.calls = point, radius, fail_at, inner, 0

    def solve(self, phase, start):
        self.calls += 1
        if self.inner is not None and self.calls != self.fail_at:
            return self.inner.solve(phase, start)
        point = np.zeros(phase.dim) if self.point is None else self.point(phase)
        return SolverResult(point, self.radius)


@pytest.mark.parametrize(
    "solver",
    [
        _Broken(radius=math.nan),
        _Broken(radius=math.inf),
        _Broken(point=lambda phase: np.zeros(phase.dim + 1)),
        _Broken(point=lambda phase: np.full(phase.dim, math.nan)),
    ],
)
def test_a_bad_certificate_or_point_is_refused(solver):
    problem, algorithm, _ = _failing("sc", solver=solver)
    with pytest.raises(CertificateError):
        algorithm.run(problem)


def test_a_lying_certificate_is_caught_by_verification():
    """A solver that claims radius 0 for its (far from optimal) start is refused unless verify=False."""
    liar = _Broken(point=lambda phase: phase.centre + 1.0)
    problem, algorithm, _ = _failing("sc", solver=liar)
    with pytest.raises(CertificateError, match="above the target"):
        algorithm.run(problem)
    problem, trusting, _ = _failing("sc", solver=liar, verify=False)
    assert trusting.run(problem).phases[0].certified == 0.0


def test_a_failure_mid_run_keeps_earlier_phases_accounted():
    """Phases before the failure were released; the accountant recorded the run at its first release."""
    problem, algorithm, _ = _failing(solver=_Broken(radius=1.0, fail_at=3, inner=KatyushaSolver()))
    with pytest.raises(CertificateError, match="phase 3"):
        algorithm.run(problem)
    state = algorithm.state_dict()
    assert [r["phase"] for r in state["records"]] == [1, 2]
    assert len(state["accountant"]["ledger"]) == 1
