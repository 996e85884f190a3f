// Helpers shared by the CPU kernels: OpenMP shims, the column space of a list of tensors, and the clip rule.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

// The code of one instruction-set copy of the kernels (kernels_impl.h, ghost_impl.h) lies between
// DPVR_ISA_BEGIN and DPVR_ISA_END. The AVX-512 copy (DPVR_ISA_AVX512, which also takes the AVX2 copy's
// intrinsics) vectorises with 512-bit registers, twice the AVX2 copy's lanes (the noise transform is in
// double). The AVX2 copy (DPVR_ISA_AVX2) is compiled for AVX2 + FMA by a target pragma
// there, not by flags for its whole file: the headers included before it stay baseline, so the inline
// functions and standard-library template instances that both copies emit (the linker keeps one of each,
// from either file) never hold instructions that a CPU without AVX2 could reach.
#if defined(DPVR_ISA_AVX512) && defined(__clang__)
#define DPVR_ISA_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,avx512f,avx512dq,avx512vl,avx512bw\"))), apply_to = function)")
#define DPVR_ISA_END _Pragma("clang attribute pop")
#elif defined(DPVR_ISA_AVX512)
#define DPVR_ISA_BEGIN \
  _Pragma("GCC push_options") \
  _Pragma("GCC target(\"avx2,fma,avx512f,avx512dq,avx512vl,avx512bw,prefer-vector-width=512\")")
#define DPVR_ISA_END _Pragma("GCC pop_options")
#elif defined(DPVR_ISA_AVX2) && defined(__clang__)
#define DPVR_ISA_BEGIN _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
#define DPVR_ISA_END _Pragma("clang attribute pop")
#elif defined(DPVR_ISA_AVX2)
#define DPVR_ISA_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define DPVR_ISA_END _Pragma("GCC pop_options")
#else
#define DPVR_ISA_BEGIN
#define DPVR_ISA_END
#endif

namespace dpvr {
namespace cpu {

inline int thread_count() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// A run of consecutive columns of one tensor: columns [begin, end) of tensor k.
struct Piece {
  int k;
  int64_t begin;
  int64_t end;
};

// Splits the concatenated column space [lo, hi) of tensors with the given widths into per-tensor pieces.
inline std::vector<Piece> pieces_of(const std::vector<int64_t>& widths, int64_t lo, int64_t hi) {
  std::vector<Piece> out;
  int64_t offset = 0;
  for (int k = 0; k < static_cast<int>(widths.size()); ++k) {
    const int64_t a = std::max(lo, offset), b = std::min(hi, offset + widths[k]);
    if (a < b) out.push_back({k, a - offset, b - offset});
    offset += widths[k];
  }
  return out;
}

template <typename T>
constexpr double unit_roundoff() {
  return sizeof(T) == 4 ? 5.9604644775390625e-08 : 1.1102230246251565e-16;
}

constexpr int64_t kBlock = 32;  // float32 squares summed in float before going to double

// Relative bound on the error of a computed norm plus the rounding of the clipped entries to T. Clipping to
// C * (1 - margin) keeps every clipped vector's norm <= C after rounding (tests check this with exact sums).
// Every clip factor of the CPU backend (clip-accumulate and clip_factors) uses this one rule.
template <typename T>
double clip_margin(int64_t columns, int threads) {
  const double chain = static_cast<double>(columns / (sizeof(T) == 4 ? kBlock : 1) + threads + 8);
  const double in_t = sizeof(T) == 4 ? static_cast<double>(kBlock + 8) : 2.0;
  return in_t * unit_roundoff<T>() + chain * unit_roundoff<double>();
}

// The clip factor of one sample from the norm n of its unweighted vector and its weight: f multiplies the
// unweighted vector (0 marks a non-finite sample, which then contributes nothing) and `norm` is the reported
// norm of the weighted vector (NaN for a non-finite sample). target = C * (1 - clip_margin).
inline void clip_factor(double n, double weight, double target, double& f, double& norm) {
  n *= std::fabs(weight);
  if (!std::isfinite(n) || !std::isfinite(weight)) {
    f = 0.0;
    norm = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  norm = n;
  f = (n > target) ? weight * (target / n) : weight;
}

// The environment's cap on the instruction set (DPVR_CPU_ISA=baseline|avx2|avx512, read once): 0, 1 or 2.
// Benchmarks and tests compare the copies on one machine with it; unset, the CPU's best copy runs.
inline int isa_cap() {
  static const int cap = [] {
    const char* v = std::getenv("DPVR_CPU_ISA");
    if (v == nullptr) return 2;
    const std::string s(v);
    return s == "baseline" ? 0 : s == "avx2" ? 1 : 2;
  }();
  return cap;
}

// Whether the AVX2 + FMA copies of the kernels can run on this CPU (and the environment allows them).
inline bool use_avx2() {
#ifdef DPVR_HAVE_AVX2
  static const bool yes = isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

// Whether the AVX-512 copies of the kernels can run on this CPU (F, DQ, VL and BW, as Skylake-SP and later).
inline bool use_avx512() {
#ifdef DPVR_HAVE_AVX512
  static const bool yes = isa_cap() >= 2 && use_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  return yes;
#else
  return false;
#endif
}

// The instruction set the CPU kernels run with here: "avx512", "avx2" or "baseline".
inline const char* instruction_set() { return use_avx512() ? "avx512" : use_avx2() ? "avx2" : "baseline"; }

}  // namespace cpu
}  // namespace dpvr
