"""dpvr.ops.keep_freed_memory: freed host memory reused without page faults, in a process of its own (the
setting is process-wide and lasts for the process, so it never runs in the test process)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from dpvr.ops import keep_freed_memory

# Frees a 256 MiB block, then takes and writes one of the same size four times; prints whether the setting
# took effect and the minor page faults of the last three rounds.
_SCRIPT = """
import resource, sys
import numpy as np
from dpvr.ops import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
size = 256 << 20
for round in range(4):
    if round == 1:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.empty(size, dtype=np.uint8)
    block.fill(1)
    del block
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          check=True)
    kept, faults = done.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_blocks_are_reused_without_page_faults() -> None:
    kept, faults = _faults("keep")
    _, default_faults = _faults("default")
    assert kept == "True"
    # By default each block is mapped afresh: at least a fault per 2 MiB page (transparent huge pages, which
    # numpy asks for) of three blocks; kept, the heap's pages stay mapped.
    assert default_faults >= 3 * 128, default_faults
    assert faults <= default_faults // 10, (faults, default_faults)


@pytest.mark.parametrize("limit", [0, -1, 2**31, 1.5, True, "1"])
def test_a_limit_outside_a_c_int_is_refused(limit: object) -> None:
    with pytest.raises(ValueError, match="limit"):
        keep_freed_memory(limit)  # type: ignore[arg-type]
