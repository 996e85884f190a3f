"""The aggregator's end of the wire: :class:`RemoteClients`, DIFF2's client transport over a process group.

:class:`dpvr.algorithms.DIFF2` gets every round's (and local step's) clipped means from a
:class:`~dpvr.algorithms.diff2.algorithm.ClientTransport`:
:class:`~dpvr.algorithms.diff2.algorithm.InProcessClients` computes them in this process,
:class:`RemoteClients` asks the client ranks (each in :func:`dpvr.distributed.serve`) in the messages of
:mod:`dpvr.distributed.protocol`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from .group import AGGREGATOR, DistributedError, Group
from .protocol import ABORT, FAILED, LOCAL, ROUND, RUN, STOP, Traffic, header, nbytes, short, wait


class RemoteClients:
    """DIFF2's :class:`~dpvr.algorithms.diff2.algorithm.ClientTransport` on the aggregator: requests go to the
    client ranks, means come back.

    ``params`` are the aggregator model's parameters (the point sent is always their current value).
    ``runs``: for clients in :func:`~dpvr.distributed.serve_runs`, each client's run (as
    :func:`~dpvr.distributed.protocol.pack_run` packs it), sent first. Construction
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
            self.traffic.shipped += self._send([k], [self._header(RUN, batch=len(run)), payload])
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
            # a client's clipped mean, float64 whatever the model's dtype (a sum over records, rounded to
            # the parameters' dtype only after the noise)
            torch.zeros(self.dim, dtype=torch.float64, device=device),
        ]

    def _point(self) -> torch.Tensor:
        return torch.cat(self._flat)

    def _header(self, op: int, r: int = 0, **fields: Any) -> torch.Tensor:
        return header(op, r, device=self.group.device, **fields)

    def _send(self, ranks: Sequence[int], tensors: Sequence[torch.Tensor]) -> int:
        """Sends ``tensors`` to every rank in ``ranks``; returns the bytes sent."""
        works = [dist.isend(t, dst=k) for k in ranks for t in tensors]
        self.group.in_flight = works
        for k, w in zip((k for k in ranks for _ in tensors), works):
            try:
                wait(w, self.group.timeout)
            except (RuntimeError, TimeoutError) as err:
                self._lost(k - 1, f"could not be reached in {self.step_name} ({short(err)})")
        return len(ranks) * sum(map(nbytes, tensors))

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
                    wait(w, deadline - time.monotonic())
                except TimeoutError:
                    self._lost(k - 1, f"did not {what} in {self.step_name} within {self.group.timeout:g} s")
                except RuntimeError as err:
                    message = str(err)
                    if "Timed out" in message or "timeout" in message.lower():
                        self._lost(
                            k - 1, f"did not {what} in {self.step_name} within {self.group.timeout:g} s"
                        )
                    self._lost(k - 1, f"was lost in {self.step_name} ({short(err)})")
            if len(bufs) == 2 and int(bufs[0][0]) == FAILED:
                self._lost(k - 1, f"failed in {self.step_name}", alive=True)
            self.traffic.up += sum(map(nbytes, bufs))

    def _lost(self, client: int, what: str, alive: bool = False) -> NoReturn:
        reason = self.end(f"client {client} (rank {client + 1}) {what}", None if alive else client + 1)
        raise DistributedError(reason)

    def end(self, reason: str, failed: int | None = None) -> str:
        """Ends the run on every client with ``reason``, or with the reason a client recorded first (which
        it returns); ``failed`` is a rank that cannot be told."""
        reason = self.group.fail(reason)
        survivors = [k for k in range(1, self.group.world) if k != failed]
        abort = self._header(ABORT)
        for k in survivors:
            with contextlib.suppress(RuntimeError):  # best effort: a broken connection wakes it as well
                self.group.in_flight.append(dist.isend(abort, dst=k))
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
        head = self._header(ROUND, r, restart=restart, radius=radius, previous=resend)
        self.traffic.down += self._send(ranks, [head, payload])
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
        head = self._header(LOCAL, r, radius=radius, client=client, batch=len(index))
        tensors = [head, index.to(self.group.device), self._point()] if len(index) else [head, self._point()]
        self.traffic.down += self._send([client + 1], tensors)
        self._receive(r, [self._replies[client]], ranks=[client + 1])
        self.traffic.steps["local"] += 1
        return self._means(self._replies[client])

    def close(self) -> None:
        """Sends every client the released final iterate and ends their loops."""
        self.step_name = "the final broadcast"
        self.traffic.down += self._send(range(1, self.group.world), [self._header(STOP), self._point()])
