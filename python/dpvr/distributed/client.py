"""The client's end of the wire: :func:`serve` answers one run's requests, :func:`serve_runs` a pool's runs.

Each answer is :func:`dpvr.optim.diff2.clipped_mean` on the client's own shard, the function the
in-process clients call, which is why a distributed run releases bitwise the simulation's iterates. A
client never holds the noise seed or the accountant.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from ..grads import trainable_parameters
from ..optim.diff2 import ClippedGradients, Shard, clipped_mean
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

    ``grad_mode`` and ``chunk_size`` must be the aggregator's (:class:`~dpvr.optim.DIFF2`'s) for the
    uploads to match the simulation bitwise. Returns the released final iterate (flat).
    """
    client = group.rank - 1
    x, y = shard
    if len(x) == 0 or len(x) != len(y):
        raise ValueError(f"client {client}: needs matching, non-empty inputs and targets")
    # Rounds see the whole shard at x_{r-1} again in the next round: keep that recording (checked before every
    # reuse), as DIFF2-GD does in-process; local steps draw fresh batches and recompute.
    rounds = ClippedGradients(model, loss_fn, mode=grad_mode, chunk_size=chunk_size, reuse_recording=True)
    local = ClippedGradients(model, loss_fn, mode=grad_mode, chunk_size=chunk_size)
    params = [p for _, p in trainable_parameters(model)]
    flat = [p.detach().view(-1) for p in params]
    numels = [t.numel() for t in flat]
    dim, dtype, device = sum(numels), params[0].dtype, group.device
    anchor = torch.zeros(dim, dtype=dtype, device=device)  # x_{r-1}: the last round's point
    anchor_prev = torch.zeros_like(anchor)  # x_{r-2}
    local_prev = torch.zeros_like(anchor)  # x_{k-2,r-1} during local steps
    shaped = lambda v: [t.view_as(p) for t, p in zip(torch.split(v, numels), params)]  # noqa: E731
    out = accumulators(flat)  # the clipped mean, sent in float64: rounded only after the noise
    header = torch.zeros(HEADER, dtype=torch.float64, device=device)
    status = torch.zeros(2, dtype=torch.float64, device=device)
    where = "before the first round"

    def receive(t: torch.Tensor) -> None:
        _listen(group, t, where)

    def load(point: torch.Tensor) -> None:
        with torch.no_grad():
            for f, v in zip(flat, torch.split(point, numels)):
                f.copy_(v)

    dist.send(torch.tensor([len(x), dim], dtype=torch.float64, device=device), dst=AGGREGATOR)
    while True:
        receive(header)
        op, r, restart, radius, _, resend, batch = header.tolist()
        if op == ABORT:
            _stop(group, f"the aggregator ended the run ({where})")
        if op == STOP:
            receive(anchor)
            load(anchor)
            return anchor
        where = f"in round {int(r)}"
        try:
            if op == ROUND:
                payload = torch.empty(2 * dim if resend else dim, dtype=dtype, device=device)
                receive(payload)
                anchor_prev.copy_(payload[dim:] if resend else anchor)
                anchor.copy_(payload[:dim])
                local_prev.copy_(anchor)
                load(anchor)
                dropped = clipped_mean(rounds, x, y, radius, out, None if restart else shaped(anchor_prev))
            else:
                index = torch.empty(int(batch), dtype=torch.int64, device=device)
                if batch:
                    receive(index)
                point = torch.empty(dim, dtype=dtype, device=device)
                receive(point)
                load(point)
                index = index.cpu()
                dropped = clipped_mean(local, x[index], y[index], radius, out, shaped(local_prev))
                local_prev.copy_(point)
            status[:] = torch.tensor([OK, dropped], dtype=torch.float64)
            reply = torch.cat(out)
        except DistributedError:
            raise
        except Exception as err:
            group.fail(f"client {client} (rank {group.rank}) failed {where}: {type(err).__name__}: {err}")
            status[0], reply = FAILED, torch.zeros(dim, dtype=torch.float64, device=device)
        dist.send(status, dst=AGGREGATOR)
        dist.send(reply, dst=AGGREGATOR)


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
