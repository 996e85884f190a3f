"""The algorithm registry's protocol: :class:`AlgorithmSpec`, the :class:`Argument` form of its settings, and
:func:`register`/:func:`get`.

An entry ties a name (``diff2``) to everything the layers above the algorithms need: the plan that describes
a run's releases to the accountant, the arguments that plan takes (with the Python API's defaults, which the
command line shows and uses), the paper's name for each stream's noise, the class that runs the algorithm,
its default neighbouring relation, how ``make_private`` lays out its run, the settings it derives from its
theorems, whether ``make_private`` may split it over a process group, and the audit games that exercise it.
``dpvr account|calibrate`` build their flags from it, ``make_private`` reads its layout, its theorem rules and
its data-parallel support from it, and ``dpvr audit`` lists its games by it.

The built-in algorithms register themselves from their own modules in :mod:`dpvr.algorithms` (imported with
``dpvr``); an algorithm defined outside dpvr registers the same way, with :func:`register`, and is then run,
defaulted and split like them. Its arguments come from one schema: a frozen dataclass of its settings, each
field a :func:`setting` with its help text (:func:`schema_arguments`).

The registry sits above :mod:`dpvr.optim` and :mod:`dpvr.audit` and imports neither: classes are named by
import path and games by name, resolved on demand, so reading it costs no torch import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .privacy import ACCOUNTANTS, NEIGHBOURING, Plan


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


# ---- the settings schema --------------------------------------------------------------------------------


def setting(help: str, default: Any = dataclasses.MISSING, *, choices: tuple[Any, ...] | None = None,
            parse: Callable[[str], Any] | None = None) -> Any:
    """A field of an algorithm's settings schema: its ``help`` text, its ``default`` (none: required), the
    ``choices`` it takes, and how its flag's text is parsed where its annotation does not say (``parse``)."""
    metadata = {"help": help, "choices": choices, "parse": parse}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


# An annotation's text -> how a flag's text is parsed (``x | None`` reads as ``x``: no default).
_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "bool": bool,
    "tuple[int, ...]": ints, "tuple[float, ...]": floats,
}


def schema_arguments(schema: type) -> tuple[Argument, ...]:
    """The :class:`Argument` of every field of ``schema`` (a dataclass whose fields are :func:`setting`), in
    field order: a field without a default is required, and its annotation (or its ``parse``) gives the
    flag's parser."""
    if not dataclasses.is_dataclass(schema) or not isinstance(schema, type):
        raise TypeError(f"schema: expected a dataclass type, got {schema!r}")
    arguments = []
    for f in dataclasses.fields(schema):
        if "help" not in f.metadata:
            raise TypeError(f"{schema.__name__}.{f.name}: declare it with setting(help, ...)")
        # The annotation's text: as written under postponed evaluation, else the class's name or the alias'
        # own text (``tuple[int, ...]``, ``float | None``).
        annotation = f.type if isinstance(f.type, str) else (
            f.type.__name__ if isinstance(f.type, type) else repr(f.type))
        parse = f.metadata["parse"] or _PARSERS.get(annotation.removesuffix(" | None"))
        if parse is None:
            raise TypeError(f"{schema.__name__}.{f.name}: no parser for {annotation!r}; "
                            "give setting(parse=...)")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        arguments.append(Argument(f.name, parse, f.metadata["help"], default=None if required else f.default,
                                  required=required, choices=f.metadata["choices"]))
    return tuple(arguments)


# ---- data-parallel support ------------------------------------------------------------------------------


def all_reduced(settings: Mapping[str, Any]) -> str | None:
    """:attr:`AlgorithmSpec.data_parallel` of an algorithm whose every release is a sum of per-record terms
    (clipped gradients or their differences) that ``make_private``'s process-group split all-reduces: it
    refuses no settings."""
    return None


def refuses(why: str) -> Callable[[Mapping[str, Any]], str]:
    """:attr:`AlgorithmSpec.data_parallel` of an algorithm that never runs split over a process group:
    ``why`` says what it releases that is not all-reduced."""

    def refusal(settings: Mapping[str, Any]) -> str:
        return (f"algorithm: not data-parallel over a process group: it {why}; run it in one process (DIFF2 "
                "across processes: dpvr.distributed)")

    return refusal


#: The default of :attr:`AlgorithmSpec.data_parallel`: an algorithm that does not state otherwise is refused.
undeclared = refuses("does not state that its releases are all-reduced (AlgorithmSpec.data_parallel)")


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
      (``phased``: bring your own solver, through :mod:`dpvr.algorithms.phased`):

      - ``"sampled"``: one batch of ``batch_size`` records per step (required), its scheme the run's
        ``sampling`` (default: ``algorithm_options``' or the settings schema's, which the class shares); an
        epoch is the sampler's (:func:`dpvr.optim.sampling.steps_per_epoch`);
      - ``"full-batch"``: every step reads the whole dataset, so an epoch is one step (no ``batch_size``);
      - ``"per-stream"``: each stream has its own batch size (the algorithm's ``batch_sizes``), so there is
        no single epoch: the run's length is ``steps=`` only;
    - ``problem`` and ``federated``, read by ``make_private`` only: ``problem`` is ``"minimisation"`` (it
      takes a loss callable) or ``"minimax"`` (a :class:`~dpvr.problems.MinimaxProblem`); a ``federated``
      class takes one dataset per client (``make_private`` passes its list of datasets);
    - ``audit_games``: the names of the audit games that exercise it (``dpvr audit GAME``), and
      ``audit_module`` the module whose ``GAMES`` maps each name to its :class:`dpvr.audit.Target` (the
      algorithm's ``audit`` module), imported only by :func:`audit_targets`;
    - ``rules``: the settings ``make_private`` derives from the algorithm's theorems when they are not given,
      each ``rule(settings, public)`` returning a :class:`dpvr.algorithms.theorems.Derived` (or None where
      it does not apply), ``public`` the run's :class:`~dpvr.algorithms.theorems.Public` quantities (so a
      default is a function of public inputs only); ``steps_rule`` the same for the run's length when
      neither ``steps`` nor ``epochs`` is given;
    - ``data_parallel(settings)``: None where ``make_private`` may split a run with these settings over a
      process group (every release a sum it all-reduces: :func:`all_reduced`), else the refusal's message
      (:func:`refuses`; the default, :data:`undeclared`, refuses).
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
    audit_module: str | None = None
    rules: Mapping[str, Callable[[Mapping[str, Any], Any], Any]] = field(default_factory=dict)
    steps_rule: Callable[[Mapping[str, Any], Any], Any] | None = None
    data_parallel: Callable[[Mapping[str, Any]], str | None] = undeclared

    def __post_init__(self) -> None:
        if (self.noise is None) == (not self.sigmas):
            raise ValueError(f"{self.name}: give the noise either as paper sigmas or as noise multipliers")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"{self.name}: layout must be one of {LAYOUTS} or None, got {self.layout!r}")
        if self.problem not in PROBLEMS:
            raise ValueError(f"{self.name}: problem must be one of {PROBLEMS}, got {self.problem!r}")
        if not callable(self.data_parallel):
            raise TypeError(f"{self.name}: data_parallel must be a callable of the settings (all_reduced, "
                            f"refuses(why) or its own), got {self.data_parallel!r}")
        bad = sorted(name for name, rule in self.rules.items() if not callable(rule))
        if bad or (self.steps_rule is not None and not callable(self.steps_rule)):
            raise TypeError(f"{self.name}: rules {bad or ['steps_rule']} must be callables of "
                            "(settings, public)")

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


def audit_targets() -> dict[str, Any]:
    """Every registered algorithm's audit games by name (:class:`dpvr.audit.Target` each), read from the
    ``GAMES`` of each entry's ``audit_module``; those modules import torch, so they are imported here, on
    first use, not with the registry. An entry whose module names other games than it declares is refused."""
    targets: dict[str, Any] = {}
    for spec in REGISTRY.values():
        if not spec.audit_games:
            continue
        if spec.audit_module is None:
            raise ValueError(f"{spec.name}: audit games {list(spec.audit_games)} but no audit_module")
        found = importlib.import_module(spec.audit_module).GAMES
        if set(found) != set(spec.audit_games):
            raise ValueError(
                f"{spec.name}: {spec.audit_module}.GAMES holds {sorted(found)}, the entry declares "
                f"{sorted(spec.audit_games)}"
            )
        targets.update(found)
    return targets




__all__ = [
    "CALIBRATION",
    "LAYOUTS",
    "PRIVACY",
    "PROBLEMS",
    "REGISTRY",
    "AlgorithmSpec",
    "Argument",
    "Sigma",
    "all_reduced",
    "audit_games",
    "audit_targets",
    "floats",
    "front_door",
    "get",
    "ints",
    "register",
    "refuses",
    "registered",
    "schema_arguments",
    "setting",
    "shares",
    "undeclared",
    "unregister",
]
