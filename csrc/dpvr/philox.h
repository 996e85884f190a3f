// Philox-4x32-10 (Salmon et al., SC'11) and the Gaussian transform shared by the CPU and CUDA backends.
//
// Counter layout for element e of a noise draw: (e / 2 low, e / 2 high, step, stream); key = seed.
// One block gives four 32-bit words -> two 53-bit uniforms -> two Gaussians (Box-Muller, in double).
// Using 53-bit uniforms keeps the radius untruncated to about 9.4 standard deviations (1 - u1 >= 2^-53), so the
// tail mass the generator cannot produce is below 1e-20 per coordinate. box_muller is the one transform of both
// backends (the CPU loop over it vectorises), so that they give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DPVR_HD __host__ __device__ __forceinline__
#else
#define DPVR_HD inline
#endif

namespace dpvr {
namespace philox {

struct Block {
  uint32_t w[4];
};

DPVR_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

DPVR_HD Block philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(M0, c0, hi0, lo0);
    mulhilo(M1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return Block{{c0, c1, c2, c3}};
}

DPVR_HD Block block_at(uint64_t seed, uint32_t stream, uint32_t step, uint64_t pair) {
  return philox4x32_10(static_cast<uint32_t>(pair), static_cast<uint32_t>(pair >> 32), step, stream,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// The two 53-bit uniforms of a block: u1 in (0, 1) (never 0, so the log is finite), u2 in [0, 1).
DPVR_HD void uniforms(const Block& b, double& u1, double& u2) {
  constexpr double two_m53 = 1.0 / 9007199254740992.0;  // 2^-53
  const uint64_t a = (static_cast<uint64_t>(b.w[0]) << 21) ^ (b.w[1] >> 11);
  const uint64_t c = (static_cast<uint64_t>(b.w[2]) << 21) ^ (b.w[3] >> 11);
  u1 = (static_cast<double>(a) + 0.5) * two_m53;
  u2 = static_cast<double>(c) * two_m53;
}

// Bit casts, and the exact double of an integer below 2^52 (vectorises where an integer conversion would not).
DPVR_HD double from_bits(uint64_t bits) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
#endif
}

DPVR_HD uint64_t to_bits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return bits;
#endif
}

DPVR_HD double small_integer(uint64_t x) { return from_bits(x | uint64_t{0x4330000000000000}) - 4503599627370496.0; }

// Box-Muller, z0 = r cos t and z1 = r sin t with r = sqrt(-2 log u1) and t = 2 pi u2, by fdlibm's log (e_log.c)
// and its sin and cos kernels (k_sin.c, k_cos.c) on [-pi/4, pi/4] after reducing t by k pi/2 (pi/2 in three
// parts; k <= 4, so the first two products are exact). Only +, -, *, / and sqrt, each correctly rounded on the
// host and on CUDA, compiled without contraction into fused multiply-adds (-ffp-contract=off, nvcc
// --fmad=false): the two backends give the same bits, where the math libraries' log, sin and cos differ by up
// to a few ulp. Within 3 ulp of the math library's transform (tests/ops/test_noise.py). Branch-free: selects let
// the CPU loop over it vectorise.
DPVR_HD void box_muller(double u1, double u2, double& z0, double& z1) {
  constexpr double Lg1 = 6.666666666666735130e-01, Lg2 = 3.999999999940941908e-01, Lg3 = 2.857142874366239149e-01,
                   Lg4 = 2.222219843214978396e-01, Lg5 = 1.818357216161805012e-01, Lg6 = 1.531383769920937332e-01,
                   Lg7 = 1.479819860511658591e-01;
  constexpr double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
  constexpr double S1 = -1.66666666666666324348e-01, S2 = 8.33333333332248946124e-03,
                   S3 = -1.98412698298579493134e-04, S4 = 2.75573137070700676789e-06,
                   S5 = -2.50507602534068634195e-08, S6 = 1.58969099521155010221e-10;
  constexpr double C1 = 4.16666666666666019037e-02, C2 = -1.38888888888741095749e-03,
                   C3 = 2.48015872894767294178e-05, C4 = -2.75573143513906633035e-07,
                   C5 = 2.08757232129817482790e-09, C6 = -1.13596475577881948265e-11;
  constexpr double pio2_1 = 1.57079632673412561417e+00, pio2_2 = 6.07710050630396597660e-11,
                   pio2_2t = 2.02226624879595063154e-21, two_over_pi = 6.36619772367581382433e-01;
  constexpr double round_magic = 6755399441055744.0;  // 1.5 * 2^52: (x + magic) - magic rounds x to an integer
  // log(u1): u1 = 2^e m with m in [sqrt(1/2), sqrt(2)); u1 is a normal number in (0, 1).
  const uint64_t bits = to_bits(u1);
  double m = from_bits((bits & uint64_t{0x000FFFFFFFFFFFFF}) | uint64_t{0x3FF0000000000000});
  const bool high = m > 1.4142135623730951;
  m *= high ? 0.5 : 1.0;
  const double e = small_integer(bits >> 52) - 1023.0 + (high ? 1.0 : 0.0);
  const double f = m - 1.0, s = f / (2.0 + f), s2 = s * s, s4 = s2 * s2;
  const double odd = s4 * (Lg2 + s4 * (Lg4 + s4 * Lg6)), even = s2 * (Lg1 + s4 * (Lg3 + s4 * (Lg5 + s4 * Lg7)));
  const double hfsq = 0.5 * f * f;
  const double log_u1 = e * ln2_hi - ((hfsq - (s * (hfsq + (even + odd)) + e * ln2_lo)) - f);
  const double r = sqrt(-2.0 * log_u1);
  // sin and cos of t in [0, 2 pi): t = k pi/2 + x, |x| <= pi/4.
  const double t = 6.283185307179586476925286766559 * u2;
  const double k = (t * two_over_pi + round_magic) - round_magic;
  const double x = ((t - k * pio2_1) - k * pio2_2) - k * pio2_2t, x2 = x * x;
  const double sin_x = x + x2 * x * (S1 + x2 * (S2 + x2 * (S3 + x2 * (S4 + x2 * (S5 + x2 * S6)))));
  const double cos_tail = x2 * x2 * (C1 + x2 * (C2 + x2 * (C3 + x2 * (C4 + x2 * (C5 + x2 * C6)))));
  const double half = 0.5 * x2, one_minus = 1.0 - half;
  const double cos_x = one_minus + (((1.0 - one_minus) - half) + cos_tail);
  const double q = k - (k >= 4.0 ? 4.0 : 0.0);  // quadrant
  const bool swap = q == 1.0 || q == 3.0;
  const double cos_sign = (q == 1.0 || q == 2.0) ? -1.0 : 1.0, sin_sign = q >= 2.0 ? -1.0 : 1.0;
  z0 = r * (cos_sign * (swap ? sin_x : cos_x));
  z1 = r * (sin_sign * (swap ? cos_x : sin_x));
}

// Two independent N(0,1) values for element pair `pair` (elements 2*pair and 2*pair+1).
DPVR_HD void gaussian_pair(uint64_t seed, uint32_t stream, uint32_t step, uint64_t pair, double& z0, double& z1) {
  double u1, u2;
  uniforms(block_at(seed, stream, step, pair), u1, u2);
  box_muller(u1, u2, z0, z1);
}

}  // namespace philox
}  // namespace dpvr
