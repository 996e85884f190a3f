"""The ghost-norm kernel and clip_factors (dpvr.ops) against float64 and exact references."""

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dpvr
from dpvr import ops
from reference import clip_accumulate as ref_clip


def outer_vectors(pieces):
    """Per-sample u_i = sum_j sum_t n_jt m_jt^T, flattened, in float64."""
    total = 0
    for m, n in pieces:
        m, n = np.asarray(m, np.float64), np.asarray(n, np.float64)
        if m.ndim == 2:
            m, n = m[:, None], n[:, None]
        total = total + np.einsum("btq,btp->bqp", n, m)
    return total.reshape(total.shape[0], -1)


def index_vectors(pieces, rows, skip=None):
    batch, width = pieces[0][1].shape[0], pieces[0][1].shape[-1]
    u = np.zeros((batch, rows, width))
    for keys, grads in pieces:
        for i in range(batch):
            for t in range(keys.shape[1]):
                if keys[i, t] != skip:
                    u[i, keys[i, t]] += grads[i, t]
    return u.reshape(batch, -1)


def norms_sq_of(batch, **terms):
    out = np.zeros(batch)
    ops.ghost_norms(out, **terms)
    return out


def tol(dtype):
    # Inputs of either dtype are read exactly and accumulated in double; the result is an upper bound that
    # includes its rounding error (about 1e-12 relative here).
    return dict(rtol=1e-10, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("form", ["auto", "gram", "direct"])
@pytest.mark.parametrize(("steps", "p", "q", "n_pieces"), [(None, 7, 3, 1), (None, 3, 7, 2), (5, 4, 6, 1),
                                                          (5, 6, 4, 2), (1, 1, 1, 1), (9, 2, 3, 3)])
def test_outer_terms_match_reference(rng, dtype, form, steps, p, q, n_pieces):
    batch = 11
    shape = (batch,) if steps is None else (batch, steps)
    pieces = [(rng.normal(size=(*shape, p)).astype(dtype), rng.normal(size=(*shape, q)).astype(dtype))
              for _ in range(n_pieces)]
    out = np.zeros(batch)
    ops.ghost_norms(out, outer=[pieces], form=form)
    expected = (outer_vectors(pieces) ** 2).sum(axis=1)
    np.testing.assert_allclose(out, expected, **tol(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("form", ["gram", "direct"])
def test_outer_bounds_are_each_terms_sum_of_norm_products(rng, dtype, form):
    """R_i = sum over a term's pieces and steps of ||m|| ||n||, in double, for each outer term: what the
    clipped sums' rounding bound reads (grads.ghost.norms.write_error), off the same pass as the norms."""
    batch = 6
    terms = [[(rng.normal(size=(batch, 5, 4)).astype(dtype), rng.normal(size=(batch, 5, 3)).astype(dtype)),
              (rng.normal(size=(batch, 2, 4)).astype(dtype), rng.normal(size=(batch, 2, 3)).astype(dtype))],
             [(rng.normal(size=(batch, 7)).astype(dtype), rng.normal(size=(batch, 2)).astype(dtype))]]
    out, bounds = np.zeros(batch), np.zeros((2, batch))
    ops.ghost_norms(out, outer=terms, form=form, outer_bounds=bounds)
    for k, term in enumerate(terms):
        norms = [np.linalg.norm(m.astype(np.float64), axis=-1) * np.linalg.norm(n.astype(np.float64), axis=-1)
                 for m, n in term]
        expected = sum(r.reshape(batch, -1).sum(axis=1) for r in norms)
        np.testing.assert_allclose(bounds[k], expected, rtol=1e-13)
    with pytest.raises(ValueError, match="outer_bounds"):
        ops.ghost_norms(out, outer=terms, outer_bounds=np.zeros((1, batch)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_index_terms_match_reference(rng, dtype):
    batch, steps, rows, width = 9, 12, 5, 4
    keys = [rng.integers(0, rows, size=(batch, steps)), rng.integers(0, rows, size=(batch, 3))]
    grads = [rng.normal(size=(batch, t, width)).astype(dtype) for t in (steps, 3)]
    for skip in (None, 2):
        pieces = list(zip(keys, grads))
        out = np.zeros(batch)
        ops.ghost_norms(out, index=[ops.IndexTerm(pieces, skip)])
        np.testing.assert_allclose(out, (index_vectors(pieces, rows, skip) ** 2).sum(axis=1), **tol(dtype))


def test_terms_add_up(rng):
    batch = 6
    outer = [[(rng.normal(size=(batch, 4, 3)), rng.normal(size=(batch, 4, 2)))],
             [(rng.normal(size=(batch, 5)), rng.normal(size=(batch, 2)))]]
    index = [ops.IndexTerm([(rng.integers(0, 3, size=(batch, 4)), rng.normal(size=(batch, 4, 2)))])]
    dense = [rng.normal(size=(batch, 3)), rng.normal(size=(batch, 2, 2))]
    parts = [norms_sq_of(batch, outer=[t]) for t in outer] + [norms_sq_of(batch, index=index)] + [
        norms_sq_of(batch, dense=[d]) for d in dense]
    together = norms_sq_of(batch, outer=outer, index=index, dense=dense)
    np.testing.assert_allclose(together, sum(parts), rtol=1e-13)
    np.testing.assert_allclose(parts[-1], (dense[1].reshape(batch, -1) ** 2).sum(axis=1), rtol=1e-13)


def test_strided_torch_and_numpy_views(rng):
    base_m = rng.normal(size=(8, 6, 5))
    base_n = rng.normal(size=(8, 3, 6))
    m, n = np.swapaxes(base_m, 1, 2), np.swapaxes(base_n, 1, 2)  # (8, 5, 6) and (8, 6, 3): strided steps
    m = m[:, ::2]  # (8, 3, 6): every other step
    n = n[:, ::2]
    expected = (outer_vectors([(m, n)]) ** 2).sum(axis=1)
    for a, b in ((m, n), (torch.from_numpy(m), torch.from_numpy(n))):
        out = torch.zeros(8, dtype=torch.float64)
        ops.ghost_norms(out, outer=[[(a, b)]])
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12)


def test_difference_pieces_at_identical_points_are_exactly_zero(rng):
    acts = rng.normal(size=(7, 4, 5)).astype(np.float32)
    grads = rng.normal(size=(7, 4, 3)).astype(np.float32)
    pieces = [(acts, grads - grads), (acts - acts, grads)]
    for form in ("gram", "direct"):
        out = np.ones(7)
        ops.ghost_norms(out, outer=[pieces], form=form)
        assert (out == 0).all()


def test_nonfinite_samples_give_nan(rng):
    m, n = rng.normal(size=(5, 3, 4)), rng.normal(size=(5, 3, 2))
    m[1, 2, 0] = np.inf
    n[3, 0, 1] = np.nan
    for form in ("gram", "direct"):
        out = np.zeros(5)
        ops.ghost_norms(out, outer=[[(m, n)]], form=form)
        assert np.isnan(out[[1, 3]]).all() and np.isfinite(out[[0, 2, 4]]).all()


def exact_sumsq(pieces):
    """||sum_j N_j^T M_j||^2 for one sample, in exact rational arithmetic."""
    p, q = pieces[0][0].shape[1], pieces[0][1].shape[1]
    u = [[Fraction(0)] * p for _ in range(q)]
    for m, n in pieces:
        for t in range(m.shape[0]):
            for o in range(q):
                for k in range(p):
                    u[o][k] += Fraction(float(n[t, o])) * Fraction(float(m[t, k]))
    return sum(x * x for row in u for x in row)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    steps=st.integers(1, 4),
    p=st.integers(1, 4),
    q=st.integers(1, 4),
    log_gap=st.floats(-12, 0),
    seed=st.integers(0, 2**32 - 1),
    form=st.sampled_from(["gram", "direct"]),
)
def test_norm_is_an_upper_bound_even_under_cancellation(dtype, steps, p, q, log_gap, seed, form):
    # A second piece that nearly cancels the first: the computed norm must still bound the exact one.
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(1, steps, p)).astype(dtype)
    n = rng.normal(size=(1, steps, q)).astype(dtype)
    m2 = (m * (1 + 10.0**log_gap * rng.normal(size=m.shape))).astype(dtype)
    pieces = [(m, n), (m2, -n)]
    out = np.zeros(1)
    ops.ghost_norms(out, outer=[pieces], form=form)
    exact = exact_sumsq([(a[0], b[0]) for a, b in pieces])
    assert Fraction(float(out[0])) >= exact
    scale = sum((np.abs(a[0]).sum(axis=1) * np.abs(b[0]).sum(axis=1)).sum() for a, b in pieces) ** 2
    assert float(out[0]) - float(exact) <= 1e-12 * scale


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_factors_reproduce_clip_accumulate(rng, dtype):
    batch, shapes = 64, [(20, 30), (30,), (1,)]
    grads = [rng.normal(size=(batch, *s)).astype(dtype) for s in shapes]
    grads[0][::3] *= 0.01  # some samples below the clip, some above
    flat = np.concatenate([g.reshape(batch, -1) for g in grads], axis=1)
    d = flat.shape[1]
    weights = rng.uniform(-2, 2, batch).astype(dtype)
    for w in (None, weights):
        out = [np.zeros(int(np.prod(s)), dtype) for s in shapes]
        norms = np.zeros(batch, dtype)
        dpvr.clip_accumulate(grads, 3.0, out, weights=w, norms=norms)
        factors, ghost_norms_ = np.zeros(batch, dtype), np.zeros(batch, dtype)
        norms_sq = (flat.astype(np.float64) ** 2).sum(axis=1)
        assert ops.clip_factors(norms_sq, 3.0, factors, columns=d, weights=w, norms=ghost_norms_) == 0
        np.testing.assert_allclose(ghost_norms_, norms, rtol=1e-6 if dtype == np.float32 else 1e-13)
        summed = factors.astype(np.float64) @ flat.astype(np.float64)
        np.testing.assert_allclose(summed, np.concatenate(out), rtol=1e-5 if dtype == np.float32 else 1e-12,
                                   atol=1e-5 if dtype == np.float32 else 1e-12)
        expected, _ = ref_clip(grads, 3.0, weights=w)
        np.testing.assert_allclose(summed, np.concatenate(expected), rtol=1e-5, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), log_norm=st.floats(-30, 30),
       log_clip=st.floats(-6, 6), columns=st.integers(0, 10**6))
def test_clipped_factor_times_norm_stays_below_clip(dtype, log_norm, log_clip, columns):
    norm_sq = np.array([10.0 ** (2 * log_norm)])
    clip = 10.0**log_clip
    factor = np.zeros(1, dtype)
    ops.clip_factors(norm_sq, clip, factor, columns=columns)
    assert Fraction(float(factor[0])) ** 2 * Fraction(float(norm_sq[0])) <= Fraction(clip) ** 2


def test_clip_factors_nonfinite_policies():
    norms_sq = np.array([1.0, np.nan, 4.0, np.inf, 0.0])
    factors, norms = np.full(5, 7.0), np.full(5, 7.0)
    assert ops.clip_factors(norms_sq, 1.0, factors, columns=3, norms=norms) == 2
    assert factors[1] == factors[3] == 0 and np.isnan(norms[[1, 3]]).all()
    assert factors[4] == 1 and factors[2] == pytest.approx(0.5, rel=1e-12)
    factors, norms = np.full(5, 7.0), np.full(5, 7.0)
    with pytest.raises(FloatingPointError, match="2 sample"):
        ops.clip_factors(norms_sq, 1.0, factors, columns=3, norms=norms, nonfinite="raise")
    assert (factors == 7.0).all() and (norms == 7.0).all()  # nothing was written
    weights = np.array([1.0, 1.0, np.nan, 1.0, 1.0])
    assert ops.clip_factors(np.ones(5), 1.0, np.zeros(5), columns=3, weights=weights) == 1
