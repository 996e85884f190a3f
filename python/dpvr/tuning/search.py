"""Private hyper-parameter search by random stopping (Papernot and Steinke, ICLR 2022).

:func:`tune` runs a random number ``K`` of full private trials, each on a candidate drawn from a grid or a
sampler, and releases only the best. The whole search is one dp_accounting ``RepeatAndSelectDpEvent`` of
the per-trial event, whose noise is calibrated so that the *search* meets the target ``(epsilon, delta)``.
The trials must be independent runs (:mod:`dpvr.tuning.independence` checks it before each one runs), and
``K`` must stay secret, which its running time does not keep unless ``constant_time=True``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, Union

import dp_accounting as dpa
import numpy as np
from dp_accounting import dp_event

from ..optim import DivergedError, PrivacyConfig, PrivateAlgorithm
from ..privacy import Accountant, calibrate, event_from_dict
from ..privacy.backends import RDP
from ..privacy.events import Plan, output_perturbation_multiplier
from .independence import Independence
from .randomness import SearchRandomness
from .trials import TrialCount

C = TypeVar("C")
# A build returns a PrivateAlgorithm, or a front-door trainer (dpvr.make_private's PrivateTrainer, which this
# layer does not import: anything whose .algorithm is a PrivateAlgorithm and that has run() and close()).
Build = Callable[[C, PrivacyConfig], Any]
Candidates = Union[Sequence[C], Callable[[np.random.Generator], C]]

_SEARCH_STREAM = "search"


@dataclass(frozen=True)
class Trial(Generic[C]):
    """One trial: its candidate and its score (noisy when the score reads private data)."""

    candidate: C
    score: float


@dataclass
class TuningResult(Generic[C]):
    """What :func:`tune` found and what the search spent.

    Released by the guarantee: ``best``, ``algorithm`` (the best trial's run; its own accountant holds that
    trial alone; ``trainer``: the same run as the build returned it, when that was a ``make_private``
    trainer, else ``None``), ``score`` and the accounting (``per_trial_epsilon``, ``epsilon``, ``delta``, the
    distribution). ``None`` for the first three when a Poisson search drew no trial.

    Not covered, and not in :meth:`to_dict` unless asked: ``trials`` (every candidate and score) and
    ``trials_drawn`` (``K``). The theorem bounds the output of the best trial only; publishing ``K`` or the
    other trials' scores turns the search back into a composition of ``K`` runs. Keep them with the data.
    ``max_trials`` is the public cap of a ``constant_time`` search (``None`` otherwise).
    """

    best: C | None
    algorithm: PrivateAlgorithm | None
    score: float | None
    trials: tuple[Trial[C], ...]
    trials_drawn: int
    per_trial_epsilon: float
    epsilon: float
    delta: float
    count: TrialCount
    noise: dict[str, float]
    event: dpa.DpEvent
    accountant: Accountant = field(repr=False)
    max_trials: int | None = None
    trainer: Any = None

    def to_dict(self, *, diagnostics: bool = False) -> dict[str, Any]:
        """The publishable summary; ``diagnostics=True`` adds ``trials_drawn`` and ``trials`` (see above)."""
        out: dict[str, Any] = {
            "best": self.best,
            "score": self.score,
            "per_trial_epsilon": self.per_trial_epsilon,
            "spent_epsilon": self.epsilon,
            "delta": self.delta,
            "trials_distribution": self.count.distribution,
            "trials_mean": self.count.mean,
            "trials_shape": self.count.shape,
            "noise": dict(self.noise),
            "hyperparameter_tuning_accounted": True,
        }
        if self.max_trials is not None:
            out["max_trials"] = self.max_trials
        if diagnostics:
            out["trials_drawn"] = self.trials_drawn
            out["trials"] = [{"candidate": t.candidate, "score": t.score} for t in self.trials]
        return out


@dataclass(frozen=True)
class _Trial:
    """What one trial releases, in dpvr's noise convention: the run's plan and noise, the score's noise."""

    plan: Plan
    neighbouring: str
    noise: dict[str, float]
    score_multiplier: float | None
    failure_probability: float

    @property
    def event(self) -> dpa.DpEvent:
        run = self.plan.mechanism(self.noise).event
        if self.score_multiplier is None:
            return run
        return dpa.ComposedDpEvent([run, dpa.GaussianDpEvent(self.score_multiplier)])


def search_event(trial_event: dpa.DpEvent, count: TrialCount) -> dp_event.RepeatAndSelectDpEvent:
    """The whole search: ``count.mean`` expected repetitions of ``trial_event``, the best one released."""
    return dp_event.RepeatAndSelectDpEvent(trial_event, count.mean, count.shape)


def epsilon_of(event: dpa.DpEvent, delta: float, neighbouring: str) -> float:
    """epsilon at ``delta`` of ``event`` (dpvr's convention) by dp_accounting's RDP accountant."""
    accountant = RDP.make(neighbouring)
    accountant.compose(RDP.rewrite(event, neighbouring))
    return float(accountant.get_epsilon(delta))


def tune(
    build: Build[C],
    candidates: Candidates[C],
    *,
    epsilon: float,
    delta: float,
    score: Callable[[Any], float],
    trials_mean: float,
    distribution: str = "negative-binomial",
    shape: float | None = None,
    maximize: bool = True,
    train: Callable[[Any], None] | None = None,
    score_sensitivity: float | None = None,
    score_noise: float | None = None,
    privacy: PrivacyConfig | None = None,
    seed: int | None = None,
    reproducible: bool = False,
    constant_time: bool = False,
    max_trials: int | None = None,
) -> TuningResult[C]:
    """Private search: the best of a random number of private runs, ``(epsilon, delta)``-DP as a whole.

    - ``build(candidate, privacy)`` constructs (does not run) the algorithm of one trial, passing ``privacy``
      on as its ``privacy=``: the tuner sets its per-trial budget there, and the algorithm calibrates its
      noise to it. It may return a :mod:`dpvr.optim` algorithm or a :func:`dpvr.make_private` trainer
      (``make_private(..., privacy=privacy)``); ``train`` and ``score`` then receive the trainer. Every
      candidate must give the same plan (what a run releases): tune learning rates, clip radii, momenta;
      not the number of steps or the sampling, whose runs are different mechanisms.
      Every call must build a *fresh* run: its own model (e.g. ``copy.deepcopy`` of a template), optimizer,
      noise generator and seeds. A trial that shares a parameter, buffer, optimizer (or optimizer state),
      algorithm state, noise generator or seed with an earlier trial chains the trials, which the theorem
      does not cover (the released trial would carry the others' runs): it is refused with a ``ValueError``
      before it runs (:class:`~dpvr.tuning.independence.Independence`). The plan probes below, plus a second
      build of the first candidate, are checked the same way before any trial runs, which catches a build
      that closes over one model or caches one per candidate without touching the data. Nothing can check
      values a build *copies* from an earlier trial (warm starts): don't.
    - ``candidates``: a non-empty grid, drawn from uniformly, or ``sampler(rng) -> candidate``. Either way the
      draw is independent of the data, and secret: ``rng`` is the search's candidate stream (see ``seed``).
    - ``score(run)`` rates a finished trial, ``run`` being what ``build`` returned (``maximize`` says which
      way). A run that diverges (:class:`~dpvr.optim.DivergedError`, or a non-finite score) scores worst:
      divergence is a property of the released iterates, and aborting the search on it would leak it.
    - ``train(run)`` runs a trial (default ``run.run()``): a loop that records curves or stops early on
      released iterates. What it released is checked against the plan afterwards. Each trial is then
      closed (its ``DataLoader`` workers shut down, the best trial's too: they start again if it is used),
      so a search holds no worker processes between trials.

      Which data the score may read: with ``score_sensitivity=None`` it must read only the released model
      and data disjoint from the private training data (a public or held-out split): it is then
      post-processing of the trial and costs nothing. A score that reads the private data must declare its
      sensitivity ``score_sensitivity`` (its largest change when one record changes, under the plan's
      neighbouring relation) and ``score_noise`` (noise std per unit of sensitivity): the tuner adds
      ``N(0, (score_noise * score_sensitivity)^2)`` to it and charges that Gaussian release inside the
      per-trial event.
    - ``trials_mean``, ``distribution`` (``"poisson"`` or ``"negative-binomial"``) and ``shape`` (of the
      truncated negative binomial; default 1, the geometric): the law of the number of trials ``K``
      (:mod:`dpvr.tuning.trials`). A Poisson search draws ``K = 0`` with probability ``exp(-trials_mean)`` and
      then selects nothing.
    - ``privacy``: the template of every trial's :class:`~dpvr.optim.PrivacyConfig` (neighbouring relation,
      stream shares, calibration); its ``epsilon`` and ``delta`` are the tuner's to set, and its accountant
      must be ``"rdp"``, the accountant with the search's analysis.
    - ``seed`` and ``reproducible``: the draws of ``K``, of each trial's candidate and of the score noise
      are secret by default, each from fresh operating-system entropy (:mod:`dpvr.tuning.randomness`): the
      guarantee needs ``K`` and the score noise unknown to the observer, and a known sequence of candidates
      would bound ``K`` from below through the released best one. A fixed ``seed`` derives all three (each
      its own stream) and makes the search reproducible *and predictable* to whoever knows the seed: like
      :class:`~dpvr.ops.NoiseGenerator`'s, it needs ``reproducible=True`` (tests, experiments that must be
      replayed; the seed must then be kept secret like the data) and raises
      :class:`~dpvr.ops.PredictableNoiseError` without it. For public candidates pass them as a grid,
      drawn with any seed you like: the tuner picks among them secretly.
    - ``constant_time`` and ``max_trials``: the theorem needs ``K`` secret, and the search's wall time
      reveals it (about ``K`` times a trial's), to anyone who can time the search, unless
      ``constant_time=True``. Then every search runs exactly ``max_trials`` trials (a public cap), whatever
      ``K`` is: the first ``min(K, max_trials)`` are the search's and the rest are padding, the same work
      (a fresh candidate, built, trained, scored) whose output is dropped. All trials being independent draws
      of one trial, the running time is a sum of ``max_trials`` identically distributed trial times, whose
      law does not depend on ``K``. What it costs: ``max_trials`` runs instead of ``trials_mean`` on average,
      and, as the capped search differs from the accounted one only when ``K > max_trials``, a coupling
      gives ``(epsilon, delta + (1 + e^epsilon) P(K > max_trials))``: that term is charged to ``delta``
      (and recorded in the accountant as a failure probability). Default cap: the smallest whose term is at
      most ``delta / 10`` (at ``epsilon=1, delta=1e-5``: 15 trials for a Poisson count of mean 3, 29 for
      mean 10; the geometric count's tail is heavy: 38 for mean 3, 144 for mean 10). A cap too small for
      ``delta`` is refused. Each trial's own duration may still depend on the data and on its candidate (a
      diverging run stops early), as any single run's does; that side channel is outside both analyses.
    Why the search is ``(epsilon, delta)``-DP. One trial ``Q`` draws a candidate independently of the data,
    runs it with the calibrated noise and scores it. Every candidate's run is the same mechanism (its plan
    and noise are checked equal to the calibrated ones before it runs, and its releases against the plan
    after), so ``Q`` satisfies that mechanism's RDP curve ``eps(lambda)`` (plus the noisy score's Gaussian
    release when the score reads private data; a score on public data is post-processing). Papernot and
    Steinke (ICLR 2022, arXiv:2110.03620 v2) bound the RDP of running ``Q`` ``K`` times and returning only the
    best output: Theorem 2 for ``K`` truncated negative binomial (the geometric and logarithmic laws
    included) and Theorem 6 for ``K`` Poisson, each in terms of ``eps`` at two orders (Theorem 6 through the
    ``(epsilon, delta)`` guarantee that ``eps`` implies). dp_accounting's ``RdpAccountant`` evaluates exactly
    these bounds for ``RepeatAndSelectDpEvent(event, mean, shape)`` on its grid of orders and converts the
    result to ``(epsilon, delta)`` with its ``compute_epsilon``. The tuner bisects on the per-trial epsilon
    (each value calibrated to noise by :func:`dpvr.privacy.calibrate`) for the largest one whose search
    event spends at most ``epsilon`` there, and checks the final event before any trial runs. A per-trial
    sensitivity bound that fails with probability ``beta`` fails in some trial with probability at most
    ``E[K] beta`` (a union bound), which is taken off ``delta``. What is released is the best trial's
    output alone (see :class:`TuningResult`); ``K`` is not, which the caller must keep so: the tuner draws it
    from the operating system (from the seed only with ``reproducible=True``), keeps it out of
    :meth:`TuningResult.to_dict`, and hides it from the wall time only with ``constant_time=True``.

    Returns a :class:`TuningResult`; its ``accountant`` holds the search as one release, so what a pipeline
    spends besides (a noisy preprocessing release, say) composes with it there.
    """
    count = TrialCount.make(distribution, trials_mean, shape)
    _check_settings(epsilon, delta, score_sensitivity, score_noise, max_trials, constant_time)
    cap = _cap(count, epsilon, delta, max_trials) if constant_time else None
    truncation = 0.0 if cap is None else _truncation(count, epsilon, cap)
    template = _template(privacy)
    draw = _drawer(candidates)
    randomness = SearchRandomness.make(seed, reproducible=reproducible)

    probes = list(candidates) if not callable(candidates) else [draw(randomness.candidates)]
    plan = _plan_of(build, probes, dataclasses.replace(template, epsilon=epsilon, delta=delta))
    trial_delta = _trial_delta(delta, count, plan, truncation, cap)
    solver = _Calibration(plan, template, count, delta, trial_delta, score_sensitivity, score_noise)
    run_epsilon, trial = _solve(solver, epsilon)
    event = search_event(trial.event, count)
    spent = epsilon_of(event, trial_delta, trial.neighbouring)
    assert spent <= epsilon, f"the calibrated search spends {spent} > {epsilon}"

    trial_privacy = dataclasses.replace(template, epsilon=run_epsilon, delta=delta)
    drawn = count.draw(randomness.count)
    # A constant-time search runs the cap whatever K is; trials past K are padding (same work, dropped).
    trials, best = _run_trials(
        build, draw, trial, trial_privacy, randomness, drawn=drawn, runs=drawn if cap is None else cap,
        train=train, score=score, sign=1.0 if maximize else -1.0,
        score_noise=None if score_noise is None else score_noise * score_sensitivity,
    )
    accountant = _search_accountant(event, trial, count, truncation, cap, seeded=randomness.seed is not None)
    chosen = None if best is None else trials[best[1]]
    return TuningResult(
        best=None if chosen is None else chosen.candidate,
        algorithm=None if best is None else _algorithm_of(best[2]),
        score=None if chosen is None else chosen.score,
        trials=tuple(trials),
        trials_drawn=drawn,
        per_trial_epsilon=epsilon_of(trial.event, delta - trial.failure_probability, trial.neighbouring),
        epsilon=spent,
        delta=delta,
        count=count,
        noise=dict(trial.noise),
        event=event,
        accountant=accountant,
        max_trials=cap,
        trainer=None if best is None or isinstance(best[2], PrivateAlgorithm) else best[2],
    )


def _check_settings(epsilon: float, delta: float, score_sensitivity: float | None, score_noise: float | None,
                    max_trials: int | None, constant_time: bool) -> None:
    """Refuses the settings of :func:`tune` that describe no search it can account."""
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    if (score_sensitivity is None) != (score_noise is None):
        raise ValueError(
            "a score on private data needs both score_sensitivity and score_noise; give neither "
            "for a score on public data"
        )
    for name, value in (("score_sensitivity", score_sensitivity), ("score_noise", score_noise)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if max_trials is not None and not constant_time:
        raise ValueError(
            "max_trials caps a constant_time search; give constant_time=True (a cap alone would "
            "change the law of K and still let the running time reveal it)"
        )


def _trial_delta(delta: float, count: TrialCount, plan: Plan, truncation: float, cap: int | None) -> float:
    """The delta left to the trials' event: ``delta`` less the union bound over the expected ``K`` trials'
    failure probabilities and the cost of the cap (refused when nothing is left)."""
    trial_delta = delta - count.mean * _failure(plan) - truncation
    if trial_delta <= 0:
        raise ValueError(
            f"delta ({delta}) must exceed trials_mean times the per-trial failure probability "
            f"({count.mean} x {_failure(plan)})"
            + (f" plus the cost of the cap max_trials={cap} ({truncation:.3g})" if cap else "")
        )
    return trial_delta


def _run_trials(build: Build[C], draw: Callable[[np.random.Generator], C], trial: _Trial,
                trial_privacy: PrivacyConfig, randomness: SearchRandomness, *, drawn: int, runs: int,
                train: Callable[[Any], None] | None, score: Callable[[Any], float], sign: float,
                score_noise: float | None) -> tuple[list[Trial[C]], tuple[float, int, Any] | None]:
    """Runs ``runs`` trials, of which the first ``drawn`` (K) are the search's and the rest padding; returns
    the search's trials and its best one as ``(signed score, trial index, its run as built)``.

    Each trial is checked against the calibrated mechanism before it runs and against the plan after, is
    independent of the others (:class:`Independence`), and is closed when scored. ``score_noise``: the std
    of the Gaussian noise on a score that reads private data (None: the score is post-processing)."""
    trials: list[Trial[C]] = []
    best: tuple[float, int, Any] | None = None
    independence = Independence()
    for index in range(runs):
        candidate = draw(randomness.candidates)
        built = build(candidate, trial_privacy)
        try:
            algorithm = _algorithm_of(built)
            _check_trial(algorithm, trial)
            started = independence.admit(algorithm, f"trial {index + 1}")
            value = _run_and_score(built, train, score)
            _check_releases(algorithm, trial)
            independence.finish(started)
        finally:  # its loader workers now, not when collected (possibly inside a later trial's worker)
            _close(built)
        if score_noise is not None and math.isfinite(value):
            value += float(randomness.score_noise.normal(0.0, score_noise))
        if index >= drawn:
            continue
        trials.append(Trial(candidate, value))
        key = sign * value if math.isfinite(value) else -math.inf
        if best is None or key > best[0]:
            best = (key, index, built)
    return trials, best


def _search_accountant(event: dpa.DpEvent, trial: _Trial, count: TrialCount, truncation: float,
                       cap: int | None, *, seeded: bool) -> Accountant:
    """An accountant holding the whole search as one release, with its failure probabilities and the
    assumptions its guarantee rests on."""
    accountant = Accountant(RDP.name, trial.neighbouring)
    accountant.record(_SEARCH_STREAM, event)
    if trial.failure_probability:
        accountant.add_failure_probability(count.mean * trial.failure_probability)
    if truncation:
        accountant.add_failure_probability(truncation)
        accountant.assume(
            f"the search ran max_trials={cap} trials whatever K was; that it selects among the "
            f"first min(K, {cap}) only is charged (1 + e^epsilon) P(K > {cap}) in delta"
        )
    accountant.assume("the number of trials and every trial but the best stay secret")
    if seeded:
        accountant.assume(
            "the search's seed stays secret: it fixes the number of trials, the candidates and the score "
            "noise"
        )
    return accountant


def _truncation(count: TrialCount, epsilon: float, cap: int) -> float:
    """What capping the search at ``cap`` trials adds to delta: ``(1 + e^epsilon) P(K > cap)``. The capped
    and uncapped searches agree unless ``K > cap``, so for every set ``S`` of outputs
    ``P(capped(D) in S) <= P(uncapped(D) in S) + p <= e^eps (P(capped(D') in S) + p) + delta + p``."""
    tail = count.tail(cap)
    return 0.0 if tail == 0 else (1.0 + math.exp(min(epsilon, 700.0))) * tail


def _cap(count: TrialCount, epsilon: float, delta: float, max_trials: int | None) -> int:
    """The public cap of a constant-time search: ``max_trials``, or the smallest whose truncation term is at
    most ``delta / 10``."""
    if max_trials is not None:
        if not (isinstance(max_trials, (int, np.integer)) and max_trials >= 1):
            raise ValueError(f"max_trials must be an integer >= 1, got {max_trials!r}")
        cost = _truncation(count, epsilon, int(max_trials))
        if cost >= delta:
            raise ValueError(
                f"max_trials={max_trials}: the search it caps differs from the accounted one with "
                f"probability P(K > {max_trials}) = {count.tail(int(max_trials)):.3g}, which costs "
                f"{cost:.3g} of delta={delta:g}; raise max_trials (or leave it None for the smallest cap "
                "costing delta/10)"
            )
        return int(max_trials)
    cap = max(1, math.ceil(count.mean))
    while _truncation(count, epsilon, cap) > delta / 10:
        cap += 1
        if cap > 10**6:
            raise ValueError(
                f"no cap up to 10^6 trials keeps the truncation of this search within delta={delta:g}"
            )
    while cap > 1 and _truncation(count, epsilon, cap - 1) <= delta / 10:
        cap -= 1
    return cap


def _template(privacy: PrivacyConfig | None) -> PrivacyConfig:
    template = PrivacyConfig() if privacy is None else privacy
    if not isinstance(template, PrivacyConfig):
        raise TypeError(f"privacy: expected a PrivacyConfig, got {type(template).__name__}")
    if template.epsilon is not None:
        raise ValueError("privacy.epsilon is set by tune (the per-trial budget); leave it None")
    if template.accountant is None:  # "the tightest one": for a search, the one with its analysis
        template = dataclasses.replace(template, accountant=RDP.name)
    if template.accountant != RDP.name:
        raise ValueError(
            "the search is accounted by dp_accounting's RDP accountant: privacy.accountant must "
            f"be 'rdp', got {template.accountant!r}"
        )
    return template


def _drawer(candidates: Candidates[C]) -> Callable[[np.random.Generator], C]:
    if callable(candidates):
        return candidates
    grid = list(candidates)
    if not grid:
        raise ValueError("the grid of candidates is empty")
    return lambda rng: grid[int(rng.integers(len(grid)))]


def _plan_of(build: Build[C], probes: Sequence[C], privacy: PrivacyConfig) -> Plan:
    """The plan every candidate's run shares (constructed, not run: a probe releases nothing).

    The probes, and a second build of the first one, must also be independent runs: a build that closes
    over one model, or keeps one per candidate, is refused here, before any trial touches the data."""
    independence = Independence()
    built = []  # kept alive while the others are built: a shared tensor is then seen exactly
    try:
        for i, candidate in enumerate([*probes, probes[0]]):
            run = build(candidate, privacy)
            built.append(run)
            algorithm = _algorithm_of(run)
            again = "a second build" if i == len(probes) else "the build"
            independence.admit(algorithm, f"{again} of candidate {candidate!r}")
        plan = _algorithm_of(built[0]).plan
        for candidate, run in zip(probes[1:], built[1:]):
            if _algorithm_of(run).plan != plan:
                raise ValueError(
                    f"candidate {candidate!r} changes what a trial releases ({_algorithm_of(run).plan} != "
                    f"{plan}); tune it in a separate search, or fix it"
                )
    finally:
        for run in built:
            _close(run)
    return plan


def _algorithm_of(built: Any) -> PrivateAlgorithm:
    """The algorithm of what a build returned: itself, or a ``make_private`` trainer's ``.algorithm``."""
    if isinstance(built, PrivateAlgorithm):
        return built
    inner = getattr(built, "algorithm", None)
    if isinstance(inner, PrivateAlgorithm):
        return inner
    raise TypeError(
        "build must return a dpvr PrivateAlgorithm (from dpvr.optim) or a make_private trainer, got "
        f"{type(built).__name__}"
    )


def _close(built: Any) -> None:
    """Shuts a trial's loader workers down (a trainer's or an algorithm's ``close``), if it has any."""
    close = getattr(built, "close", None)
    if callable(close):
        close()


def _failure(plan: Plan) -> float:
    return plan.mechanism(dict.fromkeys(plan.streams, 1.0)).failure_probability


class _Calibration:
    """The largest per-trial epsilon whose search event spends at most the target (see :func:`tune`)."""

    def __init__(
        self,
        plan: Plan,
        template: PrivacyConfig,
        count: TrialCount,
        delta: float,
        trial_delta: float,
        score_sensitivity: float | None,
        score_noise: float | None,
    ) -> None:
        self.plan, self.template, self.count = plan, template, count
        self.delta, self.trial_delta = delta, trial_delta
        self.score_multiplier = (
            None
            if score_noise is None
            else output_perturbation_multiplier(
                score_noise * score_sensitivity, score_sensitivity, plan.neighbouring
            )
        )

    def trial(self, per_trial_epsilon: float) -> _Trial:
        """The trial whose run is calibrated to ``per_trial_epsilon`` at ``delta``, as the algorithm does."""
        noise = calibrate(
            self.plan,
            per_trial_epsilon,
            self.delta,
            shares=self.template.shares,
            accountant=RDP.name,
            calibration=self.template.calibration,
            **(self.template.paper_options if self.template.calibration == "paper" else {}),
        )
        return _Trial(self.plan, self.plan.neighbouring, noise, self.score_multiplier, _failure(self.plan))

    def spent(self, per_trial_epsilon: float) -> float:
        """epsilon of the search at a per-trial epsilon (inf where the per-trial one cannot be calibrated)."""
        try:
            trial = self.trial(per_trial_epsilon)
        except ValueError:
            return math.inf
        return epsilon_of(search_event(trial.event, self.count), self.trial_delta, trial.neighbouring)

    def solve(self, epsilon: float) -> tuple[float, _Trial]:
        low, high = 0.0, epsilon  # the search costs more than one trial: the root lies below epsilon
        while self.spent(high) <= epsilon:  # unless dp_accounting's bound is loose enough not to
            low, high = high, 2 * high
        for _ in range(60):
            middle = 0.5 * (low + high)
            if self.spent(middle) <= epsilon:
                low = middle
            else:
                high = middle
            if high - low <= 1e-6 * high:
                break
        if low == 0.0:
            raise ValueError(
                f"no per-trial budget lets {self.count.mean:g} expected trials fit epsilon={epsilon:g} at "
                f"delta={self.delta:g}"
                + (
                    " (the noisy score alone may exceed it: raise score_noise)"
                    if self.score_multiplier is not None
                    else ""
                )
            )
        return low, self.trial(low)


_SOLVED: dict[tuple[Any, ...], tuple[float, _Trial]] = {}


def _solve(solver: _Calibration, epsilon: float) -> tuple[float, _Trial]:
    """:meth:`_Calibration.solve`, remembered for the process: it is a deterministic function of the
    plan, the calibration settings, the law of ``K`` and the target, and repeated searches (an audit, seeds
    of an experiment) would otherwise pay its fraction of a second each time."""
    template = solver.template
    key = (
        solver.plan,
        template.calibration,
        _frozen(template.shares),
        _frozen(template.paper_options),
        solver.count,
        solver.delta,
        solver.trial_delta,
        solver.score_multiplier,
        epsilon,
    )
    try:
        hash(key)
    except TypeError:  # a plan with unhashable settings: solve every time
        return solver.solve(epsilon)
    if key not in _SOLVED:
        _SOLVED[key] = solver.solve(epsilon)
    return _SOLVED[key]


def _frozen(mapping: Mapping[str, float] | None) -> tuple[tuple[str, float], ...] | None:
    return None if mapping is None else tuple(sorted(mapping.items()))


def _check_trial(algorithm: PrivateAlgorithm, trial: _Trial) -> None:
    """Before a trial runs: its plan and noise are the calibrated ones (what the search was accounted for)."""
    if algorithm.plan != trial.plan or algorithm.noise != trial.noise:
        raise ValueError(
            f"a trial's run differs from the calibrated one (plan {algorithm.plan} vs {trial.plan}, noise "
            f"{algorithm.noise} vs {trial.noise}): build must pass its privacy argument to the algorithm "
            "(or make_private(..., privacy=privacy)) and every candidate must keep the plan"
        )


def _run_and_score(
    run: Any,
    train: Callable[[Any], None] | None,
    score: Callable[[Any], float],
) -> float:
    """``run`` (what the build returned: an algorithm or a trainer) trained and scored."""
    try:
        if train is None:
            run.run()
        else:
            train(run)
    except DivergedError:
        return math.nan
    value = float(score(run))
    return value if math.isfinite(value) else math.nan


def _check_releases(algorithm: PrivateAlgorithm, trial: _Trial) -> None:
    """After a trial: what it released is part of the plan (the same releases, no more of them)."""
    planned = {
        (tuple(sorted(r.parts)), r.step_event()): r.count for r in trial.plan.mechanism(trial.noise).releases
    }
    made: dict[tuple[Any, dpa.DpEvent], int] = {}
    for entry in algorithm.accountant.state_dict()["ledger"]:
        key = (tuple(sorted(_pairs(entry["streams"]))), event_from_dict(entry["event"]))
        made[key] = made.get(key, 0) + entry["count"]
    extra = {k: n for k, n in made.items() if n > planned.get(k, 0)}
    if extra:
        raise RuntimeError(f"a trial released more than its plan: {extra}; the search's accounting is void")


def _pairs(streams: Mapping[str, float]) -> list[tuple[str, float]]:
    return [(str(k), float(v)) for k, v in streams.items()]
