// The CPU kernels, compiled once per instruction set (see kernels_base.cpp, kernels_avx2.cpp): the including
// file defines DPVR_ISA, the namespace that holds this copy. Floating-point contraction is disabled for these
// files, so every instruction set computes bit-identical results.
//
// clip-accumulate reads the per-sample data from memory once: samples are processed in chunks small enough to
// stay in cache, so the accumulation pass re-reads a chunk from cache right after its norms are known. Every
// schedule is deterministic for a given thread count:
//   sample-parallel: each thread clips a fixed range of samples into a private double accumulator, and the
//                    accumulators are reduced in a fixed order. No thread waits for another until the end, which
//                    matters on a shared machine: there a barrier costs a scheduler time slice whenever a core
//                    is busy with other work.
//   column-parallel: each thread owns a fixed column range of the concatenated tensors and the threads meet at
//                    a barrier per chunk to add up the norms - for few samples (or accumulators too large).
// Every schedule sums over samples in double and adds the total to `out` once. A float32 running sum would
// round at the magnitude of the partial sum (up to B C), so replacing one record could move it by 2C plus
// roundings that grow with B; in double those are below 2^-53 of the partial sums.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#ifdef DPVR_ISA_AVX2
#include <immintrin.h>
#endif

#include "common.h"
#include "dpvr/core.h"
#include "dpvr/philox.h"

#ifndef DPVR_ISA
#error "define DPVR_ISA before including kernels_impl.h"
#endif

DPVR_ISA_BEGIN
namespace dpvr {
namespace cpu {
namespace DPVR_ISA {

constexpr int64_t kCacheBudgetPerThread = 1536 * 1024;  // per-sample bytes per thread kept in cache between passes
constexpr int64_t kNarrowColumns = 8192;               // at or below this, sample-parallel with double accumulators
constexpr int64_t kSamplesPerAccumulator = 8;         // wide sample-parallel: accumulators <= 1/8 of the input
// Wide sample-parallel: bytes of whole samples per thread kept in the last-level cache between the passes. The
// accumulator's tile stays in L1 across a chunk, so its cache traffic is divided by the samples in a chunk.
constexpr int64_t kSampleChunkBytes = 4096 * 1024;
constexpr int64_t kTile = 1024;                        // columns accumulated per tile (output tile stays in L1)
constexpr int64_t kSerialBelow = 1 << 16;              // less work than this (elements) runs on one thread

// The per-sample vector u_i (plain: g_i, whose weight scales the norm; difference: a_i g_i - b_i h_i), computed
// in T by the same expression in the norm pass and the accumulation pass, so the vector that is added is
// exactly the one whose norm was bounded.
template <typename T, bool Diff>
struct Source {
  const std::vector<Matrix>& g;
  const std::vector<Matrix>& h;
  const T* a;  // plain form: weights (applied through the factor); difference form: a_i
  const T* b;

  struct Row {
    const T* g;
    const T* h;
    int64_t gs, hs;
    T a, b;
    inline T operator[](int64_t j) const {
      if constexpr (Diff)
        return a * g[j * gs] - b * h[j * hs];
      else
        return g[j * gs];
    }
  };

  inline Row row(int k, int64_t i) const {
    const Matrix& G = g[k];
    Row r{static_cast<const T*>(G.data) + i * G.row_stride, nullptr, G.col_stride, 0, T(1), T(1)};
    if constexpr (Diff) {
      const Matrix& H = h[k];
      r.h = static_cast<const T*>(H.data) + i * H.row_stride;
      r.hs = H.col_stride;
      if (a) r.a = a[i];
      if (b) r.b = b[i];
    }
    return r;
  }

  inline bool unit_stride(int k) const { return g[k].col_stride == 1 && (!Diff || h[k].col_stride == 1); }

  // Sum of squares over columns [lo, hi) of tensor k for sample i. float32 squares are summed in short float
  // blocks (vectorised, error bounded by kBlock ulps) whose totals are summed in double.
  double sumsq(int k, int64_t i, int64_t lo, int64_t hi) const {
    Row r = row(k, i);
    if (!unit_stride(k)) {
      double acc = 0.0;
      for (int64_t j = lo; j < hi; ++j) {
        const double u = static_cast<double>(r[j]);
        acc += u * u;
      }
      return acc;
    }
    r.gs = r.hs = 1;
    if constexpr (sizeof(T) == 4) {
      // kLanes float partial sums, each over kBlock / kLanes squares, flushed lane-wise into doubles: no
      // horizontal reduction inside the loop, and every float chain is shorter than kBlock.
      constexpr int kLanes = 8;
      double wide[kLanes] = {};
      int64_t j0 = lo;
      for (; j0 + kBlock <= hi; j0 += kBlock) {
        float lanes[kLanes] = {};
        for (int64_t j = j0; j < j0 + kBlock; j += kLanes) {
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) {
            const float u = r[j + l];
            lanes[l] += u * u;
          }
        }
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) wide[l] += static_cast<double>(lanes[l]);
      }
      double acc = 0.0;
      for (int64_t j = j0; j < hi; ++j) {
        const double u = static_cast<double>(r[j]);
        acc += u * u;
      }
      for (int l = 0; l < kLanes; ++l) acc += wide[l];
      return acc;
    } else {
      double acc = 0.0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = lo; j < hi; ++j) {
        const double u = r[j];
        acc += u * u;
      }
      return acc;
    }
  }

  // out[lo:hi] += f * u_i[lo:hi] for tensor k, in double (u_i's entries, formed in T, widen exactly).
  void axpy(int k, int64_t i, int64_t lo, int64_t hi, double f, double* out) const {
    Row r = row(k, i);
    if (unit_stride(k)) {
      r.gs = r.hs = 1;
#pragma omp simd
      for (int64_t j = lo; j < hi; ++j) out[j] += f * static_cast<double>(r[j]);
    } else {
      for (int64_t j = lo; j < hi; ++j) out[j] += f * static_cast<double>(r[j]);
    }
  }

  // Norm of sample i over every tensor, robust to overflow (rare path). NaN when an entry is not finite.
  double robust_norm(int64_t i) const {
    double scale = 0.0;
    for (int k = 0; k < static_cast<int>(g.size()); ++k) {
      const Row r = row(k, i);
      for (int64_t j = 0; j < g[k].cols; ++j) {
        const double u = std::fabs(static_cast<double>(r[j]));
        if (!std::isfinite(u)) return std::numeric_limits<double>::quiet_NaN();
        scale = std::max(scale, u);
      }
    }
    if (scale == 0.0) return 0.0;
    double acc = 0.0;
    for (int k = 0; k < static_cast<int>(g.size()); ++k) {
      const Row r = row(k, i);
      for (int64_t j = 0; j < g[k].cols; ++j) {
        const double u = static_cast<double>(r[j]) / scale;
        acc += u * u;
      }
    }
    return scale * std::sqrt(acc);
  }
};

// Clip factor of a sample from its sum of squares.
struct Clipper {
  double clip;
  double margin;

  // f: factor applied to the unweighted vector (0 marks a non-finite sample); norm: the reported norm.
  template <typename S>
  inline void factor(const S& src, int64_t i, double sumsq, double weight, double& f, double& norm) const {
    double n = std::sqrt(sumsq);
    if (!std::isfinite(n)) n = src.robust_norm(i);
    clip_factor(n, weight, clip * (1.0 - margin), f, norm);
  }
};

// out_k[j] += s, rounded once to out's dtype (T, or double with out_f64).
template <typename T>
inline void add_out(const ClipArgs& args, int k, int64_t j, double s) {
  if (args.out_f64) {
    static_cast<double*>(args.out[k].data)[j] += s;
  } else {
    T* out = static_cast<T*>(args.out[k].data);
    out[j] = static_cast<T>(static_cast<double>(out[j]) + s);
  }
}

template <typename T, bool Diff>
int64_t run(const ClipArgs& args, bool write) {
  const Source<T, Diff> src{args.g, args.h, static_cast<const T*>(args.w), static_cast<const T*>(args.b)};
  const int K = static_cast<int>(args.g.size());
  const int64_t B = args.batch;
  std::vector<int64_t> widths(K);
  int64_t D = 0;
  for (int k = 0; k < K; ++k) D += (widths[k] = args.g[k].cols);
  const T* weights = Diff ? nullptr : static_cast<const T*>(args.w);
  T* norms = static_cast<T*>(args.norms);
  const bool accumulate = write && !args.out.empty();
  const int nt = thread_count();
  const Clipper clipper{args.clip, clip_margin<T>(D, nt)};
  int64_t nonfinite = 0;

  if (D <= kNarrowColumns && B >= 2 * nt) {
    // Sample-parallel schedule with private double accumulators.
    std::vector<double> acc(accumulate ? static_cast<size_t>(nt) * D : 0, 0.0);
#pragma omp parallel reduction(+ : nonfinite) if (B * D >= kSerialBelow)
    {
      const int t = thread_id(), team = team_size();
      double* mine = accumulate ? acc.data() + static_cast<size_t>(t) * D : nullptr;
      const int64_t i0 = B * t / team, i1 = B * (t + 1) / team;
      for (int64_t i = i0; i < i1; ++i) {
        double ss = 0.0;
        for (int k = 0; k < K; ++k) ss += src.sumsq(k, i, 0, widths[k]);
        double f, n;
        clipper.factor(src, i, ss, weights ? static_cast<double>(weights[i]) : 1.0, f, n);
        if (std::isnan(n)) ++nonfinite;
        if (write && norms) norms[i] = static_cast<T>(n);
        if (!accumulate || f == 0.0) continue;
        int64_t off = 0;
        for (int k = 0; k < K; ++k) {
          const auto r = src.row(k, i);
          for (int64_t j = 0; j < widths[k]; ++j) mine[off + j] += f * static_cast<double>(r[j]);
          off += widths[k];
        }
      }
    }
    if (accumulate) {
      const int64_t total = D;
#pragma omp parallel for schedule(static) if (D * nt >= kSerialBelow)
      for (int64_t c = 0; c < total; ++c) {
        double s = 0.0;
        for (int t = 0; t < nt; ++t) s += acc[static_cast<size_t>(t) * D + c];
        int64_t off = c;
        int k = 0;
        while (off >= widths[k]) off -= widths[k++];
        add_out<T>(args, k, off, s);
      }
    }
    return nonfinite;
  }

  const int64_t bytes_per_sample = D * static_cast<int64_t>(sizeof(T)) * (Diff ? 2 : 1);
  if (B >= kSamplesPerAccumulator * nt) {
    // Wide sample-parallel schedule: chunks of whole samples, norms then accumulation into a private double
    // vector.
    const int64_t chunk = std::max<int64_t>(1, kSampleChunkBytes / std::max<int64_t>(1, bytes_per_sample));
    std::vector<double> acc(accumulate ? static_cast<size_t>(nt) * D : 0, 0.0);
#pragma omp parallel reduction(+ : nonfinite) if (B * D >= kSerialBelow)
    {
      const int t = thread_id(), team = team_size();
      std::vector<double> factors(chunk);
      for (int64_t i0 = B * t / team, end = B * (t + 1) / team; i0 < end; i0 += chunk) {
        const int64_t n_in = std::min(chunk, end - i0);
        for (int64_t s = 0; s < n_in; ++s) {
          const int64_t i = i0 + s;
          double ss = 0.0;
          for (int k = 0; k < K; ++k) ss += src.sumsq(k, i, 0, widths[k]);
          double n;
          clipper.factor(src, i, ss, weights ? static_cast<double>(weights[i]) : 1.0, factors[s], n);
          if (std::isnan(n)) ++nonfinite;
          if (write && norms) norms[i] = static_cast<T>(n);
        }
        if (!accumulate) continue;
        double* mine = acc.data() + static_cast<size_t>(t) * D;
        for (int k = 0; k < K; mine += widths[k++])
          for (int64_t lo = 0; lo < widths[k]; lo += kTile) {
            const int64_t hi = std::min(widths[k], lo + kTile);
            for (int64_t s = 0; s < n_in; ++s)
              if (factors[s] != 0.0) src.axpy(k, i0 + s, lo, hi, factors[s], mine);
          }
      }
    }
    if (accumulate) {
      // out_k += the threads' accumulators, added in thread order.
      int64_t off = 0;
      for (int k = 0; k < K; off += widths[k++]) {
        const double* first = acc.data() + off;
#pragma omp parallel for schedule(static) if (widths[k] * nt >= kSerialBelow)
        for (int64_t j = 0; j < widths[k]; ++j) {
          double sum = first[j];
          for (int u = 1; u < nt; ++u) sum += first[static_cast<size_t>(u) * D + j];
          add_out<T>(args, k, j, sum);
        }
      }
    }
    return nonfinite;
  }

  // Column-parallel schedule over cache-sized chunks of samples.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(B, kCacheBudgetPerThread * nt /
                                                                     std::max<int64_t>(1, bytes_per_sample)));
  std::vector<double> partial(2 * static_cast<size_t>(nt) * chunk, 0.0);
  // Each thread sums its own columns over every chunk in double (in `out` itself when it holds double), and
  // adds them to `out` once at the end.
  const bool direct = args.out_f64;
  std::vector<double> total(accumulate && !direct ? static_cast<size_t>(D) : 0, 0.0);
  std::vector<int64_t> starts(K + 1, 0);
  for (int k = 0; k < K; ++k) starts[k + 1] = starts[k] + widths[k];
#pragma omp parallel reduction(+ : nonfinite) if (B * D >= kSerialBelow)
  {
    const int t = thread_id(), team = team_size();
    const std::vector<Piece> mine = pieces_of(widths, D * t / team, D * (t + 1) / team);
    std::vector<double> factors(chunk);
    int parity = 0;
    for (int64_t i0 = 0; i0 < B; i0 += chunk, parity ^= 1) {
      const int64_t n_in = std::min(chunk, B - i0);
      double* part = partial.data() + static_cast<size_t>(parity) * nt * chunk;
      for (int64_t s = 0; s < n_in; ++s) {
        double ss = 0.0;
        for (const Piece& p : mine) ss += src.sumsq(p.k, i0 + s, p.begin, p.end);
        part[static_cast<size_t>(t) * chunk + s] = ss;
      }
#pragma omp barrier
      for (int64_t s = 0; s < n_in; ++s) {
        double ss = 0.0;
        for (int u = 0; u < team; ++u) ss += part[static_cast<size_t>(u) * chunk + s];
        const int64_t i = i0 + s;
        double n;
        clipper.factor(src, i, ss, weights ? static_cast<double>(weights[i]) : 1.0, factors[s], n);
        if (t == 0) {
          if (std::isnan(n)) ++nonfinite;
          if (write && norms) norms[i] = static_cast<T>(n);
        }
      }
      if (!accumulate) continue;
      for (const Piece& p : mine) {
        double* sums = direct ? static_cast<double*>(args.out[p.k].data) : total.data() + starts[p.k];
        for (int64_t lo = p.begin; lo < p.end; lo += kTile) {
          const int64_t hi = std::min(p.end, lo + kTile);
          for (int64_t s = 0; s < n_in; ++s)
            if (factors[s] != 0.0) src.axpy(p.k, i0 + s, lo, hi, factors[s], sums);
        }
      }
    }
    if (accumulate && !direct)
      for (const Piece& p : mine)
        for (int64_t j = p.begin; j < p.end; ++j) add_out<T>(args, p.k, j, total[starts[p.k] + j]);
  }
  return nonfinite;
}

// Entry points of this instruction-set copy.
inline int64_t clip_accumulate(const ClipArgs& args, bool write) {
  if (args.dtype == DType::f32) return args.h.empty() ? run<float, false>(args, write) : run<float, true>(args, write);
  return args.h.empty() ? run<double, false>(args, write) : run<double, true>(args, write);
}


// ---- Gaussian noise ----
// Noise is generated a tile at a time: Philox blocks (the AVX2 copy evaluates four blocks per vector and the
// AVX-512 copy eight,
// bit-identical to philox::block_at), their 53-bit uniforms (exactly philox::uniforms'), then philox::box_muller
// in a loop the compiler vectorises; float32 noise is the float64 noise rounded.
constexpr int64_t kNoiseTile = 4096;  // elements; even, so a Gaussian pair never straddles two tiles
constexpr int64_t kTilePairs = kNoiseTile / 2;

// Per-thread buffers of one tile: Philox words (word k of pair p in w[k][p]), uniforms and Gaussians.
struct NoiseScratch {
  uint32_t w[4][kTilePairs];
  double u1[kTilePairs], u2[kTilePairs];
  double z[kNoiseTile];
};

// Philox blocks of pairs pair0 .. pair0 + n - 1, n a multiple of kPhiloxGroup: kPhiloxChains vectors of
// kPhiloxLanes blocks each at a time, their rounds interleaved (one vector's ten rounds are a chain of
// dependent multiplies; four chains in flight took the AVX-512 copy from 17 to 12 ms for 5.8M blocks on one
// Zen 4 core).
#ifdef DPVR_ISA_AVX512
constexpr int64_t kPhiloxLanes = 8;
#else
constexpr int64_t kPhiloxLanes = 4;
#endif
#ifdef DPVR_ISA_AVX2
constexpr int kPhiloxChains = 4;
#else
constexpr int kPhiloxChains = 1;
#endif
constexpr int64_t kPhiloxGroup = kPhiloxLanes * kPhiloxChains;
inline void philox_blocks(const NoiseKey& key, uint64_t pair0, int64_t n, NoiseScratch& out) {
#if defined(DPVR_ISA_AVX512)
  // As the AVX2 copy below, eight blocks per vector; a three-way exclusive or is one instruction here.
  const __m512i low = _mm512_set1_epi64(0xFFFFFFFF);
  const __m512i m0 = _mm512_set1_epi64(0xD2511F53), m1 = _mm512_set1_epi64(0xCD9E8D57);
  for (int64_t g = 0; g < n; g += kPhiloxGroup) {
    __m512i c[kPhiloxChains][4];
    for (int v = 0; v < kPhiloxChains; ++v) {
      const __m512i pair = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(pair0 + g + 8 * v)),
                                            _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
      c[v][0] = _mm512_and_si512(pair, low);
      c[v][1] = _mm512_srli_epi64(pair, 32);
      c[v][2] = _mm512_set1_epi64(key.step);
      c[v][3] = _mm512_set1_epi64(key.stream);
    }
    uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m512i key0 = _mm512_set1_epi64(k0), key1 = _mm512_set1_epi64(k1);
      for (int v = 0; v < kPhiloxChains; ++v) {
        const __m512i p0 = _mm512_mul_epu32(c[v][0], m0), p1 = _mm512_mul_epu32(c[v][2], m1);
        c[v][0] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p1, 32), c[v][1], key0, 0x96);  // a ^ b ^ c
        c[v][1] = _mm512_and_si512(p1, low);
        c[v][2] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p0, 32), c[v][3], key1, 0x96);
        c[v][3] = _mm512_and_si512(p0, low);
      }
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    // The low halves of the eight 64-bit lanes, in order, as eight 32-bit words.
    for (int v = 0; v < kPhiloxChains; ++v)
      for (int k = 0; k < 4; ++k)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&out.w[k][g + 8 * v]), _mm512_cvtepi64_epi32(c[v][k]));
  }
#elif defined(DPVR_ISA_AVX2)
  // Each 32-bit word in a 64-bit lane, so that _mm256_mul_epu32 gives the full 32 x 32 -> 64 products.
  const __m256i low = _mm256_set1_epi64x(0xFFFFFFFF);
  const __m256i m0 = _mm256_set1_epi64x(0xD2511F53), m1 = _mm256_set1_epi64x(0xCD9E8D57);
  const __m256i gather = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  for (int64_t g = 0; g < n; g += kPhiloxGroup) {
    __m256i c[kPhiloxChains][4];
    for (int v = 0; v < kPhiloxChains; ++v) {
      const __m256i pair = _mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(pair0 + g + 4 * v)),
                                            _mm256_setr_epi64x(0, 1, 2, 3));
      c[v][0] = _mm256_and_si256(pair, low);
      c[v][1] = _mm256_srli_epi64(pair, 32);
      c[v][2] = _mm256_set1_epi64x(key.step);
      c[v][3] = _mm256_set1_epi64x(key.stream);
    }
    uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m256i key0 = _mm256_set1_epi64x(k0), key1 = _mm256_set1_epi64x(k1);
      for (int v = 0; v < kPhiloxChains; ++v) {
        const __m256i p0 = _mm256_mul_epu32(c[v][0], m0), p1 = _mm256_mul_epu32(c[v][2], m1);
        c[v][0] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c[v][1]), key0);
        c[v][1] = _mm256_and_si256(p1, low);
        c[v][2] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c[v][3]), key1);
        c[v][3] = _mm256_and_si256(p0, low);
      }
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    // The low halves of the four 64-bit lanes, in order, as four 32-bit words.
    for (int v = 0; v < kPhiloxChains; ++v)
      for (int k = 0; k < 4; ++k)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&out.w[k][g + 4 * v]),
                         _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c[v][k], gather)));
  }
#else
  for (int64_t p = 0; p < n; ++p) {
    const philox::Block b = philox::block_at(key.seed, key.stream, key.step, pair0 + static_cast<uint64_t>(p));
    for (int k = 0; k < 4; ++k) out.w[k][p] = b.w[k];
  }
#endif
}

// philox::uniforms of pairs 0 .. n-1, with the same results.
inline void uniforms(NoiseScratch& b, int64_t n) {
  constexpr double two_m53 = 1.0 / 9007199254740992.0, two_26 = 67108864.0;
#pragma omp simd
  for (int64_t p = 0; p < n; ++p) {
    const uint64_t a = (static_cast<uint64_t>(b.w[0][p]) << 21) ^ (b.w[1][p] >> 11);
    const uint64_t c = (static_cast<uint64_t>(b.w[2][p]) << 21) ^ (b.w[3][p] >> 11);
    // a, c < 2^53: their 26-bit halves convert exactly, and so does the recombined sum.
    b.u1[p] = (philox::small_integer(a >> 26) * two_26 + philox::small_integer(a & 0x3FFFFFF) + 0.5) * two_m53;
    b.u2[p] = (philox::small_integer(c >> 26) * two_26 + philox::small_integer(c & 0x3FFFFFF)) * two_m53;
  }
}

// The Gaussians of `pairs` (<= kTilePairs) pairs from pair0 into b.z[0 .. 2 * pairs) (and up to 62 more values:
// whole groups of kPhiloxGroup pairs are generated).
inline void gaussians(const NoiseKey& key, uint64_t pair0, int64_t pairs, NoiseScratch& b) {
  static_assert(kTilePairs % kPhiloxGroup == 0, "a tile holds whole groups of Philox blocks");
  const int64_t n = (pairs + kPhiloxGroup - 1) / kPhiloxGroup * kPhiloxGroup;
  philox_blocks(key, pair0, n, b);
  uniforms(b, n);
#pragma omp simd
  for (int64_t p = 0; p < n; ++p) philox::box_muller(b.u1[p], b.u2[p], b.z[2 * p], b.z[2 * p + 1]);
}

constexpr int kUpdateLanes = 16;  // partial sums of the squared step per thread

// f(flag...) with each runtime bool as a compile-time std::bool_constant.
template <typename F>
inline void dispatch(F&& f) { f(); }
template <typename F, typename... Rest>
inline void dispatch(F&& f, bool flag, Rest... rest) {
  if (flag)
    dispatch([&](auto... c) { f(std::true_type{}, c...); }, rest...);
  else
    dispatch([&](auto... c) { f(std::false_type{}, c...); }, rest...);
}

template <typename T>
void update(const UpdateArgs& a) {
  const int K = static_cast<int>(a.v.size());
  std::vector<int64_t> widths(K);
  int64_t D = 0;
  for (int k = 0; k < K; ++k) D += (widths[k] = a.v[k].size);
  const bool noise = a.sigma > 0.0, has_sum = !a.sum.empty(), step = !a.x.empty(), keep = !a.x_prev.empty();
  const int64_t tiles = (D + kNoiseTile - 1) / kNoiseTile;
  const int nt = thread_count();
  std::vector<double> partial(nt, 0.0);

#pragma omp parallel if (D >= kSerialBelow)
  {
    const int t = thread_id(), team = team_size();
    const std::unique_ptr<NoiseScratch> scratch(noise ? new NoiseScratch : nullptr);
    double sq = 0.0, lanes[kUpdateLanes] = {};
    for (int64_t tile = tiles * t / team; tile < tiles * (t + 1) / team; ++tile) {
      const int64_t lo = tile * kNoiseTile, hi = std::min(D, lo + kNoiseTile);
      if (noise) gaussians(a.key, static_cast<uint64_t>(lo) >> 1, (hi - lo + 1) / 2, *scratch);
      int64_t base = lo;
      for (const Piece& p : pieces_of(widths, lo, hi)) {
        T* v = static_cast<T*>(a.v[p.k].data);
        // The sum is read in its own dtype (double for a float32 model's float64 sum): nothing is rounded
        // to T before the noise is added.
        const T* s = has_sum && !a.sum_f64 ? static_cast<const T*>(a.sum[p.k].data) : nullptr;
        const double* s64 = has_sum && a.sum_f64 ? static_cast<const double*>(a.sum[p.k].data) : nullptr;
        T* x = step ? static_cast<T*>(a.x[p.k].data) : nullptr;
        T* xp = keep ? static_cast<T*>(a.x_prev[p.k].data) : nullptr;
        const double* zp = noise ? scratch->z + (base - lo) - p.begin : nullptr;
        // Entry j's update; its squared step goes to a lane of its own, so that the loop vectorises (a
        // single running sum would chain every entry) and the lanes' order is the same on every copy. The
        // optional inputs are template flags: one branch-free loop per combination.
        const auto run = [&](auto has_s, auto has_s64, auto has_noise, auto has_x, auto has_xp) {
          const auto entry = [&](int64_t j, double& lane) {
            double nv = a.reset ? 0.0 : static_cast<double>(v[j]);
            if constexpr (has_s()) nv += a.scale * static_cast<double>(s[j]);
            if constexpr (has_s64()) nv += a.scale * s64[j];
            if constexpr (has_noise()) nv += a.sigma * zp[j];
            const T vt = static_cast<T>(nv);
            v[j] = vt;
            if constexpr (has_x()) {
              const T old = x[j];
              const T now = static_cast<T>(static_cast<double>(old) - a.lr * static_cast<double>(vt));
              if constexpr (has_xp()) xp[j] = old;
              x[j] = now;
              const double d = static_cast<double>(now) - static_cast<double>(old);
              lane += d * d;
            }
          };
          int64_t j = p.begin;
          for (; j + kUpdateLanes <= p.end; j += kUpdateLanes) {
#pragma omp simd
            for (int l = 0; l < kUpdateLanes; ++l) entry(j + l, lanes[l]);
          }
          for (int l = 0; j < p.end; ++j, ++l) entry(j, lanes[l]);
        };
        dispatch(run, s != nullptr, s64 != nullptr, noise, x != nullptr, xp != nullptr);
        base += p.end - p.begin;
      }
    }
    for (int l = 0; l < kUpdateLanes; ++l) sq += lanes[l];  // a fixed order
    partial[t] = sq;
  }
  if (a.step_norm) {
    double total = 0.0;
    for (double s : partial) total += s;  // fixed order: deterministic for a given thread count
    *a.step_norm = std::sqrt(total);
  }
}

inline void noisy_update(const UpdateArgs& a) {
  if (a.dtype == DType::f32)
    update<float>(a);
  else
    update<double>(a);
}

}  // namespace DPVR_ISA
}  // namespace cpu
}  // namespace dpvr
DPVR_ISA_END
