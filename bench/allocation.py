"""Equal shares against shares="auto", paired by seed, on the bundled data.

- DIFF2-GD on diabetes (the README's run: 4 clients, an MLP 10-10-1, 100 rounds, restart 10): final train
  loss.
- PrivateDiff on digits AUC (the AUC experiment's data, model, clips, restart 2 and 3 ascent steps; batch 256,
  30 epochs, lr_x = lr_y = 0.2, not tuned): final test AUC.

Each seed fixes the split, the model's initialisation, the batches and the noise seed; the two arms differ
only in the budget split. Reports mean ± sd, the paired t-test's two-sided p-value and the noise multipliers.

    python bench/allocation.py [--seeds 5] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from scipy import stats

from dpvr.algorithms import DIFF2, PrivateDiff, PrivateDiffPlan
from dpvr.data import PublicScaling, load, split_clients, split_public
from dpvr.objectives import AUCMargin
from dpvr.ops import NoiseGenerator
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.privacy import calibrate
from dpvr.privacy.allocation import stream_dimensions
from dpvr_lab.experiments import auc

DELTA = 1e-5


def diff2_loss(seed: int, epsilon: float, shares: str | None) -> tuple[float, dict[str, float]]:
    public, private = split_public(load("diabetes"), seed=seed)
    private = PublicScaling.fit(public)(private)
    shards = split_clients(private, 4, seed=seed)
    clients = [(torch.tensor(c.features), torch.tensor(c.targets)) for c in shards]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Softplus(), torch.nn.Linear(10, 1)).double()

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * (output.squeeze() - target) ** 2

    alg = DIFF2(
        model, loss, clients, lr=0.2, steps=100, restart=10, clip={"restart": 1.0, "difference": 2.0},
        privacy=PrivacyConfig(epsilon=epsilon, delta=DELTA, shares=shares),
        runtime=RuntimeConfig(generator=NoiseGenerator(seed, reproducible=True), sampler_seed=seed),
    )
    alg.run()
    with torch.no_grad():
        final = sum(float(loss(model(x).squeeze(1), t).mean()) for x, t in clients) / len(clients)
    return final, alg.noise


def privatediff_auc(
    seed: int, epsilon: float, shares: str | None, epochs: int
) -> tuple[float, dict[str, float]]:
    data = auc._prepare("digits", None, seed)
    problem = AUCMargin(data.positive_ratio)
    model = copy.deepcopy(auc._model(data.train[0].shape[1], seed))
    n, batch = len(data.train[0]), 256
    steps = epochs * max(1, n // batch)
    plan = PrivateDiffPlan(n, batch, steps, auc.RESTART, auc.Y_STEPS)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # The algorithm would pass these shapes itself; the dimensions are public (model and problem shapes).
    noise = calibrate(
        plan, epsilon, data.delta, shares=shares, dimensions=stream_dimensions(plan, parameters, problem)
    )
    alg = PrivateDiff(
        model, problem, *data.train, lr=0.2, lr_y=0.2, steps=steps, restart=auc.RESTART, y_steps=auc.Y_STEPS,
        batch_size=batch, clip=auc.CLIPS["PrivateDiff"], noise=noise,
        privacy=PrivacyConfig(epsilon=epsilon, delta=data.delta),
        runtime=RuntimeConfig(generator=NoiseGenerator(seed, reproducible=True), sampler_seed=seed),
    )
    alg.run()
    assert alg.privacy_spent().epsilon <= epsilon
    return auc._evaluate(model, problem, alg.y, data)["test_auc"], noise


def compare(name: str, metric: str, run, seeds: int, better: str) -> None:
    equal, auto = [], []
    for seed in range(seeds):
        e, noise_e = run(seed, None)
        a, noise_a = run(seed, "auto")
        equal.append(e)
        auto.append(a)
    p = stats.ttest_rel(auto, equal).pvalue
    fmt = lambda xs: f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}"  # noqa: E731
    wins = sum((a < e) if better == "lower" else (a > e) for a, e in zip(auto, equal))
    print(f"{name}: {metric} ({better} is better), {seeds} seeds")
    print(f"  equal {fmt(equal)}   auto {fmt(auto)}   auto wins {wins}/{seeds}   paired t-test p = {p:.3g}")
    print(f"  noise multipliers  equal {_round(noise_e)}   auto {_round(noise_a)}")


def _round(noise: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in noise.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="PrivateDiff for 10 epochs instead of 30")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for epsilon in (1.0, 3.0):
        compare(f"DIFF2-GD diabetes, eps={epsilon}", "final train loss",
                lambda s, sh, eps=epsilon: diff2_loss(s, eps, sh), args.seeds, "lower")
    epochs = 10 if args.quick else 30
    compare(f"PrivateDiff digits AUC, eps=1, {epochs} epochs", "test AUC",
            lambda s, sh: privatediff_auc(s, 1.0, sh, epochs), args.seeds, "higher")


if __name__ == "__main__":
    main()
