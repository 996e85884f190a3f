"""The fused CPU kernels against float64 references."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dpvr
from reference import clip_accumulate as ref_clip

SHAPES = [
    [(1,)],  # d = 1
    [(3, 4), (5,)],
    [(784, 16), (16,), (16, 8), (8,)],
    [(2, 3, 4)] * 50,  # K = 50 tensors
]


def make(rng, batch, shapes, dtype, scale=1.0):
    return [(rng.normal(size=(batch, *s)) * scale).astype(dtype) for s in shapes]


def zeros_like_params(grads):
    return [np.zeros(int(np.prod(g.shape[1:])), dtype=g.dtype) for g in grads]


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 2, 9, 300])
@pytest.mark.parametrize("shapes", SHAPES, ids=["d1", "small", "mlp", "k50"])
def test_clip_accumulate_matches_reference(rng, dtype, batch, shapes):
    grads = make(rng, batch, shapes, dtype, scale=rng.uniform(0.01, 3))
    clip = 1.5
    out, norms = zeros_like_params(grads), np.zeros(batch, dtype)
    assert dpvr.clip_accumulate(grads, clip, out, norms=norms) == 0
    expected, expected_norms = ref_clip(grads, clip)
    for o, e in zip(out, expected):
        np.testing.assert_allclose(o, e, **tol(dtype))
    np.testing.assert_allclose(norms, expected_norms, **tol(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 64, 700])
def test_weighted_and_difference_forms(rng, dtype, batch):
    shapes = [(20, 30), (30,), (1,)]
    g, h = make(rng, batch, shapes, dtype), make(rng, batch, shapes, dtype)
    w = rng.uniform(-2, 2, batch).astype(dtype)
    a, b = rng.uniform(0, 2, batch).astype(dtype), rng.uniform(0, 2, batch).astype(dtype)

    out, norms = zeros_like_params(g), np.zeros(batch, dtype)
    dpvr.clip_accumulate(g, 0.7, out, weights=w, norms=norms)
    expected, expected_norms = ref_clip(g, 0.7, weights=w)
    for o, e in zip(out, expected):
        np.testing.assert_allclose(o, e, **tol(dtype))
    np.testing.assert_allclose(norms, expected_norms, **tol(dtype))

    out, norms = zeros_like_params(g), np.zeros(batch, dtype)
    dpvr.clip_accumulate_diff(g, h, 0.7, out, a=a, b=b, norms=norms)
    expected, expected_norms = ref_clip(g, 0.7, grads_prev=h, a=a, b=b)
    for o, e in zip(out, expected):
        np.testing.assert_allclose(o, e, **tol(dtype))
    np.testing.assert_allclose(norms, expected_norms, **tol(dtype))


def test_accumulates_into_existing_output(rng):
    g = make(rng, 10, [(6,)], np.float64)
    out = [np.full(6, 2.0)]
    dpvr.clip_accumulate(g, 1.0, out)
    np.testing.assert_allclose(out[0], 2.0 + ref_clip(g, 1.0)[0][0], rtol=1e-12)


def test_difference_at_identical_points_is_exactly_zero(rng):
    g = make(rng, 33, [(40, 3), (7,)], np.float32)
    out, norms = zeros_like_params(g), np.ones(33, np.float32)
    dpvr.clip_accumulate_diff(g, [x.copy() for x in g], 1.0, out, norms=norms)
    assert all((o == 0).all() for o in out) and (norms == 0).all()


def test_zero_gradients_and_huge_norms(rng):
    g = [np.zeros((4, 5)), np.zeros((4, 2))]
    g[0][1] = 1e200  # the float64 sum of squares overflows: the kernel must rescale, not drop the sample
    g[1][2, 1] = 1e30
    out, norms = zeros_like_params(g), np.zeros(4)
    assert dpvr.clip_accumulate(g, 1.0, out, norms=norms) == 0
    np.testing.assert_allclose(norms, [0, math.sqrt(5) * 1e200, 1e30, 0], rtol=1e-12)
    np.testing.assert_allclose(out[0], np.full(5, 1 / math.sqrt(5)), rtol=1e-12)
    np.testing.assert_allclose(out[1], [0, 1.0], rtol=1e-12)

    g32 = [np.full((2, 1000), 3e37, np.float32)]  # squares overflow float32 but not the double accumulator
    out32 = zeros_like_params(g32)
    dpvr.clip_accumulate(g32, 2.0, out32)
    np.testing.assert_allclose(np.linalg.norm(out32[0].astype(np.float64)), 4.0, rtol=1e-5)


def exact_norm(x):
    x = np.asarray(x, dtype=np.float64).ravel()
    return math.sqrt(math.fsum(x * x))


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    widths=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    log_scale=st.floats(-30, 30),
    log_clip=st.floats(-6, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_clipped_norm_never_exceeds_clip_after_rounding(dtype, widths, log_scale, log_clip, seed):
    rng = np.random.default_rng(seed)
    g = [(rng.standard_normal((1, w)) * 10.0**log_scale).astype(dtype) for w in widths]
    clip = 10.0**log_clip
    out = zeros_like_params(g)
    dpvr.clip_accumulate(g, clip, out)
    assert exact_norm(np.concatenate(out)) <= clip
    h = [(rng.standard_normal((1, w)) * 10.0**log_scale).astype(dtype) for w in widths]
    out = zeros_like_params(g)
    dpvr.clip_accumulate_diff(g, h, clip, out)
    assert exact_norm(np.concatenate(out)) <= clip


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 40),
    widths=st.lists(st.integers(1, 50), min_size=1, max_size=5),
    clip=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_matches_reference(batch, widths, clip, seed):
    rng = np.random.default_rng(seed)
    g = [rng.standard_normal((batch, w)) * rng.uniform(0.1, 10) for w in widths]
    out, norms = zeros_like_params(g), np.zeros(batch)
    dpvr.clip_accumulate(g, clip, out, norms=norms)
    expected, expected_norms = ref_clip(g, clip)
    for o, e in zip(out, expected):
        np.testing.assert_allclose(o, e, rtol=1e-10, atol=1e-12 * clip * batch)
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-12)


def test_non_contiguous_torch_and_numpy_inputs(rng):
    base = rng.standard_normal((12, 6, 10))
    transposed = np.swapaxes(base, 1, 2)  # per-sample block not collapsible -> copied
    every_other = base[::2, :, ::2]  # strided rows and columns -> strided view, no copy
    column_major = np.asfortranarray(rng.standard_normal((12, 9)))
    for g in (transposed, every_other, column_major):
        batch = g.shape[0]
        for framework in ("numpy", "torch"):
            arr = torch.from_numpy(g) if framework == "torch" else g
            out = np.zeros(int(np.prod(g.shape[1:])))
            dpvr.clip_accumulate([arr], 0.5, [out])
            np.testing.assert_allclose(out, ref_clip([np.ascontiguousarray(g)], 0.5)[0][0], rtol=1e-12)
            assert batch == g.shape[0]


def test_torch_tensors_in_place(rng):
    g = [torch.randn(50, 8, 3), torch.randn(50, 3)]
    out = [torch.zeros(8, 3), torch.zeros(3)]
    dpvr.clip_accumulate(g, 1.0, out)
    expected, _ = ref_clip([x.numpy() for x in g], 1.0)
    torch.testing.assert_close(
        torch.cat([o.flatten() for o in out]).double(),
        torch.from_numpy(np.concatenate(expected)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_nonfinite_policies(rng):
    g = make(rng, 6, [(5,), (2,)], np.float64)
    g[0][2, 1] = np.nan
    g[1][4, 0] = np.inf
    out, norms = zeros_like_params(g), np.zeros(6)
    assert dpvr.clip_accumulate(g, 1.0, out, norms=norms) == 2
    assert np.isnan(norms[[2, 4]]).all() and np.isfinite(norms[[0, 1, 3, 5]]).all()
    expected, _ = ref_clip(g, 1.0)
    for o, e in zip(out, expected):
        np.testing.assert_allclose(o, e, rtol=1e-12)

    out, norms = [np.full(5, 7.0), np.full(2, 7.0)], np.full(6, 7.0)
    with pytest.raises(FloatingPointError, match="2 sample"):
        dpvr.clip_accumulate(g, 1.0, out, norms=norms, nonfinite="raise")
    assert all((o == 7.0).all() for o in out) and (norms == 7.0).all()  # nothing was written

    w = np.ones(6)
    w[0] = np.nan
    clean = make(rng, 6, [(5,)], np.float64)
    assert dpvr.clip_accumulate(clean, 1.0, [np.zeros(5)], weights=w) == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [9, 67])
def test_wide_models_in_every_form(rng, dtype, batch):
    """More than 8192 columns: few samples take the column-parallel schedule (norms added up across threads),
    many the wide sample-parallel one (private accumulators); each form and the non-finite policy on both."""
    shapes = [(90, 100), (100,), (7,)]
    g, h = make(rng, batch, shapes, dtype), make(rng, batch, shapes, dtype)
    g[0][3, 5, 7] = np.nan
    w = rng.uniform(-2, 2, batch).astype(dtype)
    a, b = rng.uniform(0, 2, batch).astype(dtype), rng.uniform(0, 2, batch).astype(dtype)
    calls = [
        (lambda out, norms: dpvr.clip_accumulate(g, 40.0, out, weights=w, norms=norms), dict(weights=w)),
        (
            lambda out, norms: dpvr.clip_accumulate_diff(g, h, 40.0, out, a=a, b=b, norms=norms),
            dict(grads_prev=h, a=a, b=b),
        ),
    ]
    for call, form in calls:
        out, norms = zeros_like_params(g), np.zeros(batch, dtype)
        assert call(out, norms) == 1
        expected, expected_norms = ref_clip(g, 40.0, **form)
        for o, e in zip(out, expected):  # entries of the clipped vectors scale with C
            np.testing.assert_allclose(o, e, rtol=tol(dtype)["rtol"], atol=40.0 * tol(dtype)["atol"])
        assert np.isnan(norms[3]) and np.isnan(expected_norms[3])
        np.testing.assert_allclose(np.delete(norms, 3), np.delete(expected_norms, 3), **tol(dtype))


def test_results_do_not_depend_on_layout_of_tensors(rng):
    """Splitting the same columns into different tensors changes nothing but summation order."""
    g = rng.standard_normal((100, 60))
    out_one = [np.zeros(60)]
    out_split = [np.zeros(10), np.zeros(50)]
    dpvr.clip_accumulate([g], 2.0, out_one)
    dpvr.clip_accumulate([g[:, :10], g[:, 10:]], 2.0, out_split)
    np.testing.assert_allclose(out_one[0], np.concatenate(out_split), rtol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_noisy_update_matches_reference(rng, dtype):
    sizes = [7, 1, 300]
    v = [rng.standard_normal(n).astype(dtype) for n in sizes]
    s = [rng.standard_normal(n).astype(dtype) for n in sizes]
    x = [rng.standard_normal(n).astype(dtype) for n in sizes]
    xp = [np.zeros(n, dtype) for n in sizes]
    v0, x0 = [a.copy() for a in v], [a.copy() for a in x]

    gen = dpvr.NoiseGenerator(seed=5, reproducible=True)
    noise = [np.zeros(n) for n in sizes]
    dpvr.add_noise(noise, 1.0, generator=gen, stream="s")

    gen = dpvr.NoiseGenerator(seed=5, reproducible=True)
    step = dpvr.noisy_update(
        v, sum=s, scale=0.5, sigma=0.3, generator=gen, stream="s", params=x, params_prev=xp, lr=0.1
    )
    for k in range(3):
        v_ref = v0[k].astype(np.float64) + 0.5 * s[k] + 0.3 * noise[k]
        np.testing.assert_allclose(v[k], v_ref, **tol(dtype))
        np.testing.assert_allclose(x[k], x0[k] - 0.1 * v[k].astype(np.float64), **tol(dtype))
        np.testing.assert_array_equal(xp[k], x0[k])
    expected_step = np.linalg.norm(np.concatenate(x).astype(np.float64) - np.concatenate(x0))
    assert step == pytest.approx(expected_step, rel=1e-12)

    vr = [a.copy() for a in v]
    dpvr.noisy_update(vr, sum=s, scale=2.0, sigma=0.0, generator=gen, stream="s", reset=True)
    for k in range(3):
        np.testing.assert_allclose(vr[k], 2.0 * s[k].astype(np.float64), **tol(dtype))
    assert gen.steps("s") == 1  # sigma = 0 draws nothing


def test_threads_do_not_change_noise(rng):
    """Noise is addressed by element, so it is the same whatever the split into tensors."""
    gen = dpvr.NoiseGenerator(seed=9, reproducible=True)
    whole = np.zeros(10001)
    dpvr.add_noise(whole, 1.0, generator=gen, stream="a")
    gen = dpvr.NoiseGenerator(seed=9, reproducible=True)
    parts = [np.zeros(3), np.zeros(4998), np.zeros(5000)]
    dpvr.add_noise(parts, 1.0, generator=gen, stream="a")
    np.testing.assert_array_equal(whole, np.concatenate(parts))
