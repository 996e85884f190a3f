"""``dpvr audit GAME [--epsilon E] [--delta D] [--trials N] [--confidence C] [--seed S] [--json FILE]``.

Runs an algorithm's canary game (see :mod:`dpvr.audit`) and prints the claimed epsilon (the algorithm's
own accountant at the audited configuration), the audited lower bound and its confidence. The games are
those the registry lists for each algorithm (:mod:`dpvr.registry`); the parser is built from the registry
alone, and the games themselves (torch and the algorithms) are imported only to run one or to describe them
in ``--help``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from tqdm import tqdm

from ..registry import REGISTRY, audit_games, audit_targets
from ..results import Record, document, format_table, write_json
from .flags import with_default

_DESCRIPTION = (
    "Run an algorithm's canary game many times and print the claimed epsilon (the algorithm's own "
    "accountant at the audited configuration), the audited lower bound on epsilon and its confidence. A "
    "lower bound above the claim refutes it; a lower bound below it proves nothing about privacy. The claim "
    "is always the whole run's epsilon, every noise stream together: the games that audit one stream "
    "calibrate the other streams' noise to 1% of an audited stream's RDP budget each, so that the claim is "
    "nearly the audited stream's own."
)


def _games_help() -> str:
    """The games of each algorithm with what each one plays, and the default delta (imports the games)."""
    from ..audit import DEFAULT_DELTA  # the games import torch: only when they are listed or run

    targets = audit_targets()
    lines = ["games, by algorithm:"]
    for spec in REGISTRY.values():
        if spec.audit_games:
            lines.append(f"  {spec.name}")
            lines += [f"    {game:29} {targets[game].help}" for game in spec.audit_games]
    lines += ["", f"default --delta: {DEFAULT_DELTA:g}"]
    return "\n".join(lines)


class _Help(argparse.Action):
    """``--help``: the usage and flags, then the games, described by the audit package (imported only now)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.epilog = _games_help()
        parser.print_help()
        parser.exit()


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "audit",
        help="empirical lower bound on epsilon by the canary method",
        description=textwrap.fill(_DESCRIPTION),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the games' table (the epilog) aligned
        add_help=False,
    )
    p.add_argument("-h", "--help", action=_Help, help="show this help message and the games, and exit")
    p.add_argument(
        "algorithm", metavar="GAME", choices=list(audit_games()), help="the game to play (see below)"
    )
    p.add_argument(
        "--epsilon",
        type=float,
        default=2.0,
        help=with_default("target epsilon the noise is calibrated to", 2.0),
    )
    p.add_argument("--delta", type=float, help="delta of the claim and of the bound (default: see below)")
    p.add_argument("--trials", type=int, help="runs, half on each dataset (default: the game's)")
    p.add_argument(
        "--confidence", type=float, default=0.95, help=with_default("confidence of the bound", 0.95)
    )
    p.add_argument(
        "--seed",
        type=int,
        help="derive a reproducible noise seed per run from this (default: operating-system entropy per run)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the result document to FILE")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..audit import DEFAULT_DELTA, audit  # as in _games_help: torch only when auditing

    target = audit_targets()[args.algorithm]
    delta = DEFAULT_DELTA if args.delta is None else args.delta
    trials = args.trials if args.trials is not None else target.trials
    game = target.make(epsilon=args.epsilon, delta=delta)
    with tqdm(total=trials, desc=f"audit {args.algorithm}", file=sys.stderr, leave=False) as bar:
        result = audit(
            game,
            trials,
            confidence=args.confidence,
            seed=args.seed,
            progress=lambda done: bar.update(done - bar.n),
        )
    record = Record(
        method=result.name,
        dataset="canary",
        epsilon=args.epsilon,
        delta=delta,
        seed=args.seed,
        spent_epsilon=result.claimed_epsilon,
        metrics={
            "epsilon_lower_bound": result.epsilon_lower_bound,
            "confidence": result.bound.confidence,
            "trials": result.bound.trials,
            "refuted": result.refuted,
        },
    )
    print(
        format_table(
            ["algorithm", "claimed epsilon", "audited lower bound", "confidence", "trials", "delta"],
            [
                [
                    result.name,
                    result.claimed_epsilon,
                    result.epsilon_lower_bound,
                    result.bound.confidence,
                    result.bound.trials,
                    delta,
                ]
            ],
        )
    )
    if args.json:
        write_json(args.json, document(f"audit/{args.algorithm}", vars_of(args, delta, trials), [record]))
    return 0


def vars_of(args: argparse.Namespace, delta: float, trials: int) -> dict:
    return {
        "algorithm": args.algorithm,
        "epsilon": args.epsilon,
        "delta": delta,
        "trials": trials,
        "confidence": args.confidence,
        "seed": args.seed,
    }
