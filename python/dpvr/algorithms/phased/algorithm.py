"""Phased output perturbation: "bring your own algorithm" (Zhang, Thekumparampil, Oh and He).

Each setting solves regularised empirical problems with any accurate base solver and releases the solution
plus Gaussian noise calibrated to its sensitivity:

========  =======================================================  ==========================================
setting   phases (chunk, regulariser)                              released (budget of each release)
========  =======================================================  ==========================================
``sc``    Algorithm 1: one, all data, none (the loss is mu-SC)     ``x`` (eps, delta)
``c``     Algorithm 2: K disjoint chunks, ``mu 2^k/2 ||x-x~||^2``  ``x~_K`` (eps, delta)
``sc-sc`` Algorithm 3: one, all data, none                         ``x`` and ``y`` (eps/2, delta/2 each)
``c-c``   Algorithms 4 and 5: two phased runs over all the data;   ``x~_K`` of the primal run and ``y~_K`` of
          primal: ``+mu_k/2||x-x~||^2 - mu/2||y-y0||^2``, dual:    the dual run (eps/2, delta/2 each)
          ``+mu/2||x-x0||^2 - mu_k/2||y-y~||^2``
``c-sc``  Sec. 4.3: K chunks, ``+mu_k/2 ||x - x~||^2`` only        ``x~_K`` (eps, delta)
========  =======================================================  ==========================================

with ``mu_k = mu 2^k``, K = ``floor(log2 n)`` phases by default (the proofs use ``mu_K = mu n``) and the
phase regulariser centred at the previous *noisy* output. All five share one phase loop.

**Privacy guarantee.** The released outputs (the intermediate phase outputs included) are
``(epsilon, delta)``-DP with respect to replace-one neighbouring datasets of public size ``n``, provided

- every per-sample loss ``f(., .; xi)`` is L-Lipschitz jointly in ``(x, y)`` on ``X x Y``
  (``problem.lipschitz``);
- ``(1/n) sum_i f + P`` is ``mu_x``-strongly convex in ``x`` and ``mu_y``-strongly concave in ``y`` for every
  dataset (``problem.moduli``; the phase regulariser adds its own moduli);
- the certificate is valid (with ``verify=True``, the default, dpvr recomputes it from the gradient
  mapping, so this rests on the problem's operators and moduli, not on the solver's code), and the solver's
  randomness comes from ``phase.rng`` only.

The exact solution of a phase with moduli ``(mu_x, mu_y)`` on ``m`` samples moves by
``mu_x ||dx||^2 + mu_y ||dy||^2 <= (2L / (m sqrt(mu)))^2``, ``mu = min(mu_x, mu_y)`` (Lemmas 3.3, 3.5, 4.3,
4.5 of the paper; ``||dx|| <= 2L/(mu m)`` for minimisation). Each phase releases a point ``z`` certified to
lie within weighted distance ``r = tolerance * 2L/(m sqrt(mu))`` of that solution, so by the triangle
inequality block ``b`` has sensitivity ``(1 + 2 tolerance) 2L / (m sqrt(mu mu_b))``, and Gaussian noise
calibrated to it makes the release ``(epsilon', delta')``-DP. Phases of one run read disjoint chunks and
depend on earlier chunks only through released outputs, so by parallel composition (the paper's Lemma A.1)
a run costs one release; the two runs of ``c-c`` (and the ``x``, ``y`` releases of ``sc-sc``) compose.

**Why a certificate.** The paper's base solver has an *in-expectation* accuracy guarantee, converted by
Markov's inequality into "within ``L/(mu n)`` with probability ``1 - delta/4``", and the failure probability
is charged to delta. That requires trusting a convergence theorem's constants for the actual iteration
budget, and an expectation bound is not a sensitivity: one unlucky run with a larger error breaks the
guarantee silently. Here the radius ``r`` is *certified* at the returned point (e.g. from the gradient
mapping: ``||z - z*|| <= ||w||/mu``, see :mod:`.problem`), so ``||z(D) - z(D')|| <= Delta* + 2r`` holds
surely, for every pair of neighbours and every realisation of the solver's randomness; no delta is spent on
failure, and a solver that does not certify ``r`` within its budget raises :class:`CertificateError` and
nothing is released. The failure itself depends on the data: treat it like a crashed job and do not publish
it. The number of gradient evaluations (the stopping time) is not covered by the guarantee either.

Departures from the paper, where it is silent or loose: the target ``tolerance`` defaults to 0.05 (the
paper's 1/2 nearly doubles the noise; any value is private, smaller ones cost a few more solver passes);
with a certificate the whole delta goes to the Gaussian mechanism (``gaussian="paper"`` reproduces the
paper's split and printed sigma, ``gaussian="tight"`` calibrates two releases jointly instead of halving
the budget); noisy outputs are projected onto the domain (post-processing); chunks are
contiguous and of near-equal size; the ``log n`` of the paper's choice of ``mu`` is taken as K.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import dp_accounting as dpa
import numpy as np
from numpy.typing import ArrayLike

from ... import ops
from ...ops import NoiseGenerator, check_nonfinite
from ...optim.binding import bind_run, canonical, digest
from ...optim.config import PrivacyConfig, RuntimeConfig
from ...optim.guard import Guarded, PrivacyGuard, tightest_accountant
from ...privacy import Accountant, account, output_perturbation_multiplier
from ...privacy.mechanism import noise_dict
from ...problems import FiniteSumProblem, check_problem
from .plan import PhasedPlan
from .problem import BaseSolver, CertificateError, PhaseProblem, split_rows
from .solvers import KatyushaSolver, VRExtragradientSolver

SETTINGS = ("sc", "c", "sc-sc", "c-c", "c-sc")
GAUSSIAN = ("analytic", "classic", "paper", "tight")
_STREAMS = ("x", "y")
_FORMAT = "dpvr.algorithms.PhasedOutputPerturbation/3"


@dataclass(frozen=True)
class _Run:
    """One phased (or single-phase) run: which blocks it releases, and its regulariser."""

    released: tuple[int, ...]  # block indices: 0 is x, 1 is y
    phased: bool  # K disjoint chunks with mu 2^k on the released block, centred at its last noisy output
    fixed_other: bool  # c-c: the other block gets mu, centred at its (public) start


_RUNS: dict[str, tuple[_Run, ...]] = {
    "sc": (_Run((0,), False, False),),
    "c": (_Run((0,), True, False),),
    "sc-sc": (_Run((0, 1), False, False),),
    "c-c": (_Run((0,), True, True), _Run((1,), True, True)),
    "c-sc": (_Run((0,), True, False),),
}


def gaussian_ratio(epsilon: float, delta: float, gaussian: str = "analytic") -> float:
    """``sigma / Delta`` of the Gaussian mechanism ``v + N(0, sigma^2 I)`` that is ``(epsilon, delta)``-DP for
    L2 sensitivity ``Delta``.

    ``"classic"``: ``sqrt(2 log(1.25/delta)) / epsilon`` (Dwork and Roth, Theorem A.1, stated for
    ``epsilon < 1``; at ``epsilon = 1`` it still exceeds the exact noise, which the tests check).
    ``"analytic"``: Balle and Wang's (2018) exact calibration, from dp_accounting's ``get_sigma_gaussian``,
    raised by a relative 1e-9 so that its root-finding tolerance never leaves the noise below the exact
    value.
    """
    epsilon, delta = float(epsilon), float(delta)
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if gaussian == "classic":
        if epsilon > 1:
            raise ValueError(
                f"the classic Gaussian mechanism needs epsilon <= 1 per release, got {epsilon}; "
                "use gaussian='analytic'"
            )
        return math.sqrt(2 * math.log(1.25 / delta)) / epsilon
    if gaussian == "analytic":
        return float(dpa.get_sigma_gaussian(epsilon, delta)) * (1 + 1e-9)
    raise ValueError(f"gaussian must be 'classic' or 'analytic' here, got {gaussian!r}")


def release_ratio(setting: str, epsilon: float, delta: float, gaussian: str = "analytic") -> float:
    """``sigma / Delta`` of every release of ``setting`` at total budget ``(epsilon, delta)``.

    ``"classic"`` and ``"analytic"``: the releases (one, or ``x`` and ``y``) share the budget equally, as in
    the paper, each ``(epsilon/r, delta/r)``-DP. ``"paper"`` is the paper's own calibration: the classic
    mechanism at ``delta/2`` per release (``delta/4`` for two), the rest of delta being the failure
    probability its in-expectation solvers need; dpvr's certified solvers do not fail silently, so the other
    options spend the whole delta. ``"tight"`` calibrates the releases jointly: ``r`` full-data Gaussian
    releases with the same ``sigma/Delta`` compose to exactly one Gaussian with ``sigma/(Delta sqrt r)``, so
    the ratio is ``sqrt(r)`` times the analytic one at ``(epsilon, delta)`` and the run spends exactly
    ``epsilon`` (the same as ``"analytic"`` for one release).
    """
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
    if gaussian not in GAUSSIAN:
        raise ValueError(f"gaussian must be one of {GAUSSIAN}, got {gaussian!r}")
    releases = len(PhasedPlan(setting).streams)
    if gaussian == "paper":
        return gaussian_ratio(epsilon / releases, delta / (2 * releases), "classic")
    if gaussian == "tight":
        return math.sqrt(releases) * gaussian_ratio(epsilon, delta, "analytic")
    return gaussian_ratio(epsilon / releases, delta / releases, gaussian)


def paper_mu(
    setting: str,
    *,
    lipschitz: float,
    radius: float,
    n: int,
    dim: int,
    epsilon: float,
    delta: float,
    phases: int,
) -> float:
    """The paper's base regulariser ``mu`` for the phased settings (``log n`` taken as ``phases``).

    ``c`` (Theorem 3.7): ``(L/D) max(1/sqrt n, 14 K sqrt(d log(2.5/delta)) / (n eps))``; ``c-c`` (Theorem
    4.8): ``(L/D) max(2/sqrt n, 13 K sqrt(d log(5/delta)) / (n eps))`` with ``d = max(d_x, d_y)``; ``c-sc``
    (Corollary 4.9): ``3 (L/D) max(1/sqrt n, 4 K sqrt(d_x log(2.5/delta)) / (n eps))``. ``D`` (``radius``)
    bounds the norm of a solution (``c``) or of every point of the domain (``c-c``, ``c-sc``).
    """
    for name, value in (("lipschitz", lipschitz), ("radius", radius), ("epsilon", epsilon)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    scale, root = lipschitz / radius, 1 / math.sqrt(n)
    if setting == "c":
        return scale * max(root, 14 * phases * math.sqrt(dim * math.log(2.5 / delta)) / (n * epsilon))
    if setting == "c-c":
        return scale * max(2 * root, 13 * phases * math.sqrt(dim * math.log(5 / delta)) / (n * epsilon))
    if setting == "c-sc":
        return 3 * scale * max(root, 4 * phases * math.sqrt(dim * math.log(2.5 / delta)) / (n * epsilon))
    raise ValueError(f"setting must be one of ('c', 'c-c', 'c-sc') for paper_mu, got {setting!r}")


@dataclass
class PhaseRecord:
    """What one phase did: its chunk ``rows = [start, stop)``, regulariser, certificate and noise."""

    run: int
    phase: int
    rows: tuple[int, int]
    rho: tuple[float, float]
    moduli: tuple[float, float]
    target: float
    certified: float
    sensitivity: dict[str, float]
    sigma: dict[str, float]
    grad_evals: int


@dataclass
class PhasedResult:
    """The released point(s), what each phase did, and the accountant that recorded the releases.

    ``x`` is ``None`` only when nothing releases it (never, for the five settings); ``y`` is released by
    ``sc-sc`` and ``c-c``. ``noise_multipliers`` are dpvr's (noise std over the add/remove unit, see
    :func:`dpvr.privacy.events.output_perturbation_multiplier`), one per stream.
    """

    setting: str
    epsilon: float
    delta: float
    x: np.ndarray | None
    y: np.ndarray | None
    accountant: Accountant
    noise_multipliers: dict[str, float]
    phases: list[PhaseRecord] = field(default_factory=list)

    @property
    def grad_evals(self) -> int:
        """Per-sample gradient evaluations over all phases (not covered by the privacy guarantee)."""
        return sum(p.grad_evals for p in self.phases)

    def spent_epsilon(self, delta: float | None = None) -> float:
        """What the accountant reports for the releases at ``delta`` (default: the target delta)."""
        return self.accountant.epsilon(self.delta if delta is None else delta)


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_arguments(setting: str, privacy: PrivacyConfig, runtime: RuntimeConfig,
                     accountant: Accountant | None, **phased_only: Any) -> None:
    """Refuses settings of :class:`PhasedOutputPerturbation` it cannot run or account."""
    if privacy.epsilon is None:
        raise ValueError("privacy: the phased framework needs the budget PrivacyConfig(epsilon=...)")
    if privacy.neighbouring not in (None, "replace-one"):
        raise ValueError(
            f"privacy: neighbouring={privacy.neighbouring!r}: the phased framework is accounted under "
            "neighbouring='replace-one' only (its sensitivities are replace-one stability bounds that "
            "shrink with the dataset size, which add/remove adjacency makes private)"
        )
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
    for name, value in phased_only.items():
        if value is not None and not _RUNS[setting][0].phased:
            raise ValueError(
                f"{name} is used only by the phased settings ('c', 'c-c', 'c-sc'), not by {setting!r}"
            )
    phases = phased_only.get("phases")
    if phases is not None and (isinstance(phases, bool) or int(phases) != phases or phases < 1):
        raise ValueError(f"phases must be an integer >= 1, got {phases!r}")
    if accountant is not None and accountant.neighbouring != "replace-one":
        raise ValueError(
            "accountant must use neighbouring='replace-one' (the phased sensitivities are "
            f"replace-one stability bounds), got {accountant.neighbouring!r}"
        )
    generator, seed = runtime.generator, runtime.sampler_seed
    if generator is not None and not isinstance(generator, NoiseGenerator):
        raise ValueError(f"generator must be a dpvr NoiseGenerator, got {type(generator).__name__}")
    if seed is not None and (isinstance(seed, bool) or int(seed) != seed or seed < 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


class PhasedOutputPerturbation(Guarded):
    """The phased output-perturbation framework for one ``setting`` (see the module documentation).

    Args:
        setting: ``"sc"``, ``"c"``, ``"sc-sc"``, ``"c-c"`` or ``"c-sc"``.
        privacy: :class:`~dpvr.optim.PrivacyConfig` with the total budget ``epsilon`` (required) and
            ``delta``; the releases are always recorded by PLD (exact for Gaussian releases). Replace-one
            only: ``neighbouring="add-remove"`` is refused (the sensitivities are replace-one stability
            bounds that shrink with ``n``, which add/remove makes private).
        solver: the base solver (:class:`BaseSolver`); default :class:`KatyushaSolver` for minimisation,
            :class:`VRExtragradientSolver` for saddle problems.
        mu: base regulariser of the phased settings; default :func:`paper_mu` from ``radius``.
        radius: the ``D`` of :func:`paper_mu` (needed when ``mu`` is not given).
        phases: K for the phased settings; default ``floor(log2 n)``.
        tolerance: the certified radius each phase must reach, as a fraction of the exact solution's
            (weighted) sensitivity; the released sensitivity is ``1 + 2 tolerance`` times the exact one.
        gaussian: ``"analytic"`` (default), ``"classic"``, ``"paper"`` or ``"tight"`` (see
            :func:`release_ratio`).
        accountant: a replace-one :class:`~dpvr.privacy.accountant.Accountant` to record into; default a new
            one of kind ``privacy.accountant``, or the tightest that prices the plan (PLD: exact for Gaussian
            releases).
        x0, y0: public starting points and regulariser centres (default 0).
        verify: recompute the certificate at the returned point (:meth:`PhaseProblem.certify`, one pass
            over the chunk) and require it too to meet the target, so that privacy does not rest on the
            solver's own certificate code. The built-in solvers' certificate is that same computation.
        noise: the noise multiplier of each released stream (``{"x": z}``, ``{"x": z_x, "y": z_y}``, or one
            number), in the accountant's convention: noise std ``z Delta / 2`` on a release of replace-one
            sensitivity ``Delta``. Default: calibrated from ``(epsilon, delta)`` by ``gaussian``. Noise that
            would spend more than ``epsilon`` is refused.
        runtime: :class:`~dpvr.optim.RuntimeConfig`: ``generator`` (the noise source; default OS entropy),
            ``sampler_seed`` (seeds the solver's per-phase randomness, which needs independence from the
            data, not secrecy) and ``nonfinite``: ``"zero"`` (default: a record whose per-sample operator is
            not finite contributes a zero operator, the record's loss taken as a constant, which is
            0-Lipschitz and convex, so the stability bound holds as long as the declared moduli hold with
            that record's loss constant) or ``"raise"`` (:class:`dpvr.ops.NonFiniteError`, which reveals
            such a record exists).

    Resuming is bound to the run: :meth:`load_state_dict` refuses a state written with other settings
    (every argument above but ``solver``, ``accountant`` and ``generator``: the released point's
    sensitivity rests on the certificate, not on which solver reached it, so a run whose solver failed may
    resume with another), and :meth:`run` refuses a problem other than
    the one the state was written for. Every phase release is written into the run's ledger
    (:class:`~dpvr.optim.ledger.RunLedger`) before it is made, so loading an older state of the same run
    charges what the run released after it: by parallel composition, the releases of one stream made after
    that state in one branch cost one release (their phases read disjoint chunks). The re-run then is a new
    branch whose own releases are charged once more, and refused (:class:`~dpvr.optim.BudgetExhaustedError`)
    if that exceeds ``epsilon``. Noise keys are derived from the settings, the release's ledger entry and the
    point each release perturbs, so no two releases share a noise draw.
    """

    def __init__(
        self,
        setting: str,
        *,
        privacy: PrivacyConfig,
        solver: BaseSolver | None = None,
        mu: float | None = None,
        radius: float | None = None,
        phases: int | None = None,
        tolerance: float = 0.05,
        gaussian: str = "analytic",
        accountant: Accountant | None = None,
        x0: ArrayLike | None = None,
        y0: ArrayLike | None = None,
        verify: bool = True,
        noise: Mapping[str, float] | float | None = None,
        runtime: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        _check_arguments(setting, privacy, runtime, accountant, mu=mu, radius=radius, phases=phases)
        epsilon, delta = privacy.epsilon, privacy.delta
        generator, seed, nonfinite = runtime.generator, runtime.sampler_seed, runtime.nonfinite
        self.setting = setting
        self.epsilon = _positive("epsilon", epsilon)
        self.delta = float(delta)
        self.tolerance = _positive("tolerance", tolerance)
        ratio = release_ratio(setting, epsilon, delta, gaussian)  # validates delta and gaussian
        self._plan = PhasedPlan(setting)
        kind = privacy.accountant or tightest_accountant(self._plan)
        self.ratios = (dict.fromkeys(self._plan.streams, ratio) if noise is None
                       else self._given_ratios(noise, kind))
        self.nonfinite = check_nonfinite(nonfinite)
        self.gaussian = gaussian
        self.solver = solver
        self.mu, self.radius, self.phases = _positive("mu", mu), _positive("radius", radius), phases
        # The privacy side of the run: each stream's phases read disjoint chunks, so one segment's releases
        # of a stream are charged once (parallel composition).
        self.guard = PrivacyGuard(
            accountant if accountant is not None else Accountant(kind, "replace-one"),
            generator if generator is not None else NoiseGenerator(),
            epsilon=self.epsilon,
            delta=self.delta,
            parallel=True,
        )
        self.seed = int(seed) if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        self._x0, self._y0 = x0, y0
        self.verify = bool(verify)
        self._records: list[PhaseRecord] = []
        self._points: dict[int, list[list[float]]] = {}  # run -> its current (x, y) after the last phase
        self._noise: dict[str, float] = {}
        self._problem_fingerprint: str | None = None  # of the problem a loaded state was written for
        self._binding = {
            k: canonical(v)
            for k, v in dict(
                setting=setting, epsilon=epsilon, delta=delta, mu=mu, radius=radius,
                phases=phases, tolerance=tolerance, gaussian=gaussian, x0=x0, y0=y0, verify=verify,
                ratios=self.ratios, nonfinite=nonfinite,
            ).items()
        }  # fmt: skip
        self.guard.ledger = bind_run(self.generator, self._binding)

    def _given_ratios(self, noise: Mapping[str, float] | float, kind: str) -> dict[str, float]:
        """Each stream's sigma / Delta from given noise multipliers, refused past the budget."""
        multipliers = noise_dict(self._plan.streams, noise)
        spent = account(self._plan(multipliers), self.delta, accountant=kind).epsilon
        if spent > self.epsilon * (1 + 1e-9):
            raise ValueError(f"noise: {multipliers} spends epsilon={spent:.4g} > the budget {self.epsilon:g}")
        return {name: z / 2 for name, z in multipliers.items()}  # sigma/Delta, in replace-one units

    # -- the phase loop ----------------------------------------------------------------------------------

    def run(self, problem: FiniteSumProblem) -> PhasedResult:
        """Run (or resume, after :meth:`load_state_dict`) every phase and return the released point(s).

        Completed phases are never run again: calling ``run`` twice returns the same release and spends
        nothing more. Raises :class:`CertificateError` if a phase's solver does not certify its target;
        nothing of that phase is released.
        """
        check_problem(problem)
        self._check_setting(problem)
        fingerprint = json.dumps(canonical(problem), sort_keys=True)
        if self._problem_fingerprint not in (None, fingerprint):
            raise ValueError(
                "problem: the loaded state was written for another problem (other data or constants); "
                "resuming on this one could release what that run released under other conditions"
            )
        self._problem_fingerprint = fingerprint
        n, dims = int(problem.n), (int(problem.dim_x), int(problem.dim_y))
        start = [
            self._start(problem.domain_x, self._x0, dims[0], "x0"),
            self._start(problem.domain_y, self._y0, dims[1], "y0"),
        ]
        phases = self._phase_count(n)
        mu = self._base_mu(problem, phases)
        solver = (
            self.solver
            if self.solver is not None
            else (VRExtragradientSolver() if dims[1] else KatyushaSolver())
        )
        released: dict[int, np.ndarray] = {}
        for index, spec in enumerate(_RUNS[self.setting]):
            points = [np.asarray(p, dtype=np.float64) for p in self._points.get(index, start)]
            done = sum(r.run == index for r in self._records)
            chunks = split_rows(n, phases) if spec.phased else [np.arange(n)]
            for k, rows in enumerate(chunks, 1):
                if k > done:
                    points = self._phase(problem, solver, index, spec, k, rows, points, mu)
            released.update({b: points[b] for b in spec.released})
        return PhasedResult(
            self.setting,
            self.epsilon,
            self.delta,
            released.get(0),
            released.get(1),
            self.accountant,
            dict(self._noise),
            list(self._records),
        )

    def _phase(
        self,
        problem: FiniteSumProblem,
        solver: BaseSolver,
        index: int,
        spec: _Run,
        k: int,
        rows: np.ndarray,
        points: list[np.ndarray],
        mu: float | None,
    ) -> list[np.ndarray]:
        """Solve phase ``k`` of run ``index``, certify, release; return the run's new (x, y)."""
        rho = [0.0, 0.0]
        if spec.phased:
            for b in range(2):
                rho[b] = mu * 2.0**k if b in spec.released else (mu if spec.fixed_other else 0.0)
        # The centre (and the solver's start) is public: released outputs and the public start only. The
        # phase's unreleased solution (e.g. y_k of the primal c-c run) must not seed the next phase.
        centre = np.concatenate(points)
        moduli = [problem.moduli[b] + rho[b] for b in range(2 if problem.dim_y else 1)]
        exact = 2 * problem.lipschitz / (rows.size * math.sqrt(min(moduli)))
        phase = PhaseProblem(
            problem,
            rows,
            (rho[0], rho[1]),
            centre,
            self.tolerance * exact,
            np.random.default_rng([self.seed, index, k]),
            nonfinite=self.nonfinite,
        )
        point, radius = self._certified(phase, solver.solve(phase, centre.copy()), f"run {index}, phase {k}")
        points = list(points)
        sensitivity, sigma = {}, {}
        for b in spec.released:
            name, block = _STREAMS[b], phase.blocks[b]
            sensitivity[name] = (1 + 2 * self.tolerance) * exact / math.sqrt(phase.moduli[b])
            sigma[name] = self.ratios[name] * sensitivity[name]
            multiplier = output_perturbation_multiplier(sigma[name], sensitivity[name])
            self._admit(name, multiplier)
            # noisy <- point + N(0, sigma^2): the key binds the point, never the solver's own array
            noisy = np.empty_like(point[block])
            ops.noisy_update(
                noisy, sum=np.ascontiguousarray(point[block]), sigma=sigma[name], reset=True,
                generator=self.generator, stream=f"phased/{name}",
            )  # fmt: skip
            points[b] = (problem.domain_x, problem.domain_y)[b].project(noisy)
        self._records.append(
            PhaseRecord(
                index,
                k,
                (int(rows[0]), int(rows[-1]) + 1),
                (rho[0], rho[1]),
                (phase.moduli[0], phase.moduli[1]),
                phase.target,
                radius,
                sensitivity,
                sigma,
                phase.grad_evals,
            )
        )
        self._points[index] = [p.tolist() for p in points]
        return points

    def _certified(self, phase: PhaseProblem, result: Any, where: str) -> tuple[np.ndarray, float]:
        """The solver's point, projected onto the domain, and its certified radius; a
        :class:`CertificateError` (nothing released) unless the radius is within the phase's target."""
        point = np.asarray(result.point, dtype=np.float64)
        radius = float(result.radius)
        if point.shape != (phase.dim,) or not np.all(np.isfinite(point)):
            raise CertificateError(
                f"{where}: the solver returned a point of shape {point.shape} (finite: "
                f"{bool(np.all(np.isfinite(point)))}); expected a finite point of shape ({phase.dim},)"
            )
        # Projecting onto X x Y never moves a point away from the (feasible) solution, so the solver's
        # certificate still holds, and the recomputed one needs a feasible point.
        point = phase.project(point)
        if self.verify and radius <= phase.target:
            radius = max(radius, phase.certify(point))
        if not radius <= phase.target:
            raise CertificateError(
                f"{where}: the solver certified a radius of {radius:.3g}, above the target "
                f"{phase.target:.3g}, after {phase.grad_evals} gradient evaluations; nothing was released "
                "(raise the solver's budget, or the tolerance)"
            )
        return point, radius

    def _admit(self, name: str, multiplier: float) -> None:
        """Admits a phase's release of ``name``: written into the run's ledger, then charged once per branch
        (its phases read disjoint chunks: parallel composition; every release has the same ``sigma /
        Delta``, hence the same multiplier); a charge beyond the budget is refused before the release."""
        noise = dict.fromkeys(self._plan.streams, multiplier)
        attribution, event = self._plan.step(name, noise)
        first = self.guard.admit_parallel(
            name,
            attribution,
            event,
            lambda spent: (
                f"phased: re-running the '{name}' release after a resume would exceed the budget "
                f"epsilon={self.epsilon:g} (the run's releases after the loaded state are charged); nothing "
                "was released"
            ),
        )
        if not first:
            return
        for text in self._plan.mechanism(noise).assumptions:
            self.accountant.assume(text)
        self.accountant.assume(
            "every per-sample loss is L-Lipschitz on the domain, the empirical objective "
            "has the declared strong convexity/concavity moduli, and the base solver's "
            "randomness is independent of the data"
        )
        self._noise[name] = multiplier

    # -- inputs ------------------------------------------------------------------------------------------

    def _check_setting(self, problem: FiniteSumProblem) -> None:
        saddle = self.setting in ("sc-sc", "c-c", "c-sc")
        if saddle != bool(problem.dim_y):
            kind = "a saddle problem (dim_y > 0)" if saddle else "a minimisation problem (dim_y == 0)"
            raise ValueError(f"problem: setting {self.setting!r} needs {kind}")
        mu_x, mu_y = problem.moduli
        needs = {"sc": mu_x > 0, "sc-sc": mu_x > 0 and mu_y > 0, "c-sc": mu_y > 0}
        if not needs.get(self.setting, True):
            raise ValueError(
                f"problem: setting {self.setting!r} needs positive moduli "
                f"(strong convexity/concavity), got {problem.moduli}"
            )

    def _phase_count(self, n: int) -> int:
        if not _RUNS[self.setting][0].phased:
            return 1
        phases = self.phases if self.phases is not None else max(1, int(math.floor(math.log2(n))))
        if phases > n:
            raise ValueError(f"phases ({phases}) exceeds the number of samples ({n})")
        return phases

    def _base_mu(self, problem: FiniteSumProblem, phases: int) -> float | None:
        if not _RUNS[self.setting][0].phased or self.mu is not None:
            return self.mu
        if self.radius is None:
            raise ValueError(
                f"mu: setting {self.setting!r} needs mu, or radius (a norm bound D) to set it as in the paper"
            )
        dim = problem.dim_x if self.setting != "c-c" else max(problem.dim_x, problem.dim_y)
        return paper_mu(
            self.setting,
            lipschitz=problem.lipschitz,
            radius=self.radius,
            n=problem.n,
            dim=dim,
            epsilon=self.epsilon,
            delta=self.delta,
            phases=phases,
        )

    @staticmethod
    def _start(domain: Any, value: ArrayLike | None, dim: int, name: str) -> np.ndarray:
        if value is None:
            return np.zeros(dim)
        value = np.asarray(value, dtype=np.float64)
        if value.shape != (dim,) or not np.all(np.isfinite(value)):
            raise ValueError(f"{name} must be a finite vector of shape ({dim},), got shape {value.shape}")
        return domain.project(value) if dim else value

    # -- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run so far: completed phases, the current released points, the accountant, the noise
        generator and the solver seed. It holds the noise seed: protect it like the data."""
        return {
            "format": _FORMAT,
            "setting": self.setting,
            "binding": self._binding,
            "problem": self._problem_fingerprint,
            "seed": self.seed,
            "records": [asdict(r) for r in self._records],
            "points": {str(k): v for k, v in self._points.items()},
            "noise_multipliers": dict(self._noise),
            "generator": self.generator.state_dict(),
            **self.guard.state(),  # accountant, ledger, charged
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: :meth:`run` then continues with the next phase. The run's releases
        made after the state (this object's, in any branch) are charged, and what follows is a new branch."""
        if state.get("format") != _FORMAT:
            raise ValueError(f"state is not a {_FORMAT} state dict (format={state.get('format')!r})")
        if state["setting"] != self.setting:
            raise ValueError(f"state is for setting {state['setting']!r}, this run is {self.setting!r}")
        differ = sorted(k for k in self._binding if state["binding"].get(k) != self._binding[k])
        if differ:
            raise ValueError(
                f"state: written by a run with other settings ({', '.join(differ)}); resuming it here could "
                "release what that run already released under other conditions"
            )
        ledger = self.guard.ledger_of(state["ledger"])
        after = ledger.releases_after(ledger.seq)
        self._problem_fingerprint = state["problem"]
        self.seed = int(state["seed"])
        self._records = [
            PhaseRecord(
                **{**r, "rows": tuple(r["rows"]), "rho": tuple(r["rho"]), "moduli": tuple(r["moduli"])}
            )
            for r in state["records"]
        ]
        self._points = {int(k): v for k, v in state["points"].items()}
        self._noise = dict(state["noise_multipliers"])
        self.accountant.load_state_dict(state["accountant"])
        self.generator.load_state_dict(state["generator"])
        self.generator.bind(digest(self._binding))
        rerun = bool(after)  # ledger_of found every release after the state (or refused it)
        charged = PrivacyGuard.parse_counts(state, parallel=True)
        self.guard.install(self.accountant, self.generator, ledger, charged)
        # one charge per branch and stream: parallel composition over its phases
        self.guard.resume(ledger, after, rerun=rerun, seed=None)


__all__ = [
    "GAUSSIAN",
    "SETTINGS",
    "PhaseRecord",
    "PhasedOutputPerturbation",
    "PhasedResult",
    "gaussian_ratio",
    "paper_mu",
    "release_ratio",
]
