"""Batch samplers whose schemes the accountant can price.

The sampling randomness is part of the mechanism: like the noise seed it must be unpredictable, so samplers
draw their seed from the operating system unless the caller fixes it for reproducibility.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

SCHEMES = ("poisson", "wor", "full", "cyclic")


class BatchSampler:
    """Draws the indices of one step's batch from ``range(n)``.

    ``"poisson"``: each record independently with probability ``batch_size / n`` (the batch size varies);
    ``"wor"``: ``batch_size`` distinct records uniformly at random; ``"full"``: every record;
    ``"cyclic"``: consecutive disjoint batches in a fixed order (the last-iterate accountant's traversal).
    """

    def __init__(self, scheme: str, n: int, batch_size: int | None = None, seed: int | None = None) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"sampling: must be one of {SCHEMES}, got {scheme!r}")
        if n < 1:
            raise ValueError(f"dataset size must be >= 1, got {n}")
        if scheme == "full":
            batch_size = n
        if batch_size is None or not 1 <= batch_size <= n:
            raise ValueError(f"batch_size: must be in [1, {n}], got {batch_size}")
        if scheme == "cyclic" and n % batch_size:
            raise ValueError(f"batch_size: cyclic traversal needs it to divide the dataset size {n}")
        self.scheme, self.n, self.batch_size = scheme, n, batch_size
        self._rng = np.random.default_rng(
            seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        )
        self._position = 0

    @property
    def rate(self) -> float:
        return self.batch_size / self.n

    def draw(self) -> np.ndarray:
        if self.scheme == "full":
            return np.arange(self.n)
        if self.scheme == "poisson":
            return np.flatnonzero(self._rng.random(self.n) < self.rate)
        if self.scheme == "wor":
            return np.sort(self._rng.choice(self.n, size=self.batch_size, replace=False))
        start = self._position
        self._position = (start + self.batch_size) % self.n
        return np.arange(start, start + self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self._rng.bit_generator.state, "position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state["rng"]
        self._position = int(state["position"])
