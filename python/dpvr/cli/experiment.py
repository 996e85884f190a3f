"""``dpvr experiment NAME ...``: the papers' experiments (:mod:`dpvr_lab.experiments`, distribution dpvr-lab).

The command is parsed in two stages so that ``dpvr`` starts without importing any experiment: this
parser takes the experiment's name, then the experiment's own parser (the shared flags below plus its
``add_arguments``) parses the rest, ``--help`` included.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from ..results import write_json
from ._lab import available, lab


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "experiment",
        help="run a paper's experiment: table, CSV/JSON and PNG plots",
        description="Run a named experiment; 'dpvr experiment NAME --help' lists its flags.",
    )
    # Without dpvr-lab any name parses, so that running it says what to install.
    names = sorted(lab("experiments", "experiment").EXPERIMENTS) if available() else None
    p.add_argument("name", choices=names, help="the experiment")
    p.add_argument("options", nargs=argparse.REMAINDER, help="the experiment's flags")
    p.set_defaults(run=run)


def experiment_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``dpvr experiment NAME``: the shared flags and the experiment's own."""
    module = lab("experiments", "experiment").get(name)
    parser = argparse.ArgumentParser(
        prog=f"dpvr experiment {name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a reduced grid that runs in a few minutes")
    parser.add_argument("--epsilon", type=float, nargs="+", metavar="E", help="target epsilons")
    parser.add_argument("--seeds", type=int, metavar="N", help="number of seeds (default: the protocol's)")
    parser.add_argument("--dataset", nargs="+", metavar="D", help="datasets (default: the experiment's)")
    parser.add_argument("--data-dir", metavar="DIR", help="directory of user-supplied datasets")
    parser.add_argument("--out", metavar="DIR", help=f"directory for CSV/JSON/PNG (default: results/{name})")
    parser.add_argument("--json", metavar="FILE", help="also write the result document to FILE")
    module.add_arguments(parser)
    return parser


def parse(name: str, options: Sequence[str]) -> argparse.Namespace:
    """The arguments of ``dpvr experiment NAME OPTIONS...``, with ``--out`` defaulted."""
    args = experiment_parser(name).parse_args(list(options))
    if args.out is None:
        args.out = os.path.join("results", name)
    return args


def run(args: argparse.Namespace) -> int:
    options = parse(args.name, args.options)
    doc = lab("experiments", "experiment").get(args.name).run(options)
    if options.json:
        write_json(options.json, doc)
    return 0
