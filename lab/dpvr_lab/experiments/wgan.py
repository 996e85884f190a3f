"""PrivateDiff Minimax (Zhang et al.), section 9.2: a private Wasserstein GAN, PrivateDiff against DP-SGDA.

The paper's protocol (its eq. 65, Table 4, Figure 6), scaled to the data at hand:

- **Data.** scikit-learn's digits (8x8 images, pixels mapped from their declared range 0..16 onto [0, 1],
  no statistic of the data fitted), split 70/30 into train and test at random per seed. The training images
  are the private data set; the test images serve only for evaluation.
- **Objective** (:class:`~dpvr.objectives.WGAN`): ``min_G max_D E[D(x)] - E[D(G(z))] - lambda ||w_D||^2``
  with ``lambda = PENALTY``; the discriminator's parameters are the ascent block, projected onto a ball of
  radius ``RADIUS``. Each private record (a real image) is paired with a fresh latent code ``z ~ N(0, I)``
  at every step (public randomness); only the real images are private, and they enter through the
  discriminator's real-sample term only (see the objective's documentation).
- **Models.** The paper's MLPs scaled to 64-pixel images (widths / 4): generator ``LATENT`` -> 32 -> 64 ->
  128 -> 256 -> 64 (ReLU, sigmoid output), discriminator 64 -> 128 -> 64 -> 1 (LeakyReLU 0.2).
- **Methods.** ``DP-SGDA`` (``C1 = C2 = 0.3``) and ``PrivateDiff`` (``C1 = C2 = C0 = 0.3``, ``T = 2``,
  ``T2 = 1``, ``C3 = 0.03``, which the paper does not give), the same number of generator updates, learning
  rates ``LR`` (not given in the paper). Noise is calibrated to ``(epsilon, delta)`` with the accountant,
  ``delta = 1/n^1.1``, every stream in one accountant. The generator's steps are noised and accounted too,
  although they read no private data: the spent epsilon is an upper bound.
- **Metrics.** The Wasserstein estimate ``mean D(x_test) - mean D(G(z))`` of the released critic on the test
  images and 512 fixed latent codes, over iterations (the paper's Figure 6; near zero is the paper's target),
  and, since a weak critic also reads near zero, the squared RBF-kernel MMD between generated and test images
  (bandwidth: median pairwise distance of the test images), which does not depend on the critic.
  Plots: the curves per epsilon and a grid of generated digits per method and epsilon. No metric reads the
  training images, so the records hold no diagnostics.

Scale: the paper trains 11,750 iterations of batch 256 on 60,000 images; here ``STEPS`` (2000) of batch 64
on ~1,250 images, 3 seeds, epsilon {8, 16, 32}; ``--quick`` 300 steps, 1 seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from dpvr.algorithms import DPSGDA, PrivateDiff
from dpvr.data import DIGITS_RANGE, load
from dpvr.data import train_test_split as split_train_test
from dpvr.objectives import WGAN, WGANModel
from dpvr.ops import NoiseGenerator, torch_threads
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.results import Record, document, format_table, write_figure

from .common import derive_seed, format_mean_std, plot_curves, progress, record_metrics, save

NAME = "wgan"
METHODS = ("DP-SGDA", "PrivateDiff")
EPSILONS = (8.0, 16.0, 32.0)
LATENT = 16
GENERATOR = (32, 64, 128, 256)
DISCRIMINATOR = (128, 64)
PENALTY, RADIUS = 1e-3, 100.0
CLIPS = {  # each method's clip={stream: radius}; PrivateDiff's difference radius is (per move, offset)
    "DP-SGDA": {"x": 0.3, "y": 0.3},
    "PrivateDiff": {"y": 0.3, "checkpoint": 0.3, "difference": (0.3, 0.03)},
}
RESTART, Y_STEPS = 2, 1
LR = {"lr": 0.5, "lr_y": 0.05}
EVAL_LATENTS = 512
PREPROCESSING = f"pixels, {DIGITS_RANGE.description}; no statistic of the data is fitted"


@dataclasses.dataclass(frozen=True)
class Protocol:
    steps: int
    batch_size: int
    seeds: int
    evaluations: int  # points on each curve after the start


SCALED = Protocol(steps=2000, batch_size=64, seeds=3, evaluations=40)
QUICK = Protocol(steps=300, batch_size=64, seeds=1, evaluations=15)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, help="generator updates (default: the protocol's)")
    parser.add_argument("--batch-size", type=int, help="batch size (default: the protocol's)")


def _mlp(widths: tuple[int, ...], activation: type[nn.Module], out: nn.Module | None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-2], widths[1:-1]):
        layers += [nn.Linear(a, b), activation()]
    layers.append(nn.Linear(widths[-2], widths[-1]))
    return nn.Sequential(*layers, *([out] if out is not None else []))


def _models(dim: int, seed: int) -> tuple[WGANModel, nn.Module]:
    torch.manual_seed(derive_seed(seed, 5) % 2**63)  # public initialisation
    generator = _mlp((LATENT, *GENERATOR, dim), nn.ReLU, nn.Sigmoid())
    discriminator = _mlp((dim, *DISCRIMINATOR, 1), lambda: nn.LeakyReLU(0.2), None)
    return WGANModel(generator, dim, LATENT), discriminator


def mmd2(a: torch.Tensor, b: torch.Tensor, bandwidth: float) -> float:
    """Squared maximum mean discrepancy with the RBF kernel ``exp(-||u - v||^2 / (2 bandwidth^2))``
    (the biased V-statistic)."""

    def k(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(u, v).square() / (2 * bandwidth**2)).mean()

    return float(k(a, a) + k(b, b) - 2 * k(a, b))


@dataclasses.dataclass
class _Run:
    steps: list[int] = dataclasses.field(default_factory=list)
    wasserstein: list[float] = dataclasses.field(default_factory=list)
    mmd: list[float] = dataclasses.field(default_factory=list)
    samples: np.ndarray | None = None
    spent_epsilon: float | None = None


def _train(
    method: str,
    data: tuple[torch.Tensor, torch.Tensor],
    protocol: Protocol,
    epsilon: float,
    seed: int,
    noise_seed: int,
) -> _Run:
    train, test = data
    model, discriminator = _models(train.shape[1], seed)
    problem = WGAN(discriminator, train.shape[1], penalty=PENALTY, radius=RADIUS)
    latents = torch.Generator().manual_seed(derive_seed(noise_seed, 8) % 2**63)
    records = model.records(train, latents)
    common: dict[str, Any] = dict(
        **LR,
        batch_size=protocol.batch_size,
        steps=protocol.steps,
        clip=CLIPS[method],
        privacy=PrivacyConfig(epsilon=epsilon, delta=1.0 / len(train) ** 1.1),
        runtime=RuntimeConfig(
            generator=NoiseGenerator(derive_seed(noise_seed, 6), reproducible=True),
            sampler_seed=derive_seed(noise_seed, 7),
        ),
    )
    targets = torch.zeros(len(train))  # unused: a record is its image (and its public latent code)
    if method == "DP-SGDA":
        alg: DPSGDA | PrivateDiff = DPSGDA(model, problem, records, targets, **common)
    else:
        alg = PrivateDiff(model, problem, records, targets, restart=RESTART, y_steps=Y_STEPS, **common)
    fixed = torch.randn(
        EVAL_LATENTS, LATENT, generator=torch.Generator().manual_seed(derive_seed(seed, 9) % 2**63)
    )
    bandwidth = float(torch.pdist(test).median())
    run = _Run()

    def evaluate(step: int) -> None:
        with torch.no_grad():
            fake = model.generator(fixed)
        run.steps.append(step)
        run.wasserstein.append(problem.wasserstein(alg.y, test, fake))
        run.mmd.append(mmd2(fake, test, bandwidth))
        run.samples = fake[:16].numpy()

    every = max(1, protocol.steps // protocol.evaluations)
    evaluate(0)
    for t in range(1, protocol.steps + 1):
        alg.step()
        # Fresh public latent codes for the next step; the algorithm reads its records by reference.
        records[:, train.shape[1] :].normal_(generator=latents)
        if t % every == 0 or t == protocol.steps:
            evaluate(t)
    run.spent_epsilon = alg.privacy_spent().epsilon
    return run


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    train, test = split_train_test(DIGITS_RANGE(load("digits")), test_fraction=0.3, seed=derive_seed(seed, 1))
    return (
        torch.as_tensor(train.features, dtype=torch.float32),
        torch.as_tensor(test.features, dtype=torch.float32),
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the experiment (see the module documentation); returns the result document."""
    base = QUICK if args.quick else SCALED
    protocol = dataclasses.replace(
        base,
        steps=args.steps or base.steps,
        batch_size=args.batch_size or base.batch_size,
        seeds=args.seeds or base.seeds,
    )
    epsilons = tuple(args.epsilon or EPSILONS)
    found: dict[tuple[float, str], list[_Run]] = {}
    records: list[Record] = []
    with torch_threads(1), progress(protocol.seeds * len(epsilons) * len(METHODS), NAME) as bar:
        for seed in range(protocol.seeds):
            data = _data(seed)
            for epsilon in epsilons:
                for method in METHODS:
                    bar.set_postfix_str(f"seed {seed} eps {epsilon} {method}")
                    noise_seed = derive_seed(seed, METHODS.index(method), round(epsilon * 1e6))
                    result = _train(method, data, protocol, epsilon, seed, noise_seed)
                    found.setdefault((epsilon, method), []).append(result)
                    metrics = record_metrics(
                        {"wasserstein": result.wasserstein[-1], "mmd2": result.mmd[-1]},
                        diagnostics=(),
                        curves={"step": result.steps, "wasserstein": result.wasserstein, "mmd2": result.mmd},
                    )
                    records.append(
                        Record(
                            method,
                            "digits",
                            epsilon,
                            1.0 / len(data[0]) ** 1.1,
                            seed,
                            result.spent_epsilon,
                            metrics,
                        )
                    )
                    bar.update()
    config = {
        "dataset": "digits, 70/30 split",
        "preprocessing": PREPROCESSING,
        "epsilons": list(epsilons),
        "delta": "1/n^1.1 (n: training images)",
        "generator": f"MLP {LATENT}-{'-'.join(map(str, GENERATOR))}-64 ReLU, sigmoid output",
        "discriminator": f"MLP 64-{'-'.join(map(str, DISCRIMINATOR))}-1 LeakyReLU(0.2)",
        "penalty": PENALTY,
        "radius": RADIUS,
        "clips": CLIPS,
        "restart": RESTART,
        "y_steps": Y_STEPS,
        "learning_rates": LR,
        "quick": bool(args.quick),
        "protocol": dataclasses.asdict(protocol),
        "generator_stream_accounted": True,
    }
    doc = document(NAME, config, records)
    rows = [
        [
            eps,
            method,
            max(r.spent_epsilon or 0.0 for r in runs),
            format_mean_std(r.wasserstein[-1] for r in runs),
            format_mean_std(r.mmd[-1] for r in runs),
        ]
        for (eps, method), runs in found.items()
    ]
    print(format_table(["epsilon", "method", "spent epsilon", "Wasserstein estimate", "MMD^2 (test)"], rows))
    print(
        f"\nmean ± std over {protocol.seeds} seeds at the last iterate; delta = 1/n^1.1; the spent epsilon "
        "counts the generator's steps too (an upper bound: they read no private data)."
    )
    paths = save(doc, records, args.out)
    steps = found[(epsilons[0], METHODS[0])][0].steps
    for metric, title in (("wasserstein", "Wasserstein estimate"), ("mmd", "MMD^2 to test images")):
        panels = {
            f"{title}, epsilon = {eps:g}": {m: [getattr(r, metric) for r in found[(eps, m)]] for m in METHODS}
            for eps in epsilons
        }
        path = os.path.join(args.out, f"{NAME}_{metric}.png")
        plot_curves(path, steps, panels, title=f"WGAN on digits: {title}", xlabel="iteration", log_y=False)
        paths.append(path)
    paths.append(_grid(found, epsilons, args.out))
    print("\nwrote " + ", ".join(paths))
    return doc


def _grid(found: dict[tuple[float, str], list[_Run]], epsilons: tuple[float, ...], out: str) -> str:
    """Generated digits of the first seed: one row of 16 per method and epsilon."""
    from matplotlib.figure import Figure

    rows = [(eps, m) for eps in epsilons for m in METHODS]
    fig = Figure(figsize=(16 * 0.6, len(rows) * 0.75), layout="tight")
    axes = fig.subplots(len(rows), 16, squeeze=False)
    for row, key in zip(axes, rows):
        samples = found[key][0].samples
        for i, ax in enumerate(row):
            ax.imshow(samples[i].reshape(8, 8), cmap="gray_r", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        row[0].set_ylabel(f"{key[1]}\neps {key[0]:g}", fontsize=7)
    path = os.path.join(out, f"{NAME}_samples.png")
    write_figure(path, fig, dpi=100)
    return path
