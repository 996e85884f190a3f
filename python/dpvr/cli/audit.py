"""``dpvr audit ALGORITHM [--epsilon E] [--delta D] [--trials N] [--confidence C] [--seed S] [--json FILE]``.

Runs the algorithm's canary game (see :mod:`dpvr.audit`) and prints the claimed epsilon (the algorithm's
own accountant at the audited configuration), the audited lower bound and its confidence. A lower bound
above the claim refutes it; a lower bound below it proves nothing about privacy.

The claim is always the whole run's epsilon, every noise stream together. The audits of one stream (the
difference steps and the DRO dual variables: ``private-diff-difference``, ``double-spider-difference``,
``double-spider-eta``, ``recursive-spider-difference``, ``recursive-spider-u``, ``recursive-spider-s``)
calibrate the other streams' noise to 1% of an audited stream's RDP budget each, so that the claim is
nearly the audited stream's own.
"""

from __future__ import annotations

import argparse
import sys

from ..results import Record, document, format_table, write_json


def register(commands: argparse._SubParsersAction) -> None:
    from ..audit import TARGETS

    p = commands.add_parser(
        "audit",
        help="empirical lower bound on epsilon by the canary method",
        description=__doc__,
        epilog="algorithms:\n" + "\n".join(f"  {t.name:29} {t.help}" for t in TARGETS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("algorithm", choices=sorted(TARGETS), help="what to audit")
    p.add_argument("--epsilon", type=float, default=2.0, help="target epsilon the noise is calibrated to")
    p.add_argument("--delta", type=float, default=None, help="delta of the claim and of the bound")
    p.add_argument(
        "--trials", type=int, default=None, help="runs, half on each dataset (default: the game's)"
    )
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="derive a reproducible noise seed per run from this (default: OS entropy per run)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the result document to FILE")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..audit import DEFAULT_DELTA, TARGETS, audit

    target = TARGETS[args.algorithm]
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
