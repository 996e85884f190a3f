"""The algorithm registry: every entry resolves, its defaults are the Python API's, audits are covered, and
``make_private`` runs every entry with a layout and refuses the others.

The lists below are keyed by registry name and must cover the registry: a new entry fails here until it has
its example run and its front-door settings.
"""

import dataclasses
import inspect

import pytest
import torch
from torch.utils.data import TensorDataset

import dpvr
import sensitivity as harness
from dpvr import registry
from dpvr.algorithms import DPGD, DPSGD, MinimaxAlgorithm
from dpvr.optim import PrivacyConfig
from dpvr.privacy import NEIGHBOURING, calibrate
from dpvr.registry import CALIBRATION, LAYOUTS, PRIVACY, PROBLEMS, REGISTRY, audit_games, audit_targets, get
from dpvr.trainer import ALGORITHMS as TRAINER_ALGORITHMS

# One small run per algorithm: the registry's required arguments (a new entry needs one here).
EXAMPLES = {
    "dp-sgd": {"steps": 100, "sample_rate": 0.01},
    "dp-gd": {"steps": 100},
    "diff2": {
        "dataset_size": 500,
        "clients": 4,
        "steps": 40,
        "restart": 10,
        "local_steps": 3,
        "local_batch": 20,
    },
    "dp-sgda": {"dataset_size": 1000, "batch_size": 50, "steps": 40},
    "private-diff": {"dataset_size": 1000, "batch_size": 50, "steps": 20, "restart": 5},
    "double-spider": {"dataset_size": 1000, "steps": 40, "restart": 10, "batch_sizes": (1000, 64, 1000, 64)},
    "recursive-spider": {
        "dataset_size": 1000,
        "steps": 40,
        "restart": 10,
        "batch_sizes": (1000, 64, 1000, 64),
    },
    "phased": {"setting": "c-c"},
    "last-iterate": {
        "dataset_size": 100,
        "batch_size": 10,
        "epochs": 2,
        "lr": 0.01,
        "clip": 1.0,
        "weak_convexity": 1.0,
        "smoothness": 1.0,
    },
}


def test_the_registry_names_every_algorithm_once():
    assert REGISTRY and all(name == spec.name for name, spec in REGISTRY.items())
    missing, unknown = sorted(set(REGISTRY) - set(EXAMPLES)), sorted(set(EXAMPLES) - set(REGISTRY))
    assert not missing and not unknown, f"EXAMPLES lacks {missing}, names no algorithm {unknown}"
    with pytest.raises(ValueError, match="unknown algorithm 'dp-sdg'"):
        get("dp-sdg")


def test_register_adds_an_entry_and_refuses_clashes():
    spec = dataclasses.replace(REGISTRY["dp-sgd"], name="dp-sgd-copy", audit_games=())
    with registry.registered(spec) as entry:
        assert entry is spec and get("dp-sgd-copy") is spec and "dp-sgd-copy" in registry.front_door()
        with pytest.raises(ValueError, match="registered already"):
            registry.register(spec)
    assert "dp-sgd-copy" not in REGISTRY
    with pytest.raises(ValueError, match="belong to other algorithms"):
        registry.register(dataclasses.replace(spec, audit_games=("dp-sgd",)))
    assert "dp-sgd-copy" not in REGISTRY
    with pytest.raises(TypeError, match="AlgorithmSpec"):
        registry.register("dp-sgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout"):
        dataclasses.replace(spec, layout="minibatch")
    with pytest.raises(ValueError, match="problem"):
        dataclasses.replace(spec, problem="maximin")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_entry_resolves(name):
    spec = REGISTRY[name]
    assert spec.description and spec.arguments
    plan = spec.make_plan(EXAMPLES[name])
    assert isinstance(plan, spec.plan_type)
    assert plan.neighbouring == spec.default_neighbouring(EXAMPLES[name])
    # the class that runs it, and the options that make it this algorithm, are its constructor's
    cls = spec.algorithm_class()
    assert inspect.isclass(cls)
    parameters = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert takes_any or set(spec.algorithm_options) <= set(parameters)
    # the noise: paper sigmas name streams of the plan; otherwise multipliers, one per stream
    assert {s.stream for s in spec.sigmas} <= set(plan.stream_names)
    assert {s.stream for s in spec.sigmas} >= set(plan.streams) or spec.noise is not None
    for sigma in spec.sigmas:
        assert plan.sigma(plan.noise_multiplier(0.5, sigma.stream), sigma.stream) == pytest.approx(0.5)
    paper = inspect.signature(spec.plan_type.paper_noise).parameters
    assert {a.name for a in spec.paper_options} <= set(paper)
    assert all(game in audit_targets() for game in spec.audit_games)
    # the plan calibrates and accounts with the arguments' defaults
    noise = calibrate(plan, 2.0, 1e-5)
    assert set(noise) == set(plan.streams)


def test_every_audit_target_is_reachable_from_an_entry():
    games = audit_games()
    assert set(games) == set(audit_targets())
    assert games["diff2-bvr-l-sgd"] == "diff2" and games["double-spider-eta"] == "double-spider"


def _defaults(callable_) -> dict:
    """The keyword defaults of ``callable_``'s signature."""
    parameters = inspect.signature(callable_).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_defaults_are_the_python_apis(name):
    """An argument's default is the algorithm class's where the class takes it with a default, else the
    plan's (its field, or its paper calibration's keyword)."""
    spec = REGISTRY[name]
    own = _defaults(spec.algorithm_class())
    plan = {**_defaults(spec.plan_type), **_defaults(spec.plan)}
    paper = _defaults(spec.plan_type.paper_noise)
    optional = [a for a in spec.arguments + spec.paper_options if not a.required]
    for argument in optional:
        source = own if argument.name in own else paper if argument in spec.paper_options else plan
        assert argument.default == source[argument.name], argument.name


def test_privacy_defaults_are_the_algorithms():
    config = {f.name: f.default for f in dataclasses.fields(PrivacyConfig)}
    for argument in PRIVACY + CALIBRATION:
        if not argument.required:
            assert argument.default == config[argument.name], argument.name
    assert next(a for a in PRIVACY if a.name == "neighbouring").choices == NEIGHBOURING


@pytest.mark.parametrize(
    ("name", "sampling"), [("dp-sgd", "poisson"), ("dp-sgd", "wor"), ("dp-sgd", "full"), ("dp-gd", None)]
)
def test_default_neighbouring_is_the_algorithm_classs(name, sampling):
    x, y = torch.randn(8, 2, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cls, options = (DPGD, {}) if name == "dp-gd" else (DPSGD, {"sampling": sampling, "batch_size": 4})
    if sampling == "full":
        options["batch_size"] = None
    algorithm = cls(
        torch.nn.Linear(2, 1).double(),
        lambda out, target: (out.squeeze() - target) ** 2,
        x,
        y,
        lr=0.1,
        clip=1.0,
        steps=1,
        noise=1.0,
        privacy=PrivacyConfig(public_dataset_size=8),  # as the command line's --dataset-size states it
        **options,
    )
    spec = REGISTRY[name]
    assert spec.default_neighbouring(options) == algorithm.plan.neighbouring


@pytest.mark.parametrize("name", ["diff2", "dp-sgda", "private-diff", "double-spider", "phased"])
def test_the_papers_algorithms_default_to_replace_one(name):
    # Their classes build their plans with the plan's own relation, the papers' replace-one.
    spec = REGISTRY[name]
    relation = {f.name: f.default for f in dataclasses.fields(spec.plan_type)}["neighbouring"]
    assert spec.default_neighbouring() == relation == "replace-one"


def test_make_plan_names_missing_and_unknown_arguments():
    with pytest.raises(ValueError, match=r"unknown arguments \['rounds'\], missing \['steps'\]"):
        REGISTRY["diff2"].make_plan({"dataset_size": 10, "clients": 2, "rounds": 4, "restart": 2})


# ---- the front door: make_private reads each entry's layout -----------------------------------------------
def _regression(n: int = 12) -> TensorDataset:
    x, y = harness.REGRESSION.records(n, torch.Generator().manual_seed(0))
    return TensorDataset(x, y)


def _classification(n: int = 12) -> TensorDataset:
    return TensorDataset(*harness.DRO.records(n, torch.Generator().manual_seed(0)))


def _minimax(n: int = 12) -> TensorDataset:
    return TensorDataset(*harness.MINIMAX.records(n, torch.Generator().manual_seed(0)))


def _squared(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (0.5 * (output.squeeze(-1) - target) ** 2).mean()


_LINEAR = (lambda: harness.REGRESSION.model(True), _squared, _regression)
_DRO = (lambda: harness.DRO.model(True), torch.nn.CrossEntropyLoss(), _classification)
_AUC = (lambda: harness.MINIMAX.model(True), harness.MINIMAX.problem, _minimax)

# One small front-door run per algorithm with a layout: (model, criterion, data) and make_private's keywords.
FRONT_DOOR = {
    "dp-sgd": (_LINEAR, {"batch_size": 4, "epochs": 1, "lr": 0.1, "clip": 1.0}),
    "dp-gd": (_LINEAR, {"steps": 2, "lr": 0.1, "clip": 1.0}),
    "diff2": (_LINEAR, {"steps": 2, "restart": 2, "lr": 0.1, "clip": {"restart": 1.0, "difference": 1.0}}),
    "dp-sgda": (_AUC, {"batch_size": 4, "steps": 2, "lr": 0.1, "lr_y": 0.1, "clip": {"x": 1.0, "y": 1.0}}),
    "private-diff": (
        _AUC,
        {
            "batch_size": 4,
            "steps": 2,
            "restart": 2,
            "y_steps": 1,
            "lr": 0.1,
            "lr_y": 0.1,
            "clip": {"checkpoint": 1.0, "difference": (1.0, 0.0), "y": 1.0},
        },
    ),
    "double-spider": (
        _DRO,
        {
            "steps": 2,
            "restart": 2,
            "batch_sizes": (12, 4, 12, 4),
            "divergence": harness.ChiSquare(),
            "lam": 1.0,
            "lr": 0.1,
            "lr_eta": 0.1,
            "max_move": 1.0,
            "clip": {
                "eta-refresh": 1.0,
                "eta-difference": (1.0, 1.0),
                "x-refresh": 1.0,
                "x-difference": (1.0, 1.0),
            },
        },
    ),
    "recursive-spider": (
        _DRO,
        {
            "steps": 2,
            "restart": 2,
            "batch_sizes": (12, 4, 12, 4),
            "rho": 0.5,
            "lam0": 0.1,
            "lr": 0.1,
            "lr_lam": 0.05,
            "beta": 0.5,
            "loss_bound": 10.0,
            "clip": {"v-refresh": 1.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1.0},
        },
    ),
    "last-iterate": (
        _LINEAR,
        {"batch_size": 4, "epochs": 1, "lr": 0.1, "clip": 1.0, "weak_convexity": 0.0, "smoothness": 1.0},
    ),
}


def test_the_front_door_covers_every_entry_with_a_layout():
    front = registry.front_door()
    assert set(FRONT_DOOR) == set(front), f"FRONT_DOOR must name exactly {sorted(front)}"
    assert set(front) == {name for name, spec in REGISTRY.items() if spec.layout is not None}
    assert set(TRAINER_ALGORITHMS) == set(front)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_each_entrys_layout_fits_its_class(name):
    """The fields make_private reads agree with the class that runs the algorithm."""
    spec = REGISTRY[name]
    assert spec.layout in (*LAYOUTS, None) and spec.problem in PROBLEMS
    if spec.layout is None:
        return
    cls = spec.algorithm_class()
    parameters = inspect.signature(cls).parameters
    assert (spec.problem == "minimax") == issubclass(cls, MinimaxAlgorithm)
    assert spec.federated == ("clients" in parameters)
    if spec.layout == "sampled":  # make_private passes batch_size and reads the sampling scheme
        assert "batch_size" in parameters
        sampling = parameters.get("sampling")
        assert "sampling" in spec.algorithm_options or (
            sampling is not None and sampling.default is not inspect.Parameter.empty
        )
    if spec.layout == "per-stream":
        assert "batch_sizes" in parameters


def _required(cls: type) -> tuple[str, ...]:
    """The keyword arguments ``cls(...)`` takes no default for, through constructors that pass ``**kwargs``
    on to their base's."""
    required: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        required += [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY
                     and p.default is inspect.Parameter.empty and p.name not in required]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return tuple(required)
    return tuple(required)


@pytest.mark.parametrize("name", [name for name, spec in REGISTRY.items() if spec.layout is not None])
def test_what_make_private_reads_of_a_class_is_what_its_constructor_takes(name):
    """make_private reads the class's declarations (its required settings, the streams it clips) and the
    entry's sampling default, never the constructor's signature: here they are held to it."""
    spec = REGISTRY[name]
    cls = spec.algorithm_class()
    assert set(cls.required_settings) == set(_required(cls))
    for variant in {cls, *cls.__subclasses__()}:
        clip = inspect.signature(variant).parameters.get("clip")
        if clip is not None:  # a variant taking **kwargs takes its base's clip
            assert bool(variant.clip_streams) == ("Mapping" in str(clip.annotation)), variant
        assert set(variant.clip_pairs) <= set(variant.clip_streams), variant
    if spec.layout == "sampled":
        sampling = {**spec.defaults(), **spec.algorithm_options}.get("sampling")
        default = inspect.signature(cls).parameters["sampling"].default
        assert sampling is not None and ("sampling" in spec.algorithm_options or sampling == default)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_make_private_runs_every_entry_with_a_layout_and_refuses_the_others(name):
    spec = REGISTRY[name]
    if spec.layout is None:
        model, criterion, data = _LINEAR
        with pytest.raises(ValueError, match="algorithm: must be one of"):
            dpvr.make_private(model(), criterion, data(), algorithm=name, epsilon=1.0, steps=1)
        return
    (model, criterion, data), settings = FRONT_DOOR[name]
    trainer = dpvr.make_private(model(), criterion, data(), algorithm=name, epsilon=2.0, **settings)
    assert isinstance(trainer.algorithm, spec.algorithm_class())
    trainer.run()
    assert trainer.steps_done == trainer.total_steps >= 1
    assert trainer.privacy_spent().epsilon <= 2.0 * (1 + 1e-9)


def test_make_private_refuses_an_unknown_algorithm():
    model, criterion, data = _LINEAR
    with pytest.raises(ValueError, match="algorithm: must be one of"):
        dpvr.make_private(model(), criterion, data(), algorithm="dp-sdg", epsilon=1.0, steps=1)


# ---- one home per algorithm: each entry from its own module, its arguments from one schema ---------------
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_built_in_entry_is_registered_from_its_own_module(name):
    """dpvr.algorithms.<name> holds the entry that the registry serves, and the rules make_private applies
    are the ones bound there (no table elsewhere keyed by the name)."""
    import importlib

    from dpvr.trainer import defaults

    home = importlib.import_module(f"dpvr.algorithms.{name.replace('-', '_')}")
    assert home.SPEC is get(name)
    assert defaults.derivable(name) == tuple(home.SPEC.rules)
    assert defaults.derives_steps(name) == (home.SPEC.steps_rule is not None)
    assert callable(home.SPEC.data_parallel)


def test_the_schema_derives_arguments_and_refuses_what_it_cannot_parse():
    @dataclasses.dataclass(frozen=True)
    class Settings:
        size: int = registry.setting("n")
        sizes: tuple[int, ...] = registry.setting("b1,b2")
        rate: float | None = registry.setting("q", None)
        mode: str = registry.setting("a or b", "a", choices=("a", "b"))
        flag: bool = registry.setting("switch", True)

    size, sizes, rate, mode, flag = registry.schema_arguments(Settings)
    assert size == registry.Argument("size", int, "n", required=True)
    assert sizes.type is registry.ints and sizes.type("3,4") == (3, 4) and sizes.required
    assert rate == registry.Argument("rate", float, "q") and not rate.required
    assert mode == registry.Argument("mode", str, "a or b", default="a", choices=("a", "b"))
    assert flag.type is bool and flag.flag == "--no-flag"

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        size: int = 3

    with pytest.raises(TypeError, match=r"Undeclared.size: declare it with setting\(help, ...\)"):
        registry.schema_arguments(Undeclared)

    @dataclasses.dataclass(frozen=True)
    class Unparsed:
        point: complex = registry.setting("z")

    with pytest.raises(TypeError, match=r"Unparsed.point: no parser for 'complex'"):
        registry.schema_arguments(Unparsed)
    parsed = dataclasses.make_dataclass("Parsed", [("point", complex, registry.setting("z", parse=complex))])
    assert registry.schema_arguments(parsed)[0].type is complex
    with pytest.raises(TypeError, match="schema: expected a dataclass type"):
        registry.schema_arguments(Settings(1, (2,)))


def test_an_entry_states_its_data_parallel_support_as_a_callable():
    spec = get("dp-sgd")
    with pytest.raises(TypeError, match="dp-sgd: data_parallel must be a callable of the settings"):
        dataclasses.replace(spec, data_parallel=True)
    with pytest.raises(TypeError, match=r"dp-sgd: rules \['lr'\] must be callables"):
        dataclasses.replace(spec, rules={"lr": 0.1})
    refused = "algorithm: not data-parallel over a process group: it does not state"
    assert registry.undeclared({}).startswith(refused)
    assert registry.refuses("keeps x")({"a": 1}) == (
        "algorithm: not data-parallel over a process group: it keeps x; run it in one process (DIFF2 across "
        "processes: dpvr.distributed)"
    )
    private_diff = get("private-diff").data_parallel
    assert private_diff({"y_release": "ascent"}) is None
    assert private_diff({"y_release": "output"}).startswith("y_release: 'output' is not data-parallel")
