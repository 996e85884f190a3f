// Philox-4x32-10 (Salmon et al., SC'11) and the Gaussian transform shared by the CPU and CUDA backends.
//
// Counter layout for element e of a noise draw: (e / 2 low, e / 2 high, step, stream); key = seed.
// One block gives four 32-bit words -> two 53-bit uniforms -> two Gaussians (Box-Muller, in double).
// Using 53-bit uniforms keeps the radius untruncated to about 9.4 standard deviations (1 - u1 >= 2^-53), so the
// tail mass the generator cannot produce is below 1e-20 per coordinate. box_muller is the reference transform;
// the CPU backend's float32 noise uses a vectorised polynomial form of it (csrc/cpu/kernels_impl.h).
#pragma once

#include <cmath>
#include <cstdint>

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

// Box-Muller with the math library's log, cos and sin: the reference transform of both backends.
DPVR_HD void box_muller(double u1, double u2, double& z0, double& z1) {
  const double r = sqrt(-2.0 * log(u1));
  const double t = 6.283185307179586476925286766559 * u2;
  z0 = r * cos(t);
  z1 = r * sin(t);
}

// Two independent N(0,1) values for element pair `pair` (elements 2*pair and 2*pair+1).
DPVR_HD void gaussian_pair(uint64_t seed, uint32_t stream, uint32_t step, uint64_t pair, double& z0, double& z1) {
  double u1, u2;
  uniforms(block_at(seed, stream, step, pair), u1, u2);
  box_muller(u1, u2, z0, z1);
}

}  // namespace philox
}  // namespace dpvr
