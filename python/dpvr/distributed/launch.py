"""One machine: :func:`launch` starts the aggregator and P clients as local processes (loopback, gloo)."""

from __future__ import annotations

import contextlib
import io
import os
import queue as queues
import socket
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from ..optim.base import LossFn
from ..optim.diff2 import Shard
from .driver import AggregatorResult, aggregate, serve
from .group import DistributedError, init_group

_GRACE = 5.0  # seconds a client may take to finish once the aggregator has returned


@dataclass
class LaunchResult:
    """The aggregator's result and what every rank reported (``"ok"`` or its error message)."""

    result: AggregatorResult
    ranks: dict[int, str] = field(default_factory=dict)


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(value: Any) -> bytes:
    # Bytes, not tensors: tensors would travel as shared-memory handles that die with this process.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _main(rank: int, world: int, port: int, task: dict[str, Any], results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
    )
    import torch.distributed as dist

    torch.set_num_threads(task.pop("threads"))
    try:
        group = init_group(timeout=task.pop("timeout"), idle_timeout=task.pop("idle_timeout"), backend="gloo")
        if rank == 0:
            outcome: Any = aggregate(group, **task)
        else:
            outcome = serve(group, **task)
        results.put((rank, "ok", _pack(outcome) if rank == 0 else None))
    except DistributedError as err:
        results.put((rank, str(err), None))
    except BaseException as err:  # noqa: BLE001 - reported to the launcher, which raises
        results.put((rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()}", None))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


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
    steps: int | None = None,
    keep_iterates: bool = False,
    threads: int = 1,
    **options: Any,
) -> LaunchResult:
    """Runs DIFF2 with one client process per shard and an aggregator process, on this machine.

    Client ``p`` receives only ``shards[p]``; the aggregator receives the model and DIFF2's ``options``
    (``generator`` included: no client ever holds the noise seed). ``timeout`` is the per-step watchdog,
    ``idle_timeout`` the longest a client waits for the aggregator. Processes start from a fork server
    that has imported torch and dpvr once, so a launch costs well under a second after the first. Returns
    the aggregator's :class:`~dpvr.distributed.driver.AggregatorResult`; raises :class:`DistributedError`
    with the aggregator's message when any rank failed (``err.ranks``: every rank's message).
    """
    if not shards:
        raise ValueError("shards: at least one client shard is required")
    world = len(shards) + 1
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "dpvr.distributed"])
    results = context.Queue()
    port = free_port()
    common = {"timeout": timeout, "idle_timeout": idle_timeout, "threads": threads}
    grads = {k: options[k] for k in ("grad_mode", "chunk_size") if k in options}
    tasks: list[dict[str, Any]] = [
        dict(
            common,
            model=model,
            loss_fn=loss_fn,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            resume=resume,
            steps=steps,
            keep_iterates=keep_iterates,
            **options,
        )
    ]
    tasks += [dict(common, model=model, loss_fn=loss_fn, shard=shard, **grads) for shard in shards]
    processes = [
        context.Process(target=_main, args=(k, world, port, tasks[k], results)) for k in range(world)
    ]
    for p in processes:
        p.start()
    reports: dict[int, str] = {}
    outcome: AggregatorResult | None = None
    deadline: float | None = None
    dead: dict[int, float] = {}
    while len(reports) < world:
        try:
            rank, message, value = results.get(timeout=0.2)
            reports[rank] = message
            if rank == 0:
                outcome = None if value is None else torch.load(io.BytesIO(value), weights_only=False)
                deadline = time.monotonic() + _GRACE
        except queues.Empty:
            pass
        now = time.monotonic()
        for k, p in enumerate(processes):
            # A report may still be in the queue: a rank that exited is judged a second later.
            if k not in reports and p.exitcode is not None and now - dead.setdefault(k, now) > 1.0:
                reports[k] = f"rank {k} exited with code {p.exitcode} without a report"
        if deadline is not None and time.monotonic() > deadline:
            for k, p in enumerate(processes):
                if k not in reports:
                    p.terminate()
                    reports[k] = f"rank {k} did not finish within {_GRACE:g} s of the aggregator; terminated"
    for p in processes:
        p.join(timeout=_GRACE)
    if any(m != "ok" for m in reports.values()):
        error = DistributedError(reports.get(0, "the aggregator gave no report"))
        error.ranks = dict(sorted(reports.items()))  # type: ignore[attr-defined]
        raise error
    assert outcome is not None
    return LaunchResult(outcome, dict(sorted(reports.items())))
