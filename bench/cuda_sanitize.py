"""Runs every CUDA kernel path of dpvr once on small inputs, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --kernel-name kns=dpvr \\
        --error-exitcode 1 python bench/cuda_sanitize.py

Paths covered: both dtypes; plain, weighted and difference forms; the small and the large tensor table and
a call split over several launches; sliced and unsliced accumulation; norms only; NaN/Inf samples and the
float64 overflow rescue (within a tile and across tiles); the raise policy; the noisy update with and without
noise, sum, parameter step and previous parameters, with Gaussian pairs straddling tensors; Philox words.
"""

from __future__ import annotations

import sys

import torch

import dpvr
from dpvr import _C
from dpvr.ops import NoiseGenerator


def grads(batch: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(batch, *s, dtype=dtype, device="cuda") for s in shapes]


def clip_paths(dtype: torch.dtype) -> None:
    cases = {
        "small table": (7, [(3, 4), (5,), (1,)]),
        "large table": (5, [(2, 3)] * 40),
        "several launches": (3, [(2,)] * 460 + [(0,)] + [(3,)] * 20),
        "sliced samples": (300, [(6,), (11,)]),
        "unsliced, many tiles": (2, [(300_000,)]),
    }
    for batch, shapes in cases.values():
        g, h = grads(batch, shapes, dtype), grads(batch, shapes, dtype)
        out = [torch.zeros(s, dtype=dtype, device="cuda") for s in shapes]
        norms = torch.zeros(batch, dtype=dtype, device="cuda")
        w = torch.rand(batch, dtype=dtype, device="cuda")
        dpvr.clip_accumulate(g, 1.0, out, norms=norms)
        dpvr.clip_accumulate(g, 1.0, out, weights=w, norms=norms)
        dpvr.clip_accumulate_diff(g, h, 1.0, out, a=w, b=w, norms=norms)
        dpvr.clip_accumulate_diff(g, h, 1.0, out)
        dpvr.per_sample_norms(g, norms)

    big = 1e200 if dtype == torch.float64 else 1e30
    g = grads(6, [(5,), (2,)], dtype)
    g[0][1] = big
    g[0][2, 1] = float("nan")
    g[1][3, 0] = float("inf")
    out = [torch.zeros(5, dtype=dtype, device="cuda"), torch.zeros(2, dtype=dtype, device="cuda")]
    dpvr.clip_accumulate(g, 1.0, out, norms=torch.zeros(6, dtype=dtype, device="cuda"))
    try:
        dpvr.clip_accumulate(g, 1.0, out, nonfinite="raise")
        raise AssertionError("nonfinite='raise' did not raise")
    except FloatingPointError:
        pass
    dpvr.clip_accumulate(grads(4, [(5,)], dtype), 1.0, [out[0]], nonfinite="raise")
    if dtype == torch.float64:
        across = torch.full((2, 20_000), 2e152, dtype=dtype, device="cuda")  # overflows only across tiles
        dpvr.clip_accumulate(across, 1.0, torch.zeros(20_000, dtype=dtype, device="cuda"))


def update_paths(dtype: torch.dtype) -> None:
    gen = NoiseGenerator(seed=3, reproducible=True)
    for shapes in ([(3,), (5,), (1,), (7, 3)], [(3,)] * 40, [(1,)] * 470 + [(0,)] + [(5,)] * 10):
        t = {name: [torch.randn(s, dtype=dtype, device="cuda") for s in shapes] for name in "vsxp"}
        dpvr.noisy_update(t["v"], generator=gen, stream="a", sigma=0.5)
        dpvr.noisy_update(t["v"], generator=gen, stream="a", sigma=0.5, sum=t["s"], scale=0.1, reset=True)
        step = dict(sum=t["s"], params=t["x"], lr=0.1)
        dpvr.noisy_update(t["v"], generator=gen, stream="a", sigma=0.0, **step)
        dpvr.noisy_update(t["v"], generator=gen, stream="a", sigma=0.3, params_prev=t["p"], **step)
    words = torch.zeros(4 * 1000, dtype=torch.int32, device="cuda")
    _C.philox_words(0, words.data_ptr(), 1000, 1, 2, 3, torch.cuda.current_stream().cuda_stream)


def main() -> int:
    if not (torch.cuda.is_available() and dpvr.backends()["cuda_available"]):
        print("cuda_sanitize: needs a CUDA device and a CUDA build of dpvr", file=sys.stderr)
        return 2
    for dtype in (torch.float32, torch.float64):
        clip_paths(dtype)
        update_paths(dtype)
    torch.cuda.synchronize()
    print("cuda_sanitize: every kernel path ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
