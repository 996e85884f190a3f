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
