"""Wall-clock timing with warm-up; medians, never single runs."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


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
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 7,
    warmup: int = 2,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median wall-clock ms of each function, timed in turn within every round, so that a change in machine
    load during the run affects every method alike (the ratios of one run stay comparable). ``sync`` (a
    device synchronisation) runs before each timer starts and before it stops."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """A synchronisation of ``device`` (None for the host, whose work is done when a call returns)."""
    return torch.cuda.synchronize if device.type == "cuda" else None


def host_syncs(fn: Callable[[], object], rounds: int = 3) -> tuple[float, str]:
    """Synchronisations per call of ``fn`` that make the host wait for a CUDA device, as torch's sync debug
    mode reports them (each a warning): reads of device values (``float(t)``, ``.item()``, ``.tolist()``),
    blocking copies to the host, ``nonzero``. A wait inside an extension is not reported. Also the lines of
    Python that made them (``file:line xcount``, most frequent first)."""
    import collections
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            # One round uncounted: the first under the debug mode in a process reported one sync of torch's
            # own (torch/cuda/__init__.py, torch 2.11 on an H200) whatever ``fn`` was, a plain SGD step too.
            fn()
            caught.clear()
            for _ in range(rounds):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs)
    return len(syncs) / rounds, ", ".join(f"{site} x{n / rounds:g}" for site, n in sites.most_common())


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at the null device (native code writes to it directly, past sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(fn: Callable[[], object], device: str = "cpu") -> int:
    """Peak of the tensor memory that ``fn`` allocates, live at once, in one call: its working memory above
    the resident state (model, optimiser, inputs).

    CUDA: the caching allocator's ``max_memory_allocated`` over the call, less what was allocated before it.
    Host: the allocations and frees that ``torch.profiler`` records during the call (``profile_memory=True``),
    paired by address: a free of a block allocated before the call is not counted, so the result is the peak
    of the call's own live allocations however often the step has run or been profiled before. Memory
    allocated outside torch's allocators (the native core's scratch, a library's own buffers) is not seen.
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - start)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_stderr_silenced():  # the profiler's native start and stop notices
        prof.start()
    try:
        fn()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    events: list[tuple[int, int, int]] = []  # (time, address, bytes: negative for a free)
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes += node.children
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    live: dict[int, int] = {}
    total = peak = 0
    for _, address, nbytes in sorted(events):
        if nbytes > 0:
            live[address] = nbytes
            total += nbytes
        elif address in live:
            total -= live.pop(address)
        peak = max(peak, total)
    return peak
