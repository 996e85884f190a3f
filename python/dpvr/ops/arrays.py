"""Zero-copy descriptions of torch, numpy and cupy arrays for the native core.

The core takes an address, a shape and strides counted in elements. This module is the only place that knows
the array frameworks; it validates dtype, device and layout and names the offending argument when it refuses.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple

import numpy as np

CPU = -1  # device index of host memory; CUDA devices use their ordinal
DTYPE_CODES = {"float32": 0, "float64": 1}


class ArrayView(NamedTuple):
    """An array as the core sees it. ``owner`` keeps the memory alive while the view is in use. (A named
    tuple: every kernel call describes each of its arrays, and a tuple is built several times faster than a
    frozen dataclass.)"""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: int
    writable: bool
    owner: Any
    framework: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    def is_contiguous(self) -> bool:
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


_TORCH_DTYPE_NAMES: dict[Any, str] = {}  # torch dtype -> its name without the module, filled as met


def _torch_view(a: Any, name: str, torch: Any) -> ArrayView:
    """``a`` described; ``torch`` the module (imported by the caller: dpvr.ops serves numpy and cupy arrays
    without it)."""
    if a.layout != torch.strided:
        raise TypeError(f"{name}: sparse or non-strided tensors are not supported (layout {a.layout})")
    if a.is_cuda:
        device = a.get_device()
    elif a.is_cpu:
        device = CPU
    else:
        raise TypeError(f"{name}: tensors on device '{a.device}' are not supported (cpu or cuda only)")
    if a.is_conj() or a.is_neg():
        raise TypeError(f"{name}: lazily conjugated/negated tensors are not supported; call .resolve_conj()")
    dtype = _TORCH_DTYPE_NAMES.get(a.dtype)
    if dtype is None:
        dtype = _TORCH_DTYPE_NAMES.setdefault(a.dtype, str(a.dtype).removeprefix("torch."))
    return ArrayView(a.data_ptr(), tuple(a.shape), a.stride(), dtype, device, True, a, "torch")


def _strided_view(a: Any, name: str, address: int, device: int, writable: bool, framework: str) -> ArrayView:
    itemsize = a.dtype.itemsize
    if any(s % itemsize for s in a.strides):
        raise ValueError(f"{name}: strides {a.strides} are not a multiple of the item size {itemsize}")
    return ArrayView(
        address=address,
        shape=tuple(int(n) for n in a.shape),
        strides=tuple(int(s) // itemsize for s in a.strides),
        dtype=str(a.dtype),
        device=device,
        writable=writable,
        owner=a,
        framework=framework,
    )


def view(a: Any, name: str) -> ArrayView:
    """Describes ``a`` (torch tensor, numpy or cupy array) without copying it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return _torch_view(a, name, torch)
    if isinstance(a, np.ndarray):
        return _strided_view(a, name, a.ctypes.data, CPU, bool(a.flags.writeable), "numpy")
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(a, cupy.ndarray):
        return _strided_view(a, name, a.data.ptr, a.device.id, True, "cupy")
    raise TypeError(f"{name}: expected a torch tensor, numpy array or cupy array, got {type(a).__name__}")


def contiguous_copy(v: ArrayView) -> ArrayView:
    """A contiguous copy in the same framework and device (used only for layouts the core cannot stride)."""
    a = v.owner
    if v.framework == "torch":
        return view(a.contiguous(), "copy")
    if v.framework == "numpy":
        return view(np.ascontiguousarray(a), "copy")
    import cupy  # optional: only cupy arrays reach here

    return view(cupy.ascontiguousarray(a), "copy")


def as_matrix(v: ArrayView) -> tuple[ArrayView, tuple[int, int, int, int, int]]:
    """(B, ...) array -> (view kept alive, (address, B, cols, row stride, col stride)).

    Trailing dimensions are collapsed into one strided column axis when the layout allows; otherwise a
    contiguous copy is made (read-only inputs only).
    """
    if len(v.shape) == 0:
        raise ValueError("per-sample arrays need a leading batch dimension")
    rows = v.shape[0]
    dims = [(n, s) for n, s in zip(v.shape[1:], v.strides[1:]) if n != 1]
    cols = math.prod(n for n, _ in dims)
    collapsible = all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))
    if not collapsible:
        v = contiguous_copy(v)
        return v, (v.address, rows, cols, cols, 1)
    col_stride = dims[-1][1] if dims else 1
    return v, (v.address, rows, cols, v.strides[0], col_stride)


def cuda_stream(device: int, framework: str) -> int:
    """The caller's current CUDA stream on ``device`` as an integer handle (0 on the host)."""
    if device == CPU:
        return 0
    if framework == "cupy":
        import cupy  # optional: only cupy arrays reach here

        return int(cupy.cuda.get_current_stream().ptr)
    import torch  # lazily: dpvr.ops serves numpy and cupy arrays without torch

    return int(torch.cuda.current_stream(device).cuda_stream)
