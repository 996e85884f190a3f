"""Batch samplers whose schemes the accountant can price.

The sampling randomness is part of the mechanism: like the noise seed it must be unpredictable, so samplers
draw their seed from the operating system unless the caller fixes it for reproducibility.
"""

from __future__ import annotations

import math
import os
from collections import deque
from typing import Any

import numpy as np
import torch

from ..privacy.events import Plan
from ..privacy.mechanism import Sampling

SCHEMES = ("poisson", "wor", "full", "cyclic", "random-allocation")


def batch_rows(indices: np.ndarray, device: torch.device) -> torch.Tensor:
    """A drawn batch's row indices as a tensor on ``device``, the data's. On a GPU the copy goes through
    pinned memory and is asynchronous: a copy from ordinary host memory would first wait for all the work
    queued on the device (a host synchronisation every step)."""
    rows = torch.as_tensor(indices, dtype=torch.long)
    if device.type != "cuda":
        return rows
    return rows.pin_memory().to(device, non_blocking=True)


def steps_per_epoch(scheme: str, n: int, batch_size: float | None = None) -> int:
    """The steps of one epoch of :class:`BatchSampler` ``(scheme, n, batch_size)``: the one definition of an
    epoch that callers converting ``epochs`` to steps use, so that what they ask for is what is charged.

    ``"full"``: 1; ``"cyclic"``: ``n / batch_size`` (one pass; it must divide ``n``);
    ``"random-allocation"``: ``t = max(1, round(n / batch_size))``, the epoch in which the sampler allocates
    every record to one step and the plan prices (a step beyond it starts, and is charged as, a new epoch);
    ``"poisson"`` and ``"wor"``: ``ceil(n / batch_size)`` steps, which draw ``n`` records in expectation or
    more (they have no epochs of their own and are charged per step)."""
    if scheme not in SCHEMES:
        raise ValueError(f"sampling: must be one of {SCHEMES}, got {scheme!r}")
    if n < 1:
        raise ValueError(f"dataset size must be >= 1, got {n}")
    if scheme == "full":
        return 1
    if batch_size is None or not 1 <= batch_size <= n:
        raise ValueError(f"batch_size: must be in [1, {n}], got {batch_size}")
    if scheme == "cyclic":
        if n % batch_size:
            raise ValueError(f"batch_size: cyclic traversal needs it to divide the dataset size {n}")
        return int(n // batch_size)
    if scheme == "random-allocation":
        return max(1, round(n / batch_size))
    return math.ceil(n / batch_size)


class BatchSampler:
    """Draws the indices of one step's batch from ``range(n)``.

    What shapes a release reads the *public* size ``public_size`` (default ``n``), never ``n``: the
    Poisson rate ``batch_size / public_size``, random allocation's epoch ``round(public_size / batch_size)``
    and its divisor, and the normaliser :attr:`batch_size`. Under add/remove adjacency ``n`` is private and
    the two may differ (a neighbouring dataset has one record more or less; its batches are drawn at the
    same rate, into the same epochs, divided by the same normaliser); the fixed-size, full and cyclic
    schemes are accounted under replace-one, where the size is public by definition: there they are equal.

    ``"poisson"``: each record independently with probability ``batch_size / public_size`` (the batch size
    varies);
    ``"wor"``: ``batch_size`` distinct records uniformly at random; ``"full"``: every record;
    ``"cyclic"``: consecutive disjoint batches in a fixed order (the last-iterate accountant's traversal);
    ``"random-allocation"``: epochs of ``t = round(public_size / batch_size)`` steps; at the start of each
    epoch every record is allocated to one of its steps uniformly at random, independently of the others,
    and step ``j`` draws the records allocated to it (the batch size varies; ``batch_size`` becomes the
    public normaliser ``round(public_size / t)``).

    Drawing ahead: :meth:`draw_ahead` draws the next index set now and keeps it *pending* (:attr:`pending`)
    until :meth:`draw` returns it, so that a loader can prefetch the records of batches the algorithm has not
    consumed yet. The sequence of index sets :meth:`draw` returns is the same with or without drawing ahead
    (each draw depends only on this sampler's state), and the pending draws are part of :meth:`state_dict`: a
    resumed run consumes them first, so a checkpoint never skips or repeats a drawn batch. :attr:`generation`
    changes whenever the state is replaced (:meth:`load_state_dict`, :meth:`restart`), telling a prefetching
    loader that what it drew ahead is void.
    """

    def __init__(
        self,
        scheme: str,
        n: int,
        batch_size: float | None = None,
        seed: int | None = None,
        *,
        public_size: int | None = None,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"sampling: must be one of {SCHEMES}, got {scheme!r}")
        if n < 1:
            raise ValueError(f"dataset size must be >= 1, got {n}")
        public = n if public_size is None else public_size
        if public != n and scheme not in ("poisson", "random-allocation"):
            raise ValueError(
                f"sampling={scheme!r} is accounted under replace-one, where the dataset size is the data's "
                f"own ({n} records), not a public size of {public}"
            )
        if scheme == "full":
            batch_size = n
        epoch = steps_per_epoch(scheme, public, batch_size)  # also checks batch_size
        # Random allocation's epoch shapes the draws (and the accounting); the other schemes have none.
        self.steps_per_epoch = epoch if scheme == "random-allocation" else None
        if self.steps_per_epoch is not None:
            batch_size = round(public / self.steps_per_epoch)
        self.scheme, self.n, self.batch_size, self.public_size = scheme, n, batch_size, public
        self._rng = np.random.default_rng(
            seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        )
        self._position = 0
        self._allocation: np.ndarray | None = None  # random allocation: each record's step in this epoch
        self._pending: deque[np.ndarray] = deque()  # drawn ahead, not yet consumed (oldest first)
        self.generation = 0  # bumped whenever the state is replaced

    @classmethod
    def for_stream(
        cls,
        plan: Plan,
        stream: str,
        dataset_size: int,
        seed: int | None = None,
        *,
        public_size: int | None = None,
    ) -> BatchSampler:
        """The sampler of ``stream``, built from the accountant's own description of that stream
        (:meth:`Plan.stream_sampling`), so that what is drawn is what is charged.

        ``dataset_size`` is the number of records this sampler draws from: the plan's, or a client's shard
        that holds at least as many (the plan then charges the largest rate, the worst case).
        ``public_size`` is the public size the plan was made for under add/remove (default
        ``dataset_size``): the rate, epoch and normaliser are the plan's, whatever ``dataset_size``. A
        sampler that would draw at a higher rate than charged is refused."""
        charged = plan.stream_sampling(stream)
        public = dataset_size if public_size is None else public_size
        if charged.scheme == "full":
            return cls("full", dataset_size, seed=seed)
        if charged.scheme == "random-allocation":
            # An epoch of t steps is what is charged; a larger shard keeps t (each record still in one step).
            sampler = cls(charged.scheme, dataset_size, public / charged.steps_per_epoch, seed,
                          public_size=public)
            if sampler.steps_per_epoch != charged.steps_per_epoch:
                raise ValueError(
                    f"stream {stream!r}: {public} records cannot be allocated to epochs of the "
                    f"{charged.steps_per_epoch} steps the plan charges"
                )
            return sampler
        batch = charged.batch_size if charged.scheme == "wor" else round(charged.rate * public)
        sampler = cls(charged.scheme, dataset_size, batch, seed, public_size=public_size)
        if sampler.rate > charged.rate * (1 + 1e-12):
            raise ValueError(
                f"stream {stream!r}: drawing {batch} of {public} records is a higher rate than the "
                f"{charged.rate:g} the plan charges"
            )
        return sampler

    def describe(self) -> Sampling:
        """This sampler as the accountant describes a sampling scheme."""
        if self.scheme == "cyclic":
            raise ValueError("cyclic traversal is not a sampled scheme; its plan accounts it as a whole")
        if self.scheme == "random-allocation":
            return Sampling.make(self.scheme, sample_rate=1 / self.steps_per_epoch)
        return Sampling.make(self.scheme, batch_size=self.batch_size, dataset_size=self.public_size)

    @property
    def rate(self) -> float:
        """The expected fraction of the records each step draws (of the public size's, for Poisson)."""
        if self.scheme == "random-allocation":
            return 1 / self.steps_per_epoch
        return self.batch_size / self.public_size

    @property
    def pending(self) -> deque[np.ndarray]:
        """The index sets drawn ahead and not yet consumed, oldest first (read-only for callers)."""
        return self._pending

    def draw(self) -> np.ndarray:
        """The next index set (sorted for the sampled schemes): the oldest pending one, else a new draw."""
        if self._pending:
            return self._pending.popleft()
        return self._next()

    def draw_ahead(self) -> np.ndarray:
        """Draws the next index set not yet pending and keeps it pending (see the class documentation)."""
        indices = self._next()
        self._pending.append(indices)
        return indices

    def _next(self) -> np.ndarray:
        if self.scheme == "full":
            return np.arange(self.n)
        if self.scheme == "poisson":
            # Each record independently with probability rate, drawn as its two exact factors: the batch's
            # size ~ Binomial(n, rate), then a uniform subset of that size. Same law as n coin flips, in
            # O(batch) time and memory (numpy draws a small subset by Floyd's method) instead of O(n).
            size = int(self._rng.binomial(self.n, self.rate))
            return np.sort(self._rng.choice(self.n, size=size, replace=False))
        if self.scheme == "wor":
            return np.sort(self._rng.choice(self.n, size=self.batch_size, replace=False))
        if self.scheme == "random-allocation":
            if self._position == 0:
                self._allocation = self._rng.integers(self.steps_per_epoch, size=self.n)
            step = self._position
            self._position = (step + 1) % self.steps_per_epoch
            return np.flatnonzero(self._allocation == step)
        start = self._position
        self._position = (start + self.batch_size) % self.n
        return np.arange(start, start + self.batch_size)

    def restart(self, seed: int | None = None) -> None:
        """Fresh sampling randomness from here on (``seed``, or the operating system's), for a re-run: its
        batches must be independent of those a discarded branch drew from the same state. Random allocation
        starts a new epoch here, so that every epoch is one allocation of every record (a re-run that
        continued the discarded branch's epoch could use a record twice in it)."""
        self._rng = np.random.default_rng(
            seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        )
        if self.scheme == "random-allocation":
            self._position, self._allocation = 0, None
        self._pending.clear()  # drawn by the discarded branch: a re-run draws afresh
        self.generation += 1

    def state_dict(self) -> dict[str, Any]:
        allocation = None if self._allocation is None else self._allocation.tolist()
        state = {"rng": self._rng.bit_generator.state, "position": self._position, "allocation": allocation}
        if self._pending:  # drawn ahead, not consumed: the resumed run consumes them first
            state["pending"] = [p.tolist() for p in self._pending]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pending = deque(np.asarray(p, dtype=np.int64) for p in state.get("pending", ()))
        self._rng.bit_generator.state = state["rng"]
        self._position = int(state["position"])
        allocation = state.get("allocation")
        self._allocation = None if allocation is None else np.asarray(allocation, dtype=np.int64)
        self._pending = pending
        self.generation += 1
