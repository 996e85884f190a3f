"""Set-up cost of ``dpvr.make_private`` on a lazily generated dataset as it grows: the time from the call to
the end of the first step, the records loaded by then, and the host memory allocated meanwhile. The data
reach the model through the user's ``Dataset`` per step, so none of these should grow with n.

The time includes calibrating the noise to epsilon, which does not depend on the data but on the sampling
rate: it is shown with the RDP accountant (milliseconds) and the default PLD one (seconds at small rates).
A warm-up run first takes the one-off imports out of the figures.

    python bench/streaming.py [--sizes 10000 100000 1000000] [--batch 256]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dpvr


class Generated(Dataset):
    """``n`` records made on access from their index (nothing is held): a 32-feature input, a class label,
    and a random augmentation (fresh noise) at every access. Counts its accesses."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.loaded += 1
        g = torch.Generator().manual_seed(int(index))
        x = torch.randn(32, generator=g)
        return x + 0.1 * torch.randn(32), int(x[0] > 0)


def measure(n: int, batch: int, accountant: str | None = None) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    data = Generated(n)
    tracemalloc.start()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), DataLoader(data, batch_size=batch),
                                    algorithm="dp-sgd", epsilon=2.0, steps=100, clip=1.0,
                                    accountant=accountant,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    set_up = time.perf_counter() - start
    trainer.step()
    first_step = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"n": n, "set_up_s": set_up, "first_step_s": first_step, "records_loaded": data.loaded,
            "peak_python_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    measure(1000, 32, "rdp")  # imports
    print("| n | accountant | set-up s | to the end of step 1, s | records loaded | peak Python-heap MiB |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in args.sizes:
        for accountant in ("rdp", "pld"):
            r = measure(n, args.batch, accountant)
            print(f"| {r['n']:,} | {accountant} | {r['set_up_s']:.2f} | {r['first_step_s']:.2f} | "
                  f"{r['records_loaded']:,} | {r['peak_python_mib']:.1f} |")


if __name__ == "__main__":
    main()
