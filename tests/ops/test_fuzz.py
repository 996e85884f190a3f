"""Hypothesis fuzzing of the ``dpvr.ops`` bindings: every input computes correctly or raises a clear error.

Shapes (empty batches included), dtypes, strides, devices, NaN/Inf/denormals and huge/tiny values are drawn
at random. The fuzz body runs in a child interpreter, so a crash or an out-of-bounds access that kills the
process fails the test instead of pytest; ``bench/asan.sh`` runs the same body under AddressSanitizer.
"""

import os
import subprocess
import sys

import pytest

BODY = r'''
import math, sys
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from dpvr import ops

EXAMPLES = int(sys.argv[1])
CLEAR = (TypeError, ValueError, FloatingPointError)
SPECIAL = [0.0, -0.0, 5e-324, 1e-310, 1e-38, 1e-45, 1e300, -1e300, 3e38, math.inf, -math.inf, math.nan]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@st.composite
def arrays(draw, batch, cols, dtype):
    """A (batch, cols) array: numpy or torch, contiguous, transposed, sliced or broadcast."""
    values = draw(st.lists(st.one_of(st.floats(-10, 10), st.sampled_from(SPECIAL)),
                           min_size=batch * cols * 2, max_size=batch * cols * 2))
    base = np.asarray(values, dtype=np.float64).reshape(batch, cols * 2)
    layout = draw(st.sampled_from(["plain", "strided", "transposed", "fortran", "broadcast"]))
    with np.errstate(over="ignore"):
        a = base.astype(dtype)
    if layout == "strided":
        a = a[:, ::2]
    elif layout == "transposed":
        a = np.ascontiguousarray(a[:, :cols].T).T
    elif layout == "fortran":
        a = np.asfortranarray(a[:, :cols])
    elif layout == "broadcast":
        a = np.broadcast_to(a[:1, :cols], (batch, cols)) if batch else a[:, :cols]
    else:
        a = np.ascontiguousarray(a[:, :cols])
    if draw(st.booleans()) and a.dtype != np.float16:
        a = torch.from_numpy(np.array(a)).to(draw(st.sampled_from(DEVICES)))
    return a


def host(a):
    return a.cpu().numpy().astype(np.float64) if isinstance(a, torch.Tensor) else np.asarray(a, np.float64)


def zeros_like_out(a, cols):
    if isinstance(a, torch.Tensor):
        return torch.zeros(cols, dtype=a.dtype, device=a.device)
    return np.zeros(cols, dtype=a.dtype if a.dtype in (np.float32, np.float64) else np.float64)


def check_clip(g, h, out, clip, result):
    """The kernel's sum against a float64 reference: each finite sample clipped to `clip`."""
    with np.errstate(over="ignore", invalid="ignore"):
        gh = host(g) - (host(h) if h is not None else 0.0)
        finite = np.isfinite(gh).all(axis=1)
        gh = np.where(finite[:, None], gh, 0.0)
        big = np.abs(gh).max(axis=1, initial=0.0)  # scaled norms: 1e300 entries must not overflow
        norms = big * np.sqrt(((gh / np.where(big > 0, big, 1.0)[:, None]) ** 2).sum(axis=1))
    scale = np.where(norms > 0, np.minimum(1.0, clip / np.where(norms > 0, norms, 1.0)), 1.0)
    ref = (gh[finite] * scale[finite, None]).sum(axis=0)
    got = host(out)
    assert np.all(np.isfinite(got)), got
    tol = (1e-4 if host(out).dtype == np.float32 or str(getattr(out, "dtype", "")).endswith("32") else 1e-9)
    assert np.allclose(got, ref, rtol=tol, atol=tol * max(1.0, clip) * max(1, finite.sum())), (got, ref)
    assert int(result) == int((~finite).sum())


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def fuzz_clip(data):
    batch = data.draw(st.integers(0, 5))
    cols = data.draw(st.integers(1, 4))
    dtype = data.draw(st.sampled_from([np.float32, np.float64, np.float16, np.int64]))
    g = data.draw(arrays(batch, cols, dtype))
    diff = data.draw(st.booleans())
    h = data.draw(arrays(batch, cols, data.draw(st.sampled_from([dtype, np.float64])))) if diff else None
    odd_clips = [0.0, -1.0, 5e-324, 1e300, math.inf, math.nan]
    clip = data.draw(st.one_of(st.floats(1e-3, 1e3), st.sampled_from(odd_clips)))
    out = zeros_like_out(g, cols) if data.draw(st.booleans()) else zeros_like_out(g, cols + 1)
    try:
        result = (ops.clip_accumulate_diff(g, h, clip, out) if diff else ops.clip_accumulate(g, clip, out))
    except CLEAR as err:
        assert str(err), "an exception without a message"
        return
    if isinstance(out, torch.Tensor) and out.is_cuda:
        torch.cuda.synchronize()
    check_clip(g, h, out, clip, result)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def fuzz_noise(data):
    size = data.draw(st.integers(0, 6))
    dtype = data.draw(st.sampled_from([np.float32, np.float64, np.int32]))
    v = np.zeros(size, dtype)
    sigma = data.draw(st.one_of(st.floats(0, 10), st.sampled_from([-1.0, 1e-310, 1e300, math.inf, math.nan])))
    lr = data.draw(st.one_of(st.floats(-1, 1), st.sampled_from([math.nan, math.inf])))
    sizes = data.draw(st.sampled_from([size, size + 1]))
    params = np.zeros(sizes, dtype) if data.draw(st.booleans()) else None
    gen = ops.NoiseGenerator(seed=data.draw(st.integers(0, 2**64 - 1)), reproducible=True)
    try:
        norm = ops.noisy_update([v], generator=gen, stream="s", sigma=sigma, params=params, lr=lr)
    except CLEAR as err:
        assert str(err)
        return
    # Gaussian draws stay below 10 in magnitude; beyond that the noise itself overflows the dtype.
    overflow = sigma * 10 > np.finfo(dtype).max
    assert np.all(np.isfinite(v)) or overflow
    if params is not None:
        assert norm is not None and (math.isfinite(norm) or overflow)


for fuzz in (fuzz_clip, fuzz_noise):
    fuzz()
print("ok")
'''


@pytest.mark.slow  # a child interpreter (seconds to import torch) and hundreds of examples
@pytest.mark.parametrize("examples", [300])
def test_fuzz_ops_in_a_child_interpreter(examples):
    result = subprocess.run(
        [sys.executable, "-c", BODY, str(examples)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert result.returncode == 0, (
        f"child died (code {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:]
