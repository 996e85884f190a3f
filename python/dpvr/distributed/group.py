"""The process group of a distributed DIFF2 run: rank 0 is the aggregator, ranks 1..P the clients.

Failures travel out of band. Data moves point to point on the backend (gloo or NCCL), but once a rank
fails the backend's connections may be closed, so the reason is written to the rendezvous key-value store,
first writer wins, and every rank reads it from there. The aggregator then wakes the clients with an
abort message, or they see their connection close, and waits a little for them to confirm before it exits
(on one machine it hosts the store).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

AGGREGATOR = 0
_REASON, _FIRST = "abort/reason", "abort/count"


class DistributedError(RuntimeError):
    """A distributed run ended because a rank failed, timed out or lost its connection."""


def seconds(value: float) -> datetime.timedelta:
    # A zero timedelta means "the group's default" to the backend: never pass one.
    return datetime.timedelta(seconds=max(float(value), 1e-3))


@dataclass
class Group:
    """This rank's view of the run: who it is, the store for failure reasons, the round watchdog.

    ``timeout``: how long the aggregator waits for the clients' answers in one step (the watchdog).
    ``idle_timeout``: how long a client waits for the aggregator's next message, which must cover the
    aggregator's work between rounds (evaluation, checkpoints); it is also the backend group's timeout.
    ``in_flight``: the aggregator's last step's send and receive handles, kept for the group's lifetime.
    Gloo cancels an operation whose handle is freed, so after a failed step a client could block for
    ever in a send the aggregator no longer receives, or miss the abort it was sent.
    """

    rank: int
    world: int
    store: dist.Store
    device: torch.device
    timeout: float
    idle_timeout: float
    in_flight: list[Any] = field(default_factory=list)

    @property
    def clients(self) -> int:
        return self.world - 1

    def fail(self, reason: str) -> str:
        """Records ``reason`` unless another rank got there first; returns the reason that stands."""
        if self.store.add(_FIRST, 1) == 1:
            self.store.set(_REASON, reason)
        return self.reason(reason)

    def reason(self, fallback: str, wait: float = 2.0) -> str:
        """The recorded reason of the failure (waiting up to ``wait`` s for it), else ``fallback``."""
        try:
            self.store.wait([_REASON], seconds(wait))
            return self.store.get(_REASON).decode()
        except (RuntimeError, dist.DistStoreError):  # no reason recorded, or the store is gone
            return fallback

    def acknowledge(self) -> None:
        with contextlib.suppress(RuntimeError):  # the aggregator, which may host the store, has gone
            self.store.set(f"abort/ack/{self.rank}", "1")

    def await_acknowledgements(self, ranks: list[int], wait: float) -> None:
        with contextlib.suppress(RuntimeError, dist.DistStoreError):  # a hung or dead rank cannot confirm
            self.store.wait([f"abort/ack/{k}" for k in ranks], seconds(wait))


def init_group(
    *,
    timeout: float = 60.0,
    idle_timeout: float = 1800.0,
    backend: str | None = None,
    device: str | None = None,
) -> Group:
    """Joins the run from the ``env://`` variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, as ``torchrun`` and :class:`dpvr.distributed.ClientPool` set them).

    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); by default NCCL when CUDA is available and
    ``device`` is not ``"cpu"``. Each rank uses ``cuda:LOCAL_RANK`` with NCCL.
    """
    _check_timeouts(timeout, idle_timeout)
    store, rank, world = next(dist.rendezvous("env://", timeout=seconds(idle_timeout)))
    return join_group(
        store, rank, world, timeout=timeout, idle_timeout=idle_timeout, backend=backend, device=device
    )


def join_group(
    store: dist.Store,
    rank: int,
    world: int,
    *,
    timeout: float,
    idle_timeout: float,
    backend: str | None = None,
    device: str | None = None,
) -> Group:
    """Joins the run through ``store`` (the rendezvous store every rank shares) as ``rank`` of ``world``."""
    _check_timeouts(timeout, idle_timeout)
    if world < 2:
        raise ValueError("a distributed run needs the aggregator and at least one client (WORLD_SIZE >= 2)")
    if backend is None:
        backend = "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("group", store),
        rank=rank,
        world_size=world,
        timeout=seconds(idle_timeout),
    )
    return Group(rank, world, dist.PrefixStore("dpvr", store), where, float(timeout), float(idle_timeout))


def _check_timeouts(timeout: float, idle_timeout: float) -> None:
    if not timeout > 0 or not idle_timeout > 0:
        raise ValueError("timeout and idle_timeout must be > 0 seconds")
