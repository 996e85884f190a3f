"""One machine, one run: :func:`launch` runs DIFF2 with P client processes and this process aggregating."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..algorithms.diff2.algorithm import Shard
from ..ops import torch_threads
from ..optim import RuntimeConfig
from ..problems import LossFn
from .aggregator import AggregatorResult, run_rounds
from .group import DistributedError
from .pool import ClientPool


@dataclass
class LaunchResult:
    """The aggregator's result and what every rank reported (``"ok"`` or its error message)."""

    result: AggregatorResult
    ranks: dict[int, str] = field(default_factory=dict)


def launch(
    model: nn.Module,
    loss_fn: LossFn,
    shards: Sequence[Shard],
    *,
    timeout: float = 30.0,
    idle_timeout: float = 120.0,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 1,
    resume: bool = False,
    run_steps: int | None = None,
    keep_iterates: bool = False,
    threads: int = 1,
    **options: Any,
) -> LaunchResult:
    """Runs DIFF2 with one client process per shard, this process aggregating; trains ``model`` in place.

    Client ``p`` receives only ``shards[p]`` (and copies of the model and loss); the noise generator
    (``options["runtime"].generator``), the accountant and the checkpoints stay in this process, whose
    ``options`` are :func:`~dpvr.distributed.run_rounds`'s and :class:`~dpvr.algorithms.DIFF2`'s.
    ``timeout`` is the per-step watchdog, ``idle_timeout`` the longest a client waits for the
    aggregator; every process computes with ``threads`` intra-op threads. Processes start from a fork
    server that has imported torch and dpvr once, so a launch costs well under a second after the first.
    Raises :class:`DistributedError` when a client fails (``err.ranks``: every rank's message); an error
    of the aggregator's own (e.g. a refused checkpoint) is raised as it is.
    """
    if not shards:
        raise ValueError("shards: at least one client shard is required")
    runtime = options.get("runtime", RuntimeConfig())  # the clients must compute gradients as DIFF2 would
    grads = {"grad_mode": runtime.grad_mode, "chunk_size": runtime.chunk_size}
    with ClientPool(len(shards), timeout=timeout, idle_timeout=idle_timeout, threads=threads) as pool:
        try:
            with torch_threads(threads), pool.connect(model, loss_fn, shards, **grads) as clients:
                result = run_rounds(
                    clients,
                    model,
                    loss_fn,
                    checkpoint=checkpoint,
                    checkpoint_every=checkpoint_every,
                    resume=resume,
                    run_steps=run_steps,
                    keep_iterates=keep_iterates,
                    **options,
                )
        except DistributedError as err:
            err.ranks = {0: str(err), **pool.close()}  # type: ignore[attr-defined]
            raise
    return LaunchResult(result, {0: "ok", **pool.close()})
