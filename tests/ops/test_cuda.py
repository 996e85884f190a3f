"""The CUDA backend against the CPU backend on identical inputs.

Every test needs a CUDA device and a CUDA build of dpvr and is skipped otherwise (``pytest -m gpu`` selects
them). float64 results must agree with the CPU up to summation order, float32 within 1e-5 relative; Philox
words and Gaussians are identical.
"""

import math

import numpy as np
import pytest

import dpvr
from dpvr import _C
from dpvr.ops import NoiseGenerator

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (dpvr.backends()["cuda_available"] and torch.cuda.is_available()),
        reason="needs a CUDA device and a CUDA build of dpvr",
    ),
]

DTYPES = [torch.float32, torch.float64]
SHAPES = {
    "d1": [(1,)],
    "small": [(3, 4), (5,)],
    "mlp": [(784, 16), (16,), (16, 8), (8,)],
    "k50": [(2, 3, 4)] * 50,  # more tensors than the small parameter table holds
    "k500": [(3,)] * 250 + [(0,)] + [(2,)] * 249,  # more than one launch per pass, one empty tensor
    "wide": [(1 << 19,)],  # enough columns that the accumulation pass does not slice the samples
}


def tol(dtype, scale=1.0):
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    return dict(rtol=rel, atol=rel * scale, equal_nan=True)


def assert_matches(gpu, cpu, dtype, scale=None):
    """GPU tensors (or list) against CPU tensors (or list), with an absolute floor relative to `scale`."""
    gpu = [gpu] if isinstance(gpu, torch.Tensor) else list(gpu)
    cpu = [cpu] if isinstance(cpu, torch.Tensor) else list(cpu)
    assert len(gpu) == len(cpu)
    if scale is None:
        finite = [c[torch.isfinite(c)].abs().max().item() for c in cpu if torch.isfinite(c).any()]
        scale = max(finite, default=1.0)
    for g, c in zip(gpu, cpu):
        np.testing.assert_allclose(g.cpu().numpy(), c.numpy(), **tol(dtype, scale))


def make(batch, shapes, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, *s, generator=gen, dtype=dtype) * scale for s in shapes]


def zeros_like_params(grads, device="cpu"):
    return [torch.zeros(g.shape[1:], dtype=g.dtype, device=device) for g in grads]


def to_gpu(tensors):
    return [t.cuda() for t in tensors]


def run_clip(grads, clip, *, form, batch, seed, device):
    """One clip-accumulate call of the given form on `device`; returns (out, norms, count)."""
    dtype = grads[0].dtype
    gen = torch.Generator().manual_seed(seed + 1)
    weights = (torch.rand(batch, generator=gen, dtype=dtype) * 4 - 2).to(device)
    a = (torch.rand(batch, generator=gen, dtype=dtype) * 2).to(device)
    b = (torch.rand(batch, generator=gen, dtype=dtype) * 2).to(device)
    g = [x.to(device) for x in grads]
    h = [x.to(device) for x in make(batch, [x.shape[1:] for x in grads], dtype, seed=seed + 2)]
    out = zeros_like_params(g, device)
    norms = torch.zeros(batch, dtype=dtype, device=device)
    if form == "plain":
        count = dpvr.clip_accumulate(g, clip, out, norms=norms)
    elif form == "weighted":
        count = dpvr.clip_accumulate(g, clip, out, weights=weights, norms=norms)
    elif form == "diff":
        count = dpvr.clip_accumulate_diff(g, h, clip, out, a=a, b=b, norms=norms)
    else:
        count = dpvr.clip_accumulate_diff(g, h, clip, out, norms=norms)
    return (
        [o.cpu() for o in out],
        norms.cpu(),
        int(count.item() if isinstance(count, torch.Tensor) else count),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64, 300])
@pytest.mark.parametrize("form", ["plain", "weighted", "diff", "diff-unit"])
def test_clip_accumulate_matches_cpu(dtype, shapes, batch, form):
    if shapes is SHAPES["wide"] and batch > 7:
        pytest.skip("the wide case runs with small batches only")
    grads = make(batch, shapes, dtype, seed=batch)
    clip = math.sqrt(
        sum(math.prod(s) for s in shapes)
    )  # about the typical norm: some samples clipped, some not
    out_c, norms_c, count_c = run_clip(grads, clip, form=form, batch=batch, seed=batch, device="cpu")
    out_g, norms_g, count_g = run_clip(grads, clip, form=form, batch=batch, seed=batch, device="cuda")
    assert count_c == count_g == 0
    assert_matches(out_g, out_c, dtype, scale=clip)
    assert_matches(norms_g, norms_c, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_layouts(dtype):
    base = torch.randn(40, 12, 10, dtype=dtype)
    column_major = torch.randn(9, 40, dtype=dtype).t()  # row stride 1, column stride 40
    every_other = base[:, :, ::2]  # strided columns
    row_slice = torch.randn(40, 50, dtype=dtype)[:, 5:30]  # row stride 50
    transposed = base.transpose(1, 2)  # not collapsible: the ops layer copies it
    grads = [column_major, every_other, row_slice, transposed]
    for clip in (0.3, 1e3):
        out_c = zeros_like_params(grads)
        out_g = zeros_like_params(grads, "cuda")
        # The GPU tensors keep the same strides as the CPU ones.
        gpu = [torch.empty_strided(g.shape, g.stride(), dtype=dtype, device="cuda").copy_(g) for g in grads]
        dpvr.clip_accumulate(grads, clip, out_c)
        dpvr.clip_accumulate(gpu, clip, out_g)
        assert_matches(out_g, out_c, dtype, scale=clip)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    big = 1e200 if dtype == torch.float64 else 1e30
    g = [torch.zeros(8, 5, dtype=dtype), torch.zeros(8, 2, dtype=dtype)]
    g[0][1] = big  # float64: the sum of squares overflows inside one tile -> rescued
    g[1][2, 1] = 1e30
    g[0][3, 2] = float("nan")
    g[1][4, 0] = float("inf")
    g[0][5] = torch.randn(5, dtype=dtype)  # rows 0, 6, 7 stay exactly zero
    w = torch.ones(8, dtype=dtype)
    w[6] = float("nan")
    results = []
    for device in ("cpu", "cuda"):
        gd = [x.to(device) for x in g]
        out, norms = zeros_like_params(gd, device), torch.zeros(8, dtype=dtype, device=device)
        count = dpvr.clip_accumulate(gd, 1.0, out, weights=w.to(device), norms=norms)
        results.append(
            ([o.cpu() for o in out], norms.cpu(), int(count.item() if device == "cuda" else count))
        )
    (out_c, norms_c, count_c), (out_g, norms_g, count_g) = results
    assert count_c == count_g == 3
    assert torch.isnan(norms_g[[3, 4, 6]]).all()
    assert_matches(out_g, out_c, dtype, scale=1.0)
    assert_matches(norms_g, norms_c, dtype)


def test_float64_overflow_across_tiles():
    """Each tile's sum of squares is finite but the sample's total overflows: the norm is still exact."""
    g = torch.full((2, 20000), 2e152, dtype=torch.float64)
    g[1] = 1.0
    norms_c, norms_g = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64, device="cuda")
    out_c, out_g = (
        torch.zeros(20000, dtype=torch.float64),
        torch.zeros(20000, dtype=torch.float64, device="cuda"),
    )
    dpvr.clip_accumulate([g], 1.0, [out_c], norms=norms_c)
    dpvr.clip_accumulate([g.cuda()], 1.0, [out_g], norms=norms_g)
    assert norms_g[0].item() == pytest.approx(2e152 * math.sqrt(20000), rel=1e-12)
    assert_matches(norms_g, norms_c, torch.float64)
    assert_matches(out_g, out_c, torch.float64, scale=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clipped_norm_never_exceeds_clip(dtype):
    for seed, log_scale in enumerate((-20, 0, 5, 30)):
        g = make(1, [(300,), (7, 11)], dtype, seed=seed, scale=10.0**log_scale)
        h = make(1, [(300,), (7, 11)], dtype, seed=seed + 100, scale=10.0**log_scale)
        for clip in (1e-3, 1.0, 7.5):
            out = zeros_like_params(g, "cuda")
            dpvr.clip_accumulate(to_gpu(g), clip, out)
            flat = torch.cat([o.flatten() for o in out]).double().cpu().numpy()
            assert math.sqrt(math.fsum(flat * flat)) <= clip
            out = zeros_like_params(g, "cuda")
            dpvr.clip_accumulate_diff(to_gpu(g), to_gpu(h), clip, out)
            flat = torch.cat([o.flatten() for o in out]).double().cpu().numpy()
            assert math.sqrt(math.fsum(flat * flat)) <= clip


def test_raise_policy_writes_nothing():
    g = make(6, [(5,), (2,)], torch.float64)
    g[0][2, 1] = float("nan")
    gpu = to_gpu(g)
    out = [torch.full((n,), 7.0, dtype=torch.float64, device="cuda") for n in (5, 2)]
    norms = torch.full((6,), 7.0, dtype=torch.float64, device="cuda")
    with pytest.raises(FloatingPointError, match="1 sample"):
        dpvr.clip_accumulate(gpu, 1.0, out, norms=norms, nonfinite="raise")
    assert all((o == 7.0).all() for o in out) and (norms == 7.0).all()
    clean = to_gpu(make(6, [(5,), (2,)], torch.float64, seed=3))
    out_c, norms_c = zeros_like_params(clean), torch.zeros(6, dtype=torch.float64)
    dpvr.clip_accumulate([c.cpu() for c in clean], 1.0, out_c, norms=norms_c, nonfinite="raise")
    out, norms = zeros_like_params(clean, "cuda"), torch.zeros(6, dtype=torch.float64, device="cuda")
    assert dpvr.clip_accumulate(clean, 1.0, out, norms=norms, nonfinite="raise").item() == 0
    assert_matches(out, out_c, torch.float64)
    assert_matches(norms, norms_c, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_sample_norms(dtype):
    g, h = make(33, [(40, 3), (7,)], dtype), make(33, [(40, 3), (7,)], dtype, seed=5)
    w = torch.rand(33, dtype=dtype)
    for kwargs in ({}, {"weights": w}, {"grads_prev": h}, {"grads_prev": h, "weights": w, "b": w.flip(0)}):
        norms_c = torch.zeros(33, dtype=dtype)
        norms_g = torch.zeros(33, dtype=dtype, device="cuda")
        dpvr.per_sample_norms(g, norms_c, **kwargs)
        gpu_kwargs = {k: to_gpu(v) if isinstance(v, list) else v.cuda() for k, v in kwargs.items()}
        dpvr.per_sample_norms(to_gpu(g), norms_g, **gpu_kwargs)
        assert_matches(norms_g, norms_c, dtype)


# ---- noise and the estimator update ----

UPDATE_SHAPES = {
    "odd": [(3,), (5,), (1,), (7, 3)],  # Gaussian pairs straddle tensors
    "k500": [(3,)] * 300 + [(0,)] + [(1,)] * 199,
    "large": [(100003,), (7,)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", list(UPDATE_SHAPES.values()), ids=list(UPDATE_SHAPES))
@pytest.mark.parametrize("options", ["noise", "sum", "reset-step", "full", "no-noise-step"])
def test_noisy_update_matches_cpu(dtype, shapes, options):
    gen = torch.Generator().manual_seed(11)
    state = {
        name: [torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for name in ("v", "s", "x", "p")
    }
    kwargs = dict(sigma=0.7, scale=0.25, lr=0.1)
    if options == "noise":
        kwargs = dict(sigma=1.3)
    elif options == "sum":
        kwargs.update(use=("s",))
    elif options == "reset-step":
        kwargs.update(reset=True, use=("s", "x"))
    elif options == "full":
        kwargs.update(use=("s", "x", "p"))
    else:
        kwargs.update(sigma=0.0, use=("s", "x", "p"))
    results = []
    for device in ("cpu", "cuda"):
        t = {name: [x.clone().to(device) for x in xs] for name, xs in state.items()}
        use = kwargs.get("use", ())
        norm = dpvr.noisy_update(
            t["v"],
            generator=NoiseGenerator(seed=2**64 - 5, reproducible=True),
            stream="update",
            sigma=kwargs["sigma"],
            sum=t["s"] if "s" in use else None,
            scale=kwargs.get("scale", 1.0),
            reset=kwargs.get("reset", False),
            params=t["x"] if "x" in use else None,
            params_prev=t["p"] if "p" in use else None,
            lr=kwargs.get("lr", 0.0),
        )
        norm = None if norm is None else float(norm.item() if isinstance(norm, torch.Tensor) else norm)
        results.append(({k: [x.cpu() for x in v] for k, v in t.items()}, norm))
    (cpu, norm_c), (gpu, norm_g) = results
    for name in ("v", "x", "p"):
        assert_matches(gpu[name], cpu[name], dtype)
    if norm_c is None:
        assert norm_g is None
    else:
        assert norm_g == pytest.approx(norm_c, rel=1e-5 if dtype == torch.float32 else 1e-12)


def test_philox_words_identical():
    for seed, stream, step in ((0, 0, 0), (2**64 - 1, 7, 11), (0x0123456789ABCDEF, 2**32 - 1, 2**32 - 1)):
        n = 10007
        host = dpvr.ops.philox_words(n, seed, stream, step)
        dev = torch.zeros(4 * n, dtype=torch.int32, device="cuda")
        _C.philox_words(0, dev.data_ptr(), n, seed, stream, step, torch.cuda.current_stream().cuda_stream)
        np.testing.assert_array_equal(dev.cpu().numpy().view(np.uint32), host)


def test_gaussians_bit_identical():
    """float64 noise is the CPU's bit for bit, float32 noise the float64 noise rounded (one transform, no
    fused operations on either backend)."""
    n = 1_000_003
    z_c, z_g = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64, device="cuda")
    dpvr.add_noise(z_c, 1.0, generator=NoiseGenerator(seed=99, reproducible=True), stream="z")
    dpvr.add_noise(z_g, 1.0, generator=NoiseGenerator(seed=99, reproducible=True), stream="z")
    np.testing.assert_array_equal(z_g.cpu().numpy(), z_c.numpy())
    z32 = torch.zeros(n, dtype=torch.float32, device="cuda")
    dpvr.add_noise(z32, 1.0, generator=NoiseGenerator(seed=99, reproducible=True), stream="z")
    np.testing.assert_array_equal(z32.cpu().numpy(), z_c.numpy().astype(np.float32))


# ---- streams, devices, graphs ----


def test_work_is_queued_on_the_callers_stream():
    """The kernel must run after the work queued before it on the caller's (non-default) stream."""
    src = torch.randn(64, 1 << 16, dtype=torch.float64, device="cuda")
    g = torch.zeros_like(src)
    out = torch.zeros(1 << 16, dtype=torch.float64, device="cuda")
    v = torch.zeros(1 << 16, dtype=torch.float64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(
            200_000_000
        )  # keeps the side stream busy; a kernel on another stream would overtake
        g.copy_(src)
        dpvr.clip_accumulate(g, 1.0, out)
        dpvr.noisy_update(
            v, generator=NoiseGenerator(seed=1, reproducible=True), stream="s", sigma=0.0, sum=out
        )
    side.synchronize()
    expected = zeros_like_params([src.cpu()])
    dpvr.clip_accumulate(src.cpu(), 1.0, expected)
    assert expected[0].abs().max() > 0
    assert_matches(out, expected[0], torch.float64)
    assert_matches(v, expected[0], torch.float64)


def test_wrong_and_mixed_devices_raise():
    g = torch.randn(4, 3, device="cuda")
    with pytest.raises(ValueError, match="out"):
        dpvr.clip_accumulate([g], 1.0, [torch.zeros(3)])
    with pytest.raises(ValueError, match="norms"):
        dpvr.clip_accumulate([g], 1.0, [torch.zeros(3, device="cuda")], norms=torch.zeros(4))
    # The native layer checks the pointers too: host memory handed to the CUDA path is refused by name.
    host = np.zeros((4, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=r"grads\[0\].*host memory"):
        _C.clip_accumulate(0, 0, 4, [(host.ctypes.data, 4, 3, 3, 1)], [], [], 0, 0, 0, 1.0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"v\[0\].*host memory"):
        _C.noisy_update(0, 0, [(host.ctypes.data, 12)], [], [], [], 1.0, 0.0, 0.0, False, 0, 0, 0, 0, 0)
    if torch.cuda.device_count() > 1:
        other = torch.zeros(3, device="cuda:1")
        with pytest.raises(ValueError, match="cuda:1"):
            dpvr.clip_accumulate([g], 1.0, [other])
        with pytest.raises(ValueError, match=r"out\[0\].*cuda:1"):
            _C.clip_accumulate(
                0, 0, 4, [(g.data_ptr(), 4, 3, 3, 1)], [], [(other.data_ptr(), 3)], 0, 0, 0, 1.0, 0, 0, 0
            )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_data_on_a_device_other_than_the_current_one():
    g = torch.randn(16, 10, device="cuda:1")
    out = torch.zeros(10, device="cuda:1")
    with torch.cuda.device(0):
        dpvr.clip_accumulate([g], 1.0, [out])
    expected = torch.zeros(10)
    dpvr.clip_accumulate([g.cpu()], 1.0, [expected])
    assert_matches(out, expected, torch.float32)


def test_cuda_graph_capture_replays_a_step():
    """clip-accumulate + noise-free update + parameter step captured in a CUDA graph and replayed; capturing a
    noisy update is refused, since every replay would add the same noise."""
    batch, shapes, clip, lr, sigma = 16, [(20, 10), (10,), (1, 10), (1,)], 1.0, 0.1, 0.0
    sizes = [math.prod(s) for s in shapes]
    grads = [torch.zeros(batch, *s, device="cuda") for s in shapes]
    flat = {name: torch.zeros(sum(sizes), device="cuda") for name in ("out", "v", "x", "p")}
    views = {name: list(torch.split(buf, sizes)) for name, buf in flat.items()}
    gen = NoiseGenerator(seed=5, reproducible=True)

    def step():
        flat["out"].zero_()
        dpvr.clip_accumulate(grads, clip, views["out"])
        return dpvr.noisy_update(
            views["v"],
            generator=gen,
            stream="g",
            sigma=sigma,
            sum=views["out"],
            scale=1 / batch,
            reset=True,
            params=views["x"],
            params_prev=views["p"],
            lr=lr,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up, as torch requires before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm = step()
    noisy = torch.cuda.CUDAGraph()
    with pytest.raises((ValueError, RuntimeError), match="graph"), torch.cuda.graph(noisy):
        dpvr.add_noise(views["v"], 1.0, generator=gen, stream="g")

    for seed in (1, 2):
        new = make(batch, shapes, torch.float32, seed=seed)
        x0 = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed))
        for dst, src in zip(grads, new):
            dst.copy_(src)
        flat["x"].copy_(x0)
        graph.replay()
        torch.cuda.synchronize()

        out_c, v_c, x_c, p_c = (torch.zeros(sum(sizes)) for _ in range(4))
        x_c.copy_(x0)
        dpvr.clip_accumulate(new, clip, list(torch.split(out_c, sizes)))
        norm_c = dpvr.noisy_update(
            v_c,
            generator=gen,
            stream="g",
            sigma=sigma,
            sum=out_c,
            scale=1 / batch,
            reset=True,
            params=x_c,
            params_prev=p_c,
            lr=lr,
        )
        assert_matches([flat["v"], flat["x"], flat["p"]], [v_c, x_c, p_c], torch.float32)
        assert norm.item() == pytest.approx(norm_c, rel=1e-5)


def test_cupy_arrays_zero_copy():
    cupy = pytest.importorskip("cupy")
    g = cupy.random.standard_normal((32, 17))
    out = cupy.zeros(17)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        count = dpvr.clip_accumulate(g, 0.5, out)
    stream.synchronize()
    expected = torch.zeros(17, dtype=torch.float64)
    dpvr.clip_accumulate(torch.from_numpy(cupy.asnumpy(g)), 0.5, expected)
    np.testing.assert_allclose(cupy.asnumpy(out), expected.numpy(), rtol=1e-12, atol=1e-12)
    assert int(count.get()[0]) == 0
