"""The machine a benchmark ran on, named in every table: ratios move with the CPU and its instruction set."""

from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict[str, object]:
    """CPU model, cores, the instruction set dpvr's CPU kernels use, torch's threads and version."""
    from dpvr import _C

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "kernels": _C.cpu_instruction_set(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


def line() -> str:
    """:func:`describe` in one line, for the head of a table."""
    d = describe()
    return (f"host: {d['cpu']}, {d['cores']} cores; dpvr CPU kernels: {d['kernels']}; torch {d['torch']} "
            f"with {d['torch_threads']} threads")
