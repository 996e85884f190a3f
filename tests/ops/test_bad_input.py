"""Bad input raises a clear exception naming the problem; it never crashes the interpreter.

The cases run in a child interpreter, so a crash in native code fails this test instead of killing pytest.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpvr
from dpvr.algorithms import DPSGD
from dpvr.optim.gradients import ClippedGradients, check_loss

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
        ("lazy negation", TypeError, "resolve_conj", lambda: dpvr.clip_accumulate([torch.ones(4, 3)._neg_view()], 1.0, [torch.zeros(3)])),
        ("torch out strided", ValueError, "out[0]: must be contiguous", lambda: dpvr.clip_accumulate([torch.ones(4, 3)], 1.0, [torch.zeros(6)[::2]])),
        ("torch out size", ValueError, "expected 3 elements, got 4", lambda: dpvr.clip_accumulate([torch.ones(4, 3)], 1.0, [torch.zeros(4)])),
        ("torch params strided", ValueError, "params[0]: must be contiguous", lambda: dpvr.noisy_update([torch.zeros(3)], sigma=0.0, generator=gen, stream="a", params=[torch.zeros(3, 2).t()[0]])),
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
        ("ghost bounds shape", ValueError, "outer_bounds",
         lambda: ops.ghost_norms(sq, outer=[[(g[0], g[1])]], outer_bounds=np.zeros((2, 4)))),
        ("ghost bounds dtype", TypeError, "outer_bounds",
         lambda: ops.ghost_norms(sq, outer=[[(g[0], g[1])]], outer_bounds=np.zeros((1, 4), np.float32))),
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
        ("ghost cuda", ValueError, "device", lambda: dpvr.ops.ghost._C.ghost_norms(0, 0, 4, [], [], [], 1, 0)),
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


@pytest.mark.slow  # robustness, not privacy: a child interpreter (seconds to import torch)
def test_bad_input_raises_clear_errors_without_crashing():
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", CASES], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, (
        f"child interpreter died (code {result.returncode}):\n{result.stderr[-2000:]}"
    )
    assert result.stdout.startswith("ok"), result.stdout


# ---- Python-level checks: the per-sample loss, non-finite releases, client processes ----


def cross_entropy(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def squared(output, target):
    return 0.5 * (output.squeeze(-1) - target) ** 2


class Apply(nn.Module):
    """A layer that applies a function it holds (a lambda makes the model unpicklable by plain pickle)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize(
    ("model", "loss_fn", "targets", "got"),
    [
        # a criterion without reduction keeps the output's dimension
        (nn.Linear(3, 2), nn.MSELoss(reduction="none"), torch.randn(4, 2), "of shape (2,)"),
        # a (1,) output against a 0-d target broadcasts to (1,)
        (nn.Linear(3, 1), lambda o, t: (o - t) ** 2, torch.randn(4), "of shape (1,)"),
        # a criterion that insists on matching shapes
        (nn.Linear(3, 1), F.binary_cross_entropy_with_logits, torch.rand(4), "raised ValueError"),
        (nn.Linear(3, 2), lambda o, t: 1.0, torch.zeros(4, dtype=torch.long), "got float"),
        (nn.Linear(3, 2), lambda o, t: (o.argmax() == t).long(), torch.zeros(4, dtype=torch.long),
         "torch.int64 tensor of shape ()"),
    ],
    ids=["reduction-none", "broadcast", "batched-criterion", "python-float", "integer"],
)
def test_check_loss_names_loss_fn_and_the_fix(model, loss_fn, targets, got):
    with pytest.raises(ValueError) as caught:
        check_loss(model, loss_fn, torch.randn(4, 3), targets)
    message = str(caught.value)
    assert message.startswith("loss_fn: ")
    assert got in message
    assert f"output shape ({model.out_features},), target shape {tuple(targets.shape[1:])}" in message
    assert "without its batch dimension" in message
    assert "lambda o, t: criterion(o[None], t[None])" in message


def test_check_loss_accepts_per_sample_losses_and_refuses_no_data():
    x = torch.randn(4, 3)
    check_loss(nn.Linear(3, 2), cross_entropy, x, torch.randint(0, 2, (4,)))
    check_loss(nn.Linear(3, 1), squared, x, torch.randn(4))
    check_loss(nn.Linear(3, 2), nn.CrossEntropyLoss(), x, torch.randint(0, 2, (4,)))  # one sample: a scalar
    with pytest.raises(ValueError, match="no record"):
        check_loss(nn.Linear(3, 1), squared, x[:0], torch.randn(0))
    with pytest.raises(TypeError, match="loss_fn: expected a callable"):
        check_loss(nn.Linear(3, 1), "mse", x, torch.randn(4))


@pytest.mark.parametrize("mode", ["ghost", "materialised"])
def test_a_sum_of_only_nonfinite_samples_warns_once(mode):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    gradients = ClippedGradients(model, cross_entropy, mode=mode)
    out = [torch.zeros(p.numel()) for p in model.parameters()]
    point = [p.detach() for p in model.parameters()]
    previous = [p + 0.1 for p in point]
    partly, nan = x.clone(), torch.full_like(x, float("nan"))
    partly[1] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gradients.sum(partly, y, 1.0, out) == 1  # counted, no warning: the others still count
    with pytest.warns(RuntimeWarning, match=r"all 4 samples .* dropped \(nonfinite='zero'.* noise alone"):
        assert gradients.sum(nan, y, 1.0, out) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per instance
        assert gradients.sum(nan, y, 1.0, out) == 4
        assert gradients.diff_sum(nan, y, point, previous, 1.0, out) == 4
    with pytest.warns(RuntimeWarning, match="all 4 samples"):
        ClippedGradients(model, cross_entropy, mode=mode).diff_sum(nan, y, point, previous, 1.0, out)
    assert all(bool(torch.isfinite(o).all()) for o in out)  # dropped samples add nothing


def test_an_algorithm_on_all_nan_data_warns_once():
    x, y = torch.full((12, 3), float("nan")), torch.randint(0, 2, (12,))
    alg = DPSGD(nn.Linear(3, 2), cross_entropy, x, y, lr=0.1, clip=1.0, steps=3, batch_size=6,
                sampling="wor", noise=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = alg.run(progress=False)
    assert [info["nonfinite"] for info in infos] == [6, 6, 6]
    found = [w for w in caught if issubclass(w.category, RuntimeWarning) and "non-finite" in str(w.message)]
    assert len(found) == 1


@pytest.mark.slow  # starts client processes
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_client_pool_sends_lambdas_with_cloudpickle_or_names_the_fix(monkeypatch):
    pytest.importorskip("cloudpickle")  # in the test extra: the path users who have it take
    from dpvr import PaperSigmas
    from dpvr.algorithms import DIFF2
    from dpvr.distributed import ClientPool
    from dpvr.ops import torch_threads
    from dpvr.optim import RuntimeConfig

    def model_fn(activation):
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(5, 4), Apply(activation), nn.Linear(4, 1)).double()

    loss = lambda output, target: 0.5 * (output.squeeze() - target) ** 2  # noqa: E731
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 5, generator=g, dtype=torch.float64)
    y = torch.randn(20, generator=g, dtype=torch.float64)
    shards = [(x[:10], y[:10]), (x[10:], y[10:])]
    options = dict(lr=0.2, steps=3, restart=2, clip={"restart": 0.5, "difference": 1.0},
                   noise=PaperSigmas(restart=0.01, difference=0.02))

    def run(clients, model):
        runtime = RuntimeConfig(generator=dpvr.NoiseGenerator(7, reproducible=True), sampler_seed=3)
        DIFF2(model, loss, clients, **options, runtime=runtime).run(progress=False)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    with ClientPool(2) as pool:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "cloudpickle", None)  # `import cloudpickle` now fails
            lambda_loss = r"^loss_fn: a lambda cannot be sent to client processes .*at module level or install"
            with pytest.raises(TypeError, match=lambda_loss), pool.connect(model_fn(torch.tanh), loss, shards):
                pass
            lambda_model = r"^model: 'Sequential' cannot be sent .*<lambda>.*install cloudpickle$"
            with pytest.raises(TypeError, match=lambda_model), pool.connect(
                model_fn(lambda h: torch.tanh(h)), squared, shards
            ):
                pass
        assert pool.broken is None  # refused before anything was sent
        model = model_fn(lambda h: torch.tanh(h))
        with torch_threads(1), pool.connect(model, loss, shards) as clients:
            remote = run(clients, model)
    assert pool.reports == {1: "ok", 2: "ok"}
    with torch_threads(1):
        assert torch.equal(remote, run(shards, model_fn(lambda h: torch.tanh(h))))
