"""The intra-op thread count of torch and of dpvr's native kernels, which share torch's OpenMP runtime."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Runs the block with ``count`` intra-op threads (``None``: unchanged), then restores the setting.

    Tiny models want one: their kernels are too small to share, and on a busy machine an OpenMP team
    waiting for a descheduled thread makes every call orders of magnitude slower. dpvr's native kernels
    share torch's OpenMP runtime, so this governs them too.
    """
    import torch  # lazily: dpvr.ops serves numpy and cupy users without importing torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
