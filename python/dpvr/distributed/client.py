"""The client's end of the wire: :func:`serve` answers one run's requests, :func:`serve_runs` a pool's runs.

Each answer is :func:`dpvr.algorithms.diff2.algorithm.clipped_mean` on the client's own shard, the function
the in-process clients call, which is why a distributed run releases bitwise the simulation's iterates. A
client never holds the noise seed or the accountant.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from ..algorithms.diff2.algorithm import ClippedGradients, Shard, clipped_mean
from ..grads import trainable_parameters
from ..optim.gradients import accumulators
from ..problems import LossFn
from .group import AGGREGATOR, DistributedError, Group
from .protocol import ABORT, CLOSE, FAILED, HEADER, OK, ROUND, RUN, STOP, short, unpack_run, wait


def serve(
    group: Group,
    model: nn.Module,
    loss_fn: LossFn,
    shard: Shard,
    *,
    grad_mode: str = "auto",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The client loop of rank ``p + 1``: answers the aggregator's requests on ``shard`` until it stops.

    ``grad_mode`` and ``chunk_size`` must be the aggregator's (:class:`~dpvr.algorithms.DIFF2`'s) for the
    uploads to match the simulation bitwise. Returns the released final iterate (flat).
    """
    client = group.rank - 1
    x, y = shard
    if len(x) == 0 or len(x) != len(y):
        raise ValueError(f"client {client}: needs matching, non-empty inputs and targets")
    state = _Client(group, model, loss_fn, grad_mode, chunk_size)
    device = group.device
    header = torch.zeros(HEADER, dtype=torch.float64, device=device)
    status = torch.zeros(2, dtype=torch.float64, device=device)
    dist.send(torch.tensor([len(x), state.dim], dtype=torch.float64, device=device), dst=AGGREGATOR)
    while True:
        _listen(group, header, state.where)
        op, r, restart, radius, _, resend, batch = header.tolist()
        if op == ABORT:
            _stop(group, f"the aggregator ended the run ({state.where})")
        if op == STOP:
            return state.stop()
        state.where = f"in round {int(r)}"
        try:
            if op == ROUND:
                dropped = state.round(x, y, radius, restart=bool(restart), resend=bool(resend))
            else:
                dropped = state.local_step(x, y, radius, int(batch))
            status[:] = torch.tensor([OK, dropped], dtype=torch.float64)
            reply = torch.cat(state.out)
        except DistributedError:
            raise
        except Exception as err:
            failed = f"client {client} (rank {group.rank}) failed {state.where}"
            group.fail(f"{failed}: {type(err).__name__}: {err}")
            status[0], reply = FAILED, torch.zeros(state.dim, dtype=torch.float64, device=device)
        dist.send(status, dst=AGGREGATOR)
        dist.send(reply, dst=AGGREGATOR)


class _Client:
    """What a client keeps between requests: its gradient engines, the points the next request refers to
    and the buffer of its answer."""

    def __init__(self, group: Group, model: nn.Module, loss_fn: LossFn, grad_mode: str,
                 chunk_size: int | None) -> None:
        self.group, self.where = group, "before the first round"
        # Rounds see the whole shard at x_{r-1} again in the next round: keep that recording (checked before
        # every reuse), as DIFF2-GD does in-process; local steps draw fresh batches and recompute.
        self.rounds = ClippedGradients(model, loss_fn, mode=grad_mode, chunk_size=chunk_size,
                                       reuse_recording=True)
        self.local = ClippedGradients(model, loss_fn, mode=grad_mode, chunk_size=chunk_size)
        self.params = [p for _, p in trainable_parameters(model)]
        self.flat = [p.detach().view(-1) for p in self.params]
        self.numels = [t.numel() for t in self.flat]
        self.dim, self.dtype = sum(self.numels), self.params[0].dtype
        self.anchor = torch.zeros(self.dim, dtype=self.dtype, device=group.device)  # x_{r-1}: last round's
        self.anchor_prev = torch.zeros_like(self.anchor)  # x_{r-2}
        self.local_prev = torch.zeros_like(self.anchor)  # x_{k-2,r-1} during local steps
        self.out = accumulators(self.flat)  # the clipped mean, sent in float64: rounded only after the noise

    def _receive(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(size, dtype=dtype, device=self.group.device)
        _listen(self.group, t, self.where)
        return t

    def _shaped(self, v: torch.Tensor) -> list[torch.Tensor]:
        return [t.view_as(p) for t, p in zip(torch.split(v, self.numels), self.params)]

    def _load(self, point: torch.Tensor) -> None:
        with torch.no_grad():
            for f, v in zip(self.flat, torch.split(point, self.numels)):
                f.copy_(v)

    def round(self, x: torch.Tensor, y: torch.Tensor, radius: float, *, restart: bool, resend: bool) -> int:
        """A round's clipped mean on the whole shard: at the new anchor, or its difference from the last."""
        payload = self._receive(2 * self.dim if resend else self.dim, self.dtype)
        self.anchor_prev.copy_(payload[self.dim:] if resend else self.anchor)
        self.anchor.copy_(payload[: self.dim])
        self.local_prev.copy_(self.anchor)
        self._load(self.anchor)
        previous = None if restart else self._shaped(self.anchor_prev)
        return clipped_mean(self.rounds, x, y, radius, self.out, previous)

    def local_step(self, x: torch.Tensor, y: torch.Tensor, radius: float, batch: int) -> int:
        """A BVR-L-SGD local step's clipped difference on the drawn batch."""
        index = self._receive(batch, torch.int64) if batch else torch.empty(0, dtype=torch.int64)
        point = self._receive(self.dim, self.dtype)
        self._load(point)
        index = index.cpu()
        previous = self._shaped(self.local_prev)
        dropped = clipped_mean(self.local, x[index], y[index], radius, self.out, previous)
        self.local_prev.copy_(point)
        return dropped

    def stop(self) -> torch.Tensor:
        """The released final iterate, loaded into the model."""
        _listen(self.group, self.anchor, self.where)
        self._load(self.anchor)
        return self.anchor


def serve_runs(group: Group, key: bytes) -> int:
    """The client loop of a :class:`~dpvr.distributed.ClientPool`: one :func:`serve` per run the aggregator
    sends, until it closes the pool. Returns the number of runs served.

    Each run brings the model (its architecture: every request carries the point), the loss, this
    client's shard and the aggregator's gradient options, so the client computes what the in-process
    client would. It never receives the noise seed or the accountant. ``key`` is the pool's: a run whose
    authentication code does not match it ends the loop before anything of it is unpickled.
    """
    client, served = group.rank - 1, 0
    header = torch.zeros(HEADER, dtype=torch.float64, device=group.device)
    while True:
        where = f"between runs {served} and {served + 1}" if served else "before the first run"
        _listen(group, header, where)
        op, length = int(header[0]), int(header[-1])
        if op == CLOSE:
            return served
        if op == ABORT:
            _stop(group, f"the aggregator ended the run ({where})")
        failure = f"client {client} (rank {group.rank}) could not load run {served + 1}"
        if op != RUN:
            _stop(group, group.fail(f"{failure}: unexpected message {op}"))
        payload = torch.empty(length, dtype=torch.uint8, device=group.device)
        _listen(group, payload, where)
        try:
            run = unpack_run(payload.cpu().numpy().tobytes(), key)
            model, shard = run["model"].to(group.device), tuple(t.to(group.device) for t in run["shard"])
        except Exception as err:
            _stop(group, group.fail(f"{failure}: {type(err).__name__}: {err}"))
        serve(group, model, run["loss_fn"], shard, grad_mode=run["grad_mode"], chunk_size=run["chunk_size"])
        served += 1


def _listen(group: Group, t: torch.Tensor, where: str) -> None:
    """A client receives ``t`` from the aggregator, waiting up to ``idle_timeout`` seconds."""
    client = group.rank - 1
    try:
        wait(dist.irecv(t, src=AGGREGATOR), group.idle_timeout)
    except TimeoutError:
        _stop(
            group,
            f"client {client} heard nothing from the aggregator within {group.idle_timeout:g} s ({where})",
        )
    except RuntimeError as err:
        _stop(group, f"client {client} lost the aggregator {where} ({short(err)})")


def _stop(group: Group, fallback: str) -> NoReturn:
    reason = group.reason(fallback)
    group.acknowledge()
    raise DistributedError(reason)
