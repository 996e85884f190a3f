"""The aggregator's loop: DIFF2's rounds with a :class:`~dpvr.distributed.RemoteClients` transport.

The aggregator (rank 0) runs :class:`dpvr.algorithms.DIFF2` unchanged and alone holds the noise generator,
the accountant and the checkpoints, which DIFF2 itself writes (after complete rounds only) and reads, with
its run ledger: :meth:`~dpvr.algorithms.DIFF2.save_checkpoint`,
:meth:`~dpvr.algorithms.DIFF2.load_checkpoint`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..algorithms import DIFF2
from ..grads import trainable_parameters
from ..problems import LossFn
from .group import DistributedError, Group
from .protocol import Traffic
from .transport import RemoteClients


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
    run_steps: int | None = None,
    keep_iterates: bool = False,
    **options: Any,
) -> AggregatorResult:
    """DIFF2's rounds on the aggregator, with ``clients`` as its transport (which it leaves open).

    ``options`` are :class:`~dpvr.algorithms.DIFF2`'s (the noise generator, in ``runtime``, lives here only;
    ``steps`` is the planned total). A checkpoint is written after every ``checkpoint_every`` rounds and
    after the last one run; ``resume`` starts from it when it exists. ``run_steps`` bounds the rounds run
    now (default: the rest of the plan).
    """
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every: must be >= 1, got {checkpoint_every}")
    alg = DIFF2(model, loss_fn, clients, **options)
    if resume and checkpoint is not None and os.path.exists(checkpoint):
        alg.load_checkpoint(checkpoint)
    todo = alg.total_steps - alg.steps_done
    if run_steps is not None:
        todo = min(run_steps, todo)
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
