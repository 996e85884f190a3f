"""Last-iterate accounting for cyclic DP-SGD (Kong & Ribero): L1-regularised logistic regression.

Breast-cancer data (bundled): per seed, a random 10% of the records is a public split, the rest is split
80/20 into the private training split and the test split. Features are standardised with the public split's
statistics (fitted on the training split, they would let one private record move all the others), then each
record is scaled to unit norm (a per-record map: no privacy cost), so every per-example logistic gradient,
bias included, has norm at most sqrt(2) and the loss is convex (m = 0) and (1/2)-smooth. Cyclic DP-SGD with
an L1 prox runs for a fixed number of epochs; its noise is calibrated to each target epsilon three ways:

- ``composition``: plain composition of the passes (every iterate could be released);
- ``last-iterate (clipped)``: the last-iterate bound with clipping possibly active (Theorem 2.3, sqrt(2) L);
- ``last-iterate (Lipschitz)``: the bound for gradients known never to exceed the clip radius (eq. 19),
  checked at every step.

The table gives test accuracy (mean ± std over seeds) at equal spent epsilon; the plot shows epsilon against
epochs at a fixed noise for the three accountings (the paper's Figure 1) and accuracy against epsilon. The
records also hold the train accuracy, a diagnostic measured on the private data without noise.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np
import torch

from dpvr.algorithms import DPSGD, CyclicDPSGDPlan, epsilon_by_epoch
from dpvr.data import UNIT_NORM, Dataset, PublicScaling, load, split_public, unit_norm
from dpvr.data import train_test_split as split_train_test
from dpvr.ops import torch_threads
from dpvr.optim import L1, PrivacyConfig
from dpvr.results import Record, document, format_table, write_figure

from .common import derive_seed, format_mean_std, progress, record_metrics, save

NAME = "last-iterate"
DELTA = 1e-5
EPSILONS = (0.5, 1.0, 2.0, 4.0)
# The gradient bound of unit-norm features plus a bias is sqrt(2); the radius sits just above it so that
# rounding in the computed norms never trips the "no gradient is clipped" check of the Lipschitz variant.
CLIP = math.sqrt(2.0) * (1 + 1e-6)
SMOOTHNESS = 0.5  # (||x||^2 + 1) / 4 for the logistic loss
LR = 1.0  # within 1/(2(m+M)) = 1, so both last-iterate bounds apply
L1_STRENGTH = 1e-3
BATCH = 10
DIAGNOSTICS = ("train_accuracy",)
"""The metrics measured on the private training data without noise."""
PREPROCESSING = f"{PublicScaling.description()}; then {UNIT_NORM}"
METHODS = {  # method -> (bound, clipping)
    "composition": ("composition", True),
    "last-iterate (clipped)": ("last-iterate", True),
    "last-iterate (Lipschitz)": ("last-iterate", False),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="passes over the training data (default 20; quick 5)")


def logistic(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(), target)


def _split(data: Dataset, seed: int) -> tuple[Dataset, Dataset, Dataset]:
    """``(public, train, test)`` of one seed, drawn without looking at the values."""
    public, rest = split_public(data, seed=derive_seed(seed, 1))
    return (public, *split_train_test(rest, test_fraction=0.2, seed=seed))


def _prepare(data: Dataset, seed: int) -> tuple[torch.Tensor, ...]:
    """``(x, y, x_test, y_test)``; the training part is cut to whole cyclic batches."""
    public, train, test = _split(data, seed)
    scale = PublicScaling.fit(public)
    tensors = []
    for part in (train, test):
        part = unit_norm(scale(part))
        tensors += [torch.as_tensor(part.features, dtype=torch.float64),
                    torch.as_tensor(part.targets, dtype=torch.float64)]
    n = (len(tensors[0]) // BATCH) * BATCH  # cyclic batches must tile the data
    return tensors[0][:n], tensors[1][:n], tensors[2], tensors[3]


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((model(x).squeeze(-1) > 0).double() == y).double().mean())


def run(args: argparse.Namespace) -> dict[str, Any]:
    epochs = args.epochs or (5 if args.quick else 20)
    epsilons = tuple(args.epsilon or ((1.0, 4.0) if args.quick else EPSILONS))
    seeds = args.seeds or (2 if args.quick else 5)
    records: list[Record] = []
    bar = progress(len(epsilons) * len(METHODS) * seeds, NAME)
    data = load("breast_cancer")
    with torch_threads(1):
        for seed in range(seeds):
            x, y, x_test, y_test = _prepare(data, seed)
            steps = epochs * len(x) // BATCH
            for epsilon in epsilons:
                for method, (bound, clipping) in METHODS.items():
                    torch.manual_seed(derive_seed(seed))
                    model = torch.nn.Linear(x.shape[1], 1).double()
                    alg = DPSGD(
                        model,
                        logistic,
                        x,
                        y,
                        lr=LR,
                        clip=CLIP,
                        steps=steps,
                        batch_size=BATCH,
                        sampling="cyclic",
                        weak_convexity=0.0,
                        smoothness=SMOOTHNESS,
                        prox=L1(L1_STRENGTH),
                        clipping=clipping,
                        bound=bound,
                        privacy=PrivacyConfig(epsilon=epsilon, delta=DELTA),
                    )
                    alg.run(progress=False)
                    records.append(
                        Record(
                            method=method,
                            dataset="breast_cancer",
                            epsilon=epsilon,
                            delta=DELTA,
                            seed=seed,
                            spent_epsilon=alg.privacy_spent().epsilon,
                            metrics=record_metrics(
                                {
                                    "test_accuracy": _accuracy(model, x_test, y_test),
                                    "train_accuracy": _accuracy(model, x, y),
                                    "noise_multiplier": alg.noise["gradient"],
                                    "epochs": epochs,
                                },
                                DIAGNOSTICS,
                            ),
                        )
                    )
                    bar.update()
    bar.close()
    config = {
        "preprocessing": PREPROCESSING,
        "epochs": epochs,
        "epsilons": epsilons,
        "seeds": seeds,
        "delta": DELTA,
        "lr": LR,
        "clip": CLIP,
        "batch_size": BATCH,
        "l1": L1_STRENGTH,
    }
    doc = document(NAME, config, records)
    rows = []
    for epsilon in epsilons:
        for method in METHODS:
            mine = [r for r in records if r.epsilon == epsilon and r.method == method]
            rows.append(
                [
                    epsilon,
                    method,
                    max(r.spent_epsilon for r in mine),
                    mine[0].metrics["noise_multiplier"],
                    format_mean_std(r.metrics["test_accuracy"] for r in mine),
                ]
            )
    print(format_table(["target ε", "accounting", "spent ε", "noise multiplier", "test accuracy"], rows))
    os.makedirs(args.out, exist_ok=True)
    save(doc, records, args.out)
    _plot(os.path.join(args.out, f"{NAME}.png"), records, epsilons, len(x))
    return doc


def _plot(path: str, records: list[Record], epsilons: tuple[float, ...], n: int) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="tight")
    left, right = fig.subplots(1, 2)
    epochs = np.arange(1, 51)
    plan = CyclicDPSGDPlan(
        dataset_size=n,
        batch_size=BATCH,
        steps=n // BATCH,
        lr=LR,
        clip=CLIP,
        smoothness=SMOOTHNESS,
        bound="last-iterate",
    )
    z = 20.0
    curves = epsilon_by_epoch(plan, z, DELTA, epochs)
    unclipped = epsilon_by_epoch(CyclicDPSGDPlan(**{**plan.__dict__, "clipping": False}), z, DELTA, epochs)
    left.plot(epochs, curves["composition"], label="composition of passes")
    left.plot(epochs, curves["last-iterate"], label="last iterate, clipped (Thm 2.3, √2 L)")
    left.plot(epochs, unclipped["last-iterate"], label="last iterate, Lipschitz (eq. 19)")
    left.set(xlabel="epochs", ylabel=f"ε at δ={DELTA:g}", title=f"noise multiplier {z:g}, n={n}, b={BATCH}")
    left.legend()
    for method in METHODS:
        means = [
            np.mean([r.metrics["test_accuracy"] for r in records if r.method == method and r.epsilon == e])
            for e in epsilons
        ]
        right.plot(epsilons, means, marker="o", label=method)
    right.set(xscale="log", xlabel="target ε", ylabel="test accuracy", title="L1 logistic regression")
    right.legend()
    write_figure(path, fig, dpi=120)
