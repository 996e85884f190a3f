"""The host allocator's handling of freed memory (a process-wide performance setting; changes no value)."""

from __future__ import annotations

import ctypes
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int


def keep_freed_memory(limit: int = _INT_MAX) -> bool:
    """Lets the C library keep freed host memory for reuse instead of returning it to the system: blocks
    below ``limit`` bytes come from its heap (not from fresh mappings), and up to ``limit`` bytes of free
    heap are kept. Returns whether the setting took effect (``False`` where the C library is not glibc;
    then nothing changes).

    Why: a private step forms large temporaries (recorded activations, unfolded convolution patches,
    per-sample matrices, float64 sums) that glibc maps afresh above its 32 MiB threshold and unmaps when
    freed, so every step pays a page fault for each 4 KiB it touches again. With two threads on a 2-core
    AVX-512 host a ResNet's DP-SGD step took 80 000-93 000 page faults; kept, at most about 4 000 (measured in
    docs/benchmarks.md, with the resident memory it costs).

    It is process-wide and lasts for the process (glibc's adaptive threshold, once set, stays off), like
    ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...`` before start. What
    it costs: the process keeps its peak heap resident between steps. It changes no value that any
    computation produces, and so nothing that dpvr releases or accounts.

    Raises:
        ValueError: ``limit`` is not an integer in ``[1, 2**31 - 1]``.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _INT_MAX:
        raise ValueError(f"limit: must be an integer number of bytes in [1, {_INT_MAX}], got {limit!r}")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, limit)) & bool(mallopt(_M_TRIM_THRESHOLD, limit))
