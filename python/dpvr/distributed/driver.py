"""DIFF2 over a process group: the aggregator's transport, the client loop, checkpointed rounds.

The aggregator runs :class:`dpvr.optim.DIFF2` unchanged, with :class:`RemoteClients` as its client
transport; each client runs :func:`serve`, which answers every request with
:func:`dpvr.optim.diff2.clipped_mean` on its own shard. Both sides therefore execute the in-process code
path, which is why a distributed run releases bitwise the iterates of the simulation.

Messages (point to point, aggregator <-> client ``p`` on rank ``p + 1``):

- down, between runs of a :class:`~dpvr.distributed.ClientPool`: the header with op ``RUN`` and the byte
  count in its last slot, then the run (model, loss, the client's shard, gradient options; pickled), or
  op ``CLOSE``;
- down, in a run: a float64 header ``[op, round, restart, radius, client, has_previous, batch_length]``,
  for a local step the batch's record indices (int64), then the point in the parameters' dtype:
  ``x_{r-1}`` for a round (followed by ``x_{r-2}`` when the client cannot have it: a difference round
  first after a resume), ``x_{k-1,r-1}`` for a local step, the released ``x_R`` at the end;
- up: a float64 ``[status, non-finite count]`` and the client's clipped mean (one d-vector).

A client keeps the previous round's point as ``x_{r-2}`` and its previous local point as ``x_{k-2,r-1}``,
so each step moves one d-vector each way.

Runs are unpickled by the clients: they come from the aggregator, which this threat model trusts.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..grads import trainable_parameters
from ..optim import DIFF2
from ..optim.base import LossFn
from ..optim.diff2 import ClippedGradients, Shard, clipped_mean
from .group import AGGREGATOR, DistributedError, Group, seconds

ROUND, LOCAL, STOP, ABORT, RUN, CLOSE = 1, 2, 3, 4, 5, 6
HEADER = 7
OK, FAILED = 0, 1


@dataclass
class Traffic:
    """Bytes the aggregator sent and received in a run, headers included; ``shipped``: the bytes of the
    run itself sent to pooled clients (model, loss, shards), which a deployment's clients already hold."""

    down: int = 0
    up: int = 0
    shipped: int = 0
    steps: dict[str, int] = field(default_factory=lambda: {"round": 0, "local": 0})


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _wait(work: Any, within: float) -> None:
    if work.wait(seconds(within)) is False:
        raise TimeoutError


class RemoteClients:
    """DIFF2's client transport on the aggregator: requests go to the client ranks, means come back.

    ``params`` are the aggregator model's parameters (the point sent is always their current value).
    ``runs``: for clients in :func:`serve_runs`, each client's pickled run, sent first. Construction
    performs the handshake in which each client reports its shard size and dimension. ``fingerprint``
    identifies the clients' data for DIFF2's checkpoint binding where the aggregator knows it (a pool,
    which ships the shards); otherwise the binding holds only the shard sizes.
    """

    fingerprint: str | None = None

    def __init__(
        self, group: Group, params: Sequence[torch.Tensor], runs: Sequence[bytes] | None = None
    ) -> None:
        if group.rank != AGGREGATOR:
            raise ValueError("RemoteClients runs on the aggregator (rank 0)")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"model parameters: one dtype expected, got {sorted(map(str, dtypes))}")
        self.group = group
        self._flat = [p.detach().view(-1) for p in params]
        self._numels = [t.numel() for t in self._flat]
        self.dim, self.dtype = sum(self._numels), dtypes.pop()
        self.traffic = Traffic()
        self.step_name = "start"
        for k, run in enumerate(runs or (), 1):
            payload = torch.frombuffer(bytearray(run), dtype=torch.uint8).to(group.device)
            self.traffic.shipped += self._send([k], [self._header(RUN, 0, batch=len(run)), payload])
        hello = [torch.zeros(2, dtype=torch.float64, device=group.device) for _ in range(group.clients)]
        self._receive(0, [[h] for h in hello], what="report its shard")
        self.sizes = [int(h[0]) for h in hello]
        for p, h in enumerate(hello):
            if int(h[1]) != self.dim:
                self._lost(p, f"has a model of dimension {int(h[1])}, not {self.dim}", alive=True)
        self._sent: torch.Tensor | None = None  # the last point every client received
        self._replies = [self._buffers() for _ in range(group.clients)]

    def _buffers(self) -> list[torch.Tensor]:
        device = self.group.device
        return [
            torch.zeros(2, dtype=torch.float64, device=device),
            torch.zeros(self.dim, dtype=self.dtype, device=device),
        ]

    def _point(self) -> torch.Tensor:
        return torch.cat(self._flat)

    def _header(
        self,
        op: int,
        r: int,
        restart: bool = False,
        radius: float = 0.0,
        client: int = 0,
        previous: bool = False,
        batch: int = 0,
    ) -> torch.Tensor:
        values = [op, r, float(restart), radius, client, float(previous), batch]
        return torch.tensor(values, dtype=torch.float64, device=self.group.device)

    def _send(self, ranks: Sequence[int], tensors: Sequence[torch.Tensor]) -> int:
        """Sends ``tensors`` to every rank in ``ranks``; returns the bytes sent."""
        works = [dist.isend(t, dst=k) for k in ranks for t in tensors]
        self.group.in_flight = works
        for k, w in zip((k for k in ranks for _ in tensors), works):
            try:
                _wait(w, self.group.timeout)
            except (RuntimeError, TimeoutError) as err:
                self._lost(k - 1, f"could not be reached in {self.step_name} ({_short(err)})")
        return len(ranks) * sum(map(_nbytes, tensors))

    def _receive(
        self,
        r: int,
        buffers: Sequence[Sequence[torch.Tensor]],
        ranks: Sequence[int] | None = None,
        what: str = "answer",
    ) -> None:
        """Receives each client's buffers; the watchdog: all of them within ``timeout`` seconds."""
        ranks = list(range(1, self.group.world)) if ranks is None else list(ranks)
        works = [[dist.irecv(t, src=k) for t in bufs] for k, bufs in zip(ranks, buffers)]
        self.group.in_flight = [w for ws in works for w in ws]
        deadline = time.monotonic() + self.group.timeout
        for k, ws, bufs in zip(ranks, works, buffers):
            for w in ws:
                try:
                    _wait(w, deadline - time.monotonic())
                except TimeoutError:
                    self._lost(k - 1, f"did not {what} in {self.step_name} within {self.group.timeout:g} s")
                except RuntimeError as err:
                    message = str(err)
                    if "Timed out" in message or "timeout" in message.lower():
                        self._lost(
                            k - 1, f"did not {what} in {self.step_name} within {self.group.timeout:g} s"
                        )
                    self._lost(k - 1, f"was lost in {self.step_name} ({_short(err)})")
            if len(bufs) == 2 and int(bufs[0][0]) == FAILED:
                self._lost(k - 1, f"failed in {self.step_name}", alive=True)
            self.traffic.up += sum(map(_nbytes, bufs))

    def _lost(self, client: int, what: str, alive: bool = False) -> NoReturn:
        reason = self.end(f"client {client} (rank {client + 1}) {what}", None if alive else client + 1)
        raise DistributedError(reason)

    def end(self, reason: str, failed: int | None = None) -> str:
        """Ends the run on every client with ``reason``, or with the reason a client recorded first (which
        it returns); ``failed`` is a rank that cannot be told."""
        reason = self.group.fail(reason)
        survivors = [k for k in range(1, self.group.world) if k != failed]
        header = self._header(ABORT, 0)
        for k in survivors:
            with contextlib.suppress(RuntimeError):  # best effort: a broken connection wakes it as well
                self.group.in_flight.append(dist.isend(header, dst=k))
        self.group.await_acknowledgements(survivors, min(self.group.timeout, 10.0))
        return reason

    def _means(self, bufs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        return list(torch.split(bufs[1], self._numels)), int(bufs[0][1])

    def round(
        self, r: int, restart: bool, radius: float, previous: Sequence[torch.Tensor]
    ) -> Iterator[tuple[Sequence[torch.Tensor], int]]:
        self.step_name = f"round {r}"
        point = self._point()
        prev = torch.cat([t.detach().reshape(-1) for t in previous])
        # Clients keep the last point they received as x_{r-2}; send it only when a difference round
        # needs it and theirs is not it (the first round after a resume).
        resend = not restart and (self._sent is None or not torch.equal(self._sent, prev))
        payload = torch.cat([point, prev]) if resend else point
        ranks = range(1, self.group.world)
        header = self._header(ROUND, r, restart, radius, previous=resend)
        self.traffic.down += self._send(ranks, [header, payload])
        self._receive(r, self._replies)
        self._sent = point
        self.traffic.steps["round"] += 1
        for bufs in self._replies:
            yield self._means(bufs)

    def local(
        self, r: int, client: int, batch: np.ndarray | None, radius: float, previous: Sequence[torch.Tensor]
    ) -> tuple[Sequence[torch.Tensor], int]:
        self.step_name = f"a local step of round {r}"
        del previous  # the client keeps x_{k-2,r-1}: the round's point, then the local points it received
        index = torch.as_tensor(np.zeros(0) if batch is None else batch, dtype=torch.int64)
        header = self._header(LOCAL, r, radius=radius, client=client, batch=len(index))
        tensors = (
            [header, index.to(self.group.device), self._point()] if len(index) else [header, self._point()]
        )
        self.traffic.down += self._send([client + 1], tensors)
        self._receive(r, [self._replies[client]], ranks=[client + 1])
        self.traffic.steps["local"] += 1
        return self._means(self._replies[client])

    def close(self) -> None:
        """Sends every client the released final iterate and ends their loops."""
        self.step_name = "the final broadcast"
        self.traffic.down += self._send(range(1, self.group.world), [self._header(STOP, 0), self._point()])


def _short(err: BaseException) -> str:
    """The backend's message without its source location, first sentence only."""
    text = str(err).strip() or type(err).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return text.split(". ")[0].rstrip(".")


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
    uploads to match the simulation bitwise. The client never holds the noise seed or the accountant.
    Returns the released final iterate (flat).
    """
    client = group.rank - 1
    x, y = shard
    if len(x) == 0 or len(x) != len(y):
        raise ValueError(f"client {client}: needs matching, non-empty inputs and targets")
    gradients = ClippedGradients(model, loss_fn, mode=grad_mode, chunk_size=chunk_size)
    params = [p for _, p in trainable_parameters(model)]
    flat = [p.detach().view(-1) for p in params]
    numels = [t.numel() for t in flat]
    dim, dtype, device = sum(numels), params[0].dtype, group.device
    anchor = torch.zeros(dim, dtype=dtype, device=device)  # x_{r-1}: the last round's point
    anchor_prev = torch.zeros_like(anchor)  # x_{r-2}
    local_prev = torch.zeros_like(anchor)  # x_{k-2,r-1} during local steps
    shaped = lambda v: [t.view_as(p) for t, p in zip(torch.split(v, numels), params)]  # noqa: E731
    out = [torch.zeros_like(t) for t in flat]
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
                dropped = clipped_mean(gradients, x, y, radius, out, None if restart else shaped(anchor_prev))
            else:
                index = torch.empty(int(batch), dtype=torch.int64, device=device)
                if batch:
                    receive(index)
                point = torch.empty(dim, dtype=dtype, device=device)
                receive(point)
                load(point)
                index = index.cpu()
                dropped = clipped_mean(gradients, x[index], y[index], radius, out, shaped(local_prev))
                local_prev.copy_(point)
            status[:] = torch.tensor([OK, dropped], dtype=torch.float64)
            reply = torch.cat(out)
        except DistributedError:
            raise
        except Exception as err:
            group.fail(f"client {client} (rank {group.rank}) failed {where}: {type(err).__name__}: {err}")
            status[0], reply = FAILED, torch.zeros(dim, dtype=dtype, device=device)
        dist.send(status, dst=AGGREGATOR)
        dist.send(reply, dst=AGGREGATOR)


def _listen(group: Group, t: torch.Tensor, where: str) -> None:
    """A client receives ``t`` from the aggregator, waiting up to ``idle_timeout`` seconds."""
    client = group.rank - 1
    try:
        _wait(dist.irecv(t, src=AGGREGATOR), group.idle_timeout)
    except TimeoutError:
        _stop(
            group,
            f"client {client} heard nothing from the aggregator within {group.idle_timeout:g} s ({where})",
        )
    except RuntimeError as err:
        _stop(group, f"client {client} lost the aggregator {where} ({_short(err)})")


def serve_runs(group: Group) -> int:
    """The client loop of a :class:`~dpvr.distributed.ClientPool`: one :func:`serve` per run the aggregator
    sends, until it closes the pool. Returns the number of runs served.

    Each run brings the model (its architecture: every request carries the point), the loss, this
    client's shard and the aggregator's gradient options, so the client computes what the in-process
    client would. It never receives the noise seed or the accountant.
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
            run = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False)
            model, shard = run["model"].to(group.device), tuple(t.to(group.device) for t in run["shard"])
        except Exception as err:
            _stop(group, group.fail(f"{failure}: {type(err).__name__}: {err}"))
        serve(group, model, run["loss_fn"], shard, grad_mode=run["grad_mode"], chunk_size=run["chunk_size"])
        served += 1


def _stop(group: Group, fallback: str) -> NoReturn:
    reason = group.reason(fallback)
    group.acknowledge()
    raise DistributedError(reason)


# ---- the aggregator's loop ----------------------------------------------------------------------------


@dataclass
class AggregatorResult:
    """What the aggregator returns: per-round info, the released iterates (if kept), timing, traffic."""

    history: list[dict[str, float]]
    params: list[torch.Tensor]
    steps_done: int
    epsilon: float
    delta: float
    round_ms: list[float]
    traffic: Traffic
    iterates: list[torch.Tensor] = field(default_factory=list)


def aggregate(
    group: Group,
    model: nn.Module,
    loss_fn: LossFn,
    **options: Any,
) -> AggregatorResult:
    """The aggregator (rank 0): DIFF2 on ``model`` with the clients of ``group`` (each in :func:`serve`).

    ``options`` are :func:`run_rounds`'s. Any failure, here or on a client, ends the run on every rank
    with a :class:`DistributedError`, after the last complete checkpoint.
    """
    clients = RemoteClients(group, [p for _, p in trainable_parameters(model)])
    try:
        result = run_rounds(clients, model, loss_fn, **options)
        clients.close()
    except DistributedError:
        raise
    except BaseException as err:
        clients.end(f"the aggregator failed in {clients.step_name}: {type(err).__name__}: {err}")
        raise
    return result


def run_rounds(
    clients: RemoteClients,
    model: nn.Module,
    loss_fn: LossFn,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 1,
    resume: bool = False,
    steps: int | None = None,
    keep_iterates: bool = False,
    **options: Any,
) -> AggregatorResult:
    """DIFF2's rounds on the aggregator, with ``clients`` as its transport (which it leaves open).

    ``options`` are :class:`~dpvr.optim.DIFF2`'s (``generator`` lives here only). A checkpoint is written
    after every ``checkpoint_every`` rounds and after the last one run; ``resume`` starts from it when
    it exists. ``steps`` bounds the rounds run now (default: the rest of the plan).
    """
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every: must be >= 1, got {checkpoint_every}")
    alg = DIFF2(model, loss_fn, clients, **options)
    if resume and checkpoint is not None and os.path.exists(checkpoint):
        alg.load_checkpoint(checkpoint)
    todo = alg.total_steps - alg.steps_done if steps is None else min(steps, alg.total_steps - alg.steps_done)
    history, round_ms, iterates = [], [], []
    for i in range(todo):
        start = time.perf_counter()
        history.append(alg.step())
        round_ms.append((time.perf_counter() - start) * 1e3)
        if keep_iterates:
            iterates.append(torch.cat([f.clone() for f in alg.flat]))
        if checkpoint is not None and ((i + 1) % checkpoint_every == 0 or i + 1 == todo):
            alg.save_checkpoint(checkpoint)
    spent = alg.privacy_spent()
    return AggregatorResult(
        history=history,
        params=[p.detach().clone() for p in alg.params],
        steps_done=alg.steps_done,
        epsilon=spent.epsilon,
        delta=spent.delta,
        round_ms=round_ms,
        traffic=clients.traffic,
        iterates=iterates,
    )
