"""Distributed DIFF2 under ``torchrun`` (one process per rank; rank 0 is the aggregator).

    torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m dpvr.distributed --steps 200 --restart 6 --lr 0.5 --clip-restart 1 --clip-difference 1 --epsilon 3

``--problem MODULE:FUNCTION`` names the problem: ``FUNCTION(client, clients)`` returns ``(model, loss_fn,
shard)``, where ``client`` is ``None`` on the aggregator (whose shard is ignored) and each client loads only
its own shard. The default, :func:`demo`, gives client ``p`` shard ``p`` of the bundled diabetes set (80% of
what remains after a public split, standardised with the public split's statistics, dealt IID with a fixed
seed) and the DIFF2 paper's 10-unit softplus MLP.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..algorithms.diff2.algorithm import Shard
from ..data import PublicScaling, load, split_clients, split_public, train_test_split
from ..optim import PrivacyConfig
from ..privacy import PaperSigmas
from ..problems import LossFn
from .aggregator import aggregate
from .client import serve
from .group import DistributedError, init_group

Problem = Callable[[Any, int], tuple[nn.Module, LossFn, Any]]


def squared_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (output - target).pow(2).sum()


def demo(client: int | None, clients: int) -> tuple[nn.Module, LossFn, Shard | None]:
    """Shard ``client`` of the bundled diabetes set and a 10-unit softplus MLP (the same on every rank)."""
    public, private = split_public(load("diabetes"), seed=0)
    train, _ = train_test_split(private, test_fraction=0.2, seed=0)
    train = PublicScaling.fit(public)(train)
    torch.manual_seed(0)
    width = train.features.shape[1]
    model = nn.Sequential(nn.Linear(width, 10), nn.Softplus(), nn.Linear(10, 1)).double()
    if client is None:
        return model, squared_loss, None
    part = split_clients(train, clients, seed=0)[client]
    targets = torch.as_tensor(part.targets, dtype=torch.float64)[:, None]  # scaled by the public split
    return model, squared_loss, (torch.as_tensor(part.features, dtype=torch.float64), targets)


def _problem(name: str) -> Problem:
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpvr.distributed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--problem", default=f"{__name__}:demo", help="MODULE:FUNCTION giving (model, loss, shard)"
    )
    p.add_argument("--steps", type=int, required=True, help="R: communication rounds")
    p.add_argument("--restart", type=int, required=True, help="T: a restart round every T rounds")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--clip-restart", type=float, required=True, help="C1: the restart rounds' clip radius")
    p.add_argument("--clip-difference", type=float, required=True, help="C2: difference radius per unit move")
    p.add_argument("--epsilon", type=float, help="target epsilon (calibrates the noise)")
    p.add_argument("--sigma", type=float, nargs="+", help="sigma1 sigma2 [sigma3] instead of --epsilon")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--routine", choices=("gd", "bvr-l-sgd"), default="gd")
    p.add_argument("--local-steps", type=int, default=1)
    p.add_argument("--local-batch", type=int)
    p.add_argument("--clip-local", type=float, help="C3: BVR-L-SGD's local radius per unit move")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a client may take per step")
    p.add_argument("--idle-timeout", type=float, default=1800.0)
    p.add_argument("--checkpoint", help="checkpoint file (written by the aggregator after every round)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (args.epsilon is None) == (args.sigma is None):
        raise SystemExit("give --epsilon or --sigma, not both")
    group = init_group(timeout=args.timeout, idle_timeout=args.idle_timeout, backend=args.backend)
    client = None if group.rank == 0 else group.rank - 1
    model, loss_fn, shard = _problem(args.problem)(client, group.clients)
    model = model.to(group.device)
    try:
        if client is not None:
            serve(group, model, loss_fn, tuple(t.to(group.device) for t in shard))
            return 0
        noise = PaperSigmas(zip(("restart", "difference", "local"), args.sigma)) if args.sigma else None
        clip = {"restart": args.clip_restart, "difference": args.clip_difference}
        if args.clip_local is not None:
            clip["local"] = args.clip_local
        result = aggregate(
            group,
            model,
            loss_fn,
            checkpoint=args.checkpoint,
            resume=args.resume,
            steps=args.steps,
            restart=args.restart,
            lr=args.lr,
            clip=clip,
            routine=args.routine,
            local_steps=args.local_steps,
            local_batch=args.local_batch,
            noise=noise,
            privacy=PrivacyConfig(epsilon=args.epsilon, delta=args.delta),
        )
    except DistributedError as err:
        print(f"rank {group.rank}: {err}", file=sys.stderr)
        return 1
    finally:
        torch.distributed.destroy_process_group()
    mean_ms = math.fsum(result.round_ms) / max(1, len(result.round_ms))
    print(
        f"rounds {result.steps_done}, epsilon {result.epsilon:.4g} at delta {result.delta:g}, "
        f"{mean_ms:.2f} ms per round, {result.traffic.down + result.traffic.up} bytes exchanged"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
