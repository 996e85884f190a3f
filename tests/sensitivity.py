"""A sensitivity harness: every release of every dpvr algorithm moves, between neighbouring datasets, by at
most the sensitivity its accountant charges for it, and the accountant charges what was released.

**What is checked.** Every release goes through :func:`dpvr.ops.noisy_update`, which releases
``v <- (0 if reset else v) + scale * sum + sigma * xi``. A stream's noise multiplier ``z`` is the noise std
over the add/remove bound on one record's contribution to the released value (:mod:`dpvr.privacy.relations`),
so a release with noise std ``sigma`` is charged for moving by ``sigma / z`` under add/remove and
``2 sigma / z`` under replace-one. With the noise off, the released values on two neighbouring datasets must
differ by no more than that, and ``sigma`` itself must be the same on both (a noise std that depends on the
private data is not a Gaussian mechanism of that std).

**Why lockstep.** The privacy of an adaptive composition is argued release by release, each conditioned on
everything released before it. So the harness runs an algorithm ``A`` on a dataset ``D`` and a twin ``B`` on
a neighbour ``D'`` and keeps ``B`` on ``A``'s released history:

- before every step ``B`` gets ``A``'s whole state (``PrivateAlgorithm._restore``: iterates, estimators,
  samplers, accountant), so both start the step from the same released past;
- inside a step, each of ``B``'s releases is compared with ``A``'s and then *overwritten* by it, so that a
  later release of the same step (DP-SGDA's ``y`` after ``x``, Double-SPIDER's ``x`` after ``eta``) is
  conditioned on the same past too;
- ``B`` draws exactly ``A``'s batches (under add/remove, plus the added record), and the differing record is
  put into every randomly sampled batch: the worst case the bound has to cover.

After a step ``B``'s state must equal ``A``'s again: anything that still differs reached the state from the
private data without passing through a release.

**Accounting.** The same runs check the accountant against what happened: each stream is charged once per
release (for the record exposed most often), with the noise multiplier the bound used, and for the batch
sizes, dataset sizes and sampling rates that were actually drawn.

Factories (one function per algorithm, :data:`ALGORITHMS`, keyed by the algorithm's name in
:mod:`dpvr.registry`; a variant of one, such as DP-SGD's clipping policies, as ``name/variant``) build every
algorithm from a dataset and a plain config dictionary;
``tests/privacy/test_sensitivity.py`` generates the configurations. An algorithm that releases once per run
instead (the phased framework) has its own lockstep, :data:`OUTPUT_PERTURBATION`; :func:`uncovered` names
every registry algorithm that has neither, which the tests refuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

import numpy as np
import torch
from torch import nn

import dpvr
import dpvr.ops
from dpvr import registry
from dpvr.algorithms import (
    DIFF2,
    DPGD,
    DPSGD,
    DPSGDA,
    DIFF2Plan,
    DoubleSpider,
    DoubleSpiderPlan,
    DPSGDAPlan,
    LastIterateDPSGD,
    PhasedOutputPerturbation,
    PrivateDiff,
    PrivateDiffPlan,
    RecursiveSpider,
    RecursiveSpiderPlan,
)
from dpvr.objectives import KL, AUCMargin, AUCModel, ChiSquare, LogisticRegression
from dpvr.objectives.dro import cross_entropy
from dpvr.optim import PrivacyConfig, PrivateAlgorithm, RuntimeConfig
from dpvr.optim.sampling import BatchSampler
from dpvr.privacy.accountant import event_to_dict

Shard = tuple[torch.Tensor, torch.Tensor]
Data = Union[Shard, list[Shard]]  # one dataset, or DIFF2's list of client shards
Config = Mapping[str, Any]

REPLACE_ONE, ADD_REMOVE = "replace-one", "add-remove"
RANDOM_SCHEMES = ("poisson", "wor")  # samplers whose batches the harness steers to hold the differing record
BOUND_SLACK = 1e-9  # relative: a release may exceed its bound by rounding only
ROUNDING = 1e-13  # relative to the released value's norm: rounding in v_in + scale * sum


# ---- records: models, losses and adversarial neighbours ----------------------------------------------------
HUGE_FEATURES = 1e3  # a record this large has a gradient far beyond any clip radius used here
HUGE_TARGET = 1e6  # ... and a regression residual whose sign its target decides, whatever the model


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """The same initial model every time, without touching the caller's random state."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def _unit(d: int) -> torch.Tensor:
    u = torch.arange(1, d + 1, dtype=torch.float64)
    return u / u.norm()


class Task(Protocol):
    """A model family and its records: a fresh (always identical) float64 model, ``n`` benign records, and
    an ``opposed`` pair of records built so that replacing one by the other attains the worst case."""

    def model(self, bias: bool) -> nn.Module: ...

    def records(self, n: int, rng: torch.Generator) -> Shard: ...

    def opposed(self, model: nn.Module) -> tuple[Shard, Shard]: ...


class Regression:
    """Squared loss on a linear model: per-sample gradients ``(w.x + b - y) (x, 1)``, so a huge record whose
    target has the opposite sign yields the opposite clipped gradient (the replace-one worst case ``2C``)."""

    d = 3

    def model(self, bias: bool) -> nn.Module:
        with _seeded():
            return nn.Linear(self.d, 1, bias=bias).double()

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * (output.squeeze() - target) ** 2

    def records(self, n: int, rng: torch.Generator) -> Shard:
        x = torch.randn(n, self.d, generator=rng, dtype=torch.float64)
        return x, torch.randn(n, generator=rng, dtype=torch.float64)

    def opposed(self, model: nn.Module) -> tuple[Shard, Shard]:
        x = HUGE_FEATURES * _unit(self.d)
        return (x, torch.tensor(HUGE_TARGET)), (x, torch.tensor(-HUGE_TARGET))


class AUC:
    """The AUC-margin minimax problem on a linear scorer. A huge record scored ``h ~ 1`` has opposite
    y-gradients as a positive and as a negative (with ``p m < 1``), and x-gradients on ``a`` and ``b``
    respectively (the scorer saturates): replacing one by the other attains ``2 C0`` on y and
    ``sqrt(2) C1`` on x."""

    d = 3
    problem = AUCMargin(0.3)

    def model(self, bias: bool) -> nn.Module:
        with _seeded():
            return AUCModel(nn.Linear(self.d, 1, bias=bias)).double()

    def records(self, n: int, rng: torch.Generator) -> Shard:
        x = torch.randn(n, self.d, generator=rng, dtype=torch.float64)
        return x, (torch.rand(n, generator=rng) < 0.3).long()

    def opposed(self, model: nn.Module) -> tuple[Shard, Shard]:
        u = _unit(self.d)
        with torch.no_grad():
            sign = (
                1.0 if float(model.net(u[None]).squeeze() - model.net(0 * u[None]).squeeze()) >= 0 else -1.0
            )
        x = sign * HUGE_FEATURES * u  # scored h ~ 1
        return (x, torch.tensor(1)), (x, torch.tensor(0))


class Classification:
    """Cross-entropy on a linear model with three classes, for the DRO algorithms. A huge record labelled with
    the class the model predicts has loss ~0; labelled otherwise, a huge loss: the two ends of every bounded
    per-record quantity of Double- and Recursive-SPIDER (dual eta-gradients, inner values)."""

    d, classes = 3, 3

    def model(self, bias: bool) -> nn.Module:
        with _seeded():
            return nn.Linear(self.d, self.classes, bias=bias).double()

    loss = staticmethod(cross_entropy)

    def records(self, n: int, rng: torch.Generator) -> Shard:
        x = torch.randn(n, self.d, generator=rng, dtype=torch.float64)
        return x, torch.randint(0, self.classes, (n,), generator=rng)

    def opposed(self, model: nn.Module) -> tuple[Shard, Shard]:
        x = HUGE_FEATURES * _unit(self.d)
        with torch.no_grad():
            predicted = int(model(x[None]).argmax())
        wrong = (predicted + 1) % self.classes
        return (x, torch.tensor(predicted)), (x, torch.tensor(wrong))


REGRESSION, MINIMAX, DRO = Regression(), AUC(), Classification()


def adversarial_pair(task: Task, model: nn.Module, kind: str, benign: Shard) -> tuple[Shard, Shard]:
    """The differing record: ``(row in D, row in D')``.

    ``"opposed"``: built to attain the worst case (see each task); ``"huge"``: a benign row replaced by a
    huge one whose gradient is clipped; ``"nan"``/``"inf"``: a row whose features (so loss and gradients) are
    not finite, which the non-finite policy must drop.
    """
    x, y = benign
    if kind == "opposed":
        return task.opposed(model)
    if kind == "huge":
        return (x, y), task.opposed(model)[1]
    if kind in ("nan", "inf"):
        return (x, y), (torch.full_like(x, math.nan if kind == "nan" else math.inf), y)
    raise ValueError(f"unknown adversary {kind!r}")


@dataclass(frozen=True)
class Neighbours:
    """Two neighbouring datasets and where they differ.

    Under replace-one, row ``index`` of shard ``shard`` differs; under add/remove, ``neighbour`` has one row
    more, appended to that shard at row ``index`` (``original`` has no such row).
    """

    relation: str
    original: Data
    neighbour: Data
    shard: int
    index: int

    def steer(self, sampler: BatchSampler, indices: np.ndarray) -> np.ndarray:
        """``A``'s batch, with the differing row swapped in (replace-one; same size) if it was not drawn: the
        worst case for the sensitivity, and a batch of the size the accountant charges. Every random
        sampler is steered (DIFF2's other clients hold the same records on both sides: no change there)."""
        if self.relation != REPLACE_ONE or sampler.scheme not in RANDOM_SCHEMES or self.index >= sampler.n:
            return indices
        if self.index in indices:
            return indices
        if sampler.scheme == "poisson" or len(indices) == 0:
            return np.sort(np.append(indices, self.index))
        return np.sort(np.append(indices[1:], self.index))

    def mirror(self, sampler: BatchSampler, indices: np.ndarray) -> np.ndarray:
        """``B``'s batch: ``A``'s, plus the added row where ``B``'s sampler can reach it (add/remove)."""
        if self.relation == ADD_REMOVE and sampler.n > self.index and self.index not in indices:
            return np.append(indices, self.index)
        return indices


def neighbours(task: Task, config: Config) -> Neighbours:
    """The neighbouring pair of ``config``: ``sizes`` (one per shard; or ``n``), ``relation``, ``shard``,
    ``index``, ``adversary``, ``features`` (``"zero"``: all-zero features, which with a bias-free model give
    zero gradients and so releases that do not move the iterate) and ``seed``."""
    sizes = list(config.get("sizes", [config.get("n")]))
    rng = torch.Generator().manual_seed(int(config["seed"]))
    shards = [task.records(n, rng) for n in sizes]
    if config.get("features") == "zero":
        shards = [(torch.zeros_like(x), y) for x, y in shards]
    shard, index, relation = int(config.get("shard", 0)), int(config["index"]), config["relation"]
    x, y = shards[shard]
    model = task.model(config.get("bias", True))
    benign = (x[index], y[index])
    before, after = adversarial_pair(task, model, config["adversary"], benign)
    if relation == REPLACE_ONE:
        x0, y0, x1, y1 = x.clone(), y.clone(), x.clone(), y.clone()
        (x0[index], y0[index]), (x1[index], y1[index]) = before, after
        original, neighbour = (x0, y0), (x1, y1)
    elif relation == ADD_REMOVE:
        index = len(x)
        original, neighbour = (x, y), (torch.cat([x, after[0][None]]), torch.cat([y, after[1][None]]))
    else:
        raise ValueError(f"unknown relation {relation!r}")
    pair = [list(shards), list(shards)]
    pair[0][shard], pair[1][shard] = original, neighbour
    if "sizes" not in config:
        return Neighbours(relation, pair[0][0], pair[1][0], 0, index)
    return Neighbours(relation, pair[0], pair[1], shard, index)


# ---- the factory table: every algorithm's construction, in one place --------------------------------------
def _noise(streams: Sequence[str], config: Config) -> dict[str, Any]:
    """The ``noise`` keyword: a noise multiplier for each stream that releases (a stream with no releases
    takes none), distinct per stream so that a mix-up of streams shows."""
    z = float(config.get("z", 2.0))
    return {"noise": {s: z * (1 + k / 8) for k, s in enumerate(streams)}}


def _settings(config: Config, **privacy: Any) -> dict[str, Any]:
    """The keywords every algorithm takes from a config: its own ``options`` (constructor keywords), the
    ``runtime`` group from the seed and gradient path, and the ``privacy`` group from the accountant plus
    what the factory adds (``privacy``)."""
    seed = int(config["seed"])
    runtime = RuntimeConfig(
        grad_mode=config.get("grad_mode", "auto"),
        generator=dpvr.NoiseGenerator(seed, reproducible=True),
        sampler_seed=seed,
    )
    accounting = PrivacyConfig(accountant=config.get("accountant", "rdp"), **privacy)
    return {"privacy": accounting, "runtime": runtime, **config.get("options", {})}


def _batch_size(config: Config, n: int) -> int:
    options = config["options"]
    return n if options.get("sampling") == "full" else int(options["batch_size"])


def build_dpsgd(data: Shard, config: Config, cls: type = DPSGD) -> PrivateAlgorithm:
    """DP-SGD on ``data``. Under add/remove the size of ``D`` (``config["n"]``) is stated public on both
    sides, so ``D'`` (one record more) is planned from it too; with ``config["epsilon"]`` the noise is
    calibrated (where a size read from the data would show as a different noise std on ``D'``)."""
    x, y = data
    privacy: dict[str, Any] = {"neighbouring": config.get("relation")}
    if config.get("relation") == ADD_REMOVE:
        privacy["public_dataset_size"] = config.get("n")
    if "epsilon" in config:
        privacy["epsilon"] = config["epsilon"]
    options = _settings(config, **privacy)
    if options.get("sampling") == "cyclic":  # the last-iterate bound needs the loss's curvature constants
        options = {"weak_convexity": 0.0, "smoothness": 1.0, "bound": "best", **options}
    noise = {} if "epsilon" in config else _noise(["gradient"], config)
    model = REGRESSION.model(config.get("bias", True))
    return cls(model, REGRESSION.loss, x, y, **noise, **options)


def build_dpgd(data: Shard, config: Config) -> PrivateAlgorithm:
    return build_dpsgd(data, config, DPGD)


def build_last_iterate(data: Shard, config: Config) -> PrivateAlgorithm:
    """Cyclic DP-SGD accounted by its last-iterate bound: DP-SGD with the registry entry's options."""
    options = {**config["options"], **registry.get("last-iterate").algorithm_options}
    return build_dpsgd(data, {**config, "options": options})


def registry_factory(
    name: str, streams: Sequence[str] = ("gradient",), task: Task = REGRESSION
) -> Callable[[Shard, Config], PrivateAlgorithm]:
    """A factory for registry algorithm ``name`` whose class is built like DP-SGD's,
    ``cls(model, loss, inputs, targets, noise={stream: z}, **settings)`` on one dataset: the class and its
    options from the registry entry, the model and loss from ``task``, one noise multiplier per stream of
    ``streams``."""

    def build(data: Shard, config: Config) -> PrivateAlgorithm:
        spec = registry.get(name)
        x, y = data
        options = {**spec.algorithm_options, **_settings(config)}
        model = task.model(config.get("bias", True))
        return spec.algorithm_class()(model, task.loss, x, y, **_noise(streams, config), **options)

    return build


def build_diff2(data: list[Shard], config: Config) -> PrivateAlgorithm:
    o, sizes = config["options"], [len(x) for x, _ in data]
    local = o.get("routine") == "bvr-l-sgd"
    plan = DIFF2Plan(
        dataset_size=min(sizes),
        clients=len(sizes),
        steps=o["steps"],
        restart=o["restart"],
        local_steps=o.get("local_steps", 1),
        local_batch=o.get("local_batch") if local else None,
    )
    noise = _noise(plan.streams, config)
    model = REGRESSION.model(config.get("bias", True))
    return DIFF2(model, REGRESSION.loss, data, **noise, **_settings(config))


def build_dpsgda(data: Shard, config: Config) -> PrivateAlgorithm:
    x, y = data
    o = config["options"]
    plan = DPSGDAPlan(len(x), _batch_size(config, len(x)), o["steps"], o.get("sampling", "wor"))
    noise = _noise(plan.streams, config)
    model = MINIMAX.model(config.get("bias", True))
    return DPSGDA(model, MINIMAX.problem, x, y, **noise, **_settings(config))


def build_private_diff(data: Shard, config: Config) -> PrivateAlgorithm:
    x, y = data
    o = config["options"]
    plan = PrivateDiffPlan(
        len(x),
        _batch_size(config, len(x)),
        o["steps"],
        o["restart"],
        o["y_steps"],
        o.get("sampling", "wor"),
        y_release=o.get("y_release", "ascent"),
    )
    noise = _noise(plan.streams, config)
    model = MINIMAX.model(config.get("bias", True))
    return PrivateDiff(model, MINIMAX.problem, x, y, **noise, **_settings(config))


def build_double_spider(data: Shard, config: Config) -> PrivateAlgorithm:
    x, y = data
    options = _settings(config)
    options["divergence"] = {"chi2": ChiSquare(), "kl": KL()}[options.get("divergence", "chi2")]
    plan = DoubleSpiderPlan(
        len(x), options["steps"], options["restart"], tuple(options["batch_sizes"])
    )
    model = DRO.model(config.get("bias", True))
    return DoubleSpider(model, DRO.loss, x, y, **_noise(plan.streams, config), **options)


def build_recursive_spider(data: Shard, config: Config) -> PrivateAlgorithm:
    x, y = data
    options = _settings(config)
    plan = RecursiveSpiderPlan(
        len(x), options["steps"], options["restart"], tuple(options["batch_sizes"])
    )
    model = DRO.model(config.get("bias", True))
    return RecursiveSpider(model, DRO.loss, x, y, **_noise(plan.streams, config), **options)


def _diff2_exposure(alg: DIFF2, release: Release) -> Hashable | None:
    """A local step of round ``r`` reads only client ``r mod P``; the accountant charges the busiest one."""
    return release.step % len(alg.transport.sizes) if release.stream == "local" else None


@dataclass(frozen=True)
class Algorithm:
    """One row of the factory table: how to build the algorithm, on which task, and which of its streams an
    adversarial record can drive to the worst case (checked for tightness, not only as an upper bound)."""

    name: str
    build: Callable[[Data, Config], PrivateAlgorithm]
    task: Task
    tight: tuple[str, ...] = ()
    exposure: Callable[[PrivateAlgorithm, Release], Hashable | None] = lambda alg, release: None
    #: streams whose accountant, once rounds have been re-run from an older checkpoint, charges each of
    #: their releases (an upper bound the algorithm documents: it no longer knows which record is busiest)
    every_release_once_branched: tuple[str, ...] = ()


#: The stepped algorithms, keyed by their names in :mod:`dpvr.registry`.
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("dp-sgd", build_dpsgd, REGRESSION, tight=("gradient",)),
        Algorithm("dp-gd", build_dpgd, REGRESSION, tight=("gradient",)),
        Algorithm("diff2", build_diff2, REGRESSION, tight=("restart",), exposure=_diff2_exposure,
                  every_release_once_branched=("local",)),
        Algorithm("dp-sgda", build_dpsgda, MINIMAX, tight=("x", "y")),
        Algorithm("private-diff", build_private_diff, MINIMAX, tight=("checkpoint", "y")),
        Algorithm("double-spider", build_double_spider, DRO, tight=("eta-refresh",)),
        Algorithm("recursive-spider", build_recursive_spider, DRO, tight=("s",)),
        Algorithm("last-iterate", build_last_iterate, REGRESSION, tight=("gradient",)),
        # DP-SGD's clipping policies (options carry clipping=): per-layer radii, and private adaptive
        # clipping, whose noisy count of unclipped records is a second stream on the gradient's batch
        Algorithm("dp-sgd/per-layer", build_dpsgd, REGRESSION, tight=("gradient",)),
        Algorithm("dp-sgd/adaptive", build_dpsgd, REGRESSION, tight=("gradient",)),
    )
}


# ---- the tape: what one run released and drew -----------------------------------------------------------
@dataclass(frozen=True)
class Draw:
    """One batch a sampler drew, with the sampler's public settings at the time."""

    scheme: str
    population: int
    rate: float
    indices: np.ndarray


@dataclass(frozen=True)
class Release:
    """One call of the noisy release: the stream, its noise std and the released value (noise off unless the
    tape runs with noise), the batches drawn since the previous release, and what the call wrote (so that a
    replaying twin can be put on this release's output)."""

    stream: str
    sigma: float
    value: np.ndarray
    draws: tuple[Draw, ...]
    step: int
    written: tuple[Any, ...] = field(repr=False)
    result: Any = field(repr=False)


def _listed(arrays: Any) -> list[Any]:
    if arrays is None:
        return []
    return list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]


def _host(array: Any) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    return np.array(array, dtype=np.float64).reshape(-1)


def _copy(array: Any) -> Any:
    return array.detach().clone() if isinstance(array, torch.Tensor) else np.array(array, copy=True)


def _assign(target: Any, source: Any) -> None:
    if isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(source)
    else:
        np.copyto(target, source)


class Tape:
    """Records every release and every batch draw made while :meth:`running`.

    A plain tape turns the noise off and, given ``pair``, steers random batches to hold the differing
    record. A tape that ``follows`` another replays it: each draw returns the followed run's batch (mirrored
    for add/remove), and each release is recorded and then overwritten by the followed run's output, so the
    run stays on the followed run's released history. ``noise=True`` leaves the noise on (resume checks).
    """

    def __init__(
        self,
        *,
        pair: Neighbours | None = None,
        follows: Tape | None = None,
        noise: bool = False,
        step: int = 0,
    ) -> None:
        self.pair, self.follows, self.noise, self.step = pair, follows, noise, step
        self.releases: list[Release] = []
        self.draws: list[Draw] = []
        self._pending: list[Draw] = []

    # -- the patched functions --------------------------------------------------------------------------
    def _noisy_update(self, original: Callable[..., Any], v: Any, **kwargs: Any) -> Any:
        sigma = float(kwargs["sigma"])
        result = original(v, **{**kwargs, "sigma": kwargs["sigma"] if self.noise else 0.0})
        written = [*_listed(v), *_listed(kwargs.get("params")), *_listed(kwargs.get("params_prev"))]
        value = np.concatenate([_host(t) for t in _listed(v)])
        release = Release(
            kwargs["stream"],
            sigma,
            value,
            tuple(self._pending),
            self.step,
            tuple(_copy(t) for t in written),
            result,
        )
        self._pending = []
        if self.follows is not None:
            k = len(self.releases)
            if k >= len(self.follows.releases) or self.follows.releases[k].stream != release.stream:
                raise AssertionError(
                    f"step {self.step}: release {k} is of stream {release.stream!r} on the neighbour but "
                    f"{[r.stream for r in self.follows.releases[k : k + 1]] or 'absent'} on the original: "
                    "which releases happen depends on the private data"
                )
            lead = self.follows.releases[k]
            for target, source in zip(written, lead.written):
                _assign(target, source)
            result = lead.result
        self.releases.append(release)
        return result

    def _draw(self, original: Callable[[BatchSampler], np.ndarray], sampler: BatchSampler) -> np.ndarray:
        if self.follows is None:
            indices = original(sampler)
            if self.pair is not None:
                indices = self.pair.steer(sampler, indices)
        else:
            k = len(self.draws)
            if k >= len(self.follows.draws):
                raise AssertionError(f"step {self.step}: the neighbour drew more batches than the original")
            indices = self.follows.draws[k].indices
            if self.pair is not None:
                indices = self.pair.mirror(sampler, indices)
        draw = Draw(sampler.scheme, sampler.n, sampler.rate, np.array(indices))
        self.draws.append(draw)
        self._pending.append(draw)
        return indices

    @contextlib.contextmanager
    def running(self) -> Iterator[Tape]:
        """Routes every release and batch draw through this tape (the algorithms look both up at call time:
        ``ops.noisy_update``, ``sampler.draw``)."""
        noisy_update, draw = dpvr.ops.noisy_update, BatchSampler.draw
        patches = [
            (dpvr.ops, "noisy_update", lambda v, **kwargs: self._noisy_update(noisy_update, v, **kwargs)),
            (BatchSampler, "draw", lambda sampler: self._draw(draw, sampler)),
        ]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, patched in patches:
            setattr(owner, name, patched)
        try:
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


# ---- comparing two runs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """One release on ``D`` against the same release on ``D'``: ``gap`` is the distance between the two
    released values, ``bound`` what the accountant charges (``sigma / z``, twice that under replace-one)."""

    step: int
    stream: str
    sigma: float
    sigma_neighbour: float
    bound: float
    gap: float
    norm: float

    @property
    def ratio(self) -> float:
        """``gap / bound``: at most 1, and close to 1 where the charge is tight."""
        if self.bound > 0:
            return self.gap / self.bound
        return 0.0 if self.gap == 0 else math.inf

    def violation(self) -> str | None:
        """Why this release breaks its charge, or ``None``."""
        problems = []
        if self.sigma != self.sigma_neighbour:
            problems.append(
                f"noise std {self.sigma!r} on D but {self.sigma_neighbour!r} on D' (the noise "
                "depends on the private data)"
            )
        if self.bound == 0:
            ok = self.gap == 0
        else:
            ok = self.gap <= self.bound * (1 + BOUND_SLACK) + ROUNDING * self.norm
        if not ok:
            problems.append(
                f"the release moved by {self.gap:.6g}, the accountant charges {self.bound:.6g} "
                f"(ratio {self.ratio:.4g}; sigma {self.sigma:.6g})"
            )
        return f"step {self.step}, stream {self.stream!r}: " + "; ".join(problems) if problems else None


def compare(
    alg: PrivateAlgorithm | Mapping[str, float],
    original: Sequence[Release],
    neighbour: Sequence[Release],
    relation: str,
) -> list[Comparison]:
    """Pairs the releases of a step (or run) on ``D`` and ``D'``; ``alg`` gives the noise multipliers."""
    noise = alg if isinstance(alg, Mapping) else alg.noise
    if len(original) != len(neighbour):
        raise AssertionError(f"{len(original)} releases on D, {len(neighbour)} on D'")
    factor = 2.0 if relation == REPLACE_ONE else 1.0
    out = []
    for a, b in zip(original, neighbour):
        z = noise[a.stream]
        gap = float(np.linalg.norm(a.value - b.value)) if a.value.size else 0.0
        norm = float(max(np.linalg.norm(a.value), np.linalg.norm(b.value)))
        out.append(Comparison(a.step, a.stream, a.sigma, b.sigma, factor * a.sigma / z, gap, norm))
    return out


@dataclass
class Outcome:
    """What a lockstep run found: every comparison, and the original run's whole tape."""

    algorithm: PrivateAlgorithm
    comparisons: list[Comparison]
    releases: list[Release]

    def violations(self) -> list[str]:
        return [v for c in self.comparisons if (v := c.violation()) is not None]

    def ratios(self) -> dict[str, float]:
        """The largest ``gap / bound`` seen on each stream (releases with a positive bound)."""
        out: dict[str, float] = {}
        for c in self.comparisons:
            if c.bound > 0:
                out[c.stream] = max(out.get(c.stream, 0.0), c.ratio)
        return out


def assert_within_sensitivity(outcome: Outcome) -> None:
    found = outcome.violations()
    if found:
        shown = "\n  ".join(found[:6])
        more = f"\n  ... and {len(found) - 6} more" if len(found) > 6 else ""
        raise AssertionError(f"{len(found)} release(s) break their charged sensitivity:\n  {shown}{more}")


def _state(alg: PrivateAlgorithm) -> dict[str, list[torch.Tensor]]:
    state = alg.state_dict()
    return {"params": state["params"], **{f"buffer {k}": v for k, v in state["buffers"].items()}}


def assert_state_is_released(original: PrivateAlgorithm, neighbour: PrivateAlgorithm, step: int) -> None:
    """After a step replayed on ``A``'s releases, ``B``'s state must be ``A``'s: any difference reached the
    state from the private data without passing through a (noisy) release."""
    mine, theirs = _state(original), _state(neighbour)
    for name, tensors in mine.items():
        for k, (a, b) in enumerate(zip(tensors, theirs[name])):
            if not torch.equal(a, b):
                raise AssertionError(
                    f"step {step}: {name}[{k}] differs between D and D' after every release was replayed "
                    f"(max |difference| {float((a - b).abs().max()):.3g}): private data reached the state "
                    "without a release"
                )


def lockstep(spec: Algorithm, config: Config, pair: Neighbours | None = None) -> Outcome:
    """Runs ``spec`` on both datasets of ``pair`` (default: :func:`neighbours` of ``config``) in lockstep,
    noise off; returns every comparison. Raises ``ValueError`` if the library refuses the configuration."""
    pair = neighbours(spec.task, config) if pair is None else pair
    a = spec.build(pair.original, config)
    b = spec.build(pair.neighbour, config)
    comparisons: list[Comparison] = []
    releases: list[Release] = []
    relation = a.accountant.neighbouring
    for step in range(1, a.total_steps + 1):
        b._restore(a.state_dict())
        with Tape(pair=pair, step=step).running() as tape_a:
            a.step()
        with Tape(pair=pair, follows=tape_a, step=step).running() as tape_b:
            b.step()
        comparisons += compare(a, tape_a.releases, tape_b.releases, relation)
        releases += tape_a.releases
        assert_state_is_released(a, b, step)
    return Outcome(a, comparisons, releases)


# ---- accounting -----------------------------------------------------------------------------------------
def _ledger(alg: PrivateAlgorithm) -> list[dict[str, Any]]:
    return alg.accountant.state_dict()["ledger"]


def _gaussian(event: Mapping[str, Any]) -> Mapping[str, Any]:
    while "event" in event:
        event = event["event"]
    return event


def _check_draw(stream: str, step: int, draw: Draw, event: Mapping[str, Any]) -> str | None:
    """Whether a batch that was drawn is the batch the accountant's event prices."""
    where = f"step {step}, stream {stream!r}"
    kind, size = event["type"], len(draw.indices)
    unique = len(set(draw.indices.tolist())) == size and all(0 <= i < draw.population for i in draw.indices)
    if kind == "SampledWithoutReplacementDpEvent":
        if draw.scheme != "wor" or not unique or size != event["sample_size"]:
            return (
                f"{where}: drew {size} records ({draw.scheme}) but is charged for batches of "
                f"{event['sample_size']} without replacement"
            )
        if draw.population < event["source_dataset_size"]:
            return (
                f"{where}: drew from {draw.population} records but is charged for a population of "
                f"{event['source_dataset_size']}"
            )
    elif kind == "PoissonSampledDpEvent":
        if draw.scheme != "poisson" or not math.isclose(
            draw.rate, event["sampling_probability"], rel_tol=1e-12
        ):
            return (
                f"{where}: drew at rate {draw.rate:g} ({draw.scheme}) but is charged for Poisson sampling "
                f"at rate {event['sampling_probability']:g}"
            )
    elif kind == "GaussianDpEvent" and sorted(draw.indices.tolist()) != list(range(draw.population)):
        return f"{where}: drew {size} of {draw.population} records but is charged as a full batch"
    return None


def accounting_problems(
    alg: PrivateAlgorithm,
    releases: Sequence[Release],
    exposure: Callable[[PrivateAlgorithm, Release], Hashable | None],
    *,
    complete_plan: bool = True,
    every_release: Collection[str] = (),
) -> list[str]:
    """Everything on which the accountant and the run disagree (empty when they agree); ``complete_plan``:
    a complete run must also be charged exactly its plan (not so a run with re-run branches);
    ``every_release``: streams the accountant may charge once per release rather than for the busiest record
    alone (never less than the latter, never more than the former)."""
    ledger = _ledger(alg)
    problems: list[str] = []
    streams = sorted({r.stream for r in releases} | {s for e in ledger for s in e["streams"]})
    for stream in streams:
        mine = [r for r in releases if r.stream == stream]
        entries = [e for e in ledger if stream in e["streams"]]
        distinct = {json.dumps(e["event"], sort_keys=True): e for e in entries}
        if isinstance(alg, LastIterateDPSGD):
            problems += _last_iterate_problems(alg, stream, mine, entries)
            continue
        # one charge per release that can read the record exposed to the most releases
        per_key: Counter[Hashable] = Counter()
        everyone = 0
        for r in mine:
            key = exposure(alg, r)
            if key is None:
                everyone += 1
            else:
                per_key[key] += 1
        released = everyone + max(per_key.values(), default=0)
        charged = sum(e["count"] for e in entries)
        within = released <= charged <= len(mine) if stream in every_release else charged == released
        if not within:
            problems.append(
                f"stream {stream!r}: {released} release(s) reach a record, the accountant charges {charged}"
            )
        if len(distinct) > 1:
            problems.append(f"stream {stream!r}: charged with {len(distinct)} different events")
        for entry in distinct.values():
            event, gaussian = entry["event"], _gaussian(entry["event"])
            weights = entry["streams"]
            z = (
                alg.noise[stream]
                if len(weights) == 1
                else math.fsum(alg.noise[s] ** -2 for s in weights) ** -0.5
            )
            if not math.isclose(gaussian["noise_multiplier"], z, rel_tol=1e-12):
                problems.append(
                    f"stream {stream!r}: charged with noise multiplier "
                    f"{gaussian['noise_multiplier']!r}, the algorithm's is {z!r}"
                )
            for r in mine:
                problems += [p for d in r.draws if (p := _check_draw(stream, r.step, d, event))]
                if not r.draws and event["type"] != "GaussianDpEvent" and r.sigma > 0:
                    shared = [q for q in releases if q.step == r.step and q.stream in weights and q.draws]
                    if not shared:
                        problems.append(
                            f"step {r.step}, stream {stream!r}: released without drawing a batch "
                            f"but charged as sampled ({event['type']})"
                        )
    if complete_plan and alg.steps_done == alg.total_steps and not isinstance(alg, LastIterateDPSGD):
        problems += _plan_problems(alg)
    return problems


def _plan_problems(alg: PrivateAlgorithm) -> list[str]:
    """After a complete run, the ledger must be the plan's whole mechanism, which is what calibration priced:
    each stream's count, and each release's event."""
    ledger = _ledger(alg)
    problems = []
    mechanism = alg.plan.mechanism(alg.noise)
    for stream in mechanism.streams:
        charged = sum(e["count"] for e in ledger if stream.name in e["streams"])
        if charged != stream.count:
            problems.append(
                f"stream {stream.name!r}: the plan (what calibration priced) has {stream.count} "
                f"release(s), the complete run charged {charged}"
            )
        expected = event_to_dict(mechanism.step(stream.name)[1])
        if any(e["event"] != expected for e in ledger if stream.name in e["streams"]):
            problems.append(f"stream {stream.name!r}: charged another event than the plan's {expected}")
    unplanned = {s for e in ledger for s in e["streams"]} - {s.name for s in mechanism.streams}
    if unplanned:
        problems.append(f"charged streams the plan does not have: {sorted(unplanned)}")
    return problems


def _last_iterate_problems(
    alg: PrivateAlgorithm, stream: str, releases: Sequence[Release], entries: Sequence[Mapping[str, Any]]
) -> list[str]:
    """A last-iterate bound is recorded as one event covering the run so far: it must be the plan's for the
    steps released, and the batches must be the cyclic traversal the bound assumes."""
    problems = []
    expected = event_to_dict(dataclasses.replace(alg.plan, steps=len(releases)).mechanism(alg.noise).event)
    if len(entries) != 1 or entries[0]["count"] != 1:
        problems.append(f"stream {stream!r}: {len(entries)} ledger entries for a whole-run bound")
    elif entries[0]["event"] != expected:
        problems.append(
            f"stream {stream!r}: charged {entries[0]['event']}, the plan for {len(releases)} steps "
            f"gives {expected}"
        )
    draws = [d for r in releases for d in r.draws]
    b, n = alg.plan.batch_size, alg.plan.dataset_size
    for k, d in enumerate(draws):
        start = (k * b) % n
        if d.indices.tolist() != list(range(start, start + b)):
            problems.append(
                f"step {k + 1}, stream {stream!r}: drew {d.indices.tolist()}, the cyclic traversal "
                f"the bound assumes reads rows {start}..{start + b - 1}"
            )
    return problems


def assert_accounting_matches(spec: Algorithm, outcome: Outcome) -> None:
    problems = accounting_problems(outcome.algorithm, outcome.releases, spec.exposure)
    if problems:
        shown = "\n  ".join(problems[:6])
        more = f"\n  ... and {len(problems) - 6} more" if len(problems) > 6 else ""
        raise AssertionError(f"the accountant disagrees with the run:\n  {shown}{more}")


# ---- resume ---------------------------------------------------------------------------------------------
def resume_differences(spec: Algorithm, config: Config, data: Data, at: int) -> list[str]:
    """Runs ``spec`` uninterrupted, and again with a checkpoint after ``at`` steps loaded into a freshly built
    algorithm; noise on. The releases after the resume point, the batches drawn and the final accountant must
    be bit-identical (empty list), or what differs is returned."""
    whole = spec.build(data, config)
    with Tape(noise=True).running() as reference:
        for step in range(1, whole.total_steps + 1):
            reference.step = step
            whole.step()
    first = spec.build(data, config)
    with Tape(noise=True).running() as before:
        for step in range(1, at + 1):
            before.step = step
            first.step()
    with tempfile.TemporaryDirectory() as tmp, Tape(noise=True).running() as after:
        path = os.path.join(tmp, "run.ckpt")  # with the run's ledger, written as the resumed run steps
        first.save_checkpoint(path)
        resumed = spec.build(data, config)
        resumed.load_checkpoint(path)
        for step in range(at + 1, resumed.total_steps + 1):
            after.step = step
            resumed.step()
    problems = []
    expected = reference.releases[len(before.releases) :]
    if [r.stream for r in expected] != [r.stream for r in after.releases]:
        problems.append(
            f"streams after the resume: {[r.stream for r in after.releases]}, uninterrupted: "
            f"{[r.stream for r in expected]}"
        )
    for r, s in zip(expected, after.releases):
        if r.sigma != s.sigma or not np.array_equal(r.value, s.value):
            problems.append(
                f"step {r.step}, stream {r.stream!r}: the resumed release differs from the "
                f"uninterrupted one by {float(np.linalg.norm(r.value - s.value)):.3g}"
            )
    draws = reference.draws[len(before.draws) :]
    if [d.indices.tolist() for d in draws] != [d.indices.tolist() for d in after.draws]:
        problems.append("the resumed run drew other batches than the uninterrupted one")
    if resumed.accountant.state_dict() != whole.accountant.state_dict():
        problems.append("the resumed run's accountant differs from the uninterrupted run's")
    return problems


def older_resume_problems(spec: Algorithm, config: Config, data: Data, at: int) -> list[str] | None:
    """Runs ``spec`` to the end with a checkpoint after ``at`` steps, then resumes that (older) checkpoint in
    a fresh algorithm and runs it to the end again; noise on. The resumed accountant must charge every
    release both branches made, per stream and for the record exposed most (the releases the first branch
    made after the checkpoint come from the run's ledger; a stream of ``spec.every_release_once_branched``
    may be charged up to once per release), and the re-run branch must have fresh sampling
    randomness: every random sampler restarted from another state than the checkpoint's, and other batches
    drawn than the first branch's where drawing the same ones again by chance is unlikely
    (:data:`REPEAT_CHANCE`; a small run's few batches of a few records repeat often, and a fixed-size batch
    of the whole dataset always does). ``None``: the library refused to go on from the older checkpoint (a
    last-iterate run that released its last iterate)."""
    first = spec.build(data, config)
    with tempfile.TemporaryDirectory() as tmp, Tape(noise=True).running() as tape:
        path = os.path.join(tmp, "run.ckpt")
        for step in range(1, first.total_steps + 1):
            if step == at + 1:
                first.save_checkpoint(path)
                branch_start = len(tape.draws)
                at_checkpoint = _random_sampler_states(first)
            tape.step = step
            first.step()
        resumed = spec.build(data, config)
        try:
            resumed.load_checkpoint(path)
        except ValueError as refused:
            if isinstance(resumed, LastIterateDPSGD) and "second trajectory" in str(refused):
                return None
            raise
        first_branch = tape.draws[branch_start:]
        restarted = _random_sampler_states(resumed)
        for step in range(at + 1, resumed.total_steps + 1):
            tape.step = step
            resumed.step()
    problems = accounting_problems(resumed, tape.releases, spec.exposure, complete_plan=False,
                                   every_release=spec.every_release_once_branched)
    if len(restarted) != len(at_checkpoint):
        problems.append(f"{len(restarted)} random samplers after the resume, {len(at_checkpoint)} before")
    for k, (before, after) in enumerate(zip(at_checkpoint, restarted)):
        if before == after:
            problems.append(f"random sampler {k} re-runs from the state it had: its sampling is not fresh")
    rerun = tape.draws[len(tape.draws) - len(first_branch) :]
    sampled = [d for d in first_branch if d.scheme in ("poisson", "wor", "random-allocation")]
    same = [d.indices.tolist() for d in rerun] == [d.indices.tolist() for d in first_branch]
    if sampled and same and _repeat_chance(sampled) < REPEAT_CHANCE:
        problems.append("the re-run drew the first branch's batches again: its sampling is not fresh")
    return problems


REPEAT_CHANCE = 1e-4  # below this chance of a repeat, a re-run that draws the same batches is not fresh


def _random_sampler_states(alg: PrivateAlgorithm) -> list[dict[str, Any]]:
    """The state of each of ``alg``'s samplers that draws at random."""
    return [s.state_dict() for s in alg._samplers() if s.scheme in ("poisson", "wor", "random-allocation")]


def _repeat_chance(draws: Sequence[Draw]) -> float:
    """The chance that independent sampling draws these batches again: ``1 / C(n, b)`` for a fixed-size
    batch, ``(q^2 + (1 - q)^2)^n`` for a Poisson one; a random allocation's batch is counted as 1 (an upper
    bound)."""
    chance = 1.0
    for d in draws:
        if d.scheme == "wor":
            chance /= math.comb(d.population, len(d.indices))
        elif d.scheme == "poisson":
            chance *= (d.rate**2 + (1 - d.rate) ** 2) ** d.population
    return chance


# ---- phased output perturbation -------------------------------------------------------------------------
def phased_neighbours(config: Config) -> tuple[LogisticRegression, LogisticRegression]:
    """Logistic regression (unit-norm rows) on ``n`` records and its replace-one neighbour: row ``index``
    set to a fixed direction with opposite labels (``"opposed"``), or its features negated (``"negated"``)."""
    rng = np.random.default_rng(int(config["seed"]))
    n, index, l2 = int(config["n"]), int(config["index"]), float(config.get("l2", 0.0))
    x, y = rng.normal(size=(n, 3)), rng.random(n) < 0.5
    x2, y2 = x.copy(), y.copy()
    if config.get("adversary") == "opposed":
        x[index] = x2[index] = np.ones(3)
        y[index], y2[index] = True, False
    else:
        x2[index] = -x[index]
    return LogisticRegression(x, y, l2=l2), LogisticRegression(x2, y2, l2=l2)


def build_phased(config: Config) -> PhasedOutputPerturbation:
    o = dict(config.get("options", {}))
    seed = int(config["seed"])
    runtime = RuntimeConfig(generator=dpvr.NoiseGenerator(seed, reproducible=True), sampler_seed=seed)
    return PhasedOutputPerturbation(
        config["setting"], privacy=PrivacyConfig(epsilon=1.0, delta=1e-6), runtime=runtime, **o
    )


def phased_lockstep(config: Config) -> tuple[Any, list[Comparison], list[Release]]:
    """The phased framework on both datasets, the neighbour replaying the original's released phase outputs
    (each phase is centred at the previous *noisy* output, so later phases are conditioned on it)."""
    problem, neighbour = phased_neighbours(config)
    with Tape().running() as tape_a:
        result = build_phased(config).run(problem)
    with Tape(follows=tape_a).running() as tape_b:
        build_phased(config).run(neighbour)
    noise = {f"phased/{k}": z for k, z in result.noise_multipliers.items()}
    return result, compare(noise, tape_a.releases, tape_b.releases, REPLACE_ONE), tape_a.releases


def phased_accounting_problems(result: Any, releases: Sequence[Release]) -> list[str]:
    """Each phase reads a disjoint chunk, so a record is exposed to one release per run of each stream; the
    accountant must charge exactly that, with the multiplier the releases used."""
    problems = []
    ledger = result.accountant.state_dict()["ledger"]
    if len(releases) != sum(len(p.sigma) for p in result.phases):
        problems.append(f"{len(releases)} releases for {len(result.phases)} phases")
    for name, z in result.noise_multipliers.items():
        exposure: Counter[int] = Counter()
        for p in result.phases:
            if name in p.sigma:
                exposure.update(range(*p.rows))
        charged = sum(e["count"] for e in ledger if name in e["streams"])
        if charged != max(exposure.values(), default=0):
            problems.append(
                f"stream {name!r}: a record is read by {max(exposure.values(), default=0)} "
                f"release(s), the accountant charges {charged}"
            )
        for e in ledger:
            single = name in e["streams"] and len(e["streams"]) == 1
            if single and not math.isclose(_gaussian(e["event"])["noise_multiplier"], z, rel_tol=1e-12):
                problems.append(f"stream {name!r}: charged with another noise multiplier than released")
    return problems


#: The algorithms that release once per run (per phase) rather than per step, keyed by their names in
#: :mod:`dpvr.registry`: each maps a config to its lockstep (the result, the comparisons, the releases).
OUTPUT_PERTURBATION: dict[str, Callable[[Config], tuple[Any, list[Comparison], list[Release]]]] = {
    "phased": phased_lockstep,
}


def uncovered() -> list[str]:
    """The algorithms of :mod:`dpvr.registry` that the harness cannot run: a new one needs an entry in
    :data:`ALGORITHMS` (or :data:`OUTPUT_PERTURBATION`)."""
    return sorted(set(registry.REGISTRY) - set(ALGORITHMS) - set(OUTPUT_PERTURBATION))
