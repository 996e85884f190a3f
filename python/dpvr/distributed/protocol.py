"""The messages between the aggregator (rank 0) and client ``p`` (rank ``p + 1``), all point to point.

- down, between runs of a :class:`~dpvr.distributed.ClientPool`: a header with op ``RUN`` and the run's
  byte count in its ``batch`` slot, then the run (:func:`pack_run`: model, loss, the client's shard,
  gradient options), or op ``CLOSE``;
- down, in a run: a float64 header (:data:`FIELDS`), for a local step the batch's record indices (int64),
  then the point in the parameters' dtype: ``x_{r-1}`` for a round (followed by ``x_{r-2}`` when the
  client cannot have it: a difference round first after a resume), ``x_{k-1,r-1}`` for a local step, the
  released ``x_R`` with ``STOP`` at the end; ``ABORT`` ends the run after a failure;
- up: a float64 ``[status, non-finite count]`` and the client's clipped mean (one float64 d-vector,
  whatever the parameters' dtype: a sum over records is rounded to it only after the noise); at the start
  of a run, a float64 ``[shard size, dimension]``.

A client keeps the previous round's point as ``x_{r-2}`` and its previous local point as ``x_{k-2,r-1}``,
so each step moves one d-vector each way.

A run is pickled, so loading it can run code: a client unpickles one only after checking its HMAC-SHA256
under the key its pool gave it through the process's start arguments, never the network. A message
forged on the (unauthenticated) transport is refused before it is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .group import seconds

ROUND, LOCAL, STOP, ABORT, RUN, CLOSE = 1, 2, 3, 4, 5, 6
FIELDS = ("op", "round", "restart", "radius", "client", "previous", "batch")
HEADER = len(FIELDS)  # float64 values in a header
OK, FAILED = 0, 1
KEY_BYTES = 32  # the pool's key for runs
_MAC_BYTES = hashlib.sha256().digest_size


@dataclass
class Traffic:
    """Bytes the aggregator sent and received in a run, headers included; ``shipped``: the bytes of the
    run itself sent to pooled clients (model, loss, shards), which a deployment's clients already hold."""

    down: int = 0
    up: int = 0
    shipped: int = 0
    steps: dict[str, int] = field(default_factory=lambda: {"round": 0, "local": 0})


def header(
    op: int,
    r: int = 0,
    *,
    restart: bool = False,
    radius: float = 0.0,
    client: int = 0,
    previous: bool = False,
    batch: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A down message's header: :data:`FIELDS`, as float64 (one message type for every op)."""
    values = [op, r, float(restart), radius, client, float(previous), batch]
    return torch.tensor(values, dtype=torch.float64, device=device)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def wait(work: Any, within: float) -> None:
    """Waits for a ``torch.distributed`` send or receive; ``TimeoutError`` after ``within`` seconds."""
    if work.wait(seconds(within)) is False:
        raise TimeoutError


def short(err: BaseException) -> str:
    """The backend's message without its source location, first sentence only."""
    text = str(err).strip() or type(err).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return text.split(". ")[0].rstrip(".")


def pack_run(
    model: nn.Module,
    loss_fn: Any,
    shard: Sequence[torch.Tensor],
    *,
    grad_mode: str,
    chunk_size: int | None,
    key: bytes,
) -> bytes:
    """One client's run, pickled, preceded by its HMAC-SHA256 under ``key``.

    The shard's tensors are copied first: a view (a slice of the whole training set) pickles its entire
    storage, which would ship every other client's records along."""
    run = {
        "model": model,
        "loss_fn": loss_fn,
        "shard": tuple(t.clone() for t in shard),
        "grad_mode": grad_mode,
        "chunk_size": chunk_size,
    }
    payload = pickle.dumps(run, protocol=pickle.HIGHEST_PROTOCOL)
    return hmac.digest(key, payload, "sha256") + payload


def unpack_run(data: bytes, key: bytes) -> dict[str, Any]:
    """The run :func:`pack_run` packed; ``ValueError`` (nothing unpickled) unless its HMAC under ``key``
    is intact."""
    mac, payload = data[:_MAC_BYTES], data[_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.digest(key, payload, "sha256")):
        raise ValueError("the run's authentication code does not match: not sent by this pool's aggregator")
    return pickle.loads(payload)
