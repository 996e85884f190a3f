"""Persistent DIFF2 client processes on this machine (loopback gloo); the calling process aggregates."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queues
import secrets
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..algorithms.diff2.algorithm import Shard
from ..grads import trainable_parameters
from ..optim.binding import data_fingerprint
from ..problems import LossFn
from .client import serve_runs
from .group import DistributedError, init_group, join_group, seconds
from .protocol import CLOSE, KEY_BYTES, header, pack_run
from .transport import RemoteClients

_START = 120.0  # seconds the clients may take to start and join the group
_GRACE = 5.0  # seconds a client may take to report once it was told to end


class _Pickled:
    """An object pickled once for every client of a run; it unpickles as the object itself."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.payload,)


def _shippable(obj: Any, name: str) -> _Pickled:
    """``obj`` (argument ``name``) pickled for the client processes.

    Plain pickle stores functions and classes by reference, which a client resolves by importing them: a
    lambda, a nested function or one defined in an interactive ``__main__`` has no such reference.
    cloudpickle, where installed, ships those by value (and everything importable still by reference)."""
    try:
        import cloudpickle  # optional (not a dependency of dpvr): looked for when a client needs it
    except ImportError:
        cloudpickle = None
    dumps = pickle.dumps if cloudpickle is None else cloudpickle.dumps
    try:
        return _Pickled(dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        qualname = getattr(obj, "__qualname__", None)
        if qualname and "<lambda>" in qualname:
            what, fix = "a lambda", "define it at module level or install cloudpickle"
        else:
            what = repr(qualname or type(obj).__name__)
            fix = "define the functions and classes it uses at module level or install cloudpickle"
        if cloudpickle is not None:
            fix = "cloudpickle cannot serialise it either"
        raise TypeError(f"{name}: {what} cannot be sent to client processes ({err}); {fix}") from err


def _client(rank: int, world: int, port: int, key: bytes, options: dict[str, float], results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
    )
    torch.set_num_threads(int(options["threads"]))
    try:
        group = init_group(timeout=options["timeout"], idle_timeout=options["idle_timeout"], backend="gloo")
        serve_runs(group, key)
        results.put((rank, "ok"))
    except DistributedError as err:
        results.put((rank, str(err)))
    except BaseException as err:  # noqa: BLE001 - reported to the pool, which raises
        results.put((rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        # Deliver the report before leaving the group: tearing it down may block (holding the GIL, so the
        # queue's feeder thread could not run) until the aggregator leaves too.
        results.close()
        results.join_thread()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class ClientPool:
    """``clients`` DIFF2 client processes on loopback gloo, with this process as the aggregator (rank 0).

    The processes and the process group start once; :meth:`connect` then starts a run by shipping each
    client a copy of the model, the loss and its own shard, so one pool serves many short runs (an
    experiment's grid) as well as one long one (:func:`~dpvr.distributed.launch`). Clients run
    :func:`~dpvr.distributed.serve_runs` with ``threads`` intra-op threads (the in-process run must
    use as many for bitwise equal uploads). This process joins the default ``torch.distributed`` group
    for the pool's lifetime, so it must not belong to one already; it alone holds the noise generator,
    the accountant and the checkpoints.

    A failure of any client, or of the transport, ends every run for good: the pool is then
    :attr:`broken` (the reason), and :meth:`close` collects what each client reported. An exception of
    the aggregator's own between two steps (a divergence, a refused budget) ends only its run.
    """

    def __init__(
        self, clients: int, *, timeout: float = 30.0, idle_timeout: float = 600.0, threads: int = 1
    ) -> None:
        if clients < 1:
            raise ValueError(f"clients: at least one client process is required, got {clients}")
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; destroy it first")
        self.clients, world = clients, clients + 1
        self.broken: str | None = None
        self.reports: dict[int, str] | None = None
        # Port 0: the store binds a free port itself, which the clients are then given (no race for it).
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=seconds(_START), wait_for_workers=False
        )
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["torch", "dpvr.distributed"])
        self._results = context.Queue()
        # Authenticates the runs this process ships; it reaches the clients through their start arguments
        # (a local pipe), never the group's transport.
        self._key = secrets.token_bytes(KEY_BYTES)
        options = {"timeout": timeout, "idle_timeout": idle_timeout, "threads": threads}
        self._processes = [
            context.Process(
                target=_client, args=(k, world, store.port, self._key, options, self._results), daemon=True
            )
            for k in range(1, world)
        ]
        for p in self._processes:
            p.start()
        try:
            self.group = join_group(
                store, 0, world, timeout=timeout, idle_timeout=idle_timeout, backend="gloo"
            )
        except BaseException as err:
            self.broken = f"the clients did not join the group: {err}"
            self._collect(_GRACE)
            raise
        self._store = store  # it serves the whole group: keep it alive as long as the pool

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def connect(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        shards: Sequence[Shard],
        *,
        grad_mode: str = "auto",
        chunk_size: int | None = None,
    ) -> Iterator[RemoteClients]:
        """A run: client ``p`` gets ``model`` (a copy), ``loss_fn`` and ``shards[p]``; the block gets the
        aggregator's transport for :class:`~dpvr.algorithms.DIFF2` on ``model``. ``grad_mode`` and
        ``chunk_size`` must be DIFF2's. Leaving the block sends the clients the last point and ends the
        run (also when the block raised between steps); the pool then takes the next run.

        ``model`` and ``loss_fn`` are pickled for the clients with cloudpickle where it is installed, so
        lambdas and functions defined in a notebook work; without it they must be importable by name
        (``TypeError`` naming the argument otherwise, before anything is sent).
        """
        if self.reports is not None or self.broken is not None:
            raise DistributedError(self.broken or "the client pool is closed")
        if len(shards) != self.clients:
            raise ValueError(f"shards: the pool has {self.clients} clients, got {len(shards)} shards")
        shipped_model, shipped_loss = _shippable(model, "model"), _shippable(loss_fn, "loss_fn")
        runs = [
            pack_run(shipped_model, shipped_loss, shard, grad_mode=grad_mode, chunk_size=chunk_size,
                     key=self._key)
            for shard in shards
        ]
        try:
            transport = RemoteClients(self.group, [p for _, p in trainable_parameters(model)], runs)
            transport.fingerprint = data_fingerprint([t for shard in shards for t in shard])
        except DistributedError as err:
            self.broken = str(err)
            raise
        try:
            yield transport
        except DistributedError as err:
            self.broken = str(err)
            raise
        except Exception:
            # Between two steps nothing is in flight: the clients can end this run normally.
            self._end_run(transport)
            raise
        except BaseException as err:  # an interrupt may land mid-step: the protocol cannot go on
            self.broken = transport.end(
                f"the aggregator stopped in {transport.step_name}: {type(err).__name__}"
            )
            raise
        self._end_run(transport)

    def _end_run(self, transport: RemoteClients) -> None:
        try:
            transport.close()
        except DistributedError as err:
            self.broken = str(err)
            raise

    def close(self) -> dict[int, str]:
        """Ends the pool: the clients leave their loops (stragglers are terminated) and the group is
        destroyed. Returns each client rank's report: ``"ok"`` or its error. Calling it again returns the
        same reports."""
        if self.reports is not None:
            return self.reports
        if self.broken is None:
            close = header(CLOSE)
            with contextlib.suppress(RuntimeError):  # a lost client is reported by _collect
                self.group.in_flight = [dist.isend(close, dst=k) for k in range(1, self.clients + 1)]
            for work in self.group.in_flight:
                with contextlib.suppress(RuntimeError):
                    work.wait(seconds(self.group.timeout))
        self.reports = self._collect(_GRACE)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        return self.reports

    def _collect(self, grace: float) -> dict[int, str]:
        """Each client's report, waiting up to ``grace`` seconds; a client that exited without one, or is
        still running then, is reported as such (and terminated)."""
        reports: dict[int, str] = {}
        deadline, exited = time.monotonic() + grace, {}
        ranks = {k: p for k, p in enumerate(self._processes, 1)}
        while len(reports) < len(ranks) and time.monotonic() < deadline:
            try:
                rank, message = self._results.get(timeout=0.1)
                reports[rank] = message
            except queues.Empty:
                pass
            now = time.monotonic()
            for k, p in ranks.items():
                # A report may still be in the queue: a rank that exited is judged a second later.
                if k not in reports and p.exitcode is not None and now - exited.setdefault(k, now) > 1.0:
                    reports[k] = f"rank {k} exited with code {p.exitcode} without a report"
        for k, p in ranks.items():
            if k not in reports:
                reports[k] = f"rank {k} did not finish within {grace:g} s; terminated"
                p.terminate()
            p.join(timeout=grace)
        return dict(sorted(reports.items()))
