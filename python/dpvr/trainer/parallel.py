"""Data-parallel private training on a ``torch.distributed`` process group: one logical run on P processes.

Every process runs the same algorithm object on the same model, with the same sampler seed and the same
noise generator (drawn on rank 0 and broadcast, or the user's, checked to agree): so every process draws the
same batch of indices and, at each release, the same noise. Only the work on the data is split:

- each process loads its share of each drawn batch (every P-th index, :class:`ShardedRecords`) and clips
  the per-sample gradients of its records;
- the clipped sums are all-reduced (summed) before the release (:class:`AllReducedGradients`), so every
  process holds the clipped sum of the whole batch, bit for bit the same on every process.

Privacy: the release is ``sum_i clip(g_i) + N(0, sigma^2)`` with the batch's clipped sum, exactly the
one-process release (up to the order of the float additions of the all-reduce); the noise is drawn once per
release in the sense that matters: every process draws the *same* noise from the same key (its generator,
keys and the signal it is added to are identical), so what the processes hold after the release is one
value, not P independent noisy copies (which would average the noise down and void the guarantee, or be
charged P times). One accountant per process, all recording the same releases (the same epsilon
everywhere); checkpoints are written by rank 0 only.

Supported: the DP-SGD family (``dp-sgd``, ``dp-gd``), whose releases all go through the clipped sum.
The other algorithms release quantities computed outside it (dual variables, y-gradients, the STORM
estimate ``s``), which this split does not all-reduce: they are refused under a process group. A model
already wrapped in ``DistributedDataParallel`` is refused: its own gradient all-reduce would run beside
dpvr's. A checkpoint is written by rank 0 and loaded by every process (the same file): the re-run's segment
derives from the shared seed, so the processes go on in step, and they are checked to agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..ops import NoiseGenerator
from ..optim import RuntimeConfig
from ..optim.gradients import ClippedGradients
from ..optim.records import Batch, Records

SUPPORTED = ("dp-sgd", "dp-gd")


class DataParallel:
    """The process group a run is split over, and the pieces that split it (see the module documentation)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    @classmethod
    def detect(cls, group: Any = None) -> DataParallel | None:
        """The given group, or the default one when ``torch.distributed`` is initialised with more than one
        process; None for a one-process run."""
        if group is None:
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return None
            group = dist.group.WORLD
        return cls(group)

    def check(self, algorithm: str, module: nn.Module) -> None:
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise ValueError(
                "module: wrapped in DistributedDataParallel, whose gradient all-reduce would run beside "
                "dpvr's all-reduce of the clipped sums; pass the plain module (ddp_model.module): "
                "make_private trains data-parallel over the process group itself"
            )
        if algorithm not in SUPPORTED:
            raise ValueError(
                f"algorithm: data-parallel training over a process group supports {list(SUPPORTED)}; "
                f"{algorithm!r} releases quantities that are not all-reduced here: run it in one process "
                "(DIFF2 across processes: dpvr.distributed)"
            )

    def runtime(self, runtime: RuntimeConfig) -> RuntimeConfig:
        """``runtime`` with one sampler seed and one noise generator for every process: drawn on rank 0 and
        broadcast (kept inside the group, like any noise seed), or the user's own, refused unless every
        process was given the same."""
        if runtime.generator is None and runtime.sampler_seed is None:
            seeds = [secrets.randbits(63), secrets.randbits(63)] if self.rank == 0 else [0, 0]
            dist.broadcast_object_list(seeds, src=dist.get_global_rank(self.group, 0), group=self.group)
            return dataclasses.replace(runtime, sampler_seed=seeds[0],
                                       generator=NoiseGenerator(seeds[1], reproducible=True))
        mine = (runtime.sampler_seed, None if runtime.generator is None else _digest(runtime.generator))
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        if any(other != mine for other in every) or None in mine:
            raise ValueError(
                "runtime: a data-parallel run needs the same sampler_seed and noise generator on every "
                "process (give both, equal everywhere, or neither: then rank 0 draws them for all)"
            )
        return runtime

    def agree(self, algorithm: Any) -> None:
        """Refuses to go on (``RuntimeError``) unless every process holds the same run: step, ledger position
        and parameters (by digest)."""
        digest = hashlib.sha256()
        for p in algorithm.params:
            digest.update(p.detach().cpu().numpy().tobytes())
        ledger = algorithm.ledger
        mine = (algorithm.steps_done, ledger.run, ledger.segment, ledger.seq, digest.hexdigest())
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        if any(other != mine for other in every):
            raise RuntimeError(f"data-parallel run: the processes disagree after loading ({every}); load the "
                               "same checkpoint file on every process")

    def records(self, records: Records) -> ShardedRecords:
        return ShardedRecords(records, self.rank, self.world)

    def gradients(self, engine: ClippedGradients) -> AllReducedGradients:
        return AllReducedGradients(engine, self.group)


def _digest(generator: NoiseGenerator) -> str:
    return hashlib.sha256(repr(sorted(generator.state_dict().items())).encode()).hexdigest()


class ShardedRecords(Records):
    """The records of one process: every draw is the whole batch's indices, of which this process loads
    every ``world``-th, from its ``rank``; its length, probe and fingerprint are the whole dataset's."""

    def __init__(self, records: Records, rank: int, world: int) -> None:
        self.records, self.rank, self.world = records, rank, world

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, indices: np.ndarray | Sequence[int]) -> Batch:
        return self.records.batch(np.asarray(indices)[self.rank :: self.world])

    def probe(self, k: int = 1) -> Batch:
        return self.records.probe(k)

    def fingerprint(self) -> str:
        return self.records.fingerprint()

    def close(self) -> None:
        self.records.close()


class AllReducedGradients:
    """A :class:`~dpvr.optim.gradients.ClippedGradients` whose sums are the whole batch's: each process's
    clipped sum of its records, all-reduced (one flat buffer per call), added to ``out``."""

    def __init__(self, engine: ClippedGradients, group: Any) -> None:
        self.engine, self.group = engine, group

    @property
    def mode(self) -> str:
        return self.engine.mode

    def sum(self, inputs: torch.Tensor, targets: torch.Tensor, clip: float, out: Sequence[torch.Tensor],
            point: Sequence[torch.Tensor] | None = None, norms: torch.Tensor | None = None,
            weights: torch.Tensor | None = None, losses: torch.Tensor | None = None) -> int:
        if norms is not None:
            raise ValueError("norms: not gathered across processes (clipping=False is not data-parallel)")
        scratch = [torch.zeros_like(o) for o in out]
        dropped = self.engine.sum(inputs, targets, clip, scratch, point=point, weights=weights, losses=losses)
        return self._reduce(scratch, out, dropped)

    def diff_sum(self, inputs: torch.Tensor, targets: torch.Tensor, point: Sequence[torch.Tensor],
                 previous: Sequence[torch.Tensor], clip: float, out: Sequence[torch.Tensor],
                 a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> int:
        scratch = [torch.zeros_like(o) for o in out]
        dropped = self.engine.diff_sum(inputs, targets, point, previous, clip, scratch, a=a, b=b)
        return self._reduce(scratch, out, dropped)

    def _reduce(self, scratch: list[torch.Tensor], out: Sequence[torch.Tensor], dropped: int) -> int:
        flat = torch.cat([s.reshape(-1) for s in scratch]
                         + [torch.tensor([float(dropped)], dtype=scratch[0].dtype, device=scratch[0].device)])
        dist.all_reduce(flat, group=self.group)
        start = 0
        for o in out:
            o.add_(flat[start : start + o.numel()].view_as(o))
            start += o.numel()
        return int(flat[-1])
