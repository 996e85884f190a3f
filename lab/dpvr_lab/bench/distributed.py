"""Distributed DIFF2-GD on one machine against the in-process simulation: time and bytes per round.

For P = 2, 4, 8 clients, the same shards, model and noise run (a) in process (:class:`dpvr.algorithms.DIFF2`)
and (b) as P client processes and an aggregator on loopback gloo (:func:`dpvr.distributed.launch`), every
process with one thread. Per-round time is the median over the rounds after a warm-up, measured on the
aggregator around ``step()``; bytes per round are what the aggregator sent and received, headers
included, without the start-up handshake and the final broadcast. The released iterates of (a) and (b)
are checked to be identical. On a machine with fewer cores than P + 1 the processes share cores, so the
distributed time includes that contention.

    python -m dpvr_lab.bench.distributed [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from dpvr.algorithms import DIFF2
from dpvr.distributed import launch
from dpvr.ops import NoiseGenerator, torch_threads
from dpvr.optim import RuntimeConfig
from dpvr.privacy import PaperSigmas
from dpvr.results import Record, document, format_table, write_json

CLIENTS = (2, 4, 8)
WARMUP = 3


def _model(width: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, hidden), nn.Softplus(), nn.Linear(hidden, 1)).double()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (output - target).pow(2).sum()


def _shards(clients: int, records: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(clients)
    x = torch.randn(clients * records, width, generator=g, dtype=torch.float64)
    y = torch.randn(clients * records, 1, generator=g, dtype=torch.float64)
    return [(x[p * records : (p + 1) * records], y[p * records : (p + 1) * records]) for p in range(clients)]


def run(*, quick: bool = False, clients: tuple[int, ...] = CLIENTS) -> list[Record]:
    rounds = 12 if quick else 40
    records, width, hidden = (128, 32, 64) if quick else (512, 64, 256)
    noise = PaperSigmas(restart=0.01, difference=0.01)
    options = dict(lr=0.1, steps=rounds, restart=10, clip={"restart": 1.0, "difference": 1.0}, noise=noise)
    out: list[Record] = []
    for p in clients:
        shards = _shards(p, records, width)
        alg = DIFF2(
            _model(width, hidden), _loss, shards, **options,
            runtime=RuntimeConfig(generator=NoiseGenerator(1, reproducible=True)),
        )
        local_ms, local_iterates = [], []
        with torch_threads(1):
            for _ in range(rounds):
                start = time.perf_counter()
                alg.step()
                local_ms.append((time.perf_counter() - start) * 1e3)
                local_iterates.append(torch.cat([f.clone() for f in alg.flat]))
        result = launch(
            _model(width, hidden),
            _loss,
            shards,
            runtime=RuntimeConfig(generator=NoiseGenerator(1, reproducible=True)),
            keep_iterates=True,
            **options,
        ).result
        same = all(torch.equal(a, b) for a, b in zip(result.iterates, local_iterates))
        d = local_iterates[0].numel()
        final = p * (7 * 8 + 8 * d)  # the closing broadcast of x_R
        down = (result.traffic.down - final) // rounds
        up = (result.traffic.up - p * 16) // rounds  # without the handshake
        local = statistics.median(local_ms[WARMUP:])
        remote = statistics.median(result.round_ms[WARMUP:])
        case = f"P={p}, n_p={records}, d={d}"
        common = {"clients": p, "records_per_client": records, "dimension": d, "rounds": rounds}
        out.append(Record("in-process", case, metrics={**common, "ms_per_round": local}))
        out.append(
            Record(
                "torch-distributed (gloo, loopback)",
                case,
                metrics={
                    **common,
                    "ms_per_round": remote,
                    "vs_in_process": remote / local,
                    "bytes_down_per_round": down,
                    "bytes_up_per_round": up,
                    "d_vectors_per_round": (down + up) / (8 * d),
                    "identical_iterates": same,
                },
            )
        )
    return out


def table(records: list[Record]) -> str:
    rows = [
        [
            r.dataset,
            r.method,
            r.metrics["ms_per_round"],
            r.metrics.get("vs_in_process"),
            r.metrics.get("bytes_down_per_round"),
            r.metrics.get("bytes_up_per_round"),
            r.metrics.get("identical_iterates"),
        ]
        for r in records
    ]
    headers = [
        "case",
        "backend",
        "ms/round",
        "x in-process",
        "bytes down/round",
        "bytes up/round",
        "same iterates",
    ]
    return format_table(headers, rows)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m dpvr_lab.bench.distributed", description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    records = run(quick=args.quick)
    print(table(records))
    if args.json:
        write_json(args.json, document("bench-distributed", {"quick": args.quick}, records))


if __name__ == "__main__":
    main()
