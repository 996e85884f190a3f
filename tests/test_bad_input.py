"""Bad input raises a clear exception naming the problem; it never crashes the interpreter.

The cases run in a child interpreter, so a crash in native code fails this test instead of killing pytest.
"""

import os
import subprocess
import sys
import textwrap

CASES = textwrap.dedent(
    r"""
    import numpy as np, torch, dpvr

    g = [np.ones((4, 3)), np.ones((4, 2))]
    out = [np.zeros(3), np.zeros(2)]
    gen = dpvr.NoiseGenerator(seed=0, reproducible=True)
    ro = np.zeros(3); ro.setflags(write=False)
    ops = dpvr.ops
    sq, keys = np.zeros(4), np.zeros((4, 2), np.int64)
    ro4 = np.zeros(4); ro4.setflags(write=False)
    cases = [
        ("clip zero", ValueError, "clip", lambda: dpvr.clip_accumulate(g, 0.0, out)),
        ("clip negative", ValueError, "clip", lambda: dpvr.clip_accumulate(g, -1.0, out)),
        ("clip nan", ValueError, "clip", lambda: dpvr.clip_accumulate(g, float("nan"), out)),
        ("clip inf", ValueError, "clip", lambda: dpvr.clip_accumulate(g, float("inf"), out)),
        ("empty batch", ValueError, "empty", lambda: dpvr.clip_accumulate([np.ones((0, 3))], 1.0, [np.zeros(3)])),
        ("no tensors", ValueError, "grads", lambda: dpvr.clip_accumulate([], 1.0, [])),
        ("int dtype", TypeError, "dtype", lambda: dpvr.clip_accumulate([np.ones((4, 3), int)], 1.0, [np.zeros(3)])),
        ("mixed dtype", TypeError, "out[0]", lambda: dpvr.clip_accumulate([np.ones((4, 3))], 1.0, [np.zeros(3, np.float32)])),
        ("out count", ValueError, "out", lambda: dpvr.clip_accumulate(g, 1.0, out[:1])),
        ("out size", ValueError, "out[1]", lambda: dpvr.clip_accumulate(g, 1.0, [np.zeros(3), np.zeros(5)])),
        ("out read-only", ValueError, "read-only", lambda: dpvr.clip_accumulate([g[0]], 1.0, [ro])),
        ("out strided", ValueError, "contiguous", lambda: dpvr.clip_accumulate([g[0]], 1.0, [np.zeros(6)[::2]])),
        ("batch mismatch", ValueError, "grads[1]", lambda: dpvr.clip_accumulate([np.ones((4, 3)), np.ones((5, 2))], 1.0, out)),
        ("weights shape", ValueError, "weights", lambda: dpvr.clip_accumulate(g, 1.0, out, weights=np.ones(3))),
        ("weights dtype", TypeError, "weights", lambda: dpvr.clip_accumulate(g, 1.0, out, weights=np.ones(4, np.float32))),
        ("norms shape", ValueError, "norms", lambda: dpvr.clip_accumulate(g, 1.0, out, norms=np.ones((4, 1)))),
        ("policy", ValueError, "nonfinite", lambda: dpvr.clip_accumulate(g, 1.0, out, nonfinite="ignore")),
        ("prev count", ValueError, "grads_prev", lambda: dpvr.clip_accumulate_diff(g, g[:1], 1.0, out)),
        ("prev shape", ValueError, "grads_prev[0]", lambda: dpvr.clip_accumulate_diff(g, [np.ones((4, 4)), g[1]], 1.0, out)),
        ("not an array", TypeError, "grads[0]", lambda: dpvr.clip_accumulate([[1.0, 2.0]], 1.0, out)),
        ("scalar grads", ValueError, "batch", lambda: dpvr.clip_accumulate([np.array(1.0)], 1.0, out)),
        ("meta tensor", TypeError, "grads[0]", lambda: dpvr.clip_accumulate([torch.ones(4, 3, device="meta")], 1.0, [torch.zeros(3)])),
        ("sparse tensor", TypeError, "grads[0]", lambda: dpvr.clip_accumulate([torch.ones(4, 3).to_sparse()], 1.0, [torch.zeros(3)])),
        ("sigma negative", ValueError, "sigma", lambda: dpvr.add_noise([np.zeros(3)], -1.0, generator=gen, stream="a")),
        ("sigma nan", ValueError, "sigma", lambda: dpvr.add_noise([np.zeros(3)], float("nan"), generator=gen, stream="a")),
        ("lr inf", ValueError, "lr", lambda: dpvr.noisy_update([np.zeros(3)], sigma=0.0, generator=gen, stream="a", params=[np.zeros(3)], lr=float("inf"))),
        ("params size", ValueError, "params[0]", lambda: dpvr.noisy_update([np.zeros(3)], sigma=0.0, generator=gen, stream="a", params=[np.zeros(4)])),
        ("prev without params", ValueError, "params_prev", lambda: dpvr.noisy_update([np.zeros(3)], sigma=0.0, generator=gen, stream="a", params_prev=[np.zeros(3)])),
        ("generator", TypeError, "generator", lambda: dpvr.add_noise([np.zeros(3)], 1.0, generator=1, stream="a")),
        ("seed range", ValueError, "seed", lambda: dpvr.NoiseGenerator(seed=-1, reproducible=True)),
        ("cuda absent", ValueError, "CUDA", lambda: dpvr.ops.kernels._C.clip_accumulate(0, 0, 1, [(1, 1, 1, 1, 1)], [], [], 0, 0, 0, 1.0, 0, 0, 0)),
        ("ghost norms_sq dtype", TypeError, "norms_sq", lambda: ops.ghost_norms(np.zeros(4, np.float32), dense=[g[0]])),
        ("ghost norms_sq read-only", ValueError, "read-only", lambda: ops.ghost_norms(ro4, dense=[g[0]])),
        ("ghost empty batch", ValueError, "empty", lambda: ops.ghost_norms(np.zeros(0), dense=[np.ones((0, 3))])),
        ("ghost form", ValueError, "form", lambda: ops.ghost_norms(sq, outer=[[(g[0], g[1])]], form="fast")),
        ("ghost not pieces", TypeError, "outer[0]", lambda: ops.ghost_norms(sq, outer=[g])),
        ("ghost piece batch", ValueError, "outer[0][0].activations", lambda: ops.ghost_norms(sq, outer=[[(np.ones((5, 3)), g[1])]])),
        ("ghost piece rank", ValueError, "outer[0][0].grads", lambda: ops.ghost_norms(sq, outer=[[(g[0], np.ones((4, 1, 1, 2)))]])),
        ("ghost piece width", ValueError, "outer[0][1].activations", lambda: ops.ghost_norms(sq, outer=[[(g[0], g[1]), (g[1], g[1])]])),
        ("ghost piece steps", ValueError, "outer[0][0]", lambda: ops.ghost_norms(sq, outer=[[(np.ones((4, 2, 3)), np.ones((4, 3, 2)))]])),
        ("ghost mixed dtype", TypeError, "outer[0][0].grads", lambda: ops.ghost_norms(sq, outer=[[(g[0], g[1].astype(np.float32))]])),
        ("ghost index term", TypeError, "index[0]", lambda: ops.ghost_norms(sq, index=[[(keys, np.ones((4, 2, 3)))]])),
        ("ghost index dtype", TypeError, "index[0][0].indices", lambda: ops.ghost_norms(sq, index=[ops.IndexTerm([(keys.astype(float), np.ones((4, 2, 3)))])])),
        ("ghost index steps", ValueError, "index[0][0]", lambda: ops.ghost_norms(sq, index=[ops.IndexTerm([(keys, np.ones((4, 3, 3)))])])),
        ("ghost dense batch", ValueError, "dense[0]", lambda: ops.ghost_norms(sq, dense=[np.ones((5, 3))])),
        ("ghost cuda", ValueError, "device", lambda: dpvr.ops.ghost._C.ghost_norms(0, 0, 4, [], [], [], 1)),
        ("factors clip", ValueError, "clip", lambda: ops.clip_factors(sq, 0.0, np.zeros(4), columns=3)),
        ("factors columns", ValueError, "columns", lambda: ops.clip_factors(sq, 1.0, np.zeros(4), columns=-1)),
        ("factors shape", ValueError, "factors", lambda: ops.clip_factors(sq, 1.0, np.zeros(3), columns=3)),
        ("factors dtype", TypeError, "factors", lambda: ops.clip_factors(sq, 1.0, np.zeros(4, int), columns=3)),
        ("factors weights", TypeError, "weights", lambda: ops.clip_factors(sq, 1.0, np.zeros(4), columns=3, weights=np.ones(4, np.float32))),
        ("factors norms_sq", TypeError, "norms_sq", lambda: ops.clip_factors(np.ones(4, np.float32), 1.0, np.zeros(4), columns=3)),
        ("factors policy", ValueError, "nonfinite", lambda: ops.clip_factors(sq, 1.0, np.zeros(4), columns=3, nonfinite="skip")),
    ]
    failures = []
    for name, exc, fragment, call in cases:
        try:
            call()
        except exc as err:
            if fragment.lower() not in str(err).lower():
                failures.append(f"{name}: message {err!s} lacks {fragment!r}")
        except Exception as err:
            failures.append(f"{name}: raised {type(err).__name__}: {err}")
        else:
            failures.append(f"{name}: did not raise")
    print("\n".join(failures) if failures else f"ok {len(cases)}")
    """
)


def test_bad_input_raises_clear_errors_without_crashing():
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", CASES], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, (
        f"child interpreter died (code {result.returncode}):\n{result.stderr[-2000:]}"
    )
    assert result.stdout.startswith("ok"), result.stdout
