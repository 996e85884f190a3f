"""The figure and fitted exponents of the growing GPT-2 cases from several ``dpvr bench step --json`` runs
(one case per run, as the long cases are best run): time and peak memory of each library's step against
the sequence length, and ``time ~ T^a``, ``memory ~ T^b`` per method and model size.

    dpvr bench step --scale --memory --case gpt2-1e7-t128 --json t128.json   # ... one run per case
    python bench/scale_figure.py t128.json t512.json t1024.json --plot docs/figures/bench-scale.png
"""

from __future__ import annotations

import argparse
import json

from dpvr.results import Record, format_table
from dpvr_lab.bench import step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="JSON documents written by dpvr bench step --json")
    parser.add_argument("--plot", required=True, metavar="PNG")
    args = parser.parse_args()
    records = []
    for path in args.runs:
        with open(path) as f:
            records += [Record(**r) for r in json.load(f)["records"]]
    step.scale_plot(records, args.plot)
    print(format_table(["method", "time ~ T^a", "peak memory ~ T^b"],
                       [[m, a, b] for m, a, b in step.sequence_scaling(records)]))
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
