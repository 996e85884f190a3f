"""``dpvr bench parallel``: a data-parallel DP-SGD step (``make_private`` over a gloo process group on this
machine) against the same step in one process.

The case's data is the step bench's (:func:`~.step.make_case`), the trainer DP-SGD with Poisson batches of
the case's size, each process with ``threads / processes`` threads (so both runs use the same cores). Each
record has ``ms`` (median over the timed steps, the slowest process's for the parallel run) and, for the
parallel run, ``ratio_vs_one_process``.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

from dpvr.results import Record

from .step import CLIP, LR, make_case


def _steps_ms(case_name: str, batch: int, steps: int, group: bool) -> list[float]:
    from dpvr.trainer import make_private

    case = make_case(case_name, batch)
    x = torch.cat([b[0] for b in case.batches])
    y = torch.cat([b[1] for b in case.batches])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_private(case.model, case.criterion, TensorDataset(x, y), algorithm="dp-sgd",
                               epsilon=8.0, batch_size=batch, steps=steps + 2, clip=CLIP,
                               optimizer=torch.optim.SGD(case.model.parameters(), lr=LR))
    trainer.run(2)  # warm-up
    times = []
    for _ in range(steps):
        if group:
            dist.barrier()
        start = time.perf_counter()
        trainer.step()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def _rank(rank: int, world: int, port: int, args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(max(1, args[-1] // world))
        torch.save(_steps_ms(*args[:-1], group=True), f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def run(*, case: str = "mlp", batch: int = 512, steps: int = 10, processes: int = 2) -> list[Record]:
    threads = torch.get_num_threads()
    one = statistics.median(_steps_ms(case, batch, steps, group=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_rank, args=(processes, port, (case, batch, steps, threads), out), nprocs=processes)
        per_rank = [torch.load(f"{out}-{r}.pt") for r in range(processes)]
    parallel = statistics.median(max(times) for times in zip(*per_rank))
    label = f"{make_case(case, batch).name}/B={batch}/cpu"
    common = {"batch": batch, "threads": threads}
    return [
        Record(method="dpvr-make-private-dp-sgd/1-process", dataset=label, metrics={"ms": one, **common}),
        Record(method=f"dpvr-make-private-dp-sgd/{processes}-processes-gloo", dataset=label,
               metrics={"ms": parallel, "ratio_vs_one_process": parallel / one, "processes": processes,
                        **common}),
    ]
