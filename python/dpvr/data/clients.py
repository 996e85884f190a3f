"""IID partition of a (training) dataset over the P clients of distributed learning."""

from __future__ import annotations

import numpy as np

from .dataset import Dataset


def split_clients(dataset: Dataset, num_clients: int, *, seed: int) -> list[Dataset]:
    """Shuffle with ``seed`` and deal out ``num_clients`` disjoint shards of ``len(dataset) // num_clients``
    samples each.

    The ``len(dataset) % num_clients`` samples left over are dropped: DIFF2 averages the clients' losses
    unweighted and calibrates its noise to the smallest shard n_min, so unequal shards would buy nothing.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    shard = len(dataset) // num_clients
    if shard == 0:
        raise ValueError(f"{dataset.name}: {len(dataset)} samples cannot fill {num_clients} client shards")
    order = np.random.default_rng(seed).permutation(len(dataset))
    return [dataset.subset(order[p * shard:(p + 1) * shard]) for p in range(num_clients)]
