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


def box_muller_reference(words):
    """The float64 Gaussians of Philox blocks by the C library's log, cos and sin (Python's math module)."""
    z = []
    for w0, w1, w2, w3 in words.reshape(-1, 4).astype(np.uint64).tolist():
        u1 = (((w0 << 21) ^ (w1 >> 11)) + 0.5) * 2.0**-53
        u2 = ((w2 << 21) ^ (w3 >> 11)) * 2.0**-53
        r, t = math.sqrt(-2.0 * math.log(u1)), 2 * math.pi * u2
        z += [r * math.cos(t), r * math.sin(t)]
    return np.array(z)


def test_float64_noise_is_the_library_box_muller_exactly():
    """Across generation tiles, thread shares and tensor boundaries, float64 noise is bit for bit the
    reference transform of the Philox words (the vectorised Philox of the kernels included)."""
    n = 3 * 4096 + 1001
    seed, step = 0xFEDCBA9876543210, 5
    gen = dpvr.NoiseGenerator(seed=seed, reproducible=True)
    for _ in range(step):
        gen.next_key("s")
    parts = [np.zeros(k) for k in (3, 4093, 1, n - 4097)]
    dpvr.add_noise(parts, 1.0, generator=gen, stream="s")
    expected = box_muller_reference(philox_words((n + 1) // 2, seed, 0, step))[:n]
    np.testing.assert_array_equal(np.concatenate(parts), expected)


def test_float32_noise_is_the_float64_noise_rounded():
    """float32 noise comes from a vectorised transform within 3 ulp of the float64 reference: its values are
    the reference rounded to float32, but for one ulp where the reference lies next to a rounding boundary."""
    n = 1_000_003
    z64, _ = draws(n, seed=5, sigma=1.5)
    z32, _ = draws(n, seed=5, sigma=1.5, dtype=np.float32)
    rounded = z64.astype(np.float32)
    np.testing.assert_array_max_ulp(z32, rounded, maxulp=1)
    assert np.count_nonzero(z32 != rounded) <= 10  # about 1e-8 of the entries are expected to differ


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
