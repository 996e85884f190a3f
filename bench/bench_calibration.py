"""Time of a tight joint calibration of four streams over 10^4 steps, beside Opacus' one-stream calibration.

Both are measured in the same run, on the same target (epsilon = 2, delta = 1e-5): dpvr calibrates DP
Double-SPIDER's four Poisson-sampled streams (refreshes every 100 steps on 10% of 60,000 records,
differences on 256) with equal budget shares; Opacus' ``get_noise_multiplier`` calibrates one DP-SGD stream
(rate 0.01, 10^4 steps) with its RDP accountant. Also shown: the same four streams with fixed-size batches
without replacement (replace-one), whose RDP bound costs O(alpha^2) per order in dp_accounting.

Usage: ``python bench/bench_calibration.py [--repeats N] [--json FILE]``; prints median milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

from opacus.accountants.utils import get_noise_multiplier

from dpvr.algorithms import DoubleSpiderPlan, DPSGDPlan
from dpvr.privacy import account, calibrate

EPSILON, DELTA, STEPS = 2.0, 1e-5, 10_000


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: imports and caches outside the timed runs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()

    four_poisson = DoubleSpiderPlan(60_000, STEPS, 100, (6000, 256, 6000, 256), "poisson", "add-remove")
    four_wor = DoubleSpiderPlan(60_000, STEPS, 100, (6000, 256, 6000, 256), "wor", "replace-one")
    one_stream = DPSGDPlan(STEPS, "poisson", 0.01)

    def opacus() -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus warns when the optimum is its largest order
            return get_noise_multiplier(
                target_epsilon=EPSILON, target_delta=DELTA, sample_rate=0.01, steps=STEPS, accountant="rdp"
            )

    four, reference = (
        "dpvr four streams, Poisson (add/remove)",
        "opacus get_noise_multiplier, one stream (rdp)",
    )
    cases = {
        four: lambda: calibrate(four_poisson, EPSILON, DELTA),
        reference: opacus,
        "dpvr one stream, Poisson (add/remove)": lambda: calibrate(one_stream, EPSILON, DELTA),
        "dpvr four streams, without replacement (replace-one)": lambda: calibrate(four_wor, EPSILON, DELTA),
    }
    # The without-replacement case takes a few hundred ms per run; fewer repeats keep the run short.
    repeats = {name: args.repeats if "without" not in name else max(3, args.repeats // 5) for name in cases}
    results = {name: _median_ms(fn, repeats[name]) for name, fn in cases.items()}
    check = account(four_poisson(calibrate(four_poisson, EPSILON, DELTA)), DELTA).epsilon

    print(f"calibration to epsilon={EPSILON:g}, delta={DELTA:g}, {STEPS} steps (median of runs)")
    for name, ms in results.items():
        print(f"  {name:<55} {ms:8.1f} ms")
    print(f"  four-stream dpvr / one-stream opacus: {results[four] / results[reference]:.2f}")
    print(f"  epsilon spent by the calibrated four-stream run: {check:.6f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "calibration",
                    "epsilon": EPSILON,
                    "delta": DELTA,
                    "steps": STEPS,
                    "median_ms": results,
                    "spent_epsilon": check,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
