"""Every instruction-set copy of the CPU kernels (baseline, AVX2, AVX-512, chosen at run time; capped with
``DPVR_CPU_ISA``) against the others on this machine: the same noise bit for bit (the Gaussians are the same
IEEE operations at any vector width; the fused step and its norm too, summed in fixed lanes), and clipped
sums and ghost norms within their rounding bounds (a reduction's order follows the vector width)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dpvr import _C

SCRIPT = r"""
import sys, numpy as np, torch
from dpvr import _C, ops
out = {"isa": np.array(_C.cpu_instruction_set())}
for dtype in (torch.float32, torch.float64):
    g = ops.NoiseGenerator(7, reproducible=True)
    for size in (1, 7, 4099, 70001):  # tails that end inside a group of Philox lanes
        v = torch.zeros(size, dtype=dtype)
        ops.noisy_update(v, sigma=1.0, reset=True, generator=g, stream="s")
        out[f"noise-{dtype}-{size}"] = v.numpy()
        x, before, signal = (torch.linspace(-1, 1, size, dtype=dtype) for _ in range(3))
        norm = ops.noisy_update(v, sum=signal, scale=0.5, sigma=0.1, generator=g, stream="u", params=x,
                                params_prev=before, lr=0.3)
        out[f"noise-step-{dtype}-{size}"] = np.concatenate([v.numpy(), x.numpy(), before.numpy(), [norm]])
    gen = torch.Generator().manual_seed(3)
    shapes = ((64, 300), (64, 5, 7))
    grads = [torch.randn(*s, generator=gen, dtype=dtype) for s in shapes]
    sums = [torch.zeros(*s[1:], dtype=dtype) for s in shapes]
    norms = torch.zeros(64, dtype=dtype)
    ops.clip_accumulate(grads, 3.0, sums, norms=norms)
    out[f"sum0-{dtype}"], out[f"sum1-{dtype}"] = sums[0].numpy(), sums[1].numpy()
    out[f"norms-{dtype}"] = norms.numpy()
    a, b = (torch.randn(16, 9, w, generator=gen, dtype=dtype) for w in (40, 30))
    ghost = torch.zeros(16, dtype=torch.float64)
    ops.ghost_norms(ghost, outer=[[(a, b)]])
    out[f"ghost-{dtype}"] = ghost.numpy()
np.savez(sys.argv[1], **out)
"""

ISAS = ("baseline", "avx2", "avx512")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    results = {}
    for isa in ISAS:
        path = tmp_path_factory.mktemp(isa) / "out.npz"
        env = dict(os.environ, DPVR_CPU_ISA=isa)
        subprocess.run([sys.executable, "-c", SCRIPT, str(path)], check=True, env=env)
        with np.load(path) as data:
            results[isa] = {k: data[k] for k in data.files}
    return results


def test_each_copy_runs_where_the_cpu_has_it(outputs):
    ran = [str(outputs[isa]["isa"]) for isa in ISAS]
    assert ran[0] == "baseline" and ran[1] in ("baseline", "avx2") and ran[2] in ran[1:] + ["avx512"]
    assert _C.cpu_instruction_set() == ran[2]  # unset, the best copy the CPU has


def test_the_noise_is_the_same_bits_on_every_copy(outputs):
    for key in outputs["baseline"]:
        if key.startswith("noise"):
            for isa in ISAS[1:]:
                np.testing.assert_array_equal(outputs[isa][key], outputs["baseline"][key],
                                              err_msg=f"{isa} {key}")


def test_clipped_sums_and_norms_agree_to_rounding(outputs):
    for key in outputs["baseline"]:
        if key.startswith(("sum", "norms", "ghost")):
            reference = outputs["baseline"][key]
            rtol = 1e-5 if "float32" in key else 1e-12
            for isa in ISAS[1:]:
                np.testing.assert_allclose(outputs[isa][key], reference, rtol=rtol, atol=rtol,
                                           err_msg=f"{isa} {key}")
