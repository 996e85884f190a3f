"""The counter-based Gaussian generator: known answers, statistics, streams, reproducibility."""

import math
import warnings

import numpy as np
import pytest
from scipy import stats

import dpvr
from dpvr.ops import philox_words

MASK = 0xFFFFFFFF


def philox_reference(counter, key):
    """Philox-4x32-10 written from its specification, in pure Python."""
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & MASK, (p0 >> 32) ^ c[3] ^ k[1], p0 & MASK]
        k = [(k[0] + 0x9E3779B9) & MASK, (k[1] + 0xBB67AE85) & MASK]
    return c


def test_known_answers():
    # Known-answer vectors of the Philox-4x32-10 specification.
    assert philox_reference([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox_reference([MASK] * 4, [MASK] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert philox_reference([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == [
        0xD16CFE09,
        0x94FDCCEB,
        0x5001E420,
        0x24126EA1,
    ]
    assert list(philox_words(1, 0, 0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_native_words_follow_the_counter_layout():
    seed, stream, step = 0x0123456789ABCDEF, 7, 11
    words = philox_words(64, seed, stream, step).reshape(64, 4)
    for pair in (0, 1, 63):
        expected = philox_reference([pair, 0, step, stream], [seed & MASK, seed >> 32])
        assert list(words[pair]) == expected


def test_gaussians_follow_box_muller_on_53_bit_uniforms():
    gen = dpvr.NoiseGenerator(seed=42, reproducible=True)
    z = np.zeros(6)
    dpvr.add_noise(z, 1.0, generator=gen, stream="x")
    words = philox_words(3, 42, 0, 0).reshape(3, 4).astype(np.uint64)
    for pair in range(3):
        w = [int(x) for x in words[pair]]
        u1 = (((w[0] << 21) ^ (w[1] >> 11)) + 0.5) * 2.0**-53
        u2 = ((w[2] << 21) ^ (w[3] >> 11)) * 2.0**-53
        r = math.sqrt(-2 * math.log(u1))
        assert z[2 * pair] == pytest.approx(r * math.cos(2 * math.pi * u2), rel=1e-15, abs=1e-15)
        assert z[2 * pair + 1] == pytest.approx(r * math.sin(2 * math.pi * u2), rel=1e-15, abs=1e-15)


LG = (6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01, 2.222219843214978396e-01,
      1.818357216161805012e-01, 1.531383769920937332e-01, 1.479819860511658591e-01)
S = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
     2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
C = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
     -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)


def uniforms(words):
    w = words.reshape(-1, 4).astype(np.uint64)
    u1 = (((w[:, 0] << np.uint64(21)) ^ (w[:, 1] >> np.uint64(11))).astype(np.float64) + 0.5) * 2.0**-53
    u2 = ((w[:, 2] << np.uint64(21)) ^ (w[:, 3] >> np.uint64(11))).astype(np.float64) * 2.0**-53
    return u1, u2


def box_muller_reference(words):
    """The float64 Gaussians of Philox blocks (pairs interleaved)."""
    return transform(*uniforms(words))


def transform(u1, u2):
    """The Box-Muller transform of csrc/dpvr/philox.h, written again from fdlibm's log and sin/cos kernels in
    numpy (IEEE operations, none fused) in the same order of operations."""
    mantissa, exponent = np.frexp(u1)  # u1 = mantissa 2^exponent, mantissa in [1/2, 1)
    m, e = 2 * mantissa, exponent - 1.0
    high = m > 1.4142135623730951
    m, e = np.where(high, 0.5 * m, m), e + high
    f = m - 1.0
    s = f / (2.0 + f)
    s2 = s * s
    s4 = s2 * s2
    odd = s4 * (LG[1] + s4 * (LG[3] + s4 * LG[5]))
    even = s2 * (LG[0] + s4 * (LG[2] + s4 * (LG[4] + s4 * LG[6])))
    hfsq = 0.5 * f * f
    ln2_hi, ln2_lo = 6.93147180369123816490e-01, 1.90821492927058770002e-10
    log_u1 = e * ln2_hi - ((hfsq - (s * (hfsq + (even + odd)) + e * ln2_lo)) - f)
    r = np.sqrt(-2.0 * log_u1)
    t = 6.283185307179586476925286766559 * u2
    k = (t * 6.36619772367581382433e-01 + 6755399441055744.0) - 6755399441055744.0
    pio2_1, pio2_2 = 1.57079632673412561417e00, 6.07710050630396597660e-11
    pio2_2t = 2.02226624879595063154e-21
    x = ((t - k * pio2_1) - k * pio2_2) - k * pio2_2t
    x2 = x * x
    sin_x = x + x2 * x * (S[0] + x2 * (S[1] + x2 * (S[2] + x2 * (S[3] + x2 * (S[4] + x2 * S[5])))))
    cos_tail = x2 * x2 * (C[0] + x2 * (C[1] + x2 * (C[2] + x2 * (C[3] + x2 * (C[4] + x2 * C[5])))))
    half = 0.5 * x2
    one_minus = 1.0 - half
    cos_x = one_minus + (((1.0 - one_minus) - half) + cos_tail)
    q = np.where(k >= 4.0, k - 4.0, k)
    swap = (q == 1.0) | (q == 3.0)
    cos_sign = np.where((q == 1.0) | (q == 2.0), -1.0, 1.0)
    sin_sign = np.where(q >= 2.0, -1.0, 1.0)
    z = np.empty(2 * len(u1))
    z[0::2] = r * (cos_sign * np.where(swap, sin_x, cos_x))
    z[1::2] = r * (sin_sign * np.where(swap, cos_x, sin_x))
    return z


def test_float64_noise_is_the_reference_transform_exactly():
    """Across generation tiles, thread shares and tensor boundaries, float64 noise is bit for bit the
    reference transform of the Philox words (the vectorised Philox and Box-Muller of the kernels included)."""
    n = 3 * 4096 + 1001
    seed, step = 0xFEDCBA9876543210, 5
    gen = dpvr.NoiseGenerator(seed=seed, reproducible=True)
    for _ in range(step):
        gen.next_key("s")
    parts = [np.zeros(k) for k in (3, 4093, 1, n - 4097)]
    dpvr.add_noise(parts, 1.0, generator=gen, stream="s")
    expected = box_muller_reference(philox_words((n + 1) // 2, seed, 0, step))[:n]
    np.testing.assert_array_equal(np.concatenate(parts), expected)


def test_the_transform_is_within_three_ulp_of_the_math_library():
    """The polynomial log, sin and cos against the math library's (numpy's) on the same uniforms: 10^6 pairs,
    and uniforms at the ends of their ranges and at the quadrant boundaries."""
    u1, u2 = uniforms(philox_words(1_000_000, 11, 0, 0))
    ends = [(2.0**-54, 0.0), (1 - 2.0**-54, 1 - 2.0**-53), (0.5, 0.125), (0.5, 0.25), (0.75, 0.5),
            (0.9, 0.875)]
    u1, u2 = np.append(u1, [a for a, _ in ends]), np.append(u2, [b for _, b in ends])
    r, t = np.sqrt(-2.0 * np.log(u1)), 2 * np.pi * u2
    library = np.empty(2 * len(u1))
    library[0::2], library[1::2] = r * np.cos(t), r * np.sin(t)
    ours = transform(u1, u2)
    big = np.abs(library) > 1e-8  # near a zero of sin or cos an ulp of the result is not the measure
    ulps = np.abs(ours - library)[big] / np.spacing(np.abs(library[big]))
    assert ulps.max() <= 3, ulps.max()
    assert np.abs(ours - library)[~big].max(initial=0) < 1e-15


def test_float32_noise_is_the_float64_noise_rounded():
    """float32 noise is the float64 noise rounded to float32, bit for bit."""
    n = 1_000_003
    z64, _ = draws(n, seed=5, sigma=1.5)
    z32, _ = draws(n, seed=5, sigma=1.5, dtype=np.float32)
    np.testing.assert_array_equal(z32, z64.astype(np.float32))


def draws(n, *, seed=1, stream="s", dtype=np.float64, sigma=1.0):
    gen = dpvr.NoiseGenerator(seed=seed, reproducible=True)
    z = np.zeros(n, dtype)
    dpvr.add_noise(z, sigma, generator=gen, stream=stream)
    return z, gen


def test_moments_and_kolmogorov_smirnov():
    n = 2_000_000
    z, _ = draws(n)
    # Sample moments of N(0,1) with 5-sigma bounds on their sampling error.
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(stats.skew(z)) < 5 * math.sqrt(6 / n)
    assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24 / n)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    z32, _ = draws(n, dtype=np.float32, sigma=2.5)
    assert stats.kstest(z32.astype(np.float64) / 2.5, "norm").pvalue > 1e-3


def test_streams_and_steps_are_uncorrelated():
    n = 500_000
    gen = dpvr.NoiseGenerator(seed=3, reproducible=True)
    a, b, c = np.zeros(n), np.zeros(n), np.zeros(n)
    dpvr.add_noise(a, 1.0, generator=gen, stream="restart")
    dpvr.add_noise(b, 1.0, generator=gen, stream="difference")
    dpvr.add_noise(c, 1.0, generator=gen, stream="restart")  # next step of the first stream
    bound = 5 / math.sqrt(n)
    for x, y in ((a, b), (a, c), (b, c), (a[:-1], a[1:])):
        assert abs(np.corrcoef(x, y)[0, 1]) < bound
    assert gen.steps("restart") == 2 and gen.steps("difference") == 1


def test_reproducible_per_seed_and_distinct_across_seeds():
    a, _ = draws(1000, seed=10)
    b, _ = draws(1000, seed=10)
    c, _ = draws(1000, seed=11)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_default_seed_comes_from_the_os_and_fixed_seed_needs_opt_in():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seeds = {dpvr.NoiseGenerator().seed for _ in range(8)}
    assert len(seeds) == 8
    for refused in (lambda: dpvr.NoiseGenerator(seed=1), lambda: dpvr.NoiseGenerator(1)):
        with pytest.raises(dpvr.PredictableNoiseError, match="reproducible=True"):
            refused()
    assert dpvr.NoiseGenerator(seed=1, reproducible=True).seed == 1


def test_state_round_trip_resumes_the_same_noise():
    gen = dpvr.NoiseGenerator(seed=77, reproducible=True)
    z = np.zeros(100)
    dpvr.add_noise(z, 1.0, generator=gen, stream="a")
    state = gen.state_dict()
    first = np.zeros(100)
    dpvr.add_noise(first, 1.0, generator=gen, stream="a")
    resumed = dpvr.NoiseGenerator.from_state_dict(state)
    second = np.zeros(100)
    dpvr.add_noise(second, 1.0, generator=resumed, stream="a")
    np.testing.assert_array_equal(first, second)
    with pytest.raises(ValueError, match="state"):
        dpvr.NoiseGenerator.from_state_dict({"seed": 1, "streams": {"a": [3, 0]}})
    with pytest.raises(ValueError, match="state"):
        dpvr.NoiseGenerator.from_state_dict({"streams": {}})


def test_the_signal_digest_does_not_depend_on_the_thread_count(monkeypatch):
    """The key of a bound generator's draw hashes the sum it perturbs; hashed on several threads (large
    sums) or one, the digest, and so the noise, is the same: single-threaded BLAKE3 over the same bytes."""
    from blake3 import blake3

    from dpvr.ops import kernels

    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(300_000), rng.standard_normal(5).astype(np.float32)]
    scalars = (("sigma", 1.5),)
    reference = blake3(repr(scalars).encode())
    for a in arrays:
        reference.update(a.view(np.uint8))
    for threshold in (0, 1 << 62):  # every digest threaded, none threaded
        monkeypatch.setattr(kernels, "THREADED_DIGEST_BYTES", threshold)
        assert kernels._digest(arrays, scalars) == reference.digest()
