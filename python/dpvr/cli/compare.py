"""``dpvr compare FILE... --method M --baseline B --metric X``: a method against a baseline, seed by seed."""

from __future__ import annotations

import argparse

from ._lab import lab
from .flags import with_default


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "compare",
        help="paired comparison of two methods in experiment result files",
        description="Compare a method with a baseline in the records of 'dpvr experiment' JSON files: per "
        "(dataset, epsilon), both means over the shared seeds, the mean per-seed difference, the seeds won "
        "and the one-sided paired t-test of 'the method is better'.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="result documents (NAME.json)")
    p.add_argument("--method", required=True, help="the method, as named in the records")
    p.add_argument("--baseline", required=True, help="the baseline, as named in the records")
    p.add_argument("--metric", required=True, help="the metric (e.g. test_auc, test_accuracy)")
    p.add_argument(
        "--lower-is-better",
        action="store_true",
        help=with_default("the metric is a loss", "higher is better"),
    )
    p.add_argument("--plot", metavar="PNG", help="also plot the metric against epsilon to PNG")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    compare = lab("experiments.compare", "compare")

    records = compare.load_records(args.files)
    cells = compare.compare(
        records, args.method, args.baseline, args.metric, higher_is_better=not args.lower_is_better
    )
    print(compare.table(cells))
    if args.plot:
        compare.plot(cells, args.plot)
        print(f"\nwrote {args.plot}")
    return 0
