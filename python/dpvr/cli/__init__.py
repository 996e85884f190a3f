"""The ``dpvr`` command line: ``dpvr account|calibrate|bench|experiment|compare|audit``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._lab import LabMissing


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top, so that ``import dpvr.cli`` (the console script's entry) costs nothing
    # until a command line is parsed; each subcommand's own heavy imports wait for its run.
    from . import account, audit, bench, compare, experiment

    parser = argparse.ArgumentParser(
        prog="dpvr",
        description="dpvr: differential privacy with gradient-difference estimators. Privacy accounting and "
        "noise calibration, benchmarks, the papers' experiments and their comparisons, privacy audits.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")
    for module in (account, bench, experiment, compare, audit):
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, RuntimeError, LabMissing) as err:
        print(f"dpvr {args.command}: error: {err}", file=sys.stderr)
        return 2
