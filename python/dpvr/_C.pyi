"""Types of the native core ``dpvr._C`` (bound in csrc/bindings.cpp and csrc/bindings_ghost.cpp).

Arrays cross this boundary as plain integer descriptions (an address, sizes, strides counted in elements)
built by ``dpvr.ops.arrays``; nothing here sees a framework type. The bindings declare no keyword names, so
every parameter is positional-only; the names are those of the C++ lambdas. ``device`` is -1 for host
memory, else a CUDA ordinal; ``dtype`` is 0 for float32, 1 for float64; ``stream`` is a ``cudaStream_t`` as
an integer (0 on the host); an address of 0 means "not given".
"""

from collections.abc import Sequence

from typing_extensions import TypeAlias

_MatrixDesc: TypeAlias = tuple[int, int, int, int, int]  # address, rows, cols, row stride, col stride
_VectorDesc: TypeAlias = tuple[int, int]  # address, size
# address, batch, steps, width, sample stride, step stride, entry stride
_SequenceDesc: TypeAlias = tuple[int, int, int, int, int, int, int]
_IndicesDesc: TypeAlias = tuple[int, int, int, int, int]  # address, batch, steps, sample stride, step stride
_OuterDesc: TypeAlias = tuple[Sequence[_SequenceDesc], Sequence[_SequenceDesc], int]  # left, right, norm form
_IndexDesc: TypeAlias = tuple[Sequence[_IndicesDesc], Sequence[_SequenceDesc], int]  # indices, right, skip

class ArgumentError(ValueError):
    """A refused argument; the message starts with the argument's name."""

class NonFiniteError(FloatingPointError):
    """A non-finite per-sample value under the ``raise`` policy (raised before any output is written)."""

def clip_accumulate(
    device: int,
    dtype: int,
    batch: int,
    g: Sequence[_MatrixDesc],
    h: Sequence[_MatrixDesc],
    out: Sequence[_VectorDesc],
    w: int,
    b: int,
    norms: int,
    clip: float,
    nonfinite: int,
    stream: int,
    count: int,
    out_dtype: int = -1,
    /,
) -> int:
    """``out += sum_i min(1, clip / ||u_i||) u_i``, summed over samples in double and added once; returns the
    non-finite sample count (-1 on CUDA, where it is written to ``count``). ``out_dtype``: 1 for float64
    accumulators of float32 data (-1: ``dtype``)."""

def noisy_update(
    device: int,
    dtype: int,
    v: Sequence[_VectorDesc],
    sum: Sequence[_VectorDesc],
    x: Sequence[_VectorDesc],
    x_prev: Sequence[_VectorDesc],
    scale: float,
    sigma: float,
    lr: float,
    reset: bool,
    seed: int,
    stream_id: int,
    step: int,
    step_norm: int,
    stream: int,
    sum_dtype: int = -1,
    /,
) -> None:
    """``v <- (reset ? 0 : v) + scale * sum + sigma * xi``, then ``x <- x - lr * v`` when ``x`` is given.
    ``sum_dtype``: 1 for a float64 sum of a float32 update (-1: ``dtype``)."""

def philox_words(
    device: int, out: int, n_blocks: int, seed: int, stream_id: int, step: int, stream: int, /
) -> None:
    """Raw Philox-4x32-10 words of the noise generator (four uint32 per block), for cross-backend tests."""

def ghost_norms(
    device: int,
    dtype: int,
    batch: int,
    outer: Sequence[_OuterDesc],
    index: Sequence[_IndexDesc],
    dense: Sequence[_MatrixDesc],
    norms_sq: int,
    outer_bounds: int,
    /,
) -> None:
    """Writes an upper bound on each sample's squared gradient norm to the float64 ``norms_sq``, without
    forming the per-sample gradients; with ``outer_bounds`` (0: none), each outer term's ``R`` of each sample
    (the sum over its pieces' steps of ``||m|| ||n||``) to that float64 ``(len(outer), batch)`` buffer."""

def clip_factors(
    device: int,
    dtype: int,
    batch: int,
    norms_sq: int,
    weights: int,
    factors: int,
    norms: int,
    clip: float,
    columns: int,
    nonfinite: int,
    /,
) -> int:
    """Per-sample clip factors from squared norms; returns the non-finite sample count."""

def cuda_compiled() -> bool:
    """Whether this build has the CUDA backend."""

def cuda_available() -> bool:
    """Whether the CUDA backend can run now (a driver and a device)."""

def cpu_instruction_set() -> str:
    """The instruction set the CPU kernels run with here: ``"avx512"``, ``"avx2"`` or ``"baseline"``."""

def max_threads() -> int:
    """The number of threads the CPU kernels use."""
