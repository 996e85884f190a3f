"""Exact regularised solutions of neighbouring datasets move by at most the paper's stability bounds.

Minimisation (Lemmas 3.3/3.5): ``||x*(D) - x*(D')|| <= 2L/(mu n)``. Saddle problems (Lemmas 4.3/4.5):
``mu_x ||dx||^2 + mu_y ||dy||^2 <= 4 L^2 / (mu n^2)``, ``mu = min(mu_x, mu_y)``. The problems are solved
exactly (damped Newton to machine precision, or the closed form of a linear operator), with and without the
phase regularisers, and the neighbour replaces one record by an adversarial one (norm L, opposite direction)
or a random one.
"""

import numpy as np
import pytest

from dpvr.objectives import BilinearSaddle, LogisticRegression, QuadraticSaddle

SLACK = 1 + 1e-9  # the exact solutions carry rounding errors of order 1e-15


def _replace(array, i, row):
    out = array.copy()
    out[i] = row
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rho", [0.0, 0.7])
def test_logistic_minimiser_moves_at_most_2L_over_mu_n(seed, rho):
    rng = np.random.default_rng(seed)
    n, d, l2 = 24, 3, 0.2
    a = rng.normal(size=(n, d))
    b = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    centre = rng.normal(size=d)
    problem = LogisticRegression(a, b, l2=l2)
    x = problem.solution(rho=(rho, 0.0), centre=centre)
    bound = 2 * problem.lipschitz / ((l2 + rho) * n)
    worst = 0.0
    for i in range(0, n, 5):
        for a_i, b_i in ((a[i], -b[i]), (-a[i], b[i]), (rng.normal(size=d), 1.0)):
            neighbour = LogisticRegression(_replace(a, i, a_i), _replace(b, i, b_i), l2=l2)
            moved = np.linalg.norm(neighbour.solution(rho=(rho, 0.0), centre=centre) - x)
            worst = max(worst, moved / bound)
    assert worst <= SLACK
    assert worst > 0.01  # the bound is not vacuous here


def _linear_data_neighbours(u, v, rng):
    """Neighbours of a linear-data saddle problem: record 0 replaced by its opposite at full norm, and by a
    random record."""
    row = np.concatenate([u[0], v[0]])
    opposite = -row / np.linalg.norm(row)
    other = rng.normal(size=row.size)
    for new in (opposite, other / np.linalg.norm(other)):
        yield _replace(u, 0, new[: u.shape[1]]), _replace(v, 0, new[u.shape[1]:])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rho", [(0.0, 0.0), (3.0, 0.2)])
def test_scsc_saddle_point_moves_at_most_the_lemma_bound(seed, rho):
    rng = np.random.default_rng(seed)
    base = QuadraticSaddle.random(30, 3, 2, seed=seed)
    u, v = base.u, base.v
    centre = rng.normal(size=5)
    mu_x, mu_y = base.moduli[0] + rho[0], base.moduli[1] + rho[1]
    z = base.solution(rho=rho, centre=centre)
    bound = 4 * base.lipschitz**2 / (min(mu_x, mu_y) * base.n**2)
    for nu, nv in _linear_data_neighbours(u, v, rng):
        neighbour = QuadraticSaddle(nu, nv, Q=base.q, B=base.b, R=base.r)
        dz = neighbour.solution(rho=rho, centre=centre) - z
        moved = mu_x * dz[:3] @ dz[:3] + mu_y * dz[3:] @ dz[3:]
        assert moved <= bound * SLACK


@pytest.mark.parametrize("seed", range(4))
def test_cc_phase_problem_moves_at_most_the_lemma_bound(seed):
    """A C-C problem made SC-SC only by the phase regularisers of Algorithm 4 (mu_k on x, mu on y)."""
    rng = np.random.default_rng(seed)
    base = BilinearSaddle.random(40, 3, radius=50.0, seed=seed)
    u, v = base.u, base.v
    mu, mu_k = 0.3, 0.3 * 2**3
    centre = np.concatenate([rng.normal(size=3), np.zeros(3)])
    z = base.solution(rho=(mu_k, mu), centre=centre)
    bound = 4 * base.lipschitz**2 / (mu * base.n**2)
    for nu, nv in _linear_data_neighbours(u, v, rng):
        neighbour = BilinearSaddle(nu, nv, B=base.b, radius_x=50.0, radius_y=50.0)
        dz = neighbour.solution(rho=(mu_k, mu), centre=centre) - z
        assert mu_k * dz[:3] @ dz[:3] + mu * dz[3:] @ dz[3:] <= bound * SLACK
