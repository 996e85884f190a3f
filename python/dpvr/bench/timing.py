"""Wall-clock timing with warm-up; medians, never single runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(
    fn: Callable[[], object],
    *,
    repeats: int = 7,
    warmup: int = 2,
    sync: Callable[[], None] | None = None,
) -> float:
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def interleaved_median_ms(
    fns: dict[str, Callable[[], object]], *, repeats: int = 7, warmup: int = 2
) -> dict[str, float]:
    """Median wall-clock ms of each function, timed in turn within every round, so that a change in machine
    load during the run affects every method alike (the ratios of one run stay comparable)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}
