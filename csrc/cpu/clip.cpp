// CPU clip-accumulate: per-sample global norm over K tensors, clip factor, accumulation into K outputs.
//
// One read of the per-sample data from memory: samples are processed in chunks small enough to stay in cache,
// so the accumulation pass re-reads a chunk from cache right after its norms are known. Two schedules:
//   column-parallel: each thread owns a fixed column range of the concatenated tensors (no write conflicts,
//                    deterministic for a given thread count) — for wide models;
//   sample-parallel: each thread clips its own samples into a private accumulator that is reduced in a fixed
//                    order — for narrow models with many samples.
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "dpvr/core.h"

namespace dpvr {
namespace {

using cpu::Piece;

constexpr int64_t kCacheBudgetPerThread = 768 * 1024;  // bytes of per-sample data kept hot per thread
constexpr int64_t kNarrowColumns = 8192;               // at or below this, prefer the sample-parallel schedule
constexpr int64_t kTile = 1024;                        // columns accumulated per tile (output tile stays in L1)

template <typename T, bool Diff>
struct Source {
  const std::vector<Matrix>& g;
  const std::vector<Matrix>& h;
  const T* a;  // plain form: weights; difference form: a_i
  const T* b;

  // Entry j of sample i of tensor k, in double: w_i-free for the plain form (the weight scales the norm).
  inline double at(int k, int64_t i, int64_t j) const {
    const Matrix& G = g[k];
    const double gv = static_cast<const T*>(G.data)[i * G.row_stride + j * G.col_stride];
    if constexpr (Diff) {
      const Matrix& H = h[k];
      const double hv = static_cast<const T*>(H.data)[i * H.row_stride + j * H.col_stride];
      const double ai = a ? static_cast<double>(a[i]) : 1.0;
      const double bi = b ? static_cast<double>(b[i]) : 1.0;
      return ai * gv - bi * hv;
    } else {
      return gv;
    }
  }

  // Sum of squares over columns [lo, hi) of tensor k for sample i.
  double sumsq(int k, int64_t i, int64_t lo, int64_t hi) const {
    const Matrix& G = g[k];
    double acc = 0.0;
    if (G.col_stride == 1 && (!Diff || h[k].col_stride == 1)) {
      const T* gp = static_cast<const T*>(G.data) + i * G.row_stride;
      if constexpr (Diff) {
        const T* hp = static_cast<const T*>(h[k].data) + i * h[k].row_stride;
        const double ai = a ? static_cast<double>(a[i]) : 1.0;
        const double bi = b ? static_cast<double>(b[i]) : 1.0;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = lo; j < hi; ++j) {
          const double u = ai * static_cast<double>(gp[j]) - bi * static_cast<double>(hp[j]);
          acc += u * u;
        }
      } else {
#pragma omp simd reduction(+ : acc)
        for (int64_t j = lo; j < hi; ++j) {
          const double u = static_cast<double>(gp[j]);
          acc += u * u;
        }
      }
    } else {
      for (int64_t j = lo; j < hi; ++j) {
        const double u = at(k, i, j);
        acc += u * u;
      }
    }
    return acc;
  }

  // out[lo:hi] += f * u_i[lo:hi] for tensor k.
  void axpy(int k, int64_t i, int64_t lo, int64_t hi, double f, T* out) const {
    const Matrix& G = g[k];
    if (G.col_stride == 1 && (!Diff || h[k].col_stride == 1)) {
      const T* gp = static_cast<const T*>(G.data) + i * G.row_stride;
      if constexpr (Diff) {
        const T* hp = static_cast<const T*>(h[k].data) + i * h[k].row_stride;
        const double ai = a ? static_cast<double>(a[i]) : 1.0;
        const double bi = b ? static_cast<double>(b[i]) : 1.0;
        // Same expression as in sumsq, so the clipped vector is exactly the one whose norm was bounded.
#pragma omp simd
        for (int64_t j = lo; j < hi; ++j) {
          const double u = ai * static_cast<double>(gp[j]) - bi * static_cast<double>(hp[j]);
          out[j] = static_cast<T>(static_cast<double>(out[j]) + f * u);
        }
      } else {
#pragma omp simd
        for (int64_t j = lo; j < hi; ++j) {
          out[j] = static_cast<T>(static_cast<double>(out[j]) + f * static_cast<double>(gp[j]));
        }
      }
    } else {
      for (int64_t j = lo; j < hi; ++j) out[j] = static_cast<T>(static_cast<double>(out[j]) + f * at(k, i, j));
    }
  }

  // Norm of sample i over every tensor, robust to overflow of the sum of squares (rare path). Returns NaN when
  // an entry is not finite.
  double robust_norm(int64_t i) const {
    double scale = 0.0;
    for (int k = 0; k < static_cast<int>(g.size()); ++k)
      for (int64_t j = 0; j < g[k].cols; ++j) {
        const double u = std::fabs(at(k, i, j));
        if (!std::isfinite(u)) return std::numeric_limits<double>::quiet_NaN();
        scale = std::max(scale, u);
      }
    if (scale == 0.0) return 0.0;
    double acc = 0.0;
    for (int k = 0; k < static_cast<int>(g.size()); ++k)
      for (int64_t j = 0; j < g[k].cols; ++j) {
        const double u = at(k, i, j) / scale;
        acc += u * u;
      }
    return scale * std::sqrt(acc);
  }
};

// Clip factor of a sample from its sum of squares. `margin` makes the rounded clipped vector's norm <= C:
// it covers the relative error of the computed norm and the final rounding of each entry to T.
struct Clipper {
  double clip;
  double margin;

  // Returns (factor applied to the unweighted vector, reported norm). factor = 0 marks a non-finite sample.
  template <typename S>
  inline void factor(const S& src, int64_t i, double sumsq, double weight, double& f, double& norm) const {
    double n = std::sqrt(sumsq);
    if (!std::isfinite(n)) n = src.robust_norm(i);
    n *= std::fabs(weight);
    if (!std::isfinite(n) || !std::isfinite(weight)) {
      f = 0.0;
      norm = std::numeric_limits<double>::quiet_NaN();
      return;
    }
    norm = n;
    const double target = clip * (1.0 - margin);
    f = (n > target) ? weight * (target / n) : weight;
  }
};

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
  const int nt = cpu::thread_count();
  // The sum of squares of D terms is summed in double in chains of at most D + nt additions.
  const Clipper clipper{args.clip, (static_cast<double>(D) + nt + 8.0) * cpu::unit_roundoff<double>() +
                                       2.0 * cpu::unit_roundoff<T>()};
  int64_t nonfinite = 0;

  if (D <= kNarrowColumns && B >= 2 * nt) {
    // Sample-parallel schedule with private double accumulators.
    std::vector<double> acc(accumulate ? static_cast<size_t>(nt) * D : 0, 0.0);
#pragma omp parallel reduction(+ : nonfinite)
    {
      const int t = cpu::thread_id(), team = cpu::team_size();
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
          for (int64_t j = 0; j < widths[k]; ++j) mine[off + j] += f * src.at(k, i, j);
          off += widths[k];
        }
      }
    }
    if (accumulate) {
      const int64_t total = D;
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < total; ++c) {
        double s = 0.0;
        for (int t = 0; t < nt; ++t) s += acc[static_cast<size_t>(t) * D + c];
        int64_t off = c;
        int k = 0;
        while (off >= widths[k]) off -= widths[k++];
        T* out = static_cast<T*>(args.out[k].data);
        out[off] = static_cast<T>(static_cast<double>(out[off]) + s);
      }
    }
    return nonfinite;
  }

  // Column-parallel schedule over cache-sized chunks of samples.
  const int64_t bytes_per_sample = D * static_cast<int64_t>(sizeof(T)) * (Diff ? 2 : 1);
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(B, kCacheBudgetPerThread * nt /
                                                                     std::max<int64_t>(1, bytes_per_sample)));
  std::vector<double> partial(2 * static_cast<size_t>(nt) * chunk, 0.0);
#pragma omp parallel reduction(+ : nonfinite)
  {
    const int t = cpu::thread_id(), team = cpu::team_size();
    const std::vector<Piece> mine = cpu::pieces_of(widths, D * t / team, D * (t + 1) / team);
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
        T* out = static_cast<T*>(args.out[p.k].data);
        for (int64_t lo = p.begin; lo < p.end; lo += kTile) {
          const int64_t hi = std::min(p.end, lo + kTile);
          for (int64_t s = 0; s < n_in; ++s)
            if (factors[s] != 0.0) src.axpy(p.k, i0 + s, lo, hi, factors[s], out);
        }
      }
    }
  }
  return nonfinite;
}

template <typename T>
int64_t dispatch_form(const ClipArgs& args, bool write) {
  return args.h.empty() ? run<T, false>(args, write) : run<T, true>(args, write);
}

}  // namespace

int64_t clip_accumulate_cpu(const ClipArgs& args) {
  validate(args);
  auto go = [&](bool write) {
    return args.dtype == DType::f32 ? dispatch_form<float>(args, write) : dispatch_form<double>(args, write);
  };
  if (args.nonfinite == NonFinite::raise && (!args.out.empty() || args.norms)) {
    // Look before writing anything, so a failing call leaves every output untouched.
    const int64_t bad = go(false);
    if (bad > 0)
      throw NonFiniteError(std::to_string(bad) + " sample(s) have non-finite gradients or weights");
  }
  return go(true);
}

int max_threads() { return cpu::thread_count(); }

}  // namespace dpvr
