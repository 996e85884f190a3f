"""The algorithm registry: one :class:`AlgorithmSpec` per algorithm name.

An entry ties a name (``diff2``) to everything the layers above the algorithms need: the plan that describes
a run's releases to the accountant, the arguments that plan takes (with the Python API's defaults, which the
command line shows and uses), the paper's name for each stream's noise, the class that runs the algorithm,
its default neighbouring relation, how ``make_private`` lays out its run and the audit games that exercise
it. ``dpvr account|calibrate`` build their flags from it, ``make_private`` reads its layout from it and
``dpvr audit`` lists its games by it, so adding an algorithm is its plan (:class:`dpvr.privacy.Plan`), its
class (:class:`dpvr.optim.PrivateAlgorithm`) and one entry here: the built-in ones below, or
:func:`register` for an algorithm defined outside dpvr (its games, if any, in :data:`dpvr.audit.TARGETS`).

The registry sits above :mod:`dpvr.optim` and :mod:`dpvr.audit` and imports neither: classes are named by
import path and games by name, resolved on demand, so reading it costs no torch import.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .privacy import (
    ACCOUNTANTS,
    NEIGHBOURING,
    CyclicDPSGDPlan,
    DIFF2Plan,
    DoubleSpiderPlan,
    DPSGDAPlan,
    DPSGDPlan,
    PhasedPlan,
    Plan,
    PrivateDiffPlan,
    RecursiveSpiderPlan,
)


def ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers: ``"6000,256"``."""
    return tuple(int(v) for v in text.split(","))


def floats(text: str) -> tuple[float, ...]:
    """A comma-separated list of numbers: ``"1.1,0.9"``."""
    return tuple(float(v) for v in text.split(","))


def shares(text: str) -> dict[str, float]:
    """``name=weight`` pairs separated by commas: ``"restart=0.8,difference=0.2"``."""
    weights = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not value:
            raise ValueError(f"shares are name=weight pairs separated by commas, got {text!r}")
        weights[name.strip()] = float(value)
    return weights


@dataclass(frozen=True)
class Argument:
    """One keyword argument as a command-line flag (``dataset_size`` is ``--dataset-size``).

    ``type`` parses the flag's text. A ``bool`` argument is a switch that flips ``default``: ``--name`` when
    it is off by default, ``--no-name`` when on, and ``help`` says what the switch does. ``default`` is the
    Python API's (the algorithm class's where it takes the argument, else the plan's); ``required``
    arguments have none.
    """

    name: str
    type: Callable[[str], Any]
    help: str
    default: Any = None
    required: bool = False
    choices: tuple[Any, ...] | None = None

    @property
    def flag(self) -> str:
        """The flag that sets the argument (for a switch: the one that flips its default)."""
        stem = self.name.replace("_", "-")
        return f"--no-{stem}" if self.type is bool and self.default else f"--{stem}"


@dataclass(frozen=True)
class Sigma:
    """A stream's noise in the paper's own units (:class:`dpvr.privacy.PaperSigmas`): its name there and what
    it is the ratio of; the plan converts it to a noise multiplier (``Plan.noise_multiplier``)."""

    stream: str
    name: str
    help: str


#: How ``make_private`` lays out a run (:attr:`AlgorithmSpec.layout`).
LAYOUTS = ("sampled", "full-batch", "per-stream")
#: What an algorithm solves (:attr:`AlgorithmSpec.problem`).
PROBLEMS = ("minimisation", "minimax")


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: its plan, arguments, paper sigmas, class, default relation, front-door layout and audit
    games.

    - ``plan(**values, neighbouring=...)`` builds the plan from one value per :attr:`arguments` entry;
      ``plan_type`` is the class it returns, which knows the default relation
      (:meth:`~dpvr.privacy.events.Plan.default_neighbouring`);
    - ``sigmas``: each stream's noise in the paper's units, for algorithms whose paper has them; ``noise``
      otherwise: the argument that gives noise multipliers (one per stream, in stream order);
    - ``paper_options``: keyword arguments of the plan's ``paper_noise`` (``calibration="paper"``);
    - ``algorithm``: ``"module:Class"`` of the class that runs it, constructed with ``algorithm_options``
      (e.g. ``sampling="cyclic"`` for last-iterate DP-SGD);
    - ``layout``: how :func:`dpvr.make_private` lays out a run of it, ``None`` where it does not run it
      (``phased``: bring your own solver, through :mod:`dpvr.optim.phased`):

      - ``"sampled"``: one batch of ``batch_size`` records per step (required), its scheme the class's
        ``sampling``; an epoch is the sampler's (:func:`dpvr.optim.sampling.steps_per_epoch`);
      - ``"full-batch"``: every step reads the whole dataset, so an epoch is one step (no ``batch_size``);
      - ``"per-stream"``: each stream has its own batch size (the algorithm's ``batch_sizes``), so there is
        no single epoch: the run's length is ``steps=`` only;
    - ``problem`` and ``federated``, read by ``make_private`` only: ``problem`` is ``"minimisation"`` (it
      takes a loss callable) or ``"minimax"`` (a :class:`~dpvr.problems.MinimaxProblem`); a ``federated``
      class takes one dataset per client (``make_private`` passes its list of datasets);
    - ``audit_games``: the keys of :data:`dpvr.audit.TARGETS` that audit it.
    """

    name: str
    description: str
    plan_type: type[Plan]
    plan: Callable[..., Plan]
    arguments: tuple[Argument, ...]
    algorithm: str
    algorithm_options: Mapping[str, Any] = field(default_factory=dict)
    sigmas: tuple[Sigma, ...] = ()
    noise: Argument | None = None
    paper_options: tuple[Argument, ...] = ()
    layout: Literal["sampled", "full-batch", "per-stream"] | None = None
    problem: Literal["minimisation", "minimax"] = "minimisation"
    federated: bool = False
    audit_games: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.noise is None) == (not self.sigmas):
            raise ValueError(f"{self.name}: give the noise either as paper sigmas or as noise multipliers")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"{self.name}: layout must be one of {LAYOUTS} or None, got {self.layout!r}")
        if self.problem not in PROBLEMS:
            raise ValueError(f"{self.name}: problem must be one of {PROBLEMS}, got {self.problem!r}")

    def algorithm_class(self) -> type:
        """The class that runs the algorithm (imported now)."""
        module, _, name = self.algorithm.partition(":")
        return getattr(importlib.import_module(module), name)

    def defaults(self) -> dict[str, Any]:
        """The default of every optional argument and paper option."""
        return {a.name: a.default for a in (*self.arguments, *self.paper_options) if not a.required}

    def default_neighbouring(self, values: Mapping[str, Any] | None = None) -> str:
        """The relation the algorithm is accounted under when none is given, for these argument values."""
        given = {**self.algorithm_options, **self.defaults(), **(values or {})}
        return self.plan_type.default_neighbouring(given.get("sampling"))

    def make_plan(self, values: Mapping[str, Any], neighbouring: str | None = None) -> Plan:
        """The plan of a run: ``values`` of the arguments (defaults for the absent optional ones) under
        ``neighbouring`` (default: :meth:`default_neighbouring`)."""
        names = {a.name for a in self.arguments}
        unknown = sorted(set(values) - names)
        missing = sorted(a.name for a in self.arguments if a.required and values.get(a.name) is None)
        if unknown or missing:
            raise ValueError(f"{self.name}: unknown arguments {unknown}, missing {missing}")
        given = {a.name: a.default for a in self.arguments if not a.required} | dict(values)
        return self.plan(**given, neighbouring=neighbouring or self.default_neighbouring(given))

    def paper_sigma(self, stream: str) -> Sigma | None:
        """The paper's name for ``stream``'s noise, if the paper has one."""
        return next((s for s in self.sigmas if s.stream == stream), None)


# ---- arguments several algorithms share ------------------------------------------------------------------


def _dataset_size(help: str = "number of records n") -> Argument:
    return Argument("dataset_size", int, help, required=True)


def _steps(help: str = "number of steps T") -> Argument:
    return Argument("steps", int, help, required=True)


def _batch_size(help: str = "batch size m (expected, for Poisson sampling)") -> Argument:
    return Argument("batch_size", int, help, required=True)


_SCHEME_HELP = {
    "poisson": "poisson (each record with rate q)",
    "wor": "wor (fixed size, without replacement)",
    "full": "full",
    "random-allocation": "random-allocation (each record in one random step of every n/b; add-remove, pld)",
}


def _sampling(default: str, choices: tuple[str, ...]) -> Argument:
    described = ", ".join(_SCHEME_HELP[c] for c in choices)
    return Argument("sampling", str, f"batch sampling: {described}", default=default, choices=choices)


def _spider_streams(streams: tuple[str, ...], letter: str) -> tuple[tuple[Argument, ...], Argument]:
    """The arguments of a SPIDER plan, and its noise multipliers."""
    arguments = (
        _dataset_size(),
        _steps(),
        Argument(
            "restart", int, "refresh period q: refreshes at the steps t with t mod q = 0", required=True
        ),
        Argument(
            "batch_sizes",
            ints,
            f"{letter}1,{letter}2,{letter}3,{letter}4: the batch size of each stream in the paper's order (a "
            "batch equal to the dataset size is the full batch)",
            required=True,
        ),
        _sampling("wor", ("wor", "poisson")),
    )
    noise = Argument(
        "noise_multipliers", floats, f"noise multipliers, one per stream in this order: {','.join(streams)}"
    )
    return arguments, noise


def _dp_gd_plan(steps: int, neighbouring: str) -> DPSGDPlan:
    """DP-SGD on the full batch."""
    return DPSGDPlan(steps, "full", neighbouring=neighbouring)


def _last_iterate_plan(epochs: int, dataset_size: int, batch_size: int, **options: Any) -> CyclicDPSGDPlan:
    """Cyclic DP-SGD over ``epochs`` passes of ``dataset_size / batch_size`` steps."""
    steps = epochs * (dataset_size // batch_size) if batch_size > 0 else 0  # the plan refuses batch_size <= 0
    return CyclicDPSGDPlan(dataset_size, batch_size, steps, **options)


_DOUBLE_SPIDER = ("eta-refresh", "eta-difference", "x-refresh", "x-difference")
_RECURSIVE_SPIDER = ("v-refresh", "v-difference", "u-refresh", "u-difference", "s")
_double_arguments, _double_noise = _spider_streams(_DOUBLE_SPIDER, "N")
_recursive_arguments, _recursive_noise = _spider_streams(_RECURSIVE_SPIDER, "b")
_NOISE_MULTIPLIER = Argument(
    "noise_multiplier", float, "noise std on the sum of clipped gradients, over the clip norm C"
)

_SPECS = (
    AlgorithmSpec(
        "dp-sgd",
        "DP-SGD with Poisson sampling, fixed-size batches without replacement, random allocation "
        "(balls-in-bins) or the full batch",
        DPSGDPlan,
        DPSGDPlan,
        (
            _steps(),
            _sampling("poisson", ("poisson", "wor", "full", "random-allocation")),
            Argument(
                "sample_rate",
                float,
                "sampling rate q, 1/t for random allocation (or give --batch-size and --dataset-size)",
            ),
            Argument(
                "batch_size",
                int,
                "batch size b: fixed for wor, expected for poisson (rate b/n) and random-allocation",
            ),
            Argument("dataset_size", int, "number of records n, public (with --batch-size; optional for "
                     "poisson); under add-remove the size stated public (public_dataset_size)"),
        ),
        "dpvr.optim:DPSGD",
        noise=_NOISE_MULTIPLIER,
        layout="sampled",
        audit_games=("dp-sgd",),
    ),
    AlgorithmSpec(
        "dp-gd",
        "DP-GD: DP-SGD on the full batch every step",
        DPSGDPlan,
        _dp_gd_plan,
        (_steps(),),
        "dpvr.optim:DPGD",
        algorithm_options={"sampling": "full"},
        noise=_NOISE_MULTIPLIER,
        layout="full-batch",
        audit_games=("dp-gd", "dp-gd-input"),
    ),
    AlgorithmSpec(
        "diff2",
        "DIFF2 with the GD routine, or the BVR-L-SGD routine when --local-steps is above 1 (record-level DP "
        "w.r.t. each client)",
        DIFF2Plan,
        DIFF2Plan,
        (
            _dataset_size("records per client: the smallest local dataset size n_min"),
            Argument("clients", int, "number of clients P", required=True),
            _steps("communication rounds R"),
            Argument(
                "restart", int, "restart period T: rounds r with (r - 1) mod T = 0 restart", required=True
            ),
            Argument("local_steps", int, "BVR-L-SGD local steps K per round (1: the GD routine)", default=1),
            Argument("local_batch", int, "BVR-L-SGD local batch b, drawn without replacement"),
        ),
        "dpvr.optim:DIFF2",
        sigmas=(
            Sigma("restart", "sigma1", "noise std over C1 on the average over clients"),
            Sigma("difference", "sigma2", "noise std over the radius C2,r"),
            Sigma("local", "sigma3", "BVR-L-SGD local steps: noise std over the radius C3,k,r"),
        ),
        paper_options=(
            Argument("u", float, "budget split u of Proposition 4.1 (GD routine)", default=1.25),
            Argument("u1", float, "u1 of Proposition E.2 (BVR-L-SGD)", default=3.0),
            Argument("u2", float, "u2 of Proposition E.2 (BVR-L-SGD)", default=3.0),
        ),
        layout="full-batch",
        federated=True,
        audit_games=("diff2-gd", "diff2-bvr-l-sgd"),
    ),
    AlgorithmSpec(
        "dp-sgda",
        "DP-SGDA: noisy stochastic gradient descent-ascent (x and y streams)",
        DPSGDAPlan,
        DPSGDAPlan,
        (
            _dataset_size(),
            _batch_size(),
            _steps(),
            _sampling("wor", ("wor", "poisson", "full")),
            Argument("shared_batch", bool, "x and y draw independent batches", default=True),
        ),
        "dpvr.optim:DPSGDA",
        sigmas=(
            Sigma("x", "sigma_x", "noise std over C1 on the x-gradient batch mean"),
            Sigma("y", "sigma_y", "noise std over C2 on the y-gradient batch mean"),
        ),
        layout="sampled",
        problem="minimax",
        audit_games=("dp-sgda",),
    ),
    AlgorithmSpec(
        "private-diff",
        "PrivateDiff Minimax (checkpoint, difference and y streams)",
        PrivateDiffPlan,
        PrivateDiffPlan,
        (
            _dataset_size(),
            _batch_size(),
            _steps("outer rounds R"),
            Argument("restart", int, "checkpoint period T: rounds r with (r - 1) mod T = 0", required=True),
            Argument("y_steps", int, "T2: ascent steps per round, or the output solver's cap", default=1),
            _sampling("wor", ("wor", "poisson", "full")),
            Argument(
                "y_release",
                str,
                "how y is made private: ascent (noisy clipped ascent steps, as dpvr runs it) or output (the "
                "paper's output perturbation, priced as a worst-case sensitivity)",
                default="ascent",
                choices=("ascent", "output"),
            ),
        ),
        "dpvr.optim:PrivateDiff",
        sigmas=(
            Sigma("checkpoint", "sigma_x1", "noise std over C1 on the batch mean"),
            Sigma("difference", "sigma_x2", "noise std over the radius C2,r"),
            Sigma(
                "y",
                "sigma_y",
                "ascent: noise std over C0 on the y batch mean; output: noise std over the worst-case "
                "replace-one sensitivity of y",
            ),
        ),
        layout="sampled",
        problem="minimax",
        audit_games=("private-diff", "private-diff-difference", "private-diff-y-output"),
    ),
    AlgorithmSpec(
        "double-spider",
        "DP Double-SPIDER for psi-divergence DRO (four streams)",
        DoubleSpiderPlan,
        DoubleSpiderPlan,
        _double_arguments,
        "dpvr.optim:DoubleSpider",
        noise=_double_noise,
        layout="per-stream",
        audit_games=("double-spider", "double-spider-difference", "double-spider-eta"),
    ),
    AlgorithmSpec(
        "recursive-spider",
        "DP Recursive-SPIDER for KL-DRO (five streams)",
        RecursiveSpiderPlan,
        RecursiveSpiderPlan,
        _recursive_arguments,
        "dpvr.optim:RecursiveSpider",
        noise=_recursive_noise,
        layout="per-stream",
        audit_games=(
            "recursive-spider",
            "recursive-spider-difference",
            "recursive-spider-u",
            "recursive-spider-s",
        ),
    ),
    AlgorithmSpec(
        "phased",
        "phased output perturbation (bring your own algorithm)",
        PhasedPlan,
        PhasedPlan,
        (
            Argument(
                "setting",
                str,
                "sc, c (Algorithms 1, 2), sc-sc (Algorithm 3), c-c (Algorithms 4, 5) or c-sc",
                required=True,
                choices=("sc", "c", "sc-sc", "c-c", "c-sc"),
            ),
            Argument(
                "failure_probability",
                float,
                "probability that the base solver misses its accuracy target (added to delta; 0 with "
                "certificates)",
                default=0.0,
            ),
        ),
        "dpvr.optim.phased:PhasedOutputPerturbation",
        layout=None,  # make_private does not run it: the phases call the user's own solver
        sigmas=(
            Sigma("x", "sigma_x", "noise std over the replace-one sensitivity of x"),
            Sigma("y", "sigma_y", "noise std over the replace-one sensitivity of y"),
        ),
        paper_options=(
            Argument(
                "gaussian",
                str,
                "the paper calibration's Gaussian mechanism: classic (the paper's, epsilon < 1) or analytic",
                default="analytic",
                choices=("classic", "analytic"),
            ),
        ),
        audit_games=("phased",),
    ),
    AlgorithmSpec(
        "last-iterate",
        "cyclic DP-SGD releasing only its last iterate (Kong and Ribero, Theorems 2.2 and 2.3)",
        CyclicDPSGDPlan,
        _last_iterate_plan,
        (
            _dataset_size("number of records k"),
            Argument("batch_size", int, "batch size b (must divide k)", required=True),
            Argument("epochs", int, "passes E over the data (T = E k / b steps)", required=True),
            Argument("lr", float, "step size lambda", required=True),
            Argument("clip", float, "clip norm C", required=True),
            Argument("weak_convexity", float, "weak convexity m of the losses", required=True),
            Argument("smoothness", float, "upper smoothness M of the losses", required=True),
            Argument("domain_diameter", float, "diameter of the domain of h", default=math.inf),
            Argument(
                "clipping",
                bool,
                "assert that no per-example gradient norm ever exceeds C (Theorem 2.3, eq. 19)",
                default=True,
            ),
            Argument(
                "bound",
                str,
                "last-iterate (the theorems; refuses step sizes they do not cover), composition (of the "
                "passes) or best (the smaller)",
                default="last-iterate",
                choices=("last-iterate", "composition", "best"),
            ),
        ),
        "dpvr.optim:DPSGD",
        algorithm_options={"sampling": "cyclic"},
        sigmas=(Sigma("gradient", "sigma", "noise std in parameter space"),),
        layout="sampled",
        audit_games=("last-iterate",),
    ),
)

#: Every algorithm by name, in the order the command line lists them (change it through :func:`register`).
REGISTRY: dict[str, AlgorithmSpec] = {}


#: The privacy settings every algorithm shares, with the defaults of :class:`dpvr.optim.PrivacyConfig`. A
#: neighbouring relation of None is the algorithm's own (:meth:`AlgorithmSpec.default_neighbouring`).
PRIVACY: tuple[Argument, ...] = (
    Argument("delta", float, "target delta", default=1e-5),
    Argument(
        "accountant",
        str,
        "pld (privacy loss distributions: the tightest; needed for random allocation) or rdp "
        "(dp_accounting's RDP accountant: about twice the noise for fixed-size batches)",
        choices=ACCOUNTANTS,
    ),
    Argument(
        "neighbouring",
        str,
        "neighbouring datasets: replace one record, or add or remove one",
        choices=NEIGHBOURING,
    ),
)
#: The settings of a calibration to a target epsilon (the target itself is required).
CALIBRATION: tuple[Argument, ...] = (
    Argument("epsilon", float, "target epsilon", required=True),
    Argument(
        "calibration",
        str,
        "tight (the accountant's smallest noise) or paper (the paper's closed form)",
        default="tight",
        choices=("tight", "paper"),
    ),
    Argument(
        "shares",
        shares,
        "tight calibration's budget shares per stream, e.g. restart=0.8,difference=0.2 (default: equal)",
    ),
)


def get(name: str) -> AlgorithmSpec:
    """The entry of algorithm ``name``."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; one of {sorted(REGISTRY)}") from None


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Adds ``spec`` to :data:`REGISTRY` (and so to ``dpvr account|calibrate`` and, with a ``layout``, to
    :func:`dpvr.make_private`); returns it. A name or an audit game another entry has is refused."""
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"spec: expected an AlgorithmSpec, got {type(spec).__name__}")
    if spec.name in REGISTRY:
        raise ValueError(f"algorithm {spec.name!r} is registered already")
    claimed = sorted(set(spec.audit_games) & set(audit_games()))
    if claimed:
        raise ValueError(f"{spec.name}: audit games {claimed} belong to other algorithms")
    REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> AlgorithmSpec:
    """Removes algorithm ``name`` from :data:`REGISTRY`; returns its entry."""
    spec = get(name)
    del REGISTRY[name]
    return spec


@contextlib.contextmanager
def registered(spec: AlgorithmSpec) -> Iterator[AlgorithmSpec]:
    """``spec`` registered for the block's duration (e.g. a test's own algorithm)."""
    register(spec)
    try:
        yield spec
    finally:
        unregister(spec.name)


def front_door() -> tuple[str, ...]:
    """The algorithms :func:`dpvr.make_private` runs (those with a :attr:`~AlgorithmSpec.layout`)."""
    return tuple(name for name, spec in REGISTRY.items() if spec.layout is not None)


def audit_games() -> dict[str, str]:
    """Every audit game, mapped to the algorithm it audits."""
    return {game: spec.name for spec in REGISTRY.values() for game in spec.audit_games}


for _spec in _SPECS:
    register(_spec)
del _spec


__all__ = [
    "CALIBRATION",
    "LAYOUTS",
    "PRIVACY",
    "PROBLEMS",
    "REGISTRY",
    "AlgorithmSpec",
    "Argument",
    "Sigma",
    "audit_games",
    "floats",
    "front_door",
    "get",
    "ints",
    "register",
    "registered",
    "shares",
    "unregister",
]
