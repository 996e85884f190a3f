"""DIFF2 (Murata & Suzuki, ICML 2023), section 6: DIFF2-GD against DP-GD at the same spent epsilon.

The paper's protocol (section 6 and appendix A), scaled to the data at hand:

- **Data.** Per seed: a random 10% of the records is held out as a public split; the rest is split 80/20
  at random into the private training split and the test split. Features are standardised and regression
  targets divided by their largest absolute value with the public split's statistics
  (:class:`~dpvr.data.PublicScaling`; the paper fits them on the data itself, which lets one private record
  move every other record's preprocessed value; ``--private-tuning`` scores its trials on that split too);
  classification labels are coded ±1 (one output for two classes, one per class otherwise) so that the
  squared loss applies. The training split is dealt into ``P`` equal IID client shards (``--clients``,
  default 10; ``split_clients``, the remainder is dropped).
- **Model.** One hidden layer of 10 softplus units; parameters drawn from U(-1/sqrt(w_in), 1/sqrt(w_in)),
  w_in the layer's inputs (the paper prints sqrt(w_in), read as a typo); per-sample loss
  ``0.5 ||output - target||^2``; the objective ``f`` is the mean over clients of their mean losses.
- **Methods**, all for ``R`` rounds: ``GD`` (non-private, the paper's "GD (ref)"), ``DP-GD``, ``DIFF2-GD``
  and ``DIFF2-BVR-L-SGD`` (``K`` local steps on batches of ``b = K`` records, ``C3 = C2`` as in Theorem 5.3;
  the paper runs no experiment with it). DP-GD is :class:`~dpvr.algorithms.DIFF2` with ``restart=1``: the
  paper defines it so (T = 1), it runs the same code path as DIFF2-GD and it admits the paper's calibration
  (Proposition 4.1 with u -> 1). With equal shards the average of client means is the pooled mean, so by
  default the GD-routine methods run on one pooled shard with the same plan (``n_min P`` records): the
  same algorithm and the same accounting, with a P-th of the per-sample-gradient calls (its noise draws
  are its own: each noise key binds the run's settings, so its records differ from ``local``'s).
  BVR-L-SGD, whose local steps run on one client's shard, gets the ``P`` shards.
- **Backends.** ``--backend pooled`` (default) is the above; ``--backend local`` runs every private
  method on the ``P`` shards in this process (the simulation); ``--backend torch-distributed`` runs them
  on ``P`` client processes on loopback gloo (:class:`dpvr.distributed.ClientPool`) with this process as
  the trusted aggregator, which alone holds the noise seeds and the accountants. Each client process is
  sent only its own shard and computes its clipped means as the simulated client does, so ``local`` and
  ``torch-distributed`` release bitwise the same iterates and write the same records. In every backend
  the non-private GD reference and the metrics are computed in this process.
- **Privacy.** Record-level (epsilon, delta)-DP w.r.t. each client's data, replace-one neighbours. Each DP
  method calibrates its noise to the target epsilon with the accountant (``--calibration tight``, default) or
  with Proposition 4.1 (``paper``: u = 1.25 for DIFF2-GD, u -> 1 for DP-GD; DIFF2-BVR-L-SGD always uses the
  tight calibration, since Proposition E.2's closed form needs ``b <= n/(2 e alpha)``). The spent epsilon
  reported is ``privacy_spent()`` of what the run released. Noise and sampling are seeded for
  reproducibility, which makes them predictable: fine for an experiment, not for a deployment.
- **Hyper-parameters.** GD tunes the step size ``eta`` only; DP-GD also ``C1``; DIFF2-GD ``C1``, ``C2`` and
  ``T``; DIFF2-BVR-L-SGD reuses DIFF2-GD's selected ``C1``, ``C2``, ``T`` and searches ``eta`` from
  DIFF2-GD's selected step size down (its ``K`` steps per round make larger ones no safer). For each grid
  point the learning rates are tried from the largest down, with the paper's early stopping: the train loss
  is checked ``evaluations`` times per run and a rate is rejected on a non-finite loss or when a patience
  count, raised by each check above 1.05 times the best loss so far and reset by a new best, reaches 5; the
  first rate that completes ``R`` rounds is taken. (The smallest rate is never stopped for patience, only
  for divergence, so each grid point yields a run.) Then, per seed, the grid point with the smallest final
  train loss gives the train and test loss, the one with the smallest final squared gradient norm gives
  that metric (the paper's rule). **This tuning uses the private training data and is not covered by the
  privacy accounting, as in the paper.** ``--private-tuning`` selects inside the budget instead: per
  method, one private search (:func:`~dpvr_lab.experiments.common.private_search`) over (``C1``, ``C2``,
  ``eta``) with ``T`` fixed at the grid's smallest (another restart period is another mechanism),
  DIFF2-BVR-L-SGD searching on its own; a trial runs all ``R`` rounds (only a diverging step stops it) and
  is scored by its final loss on the public split. The selected run gives every metric, and its record
  carries the whole search's ``spent_epsilon`` and ``hyperparameter_tuning_accounted: true``.
- **Metrics.** Final train loss ``f(x_R)``, squared gradient norm ``||grad f(x_R)||^2`` and test loss (and
  test accuracy for classification), mean ± std over seeds; the minimum over the evaluated rounds too (the
  paper's t-test statistic). The one-sided paired t-test (one sample per seed, df = seeds - 1) has the
  alternative "DIFF2-GD < DP-GD". Train loss and gradient norm are measured on the private training data
  without noise: diagnostics, not private (``metrics["diagnostics"]``, :mod:`dpvr_lab.experiments.common`).

Scale: on the bundled sets (a few hundred records) the default is R = 200, C1, C2 in {0.3, 1, 3} (their
per-sample gradient norms are about 0.2-3), T in {0.01, 0.03, 0.1} R, eta in {0.5^i : i = 0..9}, K = 5
and 5 seeds; ``--quick`` uses R = 100, C1, C2 in {0.3, 1}, T in {0.03, 0.1} R, eta in {0.5^(2i) : i =
0..4} and 3 seeds. The paper's own datasets run with ``--data-dir DIR`` (R = 2000 and the paper's full
grid unless ``--quick``): one file per dataset, the target in the last column, all features numeric, named
``california_housing``, ``gas_turbine`` (CO as target, NOx dropped), ``blogfeedback``, ``covtype`` or
``kddcup99`` (the 10% file, categorical columns encoded as numbers) with the extension ``.csv`` or
``.libsvm`` (optionally ``.gz``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from dpvr.algorithms import DIFF2
from dpvr.algorithms.diff2.algorithm import Shard
from dpvr.data import Dataset, PublicScaling, load, read_csv, read_libsvm, split_clients, split_public
from dpvr.data import train_test_split as split_train_test
from dpvr.distributed import ClientPool
from dpvr.ops import NoiseGenerator, torch_threads
from dpvr.optim import DivergedError, PrivacyConfig, RuntimeConfig
from dpvr.results import Record, document, format_table

from .common import (
    DIAGNOSTIC_NOTE,
    derive_seed,
    diagnostic,
    format_mean_std,
    one_sided_ttest,
    plot_curves,
    private_search,
    progress,
    record_metrics,
    save,
    tuning_note,
)

NAME = "diff2"
METHODS = ("GD", "DP-GD", "DIFF2-GD", "DIFF2-BVR-L-SGD")
METRICS = ("train_loss", "grad_norm_sq", "test_loss")
DIAGNOSTICS = ("train_loss", "train_loss_min", "grad_norm_sq", "grad_norm_sq_min")
"""The metrics measured on the private training data without noise."""
METRIC_TITLES = {
    "train_loss": diagnostic("train loss"),
    "grad_norm_sq": diagnostic("squared train gradient norm"),
    "test_loss": "test loss",
}
CLIENTS = 10
BACKENDS = ("pooled", "local", "torch-distributed")
IDLE_TIMEOUT = 3600.0  # seconds a pooled client waits for its next run (evaluation happens in between)
HIDDEN = 10
DELTA = 1e-5
EPSILONS = (3.0, 5.0)
BUNDLED = ("diabetes", "breast_cancer")
PAPER_DATASETS = {
    "california_housing": "regression",
    "gas_turbine": "regression",
    "blogfeedback": "regression",
    "covtype": "classification",
    "kddcup99": "classification",
}
EXTENSIONS = (".csv", ".csv.gz", ".libsvm", ".libsvm.gz")
CHUNK = 8192  # samples per per-sample-gradient call: bounds memory on the paper's larger datasets
ONE_THREAD_BELOW = 20_000  # records: smaller sets run single-threaded (see common.torch_threads)
DIVERGED = 1e150  # a step this long has diverged (and C2 ||x_r - x_{r-1}|| would overflow)


@dataclass(frozen=True)
class Protocol:
    """Rounds, grid and early-stopping rule of one run of the experiment."""

    rounds: int
    seeds: int
    lrs: tuple[float, ...]  # tried from the largest down
    clip1: tuple[float, ...]  # the paper's C1 grid: clip["restart"]
    clip2: tuple[float, ...]  # the paper's C2 grid: clip["difference"] (and BVR-L-SGD's clip["local"])
    restart_fractions: tuple[float, ...]  # T = fraction * R (at least 2)
    local_steps: int  # BVR-L-SGD's K; its local batch b = K (Table 1: K = b)
    evaluations: int = 100  # train-loss checks per run (the paper: every 20 of 2000 rounds)
    patience: int = 5
    tolerance: float = 1.05

    @property
    def checkpoints(self) -> list[int]:
        """The rounds at which the metrics are evaluated (round 0 is the initial point)."""
        every = max(1, self.rounds // self.evaluations)
        return sorted({*range(0, self.rounds + 1, every), self.rounds})

    @property
    def restarts(self) -> tuple[int, ...]:
        return tuple(sorted({max(2, round(f * self.rounds)) for f in self.restart_fractions}))


PAPER = Protocol(
    rounds=2000,
    seeds=5,
    lrs=tuple(0.5**i for i in range(10)),
    clip1=(1.0, 3.0, 10.0, 30.0, 100.0),
    clip2=(1.0, 3.0, 10.0, 30.0, 100.0),
    restart_fractions=(0.003, 0.01, 0.03, 0.1),
    local_steps=10,
)
"""Section 6 as printed (for ``--data-dir``)."""

SCALED = Protocol(
    rounds=200,
    seeds=5,
    lrs=tuple(0.5**i for i in range(10)),
    clip1=(0.3, 1.0, 3.0),
    clip2=(0.3, 1.0, 3.0),
    restart_fractions=(0.01, 0.03, 0.1),
    local_steps=5,
)
"""The bundled data (a few hundred records). Per-sample gradient norms there are about 0.2-3 and
per-sample ``||grad l(x) - grad l(x')|| / ||x - x'||`` about 0.4-2 along a GD path, so the clip radii that
matter are a third of the paper's smallest ones."""

QUICK = Protocol(
    rounds=100,
    seeds=3,
    lrs=tuple(0.5**i for i in range(0, 10, 2)),
    clip1=(0.3, 1.0),
    clip2=(0.3, 1.0),
    restart_fractions=(0.03, 0.1),
    local_steps=5,
)
"""``--quick``: a reduced grid that finishes in a few minutes on two CPU cores."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, help="communication rounds R (default: the protocol's)")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="pooled",
        help="where the clients compute: pooled shards (default), the P clients in this process (local), "
        "or P client processes with this process aggregating (torch-distributed)",
    )
    parser.add_argument(
        "--clients", type=int, default=CLIENTS, metavar="P", help=f"client shards P (default {CLIENTS})"
    )
    parser.add_argument(
        "--private-tuning",
        action="store_true",
        help="select each private method's C1, C2 and step size by a private search inside the budget, "
        "scored on the public split (restart period: the grid's smallest)",
    )
    parser.add_argument(
        "--calibration",
        choices=("tight", "paper"),
        default="tight",
        help="noise for the target epsilon: the accountant's smallest (tight) or Proposition 4.1 (paper)",
    )


# ---- data ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Data:
    """One seed's preprocessed data as float64 tensors; targets are ``(n, outputs)``."""

    clients: list[tuple[torch.Tensor, torch.Tensor]]
    train: tuple[torch.Tensor, torch.Tensor]  # the clients' records pooled (equal shards)
    test: tuple[torch.Tensor, torch.Tensor]
    test_classes: torch.Tensor | None  # class codes, for the test accuracy of classification sets
    public: tuple[torch.Tensor, torch.Tensor]  # the public split: scores a private search's trials


def _load(name: str, data_dir: str | None) -> Dataset:
    key = name.lower().replace("-", "_")
    if key not in PAPER_DATASETS:
        return load(key, data_dir=data_dir)
    if data_dir is None:
        raise ValueError(f"{key} is one of the paper's datasets: pass --data-dir, the directory holding it")
    path = _paper_file(data_dir, key)
    if path is None:
        raise ValueError(f"--data-dir {data_dir}: no {key}{{{','.join(EXTENSIONS)}}}")
    reader = read_libsvm if ".libsvm" in os.path.basename(path) else read_csv
    return reader(path, task=PAPER_DATASETS[key], name=key)


def _paper_file(data_dir: str, key: str) -> str | None:
    for extension in EXTENSIONS:
        path = os.path.join(data_dir, key + extension)
        if os.path.isfile(path):
            return path
    return None


def _coded_targets(dataset: Dataset) -> np.ndarray:
    """Regression targets as a column; class labels as ±1 (one column for two classes, else one per class)."""
    if dataset.task == "regression":
        return dataset.targets[:, None]
    if dataset.num_classes == 2:
        return np.where(dataset.targets == 1, 1.0, -1.0)[:, None]
    return np.where(dataset.targets[:, None] == np.arange(dataset.num_classes), 1.0, -1.0)


def _split(dataset: Dataset, seed: int) -> tuple[Dataset, Dataset, Dataset]:
    """``(public, train, test)`` of one seed, drawn without looking at the values."""
    public, rest = split_public(dataset, seed=derive_seed(seed, 0))
    return (public, *split_train_test(rest, test_fraction=0.2, seed=derive_seed(seed, 1)))


def _prepare(dataset: Dataset, seed: int, clients: int) -> _Data:
    public, train, test = _split(dataset, seed)
    scale = PublicScaling.fit(public)
    train, test, public = scale(train), scale(test), scale(public)

    def tensors(part: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.as_tensor(part.features, dtype=torch.float64), torch.as_tensor(_coded_targets(part))

    shards = [tensors(shard) for shard in split_clients(train, clients, seed=derive_seed(seed, 2))]
    pooled = (torch.cat([x for x, _ in shards]), torch.cat([y for _, y in shards]))
    classes = torch.as_tensor(test.targets) if dataset.task == "classification" else None
    return _Data(shards, pooled, tensors(test), classes, tensors(public))


# ---- model, loss, evaluation -----------------------------------------------------------------------------


def _model(inputs: int, outputs: int, seed: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(inputs, HIDDEN), nn.Softplus(), nn.Linear(HIDDEN, outputs)).double()
    generator = torch.Generator().manual_seed(derive_seed(seed, 3) % 2**63)
    with torch.no_grad():
        for layer in (model[0], model[2]):
            bound = 1 / math.sqrt(layer.in_features)
            for p in layer.parameters():
                p.uniform_(-bound, bound, generator=generator)
    return model


def sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The squared loss of one sample (the per-sample contract of :mod:`dpvr.grads`)."""
    return 0.5 * (output - target).pow(2).sum()


def _mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (output - target).pow(2).sum(dim=1).mean()


def _evaluate(model: nn.Module, data: _Data) -> dict[str, float]:
    params = list(model.parameters())
    with torch.enable_grad():
        loss = _mean_loss(model(data.train[0]), data.train[1])
        grads = torch.autograd.grad(loss, params)
    values = {"train_loss": loss.item(), "grad_norm_sq": float(sum(g.pow(2).sum() for g in grads))}
    with torch.no_grad():
        output = model(data.test[0])
        values["test_loss"] = _mean_loss(output, data.test[1]).item()
        if data.test_classes is not None:
            predicted = (output[:, 0] > 0).long() if output.shape[1] == 1 else output.argmax(dim=1)
            values["test_accuracy"] = (predicted == data.test_classes).double().mean().item()
    return values


# ---- methods and tuning ----------------------------------------------------------------------------------

Step = Callable[[], float]  # runs one round; returns ||x_r - x_{r-1}||


@dataclass
class _Run:
    """One completed (or rejected) run: its grid point, its metrics at the checkpoints, what it spent."""

    point: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    spent_epsilon: float | None = None
    completed: bool = False
    tuning: dict[str, Any] = field(default_factory=dict)  # --private-tuning: the search's accounting

    def curve(self, metric: str) -> np.ndarray:
        return np.array([h[metric] for h in self.history])


@dataclass(frozen=True)
class _Budget:
    epsilon: float
    delta: float
    calibration: str


def _gradient_descent(model: nn.Module, data: _Data, lr: float) -> Step:
    params = list(model.parameters())

    def step() -> float:
        grads = torch.autograd.grad(_mean_loss(model(data.train[0]), data.train[1]), params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(g, alpha=lr)
        return lr * math.sqrt(float(sum(g.pow(2).sum() for g in grads)))

    return step


class _Backend:
    """Where the private methods' clients compute (``--backend``); see the module documentation."""

    def __init__(self, name: str, clients: int, pool: ClientPool | None = None) -> None:
        self.name, self.clients, self.pool = name, clients, pool

    def shards(self, method: str, data: _Data) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.name == "pooled" and method != "DIFF2-BVR-L-SGD":
            return [data.train]
        return data.clients

    @contextlib.contextmanager
    def diff2(self, model: nn.Module, shards: Sequence[Shard], **options: Any) -> Iterator[DIFF2]:
        """DIFF2 on ``model`` with ``shards`` as its clients, in this process or in the pool's."""
        if self.pool is None:
            yield DIFF2(model, sample_loss, shards, **options)
            return
        runtime: RuntimeConfig = options["runtime"]
        with self.pool.connect(
            model, sample_loss, shards, grad_mode=runtime.grad_mode, chunk_size=runtime.chunk_size
        ) as clients:
            yield DIFF2(model, sample_loss, clients, **options)


def _private(
    method: str,
    point: dict[str, float],
    model: nn.Module,
    data: _Data,
    protocol: Protocol,
    privacy: PrivacyConfig,
    seed: int,
    backend: _Backend,
) -> contextlib.AbstractContextManager[DIFF2]:
    # The grid point is in the paper's terms: C1 and C2 are the restart and difference streams' radii.
    generator = NoiseGenerator(derive_seed(seed, 4), reproducible=True)
    runtime = RuntimeConfig(generator=generator, chunk_size=CHUNK)
    options: dict[str, Any] = dict(lr=point["lr"], steps=protocol.rounds, privacy=privacy, runtime=runtime)
    if method == "DP-GD":  # T = 1: every round restarts, C2 is never used
        options.update(restart=1, clip={"restart": point["clip1"], "difference": 1.0})
    elif method == "DIFF2-GD":
        options.update(
            restart=int(point["restart"]), clip={"restart": point["clip1"], "difference": point["clip2"]}
        )
    else:
        options.update(
            restart=int(point["restart"]),
            clip={"restart": point["clip1"], "difference": point["clip2"], "local": point["clip2"]},
            routine="bvr-l-sgd",
            local_steps=protocol.local_steps,
            local_batch=min(protocol.local_steps, min(len(x) for x, _ in data.clients)),
            runtime=dataclasses.replace(runtime, sampler_seed=derive_seed(seed, 5)),
        )
    return backend.diff2(model, backend.shards(method, data), **options)


def _privacy(method: str, budget: _Budget) -> PrivacyConfig:
    """A method's privacy: ``budget`` with its calibration. Proposition 4.1's constant ``u`` is 1.25 for
    DIFF2-GD and ``u -> 1`` for DP-GD; DIFF2-BVR-L-SGD is always calibrated tight (module documentation)."""
    if method == "DIFF2-BVR-L-SGD":
        return PrivacyConfig(epsilon=budget.epsilon, delta=budget.delta)
    u = 1 + 1e-9 if method == "DP-GD" else 1.25
    return PrivacyConfig(
        epsilon=budget.epsilon, delta=budget.delta, calibration=budget.calibration, paper_options={"u": u}
    )


def _rounds_of(alg: DIFF2) -> Step:
    def step() -> float:
        return alg.step()["move"]

    return step


def _train(
    step: Step,
    model: nn.Module,
    data: _Data,
    protocol: Protocol,
    run: _Run,
    *,
    patient: bool,
    watch_loss: bool,
) -> None:
    """Runs ``R`` rounds, evaluating at the checkpoints; sets ``run.completed`` if it was not stopped.

    A diverging step stops the run. With ``watch_loss``, so do the paper's rules, which read the train loss:
    a non-finite one, and the patience count where ``patient``. A trial of a private search may act on its
    released iterates alone, so it runs without them."""
    checkpoints = set(protocol.checkpoints)
    run.history.append(_evaluate(model, data))
    best, waited = run.history[0]["train_loss"], 0
    for r in range(1, protocol.rounds + 1):
        if not step() < DIVERGED:  # also catches NaN
            return
        if r not in checkpoints:
            continue
        run.history.append(_evaluate(model, data))
        loss = run.history[-1]["train_loss"]
        if not watch_loss:
            continue
        if not math.isfinite(loss):
            return
        if loss < best:
            best, waited = loss, 0
        elif loss > protocol.tolerance * best:
            waited += 1
            if patient and waited >= protocol.patience:
                return
    run.completed = True


def _search(
    method: str,
    point: dict[str, float],
    lrs: Sequence[float],
    init: nn.Module,
    data: _Data,
    protocol: Protocol,
    budget: _Budget | None,
    seed: int,
    backend: _Backend,
) -> _Run | None:
    """The paper's learning-rate search at one grid point: the first rate, from the largest, to finish."""
    privacy = None if budget is None else _privacy(method, budget)
    for i, lr in enumerate(lrs):
        model = copy.deepcopy(init)
        run = _Run({**point, "lr": lr})
        private = (
            contextlib.nullcontext()
            if privacy is None
            else _private(method, run.point, model, data, protocol, privacy, derive_seed(seed, i), backend)
        )
        with private as alg:
            step = _gradient_descent(model, data, lr) if alg is None else _rounds_of(alg)
            _train(step, model, data, protocol, run, patient=i < len(lrs) - 1, watch_loss=True)
            if run.completed:
                run.spent_epsilon = None if alg is None else alg.privacy_spent().epsilon
                return run
    return None


def _grid(method: str, protocol: Protocol, diff2_choice: dict[str, float] | None) -> list[dict[str, float]]:
    if method == "GD":
        return [{}]
    if method == "DP-GD":
        return [{"clip1": c} for c in protocol.clip1]
    if method == "DIFF2-GD":
        return [
            {"clip1": c1, "clip2": c2, "restart": t}
            for c1, c2, t in itertools.product(protocol.clip1, protocol.clip2, protocol.restarts)
        ]
    assert diff2_choice is not None
    return [{k: diff2_choice[k] for k in ("clip1", "clip2", "restart")}]


@dataclass
class _Outcome:
    """A method's result on one seed: the runs selected per criterion (the paper's rule)."""

    by_loss: _Run  # smallest final train loss: train loss, test loss (and accuracy)
    by_grad: _Run  # smallest final squared gradient norm

    def source(self, metric: str) -> _Run:
        return self.by_grad if metric == "grad_norm_sq" else self.by_loss

    def values(self) -> dict[str, Any]:
        """Every metric by name, the :data:`DIAGNOSTICS` among them."""
        values: dict[str, Any] = {}
        for metric in METRICS:
            curve = self.source(metric).curve(metric)
            values[metric], values[f"{metric}_min"] = float(curve[-1]), float(curve.min())
        if "test_accuracy" in self.by_loss.history[-1]:
            values["test_accuracy"] = self.by_loss.history[-1]["test_accuracy"]
        values["selected"] = {"train_loss": self.by_loss.point, "grad_norm_sq": self.by_grad.point}
        return {**values, **self.by_loss.tuning}

    @property
    def spent_epsilon(self) -> float | None:
        spent = [r.spent_epsilon for r in (self.by_loss, self.by_grad) if r.spent_epsilon is not None]
        return max(spent) if spent else None


def _tune(
    method: str,
    protocol: Protocol,
    init: nn.Module,
    data: _Data,
    budget: _Budget | None,
    seed: int,
    bar: Any,
    backend: _Backend,
    diff2: _Outcome | None = None,
) -> _Outcome:
    """A method's grid, each point with its learning-rate search, and the paper's selection.

    ``seed`` seeds the noise of every run; ``diff2`` (for DIFF2-BVR-L-SGD) is DIFF2-GD's outcome.
    """
    lrs = protocol.lrs
    if diff2 is not None:  # BVR-L-SGD: from DIFF2-GD's selected rate down
        lrs = tuple(lr for lr in lrs if lr <= diff2.by_loss.point["lr"])
    runs = []
    for j, point in enumerate(_grid(method, protocol, diff2.by_loss.point if diff2 else None)):
        seed_j = derive_seed(seed, METHODS.index(method), j)
        run = _search(method, point, lrs, init, data, protocol, budget, seed_j, backend)
        if run is not None:
            runs.append(run)
        bar.update()
    if not runs:
        raise RuntimeError(f"{method}: every learning rate diverged at every grid point")
    return _Outcome(
        by_loss=min(runs, key=lambda r: r.history[-1]["train_loss"]),
        by_grad=min(runs, key=lambda r: r.history[-1]["grad_norm_sq"]),
    )


def _private_grid(method: str, protocol: Protocol) -> list[dict[str, float]]:
    """``--private-tuning``'s candidates: the method's grid points times the learning rates, with DIFF2's
    restart period fixed at the protocol's first (another period is another mechanism, which a search
    among runs of one mechanism cannot select)."""
    if method == "DP-GD":
        points = _grid(method, protocol, None)
    else:
        first = protocol.restarts[0]
        points = [p for p in _grid("DIFF2-GD", protocol, None) if p["restart"] == first]
    return [{**point, "lr": lr} for point in points for lr in protocol.lrs]


def _private_tune(
    method: str,
    protocol: Protocol,
    init: nn.Module,
    data: _Data,
    budget: _Budget,
    seed: int,
    bar: Any,
    backend: _Backend,
) -> _Outcome:
    """``--private-tuning``: the point of :func:`_private_grid` selected by
    :func:`~.common.private_search` on the final loss on the public split (post-processing of the released
    model), the whole search ``(epsilon, delta)``-DP; it gives every metric (there is one selection).

    A trial runs all ``R`` rounds unless its released iterates diverge, which scores it worst: the paper's
    early stopping reads the private train loss. Each trial's clients live in the backend's context from its
    construction until the next trial's (the search runs its trials in turn), and the last one's until the
    search returns."""
    template = dataclasses.replace(_privacy(method, budget), epsilon=None)
    trial_seeds = itertools.count()
    trial = contextlib.ExitStack()

    def build(point: dict[str, float], privacy: PrivacyConfig) -> tuple[DIFF2, _Run]:
        trial.close()  # the previous trial (or plan probe) is over: trained and scored
        run = _Run(dict(point))
        seed_i = derive_seed(seed, METHODS.index(method), next(trial_seeds))
        alg = trial.enter_context(
            _private(method, run.point, copy.deepcopy(init), data, protocol, privacy, seed_i, backend)
        )
        return alg, run

    def train(alg: DIFF2, run: _Run) -> None:
        try:
            _train(_rounds_of(alg), alg.model, data, protocol, run, patient=False, watch_loss=False)
            if not run.completed:
                raise DivergedError(f"{method} at {run.point}: a step diverged")
        except DivergedError:
            nan = dict.fromkeys(run.history[0], math.nan)
            run.history += [nan] * (len(protocol.checkpoints) - len(run.history))
            raise

    def score(alg: DIFF2, run: _Run) -> float:
        with torch.no_grad():
            return _mean_loss(alg.model(data.public[0]), data.public[1]).item()

    grid = _private_grid(method, protocol)
    with trial:
        selection = private_search(
            build, grid, epsilon=budget.epsilon, delta=budget.delta, train=train, score=score,
            seed=derive_seed(seed, METHODS.index(method)), maximize=False, privacy=template,
        )
    bar.update(len(grid))
    best = selection.run
    best.spent_epsilon, best.tuning = selection.spent_epsilon, selection.metrics
    return _Outcome(by_loss=best, by_grad=best)


# ---- the experiment --------------------------------------------------------------------------------------


def _datasets(args: argparse.Namespace) -> list[str]:
    if args.dataset:
        return list(args.dataset)
    if args.data_dir is None:
        return list(BUNDLED)
    found = [key for key in PAPER_DATASETS if _paper_file(args.data_dir, key) is not None]
    if not found:
        raise ValueError(
            f"--data-dir {args.data_dir}: none of the paper's datasets found "
            f"({', '.join(PAPER_DATASETS)} with extension {', '.join(EXTENSIONS)})"
        )
    return found


def _protocol(name: str, args: argparse.Namespace) -> Protocol:
    base = QUICK if args.quick else PAPER if name in PAPER_DATASETS else SCALED
    return dataclasses.replace(
        base,
        rounds=base.rounds if args.rounds is None else args.rounds,
        seeds=base.seeds if args.seeds is None else args.seeds,
    )


def _key(name: str, epsilon: float | None, method: str) -> tuple[str, float | None, str]:
    """Where a method's outcomes are kept: GD, non-private, once per dataset whatever the budget."""
    return name, None if method == "GD" else epsilon, method


def _one_seed(
    name: str,
    dataset: Dataset,
    protocol: Protocol,
    seed: int,
    epsilons: Sequence[float],
    calibration: str,
    backend: _Backend,
    bar: Any,
    private_tuning: bool,
) -> dict[tuple[float | None, str], _Outcome]:
    """Every method on one seed's split, clients and initialisation: ``{(epsilon, method): outcome}``.

    ``private_tuning``: each private method's own search (:func:`_private_tune`), none reusing another's
    selection, whose budget it would also spend."""
    data = _prepare(dataset, seed, backend.clients)
    init = _model(data.train[0].shape[1], data.train[1].shape[1], seed)
    bar.set_postfix_str(f"{name} seed {seed} GD")
    found = {(None, "GD"): _tune("GD", protocol, init, data, None, seed, bar, backend)}
    for epsilon in epsilons:
        budget = _Budget(epsilon, DELTA, calibration)
        noise_seed = derive_seed(seed, round(epsilon * 1e6))
        for method in METHODS[1:]:
            bar.set_postfix_str(f"{name} seed {seed} eps {epsilon:g} {method}")
            if private_tuning:
                found[(epsilon, method)] = _private_tune(
                    method, protocol, init, data, budget, noise_seed, bar, backend
                )
                continue
            diff2 = found[(epsilon, "DIFF2-GD")] if method == "DIFF2-BVR-L-SGD" else None
            found[(epsilon, method)] = _tune(
                method, protocol, init, data, budget, noise_seed, bar, backend, diff2
            )
    return found


@contextlib.contextmanager
def _backend(args: argparse.Namespace) -> Iterator[_Backend]:
    """The ``--backend``; torch-distributed starts its client processes once, with this process's thread
    count (bitwise equal uploads need the same count as the in-process run)."""
    if args.clients < 1:
        raise ValueError(f"--clients must be at least 1, got {args.clients}")
    if args.backend != "torch-distributed":
        yield _Backend(args.backend, args.clients)
        return
    with ClientPool(args.clients, threads=torch.get_num_threads(), idle_timeout=IDLE_TIMEOUT) as pool:
        yield _Backend(args.backend, args.clients, pool)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the experiment (see the module documentation); returns the result document."""
    epsilons = tuple(args.epsilon or EPSILONS)
    names = _datasets(args)
    datasets = {name: _load(name, args.data_dir) for name in names}
    protocols = {name: _protocol(name, args) for name in names}
    for protocol in protocols.values():
        if protocol.rounds < 1 or protocol.seeds < 1:
            raise ValueError("--rounds and --seeds must be at least 1")
    if args.private_tuning:
        searched = {name: sum(len(_private_grid(m, p)) for m in METHODS[1:]) for name, p in protocols.items()}
    else:
        searched = {name: len(_grid("DP-GD", p, None)) + len(_grid("DIFF2-GD", p, None)) + 1
                    for name, p in protocols.items()}
    total = sum(p.seeds * (1 + len(epsilons) * searched[name]) for name, p in protocols.items())
    outcomes: dict[tuple[str, float | None, str], list[_Outcome]] = {}
    records: list[Record] = []
    threads = 1 if max(len(d) for d in datasets.values()) < ONE_THREAD_BELOW else None
    with torch_threads(threads), _backend(args) as backend, progress(total, NAME) as bar:
        for name, dataset in datasets.items():
            for seed in range(protocols[name].seeds):
                found = _one_seed(
                    name, dataset, protocols[name], seed, epsilons, args.calibration, backend, bar,
                    args.private_tuning,
                )
                for (epsilon, method), outcome in found.items():
                    outcomes.setdefault(_key(name, epsilon, method), []).append(outcome)
                    delta = None if epsilon is None else DELTA
                    records.append(
                        Record(
                            method,
                            name,
                            epsilon,
                            delta,
                            seed,
                            outcome.spent_epsilon,
                            record_metrics(outcome.values(), DIAGNOSTICS),
                        )
                    )
    config = {
        "datasets": names,
        "epsilons": list(epsilons),
        "delta": DELTA,
        "clients": args.clients,
        "backend": args.backend,
        "preprocessing": PublicScaling.description(),
        "model": f"MLP, one hidden layer of {HIDDEN} softplus units; loss 0.5 ||output - target||^2",
        "calibration": args.calibration,
        "quick": bool(args.quick),
        "protocols": {name: {**asdict(p), "restarts": list(p.restarts)} for name, p in protocols.items()},
        "hyperparameter_tuning_accounted": bool(args.private_tuning),
    }
    doc = document(NAME, config, records)
    _report(outcomes, names, epsilons, protocols, args.private_tuning)
    paths = save(doc, records, args.out)
    paths += _plots(outcomes, names, epsilons, protocols, args.out)
    print("\nwrote " + ", ".join(paths))
    return doc


def _report(
    outcomes: dict[tuple[str, float | None, str], list[_Outcome]],
    names: Sequence[str],
    epsilons: Sequence[float],
    protocols: dict[str, Protocol],
    private_tuning: bool,
) -> None:
    rows, tests = [], []
    for name in names:
        for epsilon in epsilons:
            for method in METHODS:
                found = outcomes[_key(name, epsilon, method)]
                spent = [o.spent_epsilon for o in found if o.spent_epsilon is not None]
                rows.append(
                    [
                        name,
                        epsilon,
                        method,
                        max(spent) if spent else "non-private",
                        *(format_mean_std(o.values()[m] for o in found) for m in METRICS),
                    ]
                )
            diff2, dpgd = outcomes[(name, epsilon, "DIFF2-GD")], outcomes[(name, epsilon, "DP-GD")]
            for label, suffix in (("final", ""), ("min over rounds", "_min")):
                tests.append(
                    [
                        name,
                        epsilon,
                        label,
                        *(
                            one_sided_ttest(
                                [o.values()[m + suffix] for o in diff2],
                                [o.values()[m + suffix] for o in dpgd],
                                paired=True,
                            )
                            for m in METRICS
                        ),
                    ]
                )
    columns = [diagnostic("train loss"), diagnostic("grad norm^2"), "test loss"]
    print(format_table(["dataset", "epsilon", "method", "spent epsilon", *columns], rows))
    print()
    print(format_table(["dataset", "epsilon", "values", *(f"p {c}" for c in columns)], tests))
    seeds = "/".join(map(str, sorted({p.seeds for p in protocols.values()})))
    if private_tuning:
        note = tuning_note("The private methods' C1, C2 and eta (T: the grid's smallest)", "the public split")
    else:
        note = tuning_note("Hyper-parameters", None)
    print(
        f"\nmean ± std over {seeds} seeds of the final values; spent epsilon: the accountant's epsilon at "
        f"delta={DELTA:g} for what the selected runs released (largest over seeds).\n"
        "p: one-sided paired t-test (one sample per seed), alternative DIFF2-GD < DP-GD.\n"
        f"{note}\n{DIAGNOSTIC_NOTE}\n"
        f"Preprocessing: {PublicScaling.description()}."
    )


def _plots(
    outcomes: dict[tuple[str, float | None, str], list[_Outcome]],
    names: Sequence[str],
    epsilons: Sequence[float],
    protocols: dict[str, Protocol],
    out: str,
) -> list[str]:
    paths = []
    for name in names:
        for epsilon in epsilons:
            panels = {
                METRIC_TITLES[metric]: {
                    method: [o.source(metric).curve(metric) for o in outcomes[_key(name, epsilon, method)]]
                    for method in METHODS
                }
                for metric in METRICS
            }
            path = os.path.join(out, f"{NAME}_{name}_eps{epsilon:g}.png")
            plot_curves(
                path,
                protocols[name].checkpoints,
                panels,
                xlabel="round",
                title=f"{name}, epsilon = {epsilon:g}, delta = {DELTA:g}",
            )
            paths.append(path)
    return paths
